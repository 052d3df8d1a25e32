"""Backend lookup: by device type, through entry points, lazily, with KVHOST_BACKEND."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

import kvhost
from kvhost.registry import registry


@pytest.fixture(autouse=True)
def fresh_choices():
    registry.clear()
    yield
    registry.clear()


def test_cpu_tensors_get_the_cpu_backend():
    assert kvhost.get_backend("cpu").name == "cpu"
    assert kvhost.get_backend(torch.zeros(1)).name == "cpu"
    assert kvhost.get_backend(torch.device("cpu")) is kvhost.get_backend("cpu")  # cached


def test_unknown_device_types_fall_back_to_the_torch_backend():
    assert kvhost.get_backend("meta").name == "torch"


def test_env_override(monkeypatch):
    monkeypatch.setenv("KVHOST_BACKEND", "torch")
    assert kvhost.get_backend("cpu").name == "torch"
    monkeypatch.setenv("KVHOST_BACKEND", "nonesuch")
    with pytest.raises(kvhost.BackendError, match="KVHOST_BACKEND='nonesuch' names no registered backend"):
        kvhost.get_backend("cpu")


def test_override_that_does_not_serve_the_device_is_ignored_for_it(monkeypatch):
    monkeypatch.setenv("KVHOST_BACKEND", "cpu")
    assert kvhost.get_backend("meta").name == "torch"


def test_named_backend_must_serve_the_device():
    with pytest.raises(kvhost.BackendError, match="'cpu' does not serve device type 'meta'"):
        kvhost.get_backend("meta", name="cpu")


def test_entry_points_list_every_in_tree_backend():
    names = {row.name for row in registry.info()}
    assert {"cpu", "torch", "cuda", "xpu", "tpu"} <= names


def test_unavailable_backends_say_why():
    rows = {row.name: row for row in registry.info()}
    if not torch.cuda.is_available() and "cuda" in rows and rows["cuda"].device_types:
        assert rows["cuda"].unavailable == "no CUDA device"
    assert rows["cpu"].available


def test_importing_kvhost_imports_no_device_stack():
    code = (
        "import sys, kvhost, torch\n"
        "kvhost.get_backend('cpu')\n"
        "kvhost.receive({'l': torch.zeros(2, 4, 8, 2, 4)}, {'r': [1]}, axes='KBNHC', remote_order='NHC')\n"
        "heavy = [m for m in ('torch_xla', 'triton', 'nixl', 'nixl_cu12', 'intel_extension_for_pytorch',"
        " 'numba', 'matplotlib') if m in sys.modules]\n"
        "print(heavy)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_cli_info_prints_the_table_and_choice():
    out = subprocess.run(
        [sys.executable, "-m", "kvhost_tools.cli", "info"], capture_output=True, text=True, check=True
    ).stdout
    assert "cpu" in out and "torch" in out and "available" in out
    assert "cpu        -> cpu" in out


# --- the registry in this process, over a distribution of probe backends on sys.path ----

PROBE_MODULE = """
from kvhost.backend import Backend
from kvhost.torch_backend import TorchBackend

SWITCH = {"absent": "the probe device is not installed"}


class Low(TorchBackend):
    name, device_types, priority = "probe", ("cpu",), 1


class High(TorchBackend):
    name, device_types, priority = "probe", ("cpu",), 5


class Same(TorchBackend):  # as High's priority, listed after it: the first one stays
    name, device_types, priority = "probe", ("cpu",), 5


class Anywhere(TorchBackend):  # as High's priority, but "*": a named device type goes first
    name, device_types, priority = "probe-any", ("*",), 5


class Absent(TorchBackend):
    name, device_types, priority = "probe-absent", ("cpu", "meta"), 100

    @classmethod
    def unavailable_reason(cls):
        return SWITCH["absent"]


class Raising(TorchBackend):
    name, device_types, priority = "probe-raising", ("cpu",), 50

    @classmethod
    def unavailable_reason(cls):
        raise RuntimeError("driver query failed")


class Plain(Backend):  # no priority of its own; hands its work to the torch path
    name, device_types = "probe-plain", ("hpu",)

    def receive(self, job):
        TorchBackend().receive(job)

    def copy(self, job):
        return TorchBackend().copy(job)


NOT_A_BACKEND = 3
"""

PROBE_ENTRY_POINTS = """
[kvhost.probe-backends]
broken = kvhost_registry_probe_missing:Nothing
low = kvhost_registry_probe:Low
high = kvhost_registry_probe:High
same = kvhost_registry_probe:Same
any = kvhost_registry_probe:Anywhere
absent = kvhost_registry_probe:Absent
raising = kvhost_registry_probe:Raising
plain = kvhost_registry_probe:Plain
wrong = kvhost_registry_probe:NOT_A_BACKEND

[kvhost.probe-unusable]
absent = kvhost_registry_probe:Absent
raising = kvhost_registry_probe:Raising

[kvhost.probe-none]
"""


@pytest.fixture
def probes(tmp_path, monkeypatch):
    """A distribution (a module and its dist-info) on sys.path: importlib.metadata finds its
    entry points as it finds an installed plugin's."""
    (tmp_path / "kvhost_registry_probe.py").write_text(PROBE_MODULE)
    info = tmp_path / "kvhost_registry_probe-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: kvhost-registry-probe\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text(PROBE_ENTRY_POINTS)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delenv("KVHOST_BACKEND", raising=False)
    import kvhost_registry_probe

    yield kvhost_registry_probe
    sys.modules.pop("kvhost_registry_probe", None)


def test_the_registry_keeps_the_highest_priority_class_of_a_name_and_reports_what_failed(probes, tmp_path):
    from kvhost.registry import BackendInfo, Registry

    probe = Registry("kvhost.probe-backends")
    classes = probe.classes()
    assert classes["probe"] is probes.High  # over Low (lower) and Same (equal, listed later)
    assert sorted(classes) == ["probe", "probe-absent", "probe-any", "probe-plain", "probe-raising"]
    rows = {row.name: row for row in probe.info()}
    assert rows["probe-plain"] == BackendInfo("probe-plain", ("hpu",), 0, "kvhost_registry_probe:Plain", None)
    assert (
        rows["probe-absent"].unavailable == "the probe device is not installed" and not rows["probe-absent"].available
    )
    assert rows["probe-raising"].unavailable == "availability check failed: RuntimeError: driver query failed"
    broken = rows["broken"]
    assert (broken.device_types, broken.priority, broken.source) == ((), 0, "kvhost_registry_probe_missing:Nothing")
    assert broken.unavailable.startswith("failed to load: ModuleNotFoundError")
    wrong = "kvhost_registry_probe:NOT_A_BACKEND"
    assert rows["wrong"] == BackendInfo("wrong", (), 0, wrong, f"{wrong} is not a kvhost Backend")
    assert rows["probe"].source == "kvhost_registry_probe:High"  # the entry point whose class was kept
    assert repr(probe.instance("probe")) == "<kvhost backend 'probe' for cpu>"
    assert probe.instance("probe") is probe.instance("probe")
    assert probe.instance("probe-plain").describe() == ""
    # Entry points are read once: a distribution removed afterwards changes nothing.
    (tmp_path / "kvhost_registry_probe-1.0.dist-info" / "entry_points.txt").unlink()
    assert probe.classes() is classes and sorted(classes)[0] == "probe"
    assert Registry("kvhost.probe-backends").classes() == {}  # a new registry reads them again


def test_the_registry_names_why_a_backend_cannot_be_had(probes):
    from kvhost.registry import Registry

    probe = Registry("kvhost.probe-backends")
    known = "probe, probe-absent, probe-any, probe-plain, probe-raising"
    with pytest.raises(kvhost.BackendError, match=rf"backend 'nonesuch' is not registered \(registered: {known}\)"):
        probe.instance("nonesuch")
    with pytest.raises(kvhost.BackendError, match=r"backend 'broken' failed to load: ModuleNotFoundError"):
        probe.instance("broken")
    with pytest.raises(kvhost.BackendError, match="backend 'probe-absent' cannot run here: the probe device is not"):
        probe.instance("probe-absent")
    with pytest.raises(kvhost.BackendError, match=r"backend 'torch' is not registered \(registered: none\)"):
        Registry("kvhost.probe-none").instance("torch")
    with pytest.raises(kvhost.BackendError, match=r"no usable backend for device type 'cpu' \(none registered\)"):
        Registry("kvhost.probe-none").for_device("cpu")
    with pytest.raises(
        kvhost.BackendError,
        match=r"device type 'cpu' \(probe-absent: the probe device is not installed; "
        r"probe-raising: availability check failed: RuntimeError: driver query failed\)",
    ):
        Registry("kvhost.probe-unusable").for_device("cpu")


def test_the_registry_chooses_by_priority_then_named_types_and_keeps_its_choice_until_cleared(probes, monkeypatch):
    from kvhost.registry import Registry

    probe = Registry("kvhost.probe-backends")
    # cpu: probe-absent (100) and probe-raising (50) cannot run; probe and probe-any tie at 5.
    assert probe.for_device("cpu").name == "probe"
    assert probe.for_device("meta").name == "probe-any" and probe.for_device("xla").name == "probe-any"
    monkeypatch.setitem(probes.SWITCH, "absent", None)  # the device appears
    assert probe.for_device("cpu").name == "probe"  # the choice is kept...
    probe.clear()
    assert probe.for_device("cpu").name == "probe-absent"  # ...until cleared
    monkeypatch.setenv("KVHOST_BACKEND", "probe-any")
    assert probe.for_device("cpu").name == "probe-any"
    monkeypatch.setenv("KVHOST_BACKEND", "probe-plain")  # it does not serve cpu: ignored for it
    assert probe.for_device("cpu").name == "probe-absent" and probe.for_device("hpu").name == "probe-plain"


def _readme_priorities() -> dict[str, int]:
    """The priority column of README's `kvhost info` example."""
    readme = (Path(__file__).parent.parent / "README.md").read_text()
    table = readme.split("  name       devices      priority  status\n", 1)[1].split("chosen per visible device", 1)[0]
    return {row.split()[0]: int(row.split()[2]) for row in table.splitlines()}


@pytest.mark.parametrize("name", ["torch", "cpu", "cuda", "tpu", "xpu"])
def test_each_backends_priority_is_the_one_readme_shows(name):
    """Plugins choose theirs against these (docs/plugins.md): they are part of the contract."""
    priorities = {row.name: row.priority for row in registry.info()}
    assert _readme_priorities()[name] == priorities[name]
