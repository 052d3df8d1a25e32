"""Backend lookup: by device type, through entry points, lazily, with KVHOST_BACKEND."""

from __future__ import annotations

import os
import re
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
    with pytest.raises(kvhost.BackendError, match=r"^KVHOST_BACKEND='nonesuch' names no registered backend \([^)]*\)$"):
        kvhost.get_backend("cpu")


def test_override_that_does_not_serve_the_device_is_ignored_for_it(monkeypatch):
    monkeypatch.setenv("KVHOST_BACKEND", "cpu")
    assert kvhost.get_backend("meta").name == "torch"


def test_named_backend_must_serve_the_device():
    with pytest.raises(kvhost.BackendError, match="'cpu' does not serve device type 'meta'"):
        kvhost.get_backend("meta", name="cpu")


@pytest.mark.parametrize("name", [["cpu"], 5, b"cpu"])
def test_a_backend_name_that_is_not_a_string_is_refused(name):
    with pytest.raises(kvhost.BackendError, match=f"a backend's name must be a string, got {re.escape(repr(name))}"):
        kvhost.get_backend("cpu", name=name)


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
from kvhost_torch.backend import TorchBackend

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


class BrokenStart(TorchBackend):
    name, device_types, priority = "probe-broken-start", ("cpu",), 60

    def __init__(self):
        raise RuntimeError("device runtime init failed")


class Abstract(Backend):  # no receive or copy: it cannot be made
    name, device_types, priority = "probe-abstract", ("cpu",), 70


class NoName(Backend):
    device_types = ("cpu",)

    def receive(self, job):
        TorchBackend().receive(job)

    def copy(self, job):
        return TorchBackend().copy(job)


class EmptyName(TorchBackend):
    name, device_types = "", ("cpu",)


class TextPriority(TorchBackend):
    name, device_types, priority = "probe-text-priority", ("cpu",), "10"


class BoolPriority(TorchBackend):
    name, device_types, priority = "probe-bool-priority", ("cpu",), True


class TextTypes(TorchBackend):
    name, device_types = "probe-text-types", "hpu"


class MixedTypes(TorchBackend):
    name, device_types = "probe-mixed-types", ("hpu", 3)


class SetTypes(TorchBackend):  # any collection of strs will do; kvhost info lists them sorted
    name, device_types, priority = "probe-set-types", frozenset({"meta", "hpu"}), 2


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

[kvhost.probe-unstartable]
broken-start = kvhost_registry_probe:BrokenStart
abstract = kvhost_registry_probe:Abstract

[kvhost.probe-unstartable-then-low]
broken-start = kvhost_registry_probe:BrokenStart
abstract = kvhost_registry_probe:Abstract
low = kvhost_registry_probe:Low

[kvhost.probe-malformed]
bad-bool-priority = kvhost_registry_probe:BoolPriority
bad-empty-name = kvhost_registry_probe:EmptyName
bad-mixed-types = kvhost_registry_probe:MixedTypes
bad-no-name = kvhost_registry_probe:NoName
bad-text-priority = kvhost_registry_probe:TextPriority
bad-text-types = kvhost_registry_probe:TextTypes
good = kvhost_registry_probe:Low
set-types = kvhost_registry_probe:SetTypes
"""


@pytest.fixture
def install(tmp_path, monkeypatch):
    """Installs a distribution (a module and its dist-info) in a directory of its own, put
    first on sys.path: importlib.metadata finds its entry points as it finds an installed
    plugin's. Its module is forgotten after the test."""
    modules: list[str] = []

    def install(module: str, source: str, entry_points: str) -> None:
        site = tmp_path / module
        info = site / f"{module}-1.0.dist-info"
        info.mkdir(parents=True)
        (site / f"{module}.py").write_text(source)
        name = module.replace("_", "-")
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: 1.0\n")
        (info / "entry_points.txt").write_text(entry_points)
        monkeypatch.syspath_prepend(str(site))
        modules.append(module)

    monkeypatch.delenv("KVHOST_BACKEND", raising=False)
    yield install
    for module in modules:
        sys.modules.pop(module, None)


@pytest.fixture
def probes(install):
    install("kvhost_registry_probe", PROBE_MODULE, PROBE_ENTRY_POINTS)
    import kvhost_registry_probe

    return kvhost_registry_probe


def test_the_registry_keeps_the_first_class_of_a_name_and_reports_what_failed(probes, tmp_path):
    from kvhost.registry import BackendInfo, Registry

    probe = Registry("kvhost.probe-backends")
    classes = probe.classes()
    # Loaded by entry point name: "high" before "low" and "same", whatever their priorities.
    assert classes["probe"] is probes.High
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
    for clash in ("low", "same"):
        assert rows[clash] == BackendInfo(
            clash,
            (),
            0,
            f"kvhost_registry_probe:{clash.title()}",
            "backend name 'probe' is already used by entry point 'high' (kvhost_registry_probe:High); "
            f"entry point {clash!r} (kvhost_registry_probe:{clash.title()}) is not registered",
        )
    assert repr(probe.instance("probe")) == "<kvhost backend 'probe' for cpu>"
    assert probe.instance("probe") is probe.instance("probe")
    assert probe.instance("probe-plain").describe() == ""
    # Entry points are read once: a distribution removed afterwards changes nothing.
    (tmp_path / "kvhost_registry_probe" / "kvhost_registry_probe-1.0.dist-info" / "entry_points.txt").unlink()
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


def test_a_backend_that_fails_to_start_is_passed_over_and_named_when_asked_for(probes, monkeypatch):
    from kvhost.registry import Registry

    probe = Registry("kvhost.probe-unstartable-then-low")
    # cpu: probe-abstract (70) and probe-broken-start (60) raise when made; Low (1) serves.
    assert probe.for_device("cpu") is probe.instance("probe")
    rows = {row.name: row for row in probe.info()}
    assert rows["probe-broken-start"].unavailable == "failed to start: RuntimeError: device runtime init failed"
    assert rows["probe-abstract"].unavailable.startswith(
        "failed to start: TypeError: Can't instantiate abstract class Abstract"
    )
    with pytest.raises(
        kvhost.BackendError,
        match=r"^backend 'probe-broken-start' \(kvhost_registry_probe:BrokenStart\) failed to start: "
        r"RuntimeError: device runtime init failed$",
    ):
        probe.instance("probe-broken-start")
    monkeypatch.setenv("KVHOST_BACKEND", "probe-abstract")  # asked for by name: an error, no fallback
    with pytest.raises(
        kvhost.BackendError,
        match=r"^backend 'probe-abstract' \(kvhost_registry_probe:Abstract\) failed to start: TypeError: Can't",
    ):
        probe.for_device("cpu")
    monkeypatch.delenv("KVHOST_BACKEND")
    probe.clear()  # a failed start is forgotten with the choices: the next lookup tries again
    assert {row.name: row.unavailable for row in probe.info()}["probe-broken-start"] is None
    with pytest.raises(
        kvhost.BackendError,
        match=r"no usable backend for device type 'cpu' \(probe-abstract \(kvhost_registry_probe:Abstract\): "
        r"failed to start: TypeError: Can't .*; probe-broken-start \(kvhost_registry_probe:BrokenStart\): "
        r"failed to start: RuntimeError: device runtime init failed\)",
    ):
        Registry("kvhost.probe-unstartable").for_device("cpu")


def test_malformed_backend_classes_are_reported_and_the_others_load(probes):
    from kvhost.registry import Registry

    probe = Registry("kvhost.probe-malformed")
    # The bad entry points load before "good" and "set-types": the registry still has those.
    assert probe.classes() == {"probe": probes.Low, "probe-set-types": probes.SetTypes}
    assert probe.for_device("cpu").name == "probe" and probe.for_device("hpu").name == "probe-set-types"
    rows = {row.name: row for row in probe.info()}
    assert rows["probe-set-types"].device_types == ("hpu", "meta")
    no_name = "has no backend name: set the class attribute `name` to a non-empty str"
    types = "device_types must be a collection of str device types, such as ('hpu',), got"
    assert {name: (row.source, row.unavailable) for name, row in rows.items() if name.startswith("bad-")} == {
        "bad-bool-priority": (
            "kvhost_registry_probe:BoolPriority",
            "kvhost_registry_probe:BoolPriority: priority must be an int, got True",
        ),
        "bad-empty-name": ("kvhost_registry_probe:EmptyName", f"kvhost_registry_probe:EmptyName {no_name}"),
        "bad-mixed-types": (
            "kvhost_registry_probe:MixedTypes",
            f"kvhost_registry_probe:MixedTypes: {types} ('hpu', 3)",
        ),
        "bad-no-name": ("kvhost_registry_probe:NoName", f"kvhost_registry_probe:NoName {no_name}"),
        "bad-text-priority": (
            "kvhost_registry_probe:TextPriority",
            "kvhost_registry_probe:TextPriority: priority must be an int, got '10'",
        ),
        "bad-text-types": ("kvhost_registry_probe:TextTypes", f"kvhost_registry_probe:TextTypes: {types} 'hpu'"),
    }
    with pytest.raises(kvhost.BackendError, match=r"^backend 'bad-no-name' kvhost_registry_probe:NoName has no"):
        probe.instance("bad-no-name")


PLUGIN_MODULE = """
from kvhost_torch.backend import TorchBackend


class BrokenStart(TorchBackend):
    name, device_types, priority = "plugin-broken-start", ("cpu",), 20

    def __init__(self):
        raise RuntimeError("device runtime init failed")


class NamedCpu(TorchBackend):
    name, device_types, priority = "cpu", ("hpu",), 10

    @classmethod
    def unavailable_reason(cls):
        return "habana_frameworks is not installed"


class Unnamed(TorchBackend):  # no name of its own: it inherits "torch"
    device_types, priority = ("hpu",), 10
"""

PLUGIN_ENTRY_POINTS = """
[kvhost.backends]
plugin-broken-start = kvhost_registry_plugin:BrokenStart
my-cpu = kvhost_registry_plugin:NamedCpu
my-hpu = kvhost_registry_plugin:Unnamed
"""


def test_kvhosts_own_backends_keep_their_names_and_serve_past_a_plugin_that_fails(install, monkeypatch):
    from kvhost_cpu import CpuBackend
    from kvhost_torch.backend import TorchBackend

    from kvhost.registry import Registry

    install("kvhost_registry_plugin", PLUGIN_MODULE, PLUGIN_ENTRY_POINTS)
    plugged = Registry()
    assert plugged.classes()["cpu"] is CpuBackend and plugged.classes()["torch"] is TorchBackend
    rows = {row.name: row for row in plugged.info()}
    assert rows["my-cpu"].unavailable == (
        "backend name 'cpu' is already used by entry point 'cpu' (kvhost_cpu:CpuBackend); "
        "entry point 'my-cpu' (kvhost_registry_plugin:NamedCpu) is not registered"
    )
    assert rows["my-hpu"].unavailable == (
        "backend name 'torch' is already used by entry point 'torch' (kvhost_torch:TorchBackend); "
        "entry point 'my-hpu' (kvhost_registry_plugin:Unnamed) is not registered"
    )
    # plugin-broken-start (20) is tried first for cpu, fails to start, and kvhost's cpu serves.
    assert plugged.for_device("cpu") is plugged.instance("cpu") and plugged.for_device("meta").name == "torch"
    failed = r"^backend 'plugin-broken-start' \(kvhost_registry_plugin:BrokenStart\) failed to start: RuntimeError"
    with pytest.raises(kvhost.BackendError, match=failed):
        plugged.instance("plugin-broken-start")
    monkeypatch.setenv("KVHOST_BACKEND", "plugin-broken-start")
    with pytest.raises(kvhost.BackendError, match=failed):
        plugged.for_device("cpu")


def test_of_two_plugins_with_one_name_the_first_by_distribution_is_kept_wherever_it_is(probes, install):
    from importlib.metadata import entry_points

    from kvhost.registry import Registry

    rival = "from kvhost_torch.backend import TorchBackend\n\n\nclass Rival(TorchBackend):\n"
    rival += '    name, device_types, priority = "probe", ("cpu",), 99\n'
    install("kvhost_registry_probe_rival", rival, "[kvhost.probe-backends]\naaa = kvhost_registry_probe_rival:Rival\n")
    assert next(iter(entry_points(group="kvhost.probe-backends"))).name == "aaa"  # first on sys.path
    probe = Registry("kvhost.probe-backends")
    # Distribution kvhost-registry-probe sorts before kvhost-registry-probe-rival: its High
    # keeps the name although the rival's priority is higher and it is found first.
    assert probe.classes()["probe"] is probes.High
    assert {row.name: row.unavailable for row in probe.info()}["aaa"] == (
        "backend name 'probe' is already used by entry point 'high' (kvhost_registry_probe:High); "
        "entry point 'aaa' (kvhost_registry_probe_rival:Rival) is not registered"
    )


@pytest.mark.parametrize("device", ["gpu", "cuda:x", 3.5])
def test_a_device_torch_cannot_parse_is_a_backend_error_naming_it(device):
    message = re.escape(f"no backend for device {device!r}: torch.device() does not accept it")
    with pytest.raises(kvhost.BackendError, match=message):
        kvhost.get_backend(device)
    with pytest.raises(kvhost.BackendError, match=message):
        kvhost.get_backend(device, "cpu")


def test_hand_made_entry_points_load_and_device_types_keep_their_own_order(probes, monkeypatch):
    """An entry point with no distribution behind it (made by hand, as a test harness or an
    embedding application may) is loaded; a backend's device types are listed in its own
    order, and a set of them sorted."""
    from importlib.metadata import EntryPoint

    from kvhost import registry as registry_module

    probes.Ordered = type("Ordered", (probes.Low,), {"name": "probe-ordered", "device_types": ("meta", "cpu")})
    probes.Unordered = type(
        "Unordered", (probes.Low,), {"name": "probe-unordered", "device_types": frozenset({"meta", "cpu"})}
    )
    group = "kvhost.probe-by-hand"
    points = [EntryPoint(name, f"kvhost_registry_probe:{name.title()}", group) for name in ("ordered", "unordered")]
    assert all(point.dist is None for point in points)
    monkeypatch.setattr(registry_module, "entry_points", lambda group: points)
    rows = {row.name: row for row in registry_module.Registry(group).info()}
    assert rows["probe-ordered"].device_types == ("meta", "cpu")
    assert rows["probe-unordered"].device_types == ("cpu", "meta")
    assert rows["probe-ordered"].available and rows["probe-unordered"].available


HOSTILE_MODULE = """
import sys

from kvhost_torch.backend import TorchBackend


class Unreadable(Exception):
    def __str__(self):
        raise ValueError("no words")


class ExitingCheck(TorchBackend):
    name, device_types, priority = "probe-exit-check", ("cpu",), 90

    @classmethod
    def unavailable_reason(cls):
        sys.exit(3)


class UnreadableCheck(TorchBackend):
    name, device_types, priority = "probe-unreadable-check", ("cpu",), 85

    @classmethod
    def unavailable_reason(cls):
        raise Unreadable()


class FalseCheck(TorchBackend):  # a bool, as is_available() would give: not the contract
    name, device_types, priority = "probe-false-check", ("cpu",), 80

    @classmethod
    def unavailable_reason(cls):
        return False


class EmptyCheck(TorchBackend):
    name, device_types, priority = "probe-empty-check", ("cpu",), 78

    @classmethod
    def unavailable_reason(cls):
        return ""


class LongCheck(TorchBackend):  # an answer whose repr is long: cut for the listing
    name, device_types, priority = "probe-long-check", ("cpu",), 77

    @classmethod
    def unavailable_reason(cls):
        return list(range(40))


class SixtyCheck(TorchBackend):  # a repr of exactly 60 characters: kept whole
    name, device_types, priority = "probe-sixty-check", ("cpu",), 76

    @classmethod
    def unavailable_reason(cls):
        return b"x" * 57


class SixtyOneCheck(TorchBackend):  # one character more: cut
    name, device_types, priority = "probe-sixty-one-check", ("cpu",), 76

    @classmethod
    def unavailable_reason(cls):
        return b"x" * 58


class ExitStart(TorchBackend):
    name, device_types, priority = "probe-exit-start", ("cpu",), 75

    def __init__(self):
        raise SystemExit(4)


class ServesRaise(TorchBackend):
    name, device_types, priority = "probe-serves-raise", ("cpu",), 70

    @classmethod
    def serves(cls, device_type):
        raise RuntimeError("serves broke")


class Fine(TorchBackend):
    name, device_types, priority = "probe-fine", ("cpu",), 1


class InterruptCheck(TorchBackend):
    name, device_types = "probe-interrupt-check", ("cpu",)

    @classmethod
    def unavailable_reason(cls):
        raise KeyboardInterrupt


class InterruptStart(TorchBackend):
    name, device_types = "probe-interrupt-start", ("cpu",)

    def __init__(self):
        raise KeyboardInterrupt


class InterruptServes(TorchBackend):
    name, device_types = "probe-interrupt-serves", ("cpu",)

    @classmethod
    def serves(cls, device_type):
        raise KeyboardInterrupt


class NoCompletion(TorchBackend):
    name, device_types, priority = "probe-no-completion", ("cpu",), 0

    def copy(self, job):
        super().copy(job)
        return None
"""

HOSTILE_ENTRY_POINTS = """
[kvhost.probe-hostile]
exits-on-import = kvhost_registry_exits:Nothing
exit-check = kvhost_registry_hostile:ExitingCheck
unreadable-check = kvhost_registry_hostile:UnreadableCheck
false-check = kvhost_registry_hostile:FalseCheck
empty-check = kvhost_registry_hostile:EmptyCheck
long-check = kvhost_registry_hostile:LongCheck
sixty-check = kvhost_registry_hostile:SixtyCheck
sixty-one-check = kvhost_registry_hostile:SixtyOneCheck
exit-start = kvhost_registry_hostile:ExitStart
serves-raise = kvhost_registry_hostile:ServesRaise
fine = kvhost_registry_hostile:Fine
no-completion = kvhost_registry_hostile:NoCompletion

[kvhost.probe-interrupt-import]
interrupts = kvhost_registry_interrupts:Nothing

[kvhost.probe-interrupt-check]
check = kvhost_registry_hostile:InterruptCheck

[kvhost.probe-interrupt-start]
start = kvhost_registry_hostile:InterruptStart

[kvhost.probe-interrupt-serves]
serves = kvhost_registry_hostile:InterruptServes
"""


def test_ctrl_c_inside_a_plugin_is_not_taken_for_its_failure(install):
    """Only KeyboardInterrupt goes through a plugin's code to the caller: an operator's
    Ctrl-C during a slow import or check must stop the program, not pass the backend over."""
    from kvhost.registry import Registry

    install("kvhost_registry_interrupts", "raise KeyboardInterrupt\n", "")
    install("kvhost_registry_hostile", HOSTILE_MODULE, HOSTILE_ENTRY_POINTS)
    for group in ("import", "check", "start", "serves"):
        with pytest.raises(KeyboardInterrupt):
            Registry(f"kvhost.probe-interrupt-{group}").for_device("cpu")


def test_a_hostile_plugin_is_passed_over_and_named_and_ends_no_program(install, monkeypatch):
    """A plugin that exits on import or in its checks, answers its availability with a bool
    or an empty str, raises from ``serves`` or an exception with no readable message: each
    is listed with what is wrong, and the backend that works is chosen."""
    from kvhost.registry import Registry

    install("kvhost_registry_exits", "import sys\nsys.exit(3)\n", "")
    install("kvhost_registry_hostile", HOSTILE_MODULE, HOSTILE_ENTRY_POINTS)
    import kvhost_registry_hostile as hostile

    probe = Registry("kvhost.probe-hostile")
    assert probe.for_device("cpu").name == "probe-fine"
    why = {row.name: row.unavailable for row in probe.info()}
    assert why["exits-on-import"] == "failed to load: SystemExit: 3"
    assert why["probe-exit-check"] == "availability check failed: SystemExit: 3"
    assert why["probe-unreadable-check"] == "availability check failed: Unreadable: (its message could not be read)"
    assert why["probe-false-check"] == (
        "availability check returned False, not None (usable) or a reason (a non-empty str)"
    )
    assert why["probe-empty-check"] == "availability check returned '', not None (usable) or a reason (a non-empty str)"
    assert why["probe-exit-start"] == "failed to start: SystemExit: 4"
    long = repr(list(range(40)))[:57] + "..."
    assert (
        why["probe-long-check"]
        == f"availability check returned {long}, not None (usable) or a reason (a non-empty str)"
    )
    sixty = repr(b"x" * 57)
    assert len(sixty) == 60
    assert (
        why["probe-sixty-check"]
        == f"availability check returned {sixty}, not None (usable) or a reason (a non-empty str)"
    )
    reason = "not None (usable) or a reason (a non-empty str)"
    assert why["probe-sixty-one-check"] == f"availability check returned {repr(b'x' * 58)[:57]}..., {reason}"
    from kvhost.registry import _serves

    assert _serves(hostile.ServesRaise, "cpu") is False and _serves(hostile.Fine, "cpu") is True
    assert why["probe-fine"] is None
    monkeypatch.setenv("KVHOST_BACKEND", "exits-on-import")
    with pytest.raises(kvhost.BackendError, match=r"names no registered backend .*: backend 'exits-on-import' failed"):
        probe.for_device("cpu")
    with pytest.raises(kvhost.BackendError, match=r"'probe-false-check' cannot run here: availability check returned"):
        probe.instance("probe-false-check")
    with pytest.raises(kvhost.BackendError, match=r"'probe-exit-start' .* failed to start: SystemExit: 4"):
        probe.instance("probe-exit-start")


def test_a_lookup_waits_only_for_the_plugins_it_asks(probes, monkeypatch):
    """A plugin whose availability check takes a second, on one thread's first lookup of its
    device type, holds no other thread's lookup of a backend already chosen or started, nor
    a first lookup of another type, nor a backend asked for by a name it does not check."""
    import threading
    import time

    from kvhost.registry import Registry

    probe = Registry("kvhost.probe-backends")
    chosen, named = probe.for_device("cpu"), probe.instance("probe-any")
    entered = threading.Event()

    def slow(cls):
        entered.set()
        time.sleep(1.0)
        return "slow"

    monkeypatch.setattr(probes.Absent, "unavailable_reason", classmethod(slow))
    first = threading.Thread(target=lambda: probe.for_device("meta"))
    first.start()
    assert entered.wait(5)
    started = time.monotonic()
    assert probe.for_device("cpu") is chosen and probe.instance("probe-any") is named
    assert probe.for_device("hpu") is named and probe.instance("probe-plain").name == "probe-plain"
    assert time.monotonic() - started < 0.5
    first.join(5)
    assert probe.for_device("meta") is named  # chosen after it was asked for by name: the one instance


def test_a_started_backend_is_had_without_running_its_plugin_code_again(probes, monkeypatch):
    from kvhost.registry import Registry

    probe = Registry("kvhost.probe-backends")
    asked = []
    monkeypatch.setattr(probes.Plain, "unavailable_reason", classmethod(lambda cls: asked.append(cls) or None))
    first = probe.instance("probe-plain")
    assert all(probe.instance("probe-plain") is first for _ in range(3)) and len(asked) == 1


def test_a_copy_that_returns_no_completion_is_refused_naming_the_backend(install):
    from kvhost.registry import Registry

    install("kvhost_registry_hostile", HOSTILE_MODULE, HOSTILE_ENTRY_POINTS)
    backend = Registry("kvhost.probe-hostile").instance("probe-no-completion")
    src, dst = {"l": torch.ones(2, 4, 8, 2, 4)}, {"l": torch.zeros(2, 4, 8, 2, 4)}
    with pytest.raises(kvhost.BackendError, match=r"backend 'probe-no-completion': copy returned NoneType, not a"):
        kvhost.copy_blocks(src, dst, [1], [2], axes="KBNHC", backend=backend)


@pytest.mark.parametrize(("override", "code"), [("bogus", 1), ("torch", 0)])
def test_kvhost_info_names_the_override_and_fails_when_a_device_has_no_backend(override, code):
    """A per-backend CI job that runs ``KVHOST_BACKEND=name kvhost info`` learns from the exit
    status that the name serves nothing here."""
    out = subprocess.run(
        [sys.executable, "-m", "kvhost_tools.cli", "info"],
        capture_output=True, text=True, env={**os.environ, "KVHOST_BACKEND": override},
    )  # fmt: skip
    assert out.returncode == code, out.stdout + out.stderr
    assert (
        f"chosen per visible device (KVHOST_BACKEND={override!r}, for the device types that backend serves):"
        in out.stdout
    )
    assert ("cpu        -> none: KVHOST_BACKEND='bogus' names no registered backend" in out.stdout) == (code == 1)


def test_kvhost_info_lists_every_device_when_a_backend_cannot_describe_itself(monkeypatch, capsys):
    from kvhost_tools import cli

    def broken(self):
        raise RuntimeError("no words")

    monkeypatch.setattr(type(registry.for_device("cpu")), "describe", broken)
    assert cli.main(["info"]) == 0
    assert "  cpu        -> cpu (describe() failed: RuntimeError: no words)" in capsys.readouterr().out


def test_a_distribution_without_metadata_breaks_no_lookup(install, tmp_path, monkeypatch):
    """A dist-info whose METADATA is gone (an interrupted install) has no name: its entry
    points are loaded after the named ones, and every other backend is found as before.
    The sort that orders them had raised an AttributeError on every lookup, cpu's too."""
    from importlib.metadata import entry_points

    from kvhost.registry import Registry

    site = tmp_path / "nameless"
    (site / "kvhost_nameless-0.1.dist-info").mkdir(parents=True)
    (site / "kvhost_nameless-0.1.dist-info" / "entry_points.txt").write_text(
        "[kvhost.backends]\nnameless = kvhost_nameless_missing:Backend\n"
    )
    monkeypatch.syspath_prepend(str(site))
    nameless = [p for p in entry_points(group="kvhost.backends") if p.name == "nameless"]
    assert len(nameless) == 1 and nameless[0].dist is not None and nameless[0].dist.name is None
    probe = Registry()
    assert probe.for_device("cpu").name == "cpu" and probe.for_device("meta").name == "torch"
    rows = {row.name: row for row in probe.info()}
    assert rows["nameless"].unavailable.startswith("failed to load: ModuleNotFoundError")


def test_entry_points_that_cannot_be_read_are_a_backend_error(monkeypatch):
    from kvhost import registry as registry_module

    def unreadable(group):
        raise ValueError("malformed entry_points.txt")

    monkeypatch.setattr(registry_module, "entry_points", unreadable)
    probe = registry_module.Registry()
    for _ in range(2):  # and again on the next lookup: a failed load leaves no load under way
        with pytest.raises(
            kvhost.BackendError,
            match=r"^the installed packages' 'kvhost.backends' entry points cannot be read: ValueError: malformed",
        ):
            probe.for_device("cpu")
    monkeypatch.undo()
    assert probe.for_device("cpu").name == "cpu"  # readable again: loaded then


def test_at_equal_priority_kvhost_s_own_backend_is_chosen_before_a_plugin_s(install):
    """A plugin at cpu's priority whose name sorts first does not silently take cpu tensors
    from kvhost's own backend (a higher priority does); among plugins, the name decides."""
    from kvhost.registry import Registry

    source = """
from kvhost_torch.backend import TorchBackend


class Same(TorchBackend):
    name, device_types, priority = "aaa-host", ("cpu",), 0


class Higher(TorchBackend):
    name, device_types, priority = "zzz-host", ("cpu",), 1


class HpuA(TorchBackend):
    name, device_types, priority = "aaa-hpu", ("hpu",), 7


class HpuB(HpuA):
    name = "bbb-hpu"
"""
    points = "[kvhost.backends]\nsame = kvhost_registry_ties:Same\nhpu-b = kvhost_registry_ties:HpuB\n"
    install("kvhost_registry_ties", source, points + "hpu-a = kvhost_registry_ties:HpuA\n")
    probe = Registry()
    assert probe.for_device("cpu").name == "cpu"
    assert probe.for_device("hpu").name == "aaa-hpu"
    install("kvhost_registry_ties_higher", "from kvhost_registry_ties import Higher\n",
            "[kvhost.backends]\nhigher = kvhost_registry_ties_higher:Higher\n")  # fmt: skip
    assert Registry().for_device("cpu").name == "zzz-host"


def test_a_backend_refused_at_load_is_explained_when_asked_for_by_its_own_name(probes, install, monkeypatch):
    """The backend's name need not be its entry point's: asked for by either, the refusal says
    why. Only a class is a backend by its name: an instance's, or a name that is no str (a
    list, which no table could be keyed by), explains nothing and breaks no lookup."""
    from kvhost.registry import Registry

    source = "from kvhost_registry_probe import Low\n\n\nclass ListName(Low):\n    name = ['probe-listed']\n\n\n"
    source += "INSTANCE = Low()\nINSTANCE.name = 'probe-instance'\n"
    points = (
        "[kvhost.probe-odd-names]\nlisted = kvhost_registry_odd:ListName\ninstance = kvhost_registry_odd:INSTANCE\n"
    )
    install("kvhost_registry_odd", source, points + "low = kvhost_registry_probe:Low\n")
    odd = Registry("kvhost.probe-odd-names")
    assert odd.for_device("cpu").name == "probe"
    with pytest.raises(
        kvhost.BackendError, match=r"^backend 'probe-instance' is not registered \(registered: probe\)$"
    ):
        odd.instance("probe-instance")

    probe = Registry("kvhost.probe-malformed")
    why = r"\(entry point 'bad-text-priority'\) kvhost_registry_probe:TextPriority: priority must be an int, got '10'"
    with pytest.raises(kvhost.BackendError, match=rf"^backend 'probe-text-priority' {why} \(registered: "):
        probe.instance("probe-text-priority")
    monkeypatch.setenv("KVHOST_BACKEND", "probe-text-priority")
    with pytest.raises(
        kvhost.BackendError, match=rf"names no registered backend .*: backend 'probe-text-priority' {why}$"
    ):
        probe.for_device("cpu")


def test_kvhost_info_shows_a_backend_that_failed_to_start_and_a_plugin_s_devices(probes, install, monkeypatch, capsys):
    """The table is printed after the choice, so a backend whose constructor raised while
    it was chosen is not listed as available; a plugin's device type whose torch module
    says it has devices is listed with them."""
    import types

    from kvhost import registry as registry_module
    from kvhost_tools import cli

    source = "from kvhost_registry_probe import Low\n\n\nclass Device(Low):\n"
    source += '    name, device_types = "probe-device", ("hpu",)\n'
    points = "[kvhost.probe-info]\nbroken-start = kvhost_registry_probe:BrokenStart\nlow = kvhost_registry_probe:Low\n"
    install("kvhost_registry_info", source, points + "device = kvhost_registry_info:Device\n")
    monkeypatch.setattr(registry_module, "registry", registry_module.Registry("kvhost.probe-info"))
    devices = types.SimpleNamespace(is_available=lambda: True, device_count=lambda: 2)
    monkeypatch.setattr(torch, "hpu", devices, raising=False)
    assert cli.main(["info"]) == 0
    rows = {line.split()[0]: line for line in capsys.readouterr().out.splitlines()}
    assert rows["probe-broken-start"].endswith("unavailable: failed to start: RuntimeError: device runtime init failed")
    assert rows["cpu"] == "  cpu        -> probe"
    assert rows["hpu:0"] == rows["hpu:1"].replace(":1", ":0") == "  hpu:0      -> probe-device"


def test_a_plugin_that_looks_a_backend_up_as_it_is_imported_is_refused_and_the_choice_is_kept_whole(
    probes, install, monkeypatch
):
    """Looked up during the entry points' import, a registry would hold only the plugins before
    the caller, and a choice made then (a device's best backend, cached) could miss a better one
    loaded after. The lookup is refused with a reason the plugin's row shows; the plugin after
    it (the higher priority) is chosen, and the next lookup loads nothing again."""
    from kvhost import registry as registry_module
    from kvhost.registry import Registry

    source = (
        "import kvhost\nfrom kvhost_registry_probe import Low\n\nFOUND = kvhost.get_backend('cpu')\n\n\n"
        "class Eager(Low):\n    name, priority = 'probe-eager', 3\n"
    )
    install("kvhost_registry_eager", source, "[kvhost.probe-eager]\na-eager = kvhost_registry_eager:Eager\n")
    install("kvhost_registry_later", "", "[kvhost.probe-eager]\nb-high = kvhost_registry_probe:High\n")
    probe = Registry("kvhost.probe-eager")
    monkeypatch.setattr(registry_module, "registry", probe)  # what kvhost.get_backend asks
    assert kvhost.get_backend("cpu").name == "probe" and kvhost.get_backend("cpu").priority == 5
    why = {row.name: row.unavailable for row in probe.info()}
    assert why == {
        "a-eager": "failed to load: BackendError: a backend was looked up while kvhost imports the backends' "
        "entry points (from a plugin's import): look it up after the import, when one is needed",
        "probe": None,
    }
    assert "kvhost_registry_eager" not in sys.modules or not hasattr(sys.modules["kvhost_registry_eager"], "Eager")
    assert probe.classes() is probe.classes()  # loaded once: a later lookup imports nothing again


def test_the_core_imports_no_backend_and_touches_no_stream():
    """docs/design.md: the core knows nothing of streams or devices; backends are packages it
    finds through entry points, never imports. Read from the source, so that a stream call
    on a path no test takes is caught too."""
    import ast
    from pathlib import Path

    core = Path(kvhost.__file__).parent
    device_calls = ("torch.cuda", "torch.xpu", "torch.accelerator", "torch.Stream", "torch.Event", "current_stream")
    found = []
    for path in sorted(core.rglob("*.py")):
        tree = ast.parse(path.read_text(), str(path))
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                modules = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                modules = [node.module or ""]
            else:
                modules = []
            found += [f"{path.name}: imports {m}" for m in modules if m.startswith("kvhost_")]
            if isinstance(node, ast.Attribute | ast.Name):
                name = ast.unparse(node)
                found += [f"{path.name}: {name}" for call in device_calls if name == call]
    assert found == []
