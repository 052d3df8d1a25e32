"""The plugin contract, through a real second distribution installed with pip.

``tests/plugins/demo_plugin`` is built and installed with ``pip install --target`` into a
temporary directory; a fresh interpreter with that directory on ``PYTHONPATH`` finds its
``kvhost.backends`` entry points in its dist-info, exactly as it would find any installed
plugin. Nothing patches the registry: the same report script runs with and without the
plugin, and the differences are the contract (docs/plugins.md).
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

PLUGINS = Path(__file__).resolve().parent / "plugins"
REPORT = PLUGINS / "registry_report.py"


def pip_install_target(source: Path, workdir: Path) -> Path:
    """Build and install the distribution at ``source`` into ``workdir/site``; return that dir.

    The source is copied first, so the build leaves nothing in the repository. Without
    build isolation the venv's setuptools builds it offline; a venv without setuptools
    lets pip fetch it.
    """
    copy = workdir / source.name
    shutil.copytree(source, copy)
    site = workdir / "site"
    command = [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--target", str(site), str(copy)]
    if importlib.util.find_spec("setuptools") is not None:
        command[4:4] = ["--no-build-isolation", "--no-index"]
    subprocess.run(command, check=True, timeout=120, capture_output=True)
    return site


def registry_report(site: Path | None) -> dict:
    """Run the report script in a fresh interpreter, with ``site`` on PYTHONPATH if given."""
    environment = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "KVHOST_BACKEND")}
    if site is not None:
        environment["PYTHONPATH"] = str(site)
    done = subprocess.run(
        [sys.executable, str(REPORT)], env=environment, capture_output=True, text=True, timeout=120, check=False
    )
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return pip_install_target(PLUGINS / "demo_plugin", tmp_path_factory.mktemp("demo_plugin"))


@pytest.fixture(scope="module")
def with_plugin(site: Path) -> dict:
    return registry_report(site)


@pytest.fixture(scope="module")
def without_plugin() -> dict:
    return registry_report(None)


pytestmark = pytest.mark.timeout(120)


def test_the_plugin_is_an_installed_distribution(site):
    dist_infos = list(site.glob("kvhost_demo_plugin-0.1.0.dist-info"))
    assert len(dist_infos) == 1
    entry_points = (dist_infos[0] / "entry_points.txt").read_text()
    assert "[kvhost.backends]" in entry_points
    assert "demo = kvhost_demo_plugin:DemoBackend" in entry_points
    assert (site / "kvhost_demo_plugin" / "__init__.py").is_file()
    assert not (PLUGINS / "demo_plugin" / "build").exists()  # the build ran on a copy


def test_without_the_plugin_in_tree_backends_serve(without_plugin):
    assert without_plugin["chosen"] == {"cpu": "cpu", "meta": "torch"}
    assert without_plugin["receive_backend"] == without_plugin["copy_backend"] == "cpu"
    assert not {name for name in without_plugin["info"] if name.startswith("demo")}
    assert "is not registered" in without_plugin["absent_error"]


def test_entry_points_register_the_plugin_backends(with_plugin):
    info = with_plugin["info"]
    assert info["demo"] == {
        "device_types": ["cpu", "meta"],
        "priority": 10,
        "source": "kvhost_demo_plugin:DemoBackend",
        "unavailable": None,
    }
    assert info["cpu"]["source"] == "kvhost_cpu:CpuBackend"  # the in-tree backends stay registered


def test_higher_priority_wins_auto_selection_for_the_device_types_it_declares(with_plugin):
    # demo (10) over the in-tree cpu (0) for CPU tensors, and over torch (-100) for meta.
    assert with_plugin["chosen"] == {"cpu": "demo", "meta": "demo"}
    assert with_plugin["receive_backend"] == with_plugin["copy_backend"] == "demo"
    assert with_plugin["demo_calls"] == {"receive": 1, "copy": 1}  # and it did the work, checked by the oracle


def test_a_backend_that_cannot_run_is_passed_over_with_its_reason(with_plugin):
    absent = with_plugin["info"]["demo-absent"]
    assert absent["priority"] == 100 and absent["unavailable"] == "the demo accelerator is not installed"
    assert with_plugin["absent_error"] == (
        "backend 'demo-absent' cannot run here: the demo accelerator is not installed"
    )


def test_an_availability_check_that_raises_counts_as_a_reason(with_plugin):
    raising = with_plugin["info"]["demo-raising"]
    assert raising["priority"] == 50
    assert raising["unavailable"] == "availability check failed: RuntimeError: driver query failed"
    assert with_plugin["chosen"]["cpu"] == "demo"


def test_broken_entry_points_are_reported_and_break_nothing_else(with_plugin):
    broken = with_plugin["info"]["demo-broken"]
    assert broken["source"] == "kvhost_demo_plugin.missing:Nothing"
    assert broken["unavailable"].startswith("failed to load: ModuleNotFoundError")
    wrong = with_plugin["info"]["demo-not-a-backend"]
    assert wrong["unavailable"] == "kvhost_demo_plugin:NOT_A_BACKEND is not a kvhost Backend"
    assert with_plugin["chosen"]["cpu"] == "demo"


def test_the_in_tree_backend_stays_reachable_by_name_and_by_kvhost_backend(with_plugin, without_plugin):
    assert with_plugin["named_cpu"] == "cpu"
    overridden = with_plugin["override_cpu"]
    assert overridden["chosen"] == {"cpu": "cpu", "meta": "demo"}  # cpu does not serve meta
    assert overridden["receive_backend"] == "cpu"
    assert overridden["demo_calls"] == with_plugin["demo_calls"]  # demo did not run again
    assert without_plugin["override_cpu"]["chosen"] == {"cpu": "cpu", "meta": "torch"}
