"""The default install is the fast one: numba (the CPU backend's kernels) is a default
dependency wherever numba publishes wheels, and nowhere else."""

from __future__ import annotations

from pathlib import Path

import pytest

tomllib = pytest.importorskip("tomllib")
requirements = pytest.importorskip("packaging.requirements")

PYPROJECT = Path(__file__).resolve().parents[1] / "pyproject.toml"


def default_requirements() -> dict[str, object]:
    project = tomllib.loads(PYPROJECT.read_text())["project"]
    parsed = [requirements.Requirement(text) for text in project["dependencies"]]
    return {r.name: r for r in parsed}


@pytest.mark.parametrize(
    ("platform", "machine", "wanted"),
    [
        ("linux", "x86_64", True),
        ("linux", "aarch64", True),
        ("darwin", "arm64", True),
        ("win32", "AMD64", True),
        ("linux", "ppc64le", False),
        ("linux", "s390x", False),
    ],
)
def test_numba_is_a_default_dependency_where_it_has_wheels(platform, machine, wanted):
    numba = default_requirements()["numba"]
    assert numba.marker is not None
    assert numba.marker.evaluate({"sys_platform": platform, "platform_machine": machine}) is wanted


def test_the_other_defaults_hold_no_device_stack():
    assert set(default_requirements()) == {"torch", "numpy", "numba"}


def test_the_command_says_its_version_and_what_it_is(capsys):
    from importlib.metadata import version

    from kvhost_tools import cli

    with pytest.raises(SystemExit) as done:
        cli.main(["--version"])
    assert done.value.code == 0 and capsys.readouterr().out == f"kvhost {version('kvhost')}\n"
    with pytest.raises(SystemExit):
        cli.main(["--help"])
    said = capsys.readouterr().out
    assert "moves and rearranges KV-cache blocks" in said and "``" not in said  # no docstring markup


def test_a_license_and_type_hints_ship():
    """pyproject names the Apache-2.0 license and its file; the package says it is typed."""
    pyproject = tomllib.loads(PYPROJECT.read_text())
    assert pyproject["project"]["license"] == "Apache-2.0" and pyproject["project"]["license-files"] == ["LICENSE"]
    assert "Apache License" in (PYPROJECT.parent / "LICENSE").read_text()
    assert (PYPROJECT.parent / "kvhost" / "py.typed").exists()


@pytest.mark.parametrize(
    "command",
    [
        ["-m", "kvhost_tools.cli", "--help"],
        ["-m", "kvhost_tools.cli", "bench", "--help"],
        ["-m", "kvhost_tools.cli", "demo", "--help"],
        ["-m", "kvhost_tools.device_checks.gpucheck", "--help"],
        ["-m", "kvhost_tools.device_checks.handoff", "--help"],
        ["-m", "kvhost_tools.device_checks.xla_scaling", "--help"],
        ["-m", "kvhost_accelerator.aot", "--help"],
    ],
)
def test_every_command_starts_under_python_dash_oo(command):
    """``python -OO`` drops docstrings: a command that built its description from
    ``__doc__.split`` died of AttributeError before it parsed anything (kvhost bench did)."""
    import os
    import subprocess
    import sys

    root = PYPROJECT.parent
    path = os.pathsep.join([str(root), str(root / "backends"), os.environ.get("PYTHONPATH", "")])
    env = dict(os.environ, PYTHONOPTIMIZE="2", PYTHONPATH=path)
    run = subprocess.run([sys.executable, *command], env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    assert "usage:" in run.stdout
