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
