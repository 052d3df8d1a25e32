"""The CUDA/XPU backends' behaviour that needs no device, and device checks that skip without one.

Here: availability messages, lazy imports, which path (Triton or torch) each device
takes, completion handles, and the host-copy routes (direct runs, staged save and load)
run by the shared accelerator class with the CPU standing in for the device. The
conformance suite runs the ``cuda``/``xpu`` targets where the devices exist.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import gc
import importlib
import itertools
import json
import subprocess
import sys
import types
import warnings
import weakref
from functools import cached_property
from pathlib import Path
from types import ModuleType

import kvhost_accelerator.backend as accelerator_backend
import numpy as np
import pytest
import torch
from kvhost_accelerator.backend import AcceleratorBackend, EventCompletion, _HostSides, _is_arange, load_kernels
from kvhost_accelerator.launch import Limits, plan_copy_launch
from kvhost_accelerator.runtime import DeviceRuntime, SynchronousRuntime
from kvhost_cuda import CudaBackend
from kvhost_torch.backend import IndexBuffers, call_scratch
from kvhost_xpu import XpuBackend
from kvhost_xpu.backend import load_ipex_if_needed
from test_nixl import needs_nixl

import kvhost
from kvhost.backend import Completion, OptionalKernels
from kvhost.batch import plan_copy_batch
from kvhost.caches import CacheSet
from kvhost.layout import Layout
from kvhost.registry import registry
from kvhost.stats import CopyResult
from kvhost.testing import CopyCase, fill_random, make_cache, raw
from kvhost.transform import plan_copy, plan_receive
from kvhost_tools.device_checks.gpucheck import (
    Sizes,
    agreement,
    host_profile,
    measure,
    one_request_receive,
    relative_paths,
    table,
)
from kvhost_tools.device_checks.gpucheck import main as gpucheck_main

CUDA = torch.cuda.is_available()
XPU = hasattr(torch, "xpu") and torch.xpu.is_available()


# --- availability and laziness -------------------------------------------------------


@pytest.mark.skipif(CUDA, reason="a CUDA device is present")
def test_cuda_says_why_it_cannot_run():
    assert CudaBackend.unavailable_reason() == "no CUDA device"
    with pytest.raises(kvhost.BackendError, match="backend 'cuda' cannot run here: no CUDA device"):
        kvhost.get_backend("cuda", "cuda")
    rows = {row.name: row for row in registry.info()}
    assert rows["cuda"].unavailable == "no CUDA device" and rows["cuda"].device_types == ("cuda",)


@pytest.mark.skipif(XPU, reason="an XPU device is present")
def test_xpu_says_why_it_cannot_run():
    assert XpuBackend.unavailable_reason() == "no XPU device"
    with pytest.raises(kvhost.BackendError, match="no XPU device"):
        kvhost.get_backend("xpu", "xpu")
    assert {row.name: row for row in registry.info()}["xpu"].unavailable == "no XPU device"


def test_importing_the_backends_imports_no_triton():
    code = (
        "import sys, kvhost, kvhost_cuda, kvhost_xpu\n"
        "kvhost.registry.registry.info()\n"
        "kvhost_cuda.CudaBackend.unavailable_reason(); kvhost_xpu.XpuBackend.unavailable_reason()\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('triton', 'intel_extension_for_pytorch')))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120)
    assert out.stdout.strip() == "[]"


def test_intel_extension_is_not_imported_on_native_xpu_torch():
    assert tuple(int(p) for p in torch.__version__.split(".")[:2]) >= (2, 5)
    assert load_ipex_if_needed() is False
    assert "intel_extension_for_pytorch" not in sys.modules


def test_each_device_says_which_path_runs():
    assert (
        CudaBackend(use_triton=False)
        .describe()
        .startswith("receive and scattered copies: torch ops (Triton switched off)")
    )
    kernels = load_kernels()
    if kernels is None:
        assert "torch ops (triton is not installed)" in CudaBackend().describe()
        return
    if kernels.interpreted():
        assert "TRITON_INTERPRET=1 is set" in CudaBackend().describe()
        assert "TRITON_INTERPRET=1 is set" in XpuBackend().describe()
        return
    compilers = kernels.compiler_targets()
    cuda_compiler = "amd" if torch.version.hip else "nvidia"
    assert ("Triton kernels" in CudaBackend().describe()) == (cuda_compiler in compilers)
    if "intel" not in compilers:
        assert "not intel" in XpuBackend().describe() and "torch ops" in XpuBackend().describe()


@pytest.mark.parametrize("fenced", [True, False], ids=["barrier fences", "barrier does not fence"])
def test_with_kernels_the_description_says_when_a_receive_takes_two_launches(fenced):
    class StandIn(CudaBackend):
        def barrier_orders_global_memory(self) -> bool:
            return fenced

    backend = StandIn()
    backend.__dict__["kernels"] = ModuleType("kernels")  # as where compiled kernels run
    text = backend.describe()
    assert text.startswith("receive and scattered copies: Triton kernels")
    assert ("every receive in two launches" in text) == (not fenced)


@pytest.mark.parametrize(
    ("version", "old"), [("3.1.9", True), ("2.9.0", True), ("3.2.0", False), ("3.10.0", False), ("4.0.0+git1", False)]
)
def test_the_kernels_need_triton_3_2_or_later(monkeypatch, version, old):
    kernels = load_kernels()
    if kernels is None:
        pytest.skip("triton is not installed")
    monkeypatch.setattr(kernels.triton, "__version__", version)
    assert kernels.too_old() == (f"triton {version} is older than 3.2" if old else None)


def test_a_triton_too_old_for_the_kernels_means_torch_ops(monkeypatch):
    kernels = load_kernels()
    if kernels is None or kernels.interpreted():
        pytest.skip("needs compiled Triton kernels")
    monkeypatch.setattr(kernels.triton, "__version__", "3.1.0")
    assert "torch ops (triton 3.1.0 is older than 3.2)" in CudaBackend().describe()


def test_without_triton_the_torch_path_says_so(monkeypatch):
    import kvhost_accelerator.backend as accelerator

    missing = OptionalKernels("json", check=lambda module: "No module named 'triton'")  # what the import says
    monkeypatch.setattr(accelerator, "TRITON_KERNELS", missing)
    backend = CudaBackend()
    assert backend.kernels_missing == "triton is not installed" and backend.kernels is None
    assert "torch ops (triton is not installed)" in backend.describe()


def test_kernels_whose_import_fails_otherwise_say_why_and_the_torch_path_runs(monkeypatch):
    """An import that fails for another reason than a missing triton (a library of its own
    that cannot load) is said, not raised: the backend runs its torch path."""
    import kvhost_accelerator.backend as accelerator

    def unloadable(name, *args, **kwargs):
        if name == "kvhost_accelerator.kernels":
            raise OSError("libtriton.so: failed to map segment from shared object")
        return real_import(name, *args, **kwargs)

    real_import = importlib.import_module
    monkeypatch.setattr(importlib, "import_module", unloadable)
    monkeypatch.setattr(accelerator, "TRITON_KERNELS", OptionalKernels("kvhost_accelerator.kernels"))
    backend = CpuStandIn()
    assert backend.kernels is None
    assert backend.kernels_missing.startswith("the Triton kernels cannot load: OSError: libtriton.so: failed to map")
    assert "torch ops (the Triton kernels cannot load: OSError" in CudaBackend().describe()
    cache = caches("KBNHC", "KBNHC", 12, 9)
    assert (
        kvhost.receive(
            cache, {"a": [1, 2]}, axes="KBNHC", remote_order="HNC", remote_block_size=16, backend=backend
        ).groups
        == 1
    )


@pytest.mark.parametrize("missing", ["compiler", "headers"])
def test_where_triton_cannot_build_its_launcher_the_torch_path_runs_and_says_why(monkeypatch, tmp_path, missing):
    """Triton compiles a C launcher at the first launch: with no compiler, or no Python.h
    (a Python without its development headers), every receive would fail there."""
    import kvhost_accelerator.backend as accelerator

    kernels = load_kernels()
    if kernels is None or kernels.interpreted():
        pytest.skip("needs compiled Triton kernels")
    if missing == "compiler":
        monkeypatch.delenv("CC", raising=False)
        monkeypatch.setattr(accelerator.shutil, "which", lambda name: None)
        said = "no C compiler (gcc, clang, or CC) for Triton to build its launcher with"
    else:
        monkeypatch.setattr(accelerator.sysconfig, "get_paths", lambda: {"include": str(tmp_path)})
        said = f"no Python.h in {tmp_path} (the Python development headers) for Triton's launcher"
    backend = CudaBackend()
    if not set(backend.triton_compilers()) & set(kernels.compiler_targets()):
        pytest.skip("this Triton has no compiler for CUDA")
    assert backend.kernels_missing == said and backend.kernels is None
    assert f"torch ops ({said})" in backend.describe()


@pytest.mark.parametrize(
    ("cc", "found", "headers", "missing"),
    [
        (None, (), True, "no C compiler (gcc, clang, or CC) for Triton to build its launcher with"),
        ("", (), True, "no C compiler (gcc, clang, or CC) for Triton to build its launcher with"),  # CC set empty
        ("my-cc", (), True, None),
        (None, ("gcc",), True, None),
        (None, ("clang",), True, None),
        (None, ("gcc", "clang"), False, "no Python.h in {} (the Python development headers) for Triton's launcher"),
    ],
)
def test_triton_s_launcher_needs_a_c_compiler_and_the_python_headers(
    monkeypatch, tmp_path, cc, found, headers, missing
):
    """Any one compiler will do (CC, else gcc or clang on PATH, as Triton looks), and
    Python.h where sysconfig says the headers are; no Triton needed to tell."""
    import kvhost_accelerator.backend as accelerator

    if cc is None:
        monkeypatch.delenv("CC", raising=False)
    else:
        monkeypatch.setenv("CC", cc)
    monkeypatch.setattr(accelerator.shutil, "which", lambda name: f"/usr/bin/{name}" if name in found else None)
    if headers:
        (tmp_path / "Python.h").write_text("")
    monkeypatch.setattr(accelerator.sysconfig, "get_paths", lambda: {"include": str(tmp_path)})
    assert accelerator.launcher_build_missing() == (None if missing is None else missing.format(tmp_path))


@pytest.mark.parametrize(
    ("targets", "launcher", "missing"),
    [
        (("nvidia", "amd"), None, ""),
        (("nvidia", "amd"), "no C compiler", "no C compiler"),
        (("intel",), None, "triton here compiles for intel, not nvidia"),
        (("intel", "spirv"), None, "triton here compiles for intel, spirv, not nvidia"),
    ],
)
def test_compiled_kernels_run_only_where_triton_targets_the_device_and_can_build_its_launcher(
    monkeypatch, targets, launcher, missing
):
    """Told by a stand-in for the kernels module: no Triton (or a compiled one) needed."""
    import kvhost_accelerator.backend as accelerator

    kernels = types.SimpleNamespace(interpreted=lambda: False, too_old=lambda: None, compiler_targets=lambda: targets)
    monkeypatch.setattr(accelerator, "load_kernels", lambda: kernels)
    monkeypatch.setattr(accelerator, "launcher_build_missing", lambda: launcher)
    monkeypatch.setattr(CudaBackend, "triton_compilers", lambda self: ("nvidia",))
    backend = CudaBackend()
    assert backend.kernels_missing == missing
    assert backend.kernels is (None if missing else kernels)


def test_kernels_run_where_this_triton_compiles_for_the_device():
    kernels = load_kernels()
    if kernels is None or kernels.interpreted():
        pytest.skip("needs compiled Triton kernels")
    backend = CudaBackend()
    if not set(backend.triton_compilers()) & set(kernels.compiler_targets()):
        pytest.skip("this Triton has no compiler for CUDA")
    assert backend.kernels_missing == "" and backend.kernels is kernels
    assert backend.describe().startswith("receive and scattered copies: Triton kernels;")
    with pytest.raises(NotImplementedError):
        AcceleratorBackend().triton_compilers()  # a device says which compilers target it


def test_a_device_where_triton_cannot_build_or_load_a_kernel_gets_the_torch_path(monkeypatch):
    """Every check of the toolchain passes (the compilers, a C compiler, Python's headers),
    but the probe kernel cannot be built or loaded on the device (Triton's own assertion
    where it finds no libcuda, stood in for; the device too): the torch path runs, and says
    why, instead of every receive failing at its first launch. Where the probe loads, the
    kernels run; where no device is, nothing is tried."""
    import contextlib

    kernels = load_kernels()
    if kernels is None or kernels.interpreted():
        pytest.skip("needs compiled Triton kernels")
    if not set(CudaBackend().triton_compilers()) & set(kernels.compiler_targets()):
        pytest.skip("this Triton has no compiler for CUDA")
    monkeypatch.setattr(accelerator_backend, "launcher_build_missing", lambda: None)
    tried: list[torch.device] = []

    def no_libcuda(device: torch.device) -> None:
        tried.append(device)
        raise AssertionError("libcuda.so cannot found!\nPossible files are located at []")

    monkeypatch.setattr(kernels, "probe", no_libcuda)
    assert CudaBackend().kernels_missing == "" and tried == []  # no device here: nothing to try on
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    monkeypatch.setattr(torch.cuda, "device", lambda index: contextlib.nullcontext())
    backend = CudaBackend()
    why = "Triton cannot build or load a kernel on cuda:1: AssertionError: libcuda.so cannot found!"
    assert backend.kernels_missing == why and backend.kernels is None and tried == [torch.device("cuda", 1)]
    assert f"torch ops ({why})" in backend.describe()
    monkeypatch.setattr(kernels, "probe", tried.append)
    loads = CudaBackend()
    assert loads.kernels_missing == "" and loads.kernels is kernels and len(tried) == 2


@pytest.mark.cuda
@pytest.mark.skipif(not CUDA, reason="no CUDA device")
def test_a_cuda_device_runs_the_triton_kernels():
    """Where a CUDA device is, the device tests are of the Triton kernels: a backend fallen
    back to torch ops (no C compiler or Python headers for Triton's launcher, a Triton
    without a CUDA compiler) fails here, not as a quiet pass of every cuda test."""
    backend = kvhost.get_backend(torch.device("cuda"))
    assert backend.name == "cuda" and backend.kernels_missing == "" and backend.kernels is not None


def test_cuda_and_xpu_share_one_runtime_and_differ_only_in_names():
    """Same class, same device-generic calls; only the device type and the Triton compiler differ."""
    assert type(CudaBackend()).__mro__[1] is AcceleratorBackend is type(XpuBackend()).__mro__[1]
    for backend, module in ((CudaBackend(), torch.cuda), (XpuBackend(), torch.xpu)):
        runtime = backend.runtime
        assert type(runtime) is DeviceRuntime and runtime.module is module
        assert runtime.generic == hasattr(torch.accelerator, "set_stream")  # torch >= 2.6: torch.accelerator
    assert CudaBackend().triton_compilers() == (("amd",) if torch.version.hip else ("nvidia",))
    assert XpuBackend().triton_compilers() == ("intel",)


@pytest.mark.parametrize(("version", "fenced"), [("3.3.0b1", False), ("3.6.0", False), ("3.7.0", False),
                                                 ("3.7.1", True), ("3.8.0+git1234", True)])  # fmt: skip
def test_xpu_splits_every_receive_where_intels_barrier_fences_only_local_memory(monkeypatch, version, fenced):
    """Intel's Triton fences global memory at tl.debug_barrier from 3.7.1 (kvhost_xpu's docstring says how we know)."""
    pytest.importorskip("triton")
    import triton

    monkeypatch.setattr(triton, "__version__", version)

    class Runtime(SynchronousRuntime):
        def processors(self, device):
            return 64

    backend = XpuBackend()
    backend.__dict__["runtime"] = Runtime()
    assert backend.barrier_orders_global_memory() is fenced
    limits = backend.limits_for(torch.device("cpu"))
    assert limits.barrier is fenced and limits.programs == 64 * backend.programs_per_processor
    assert limits.processors == 64  # a slots launch needs a slot per multiprocessor
    assert CudaBackend().barrier_orders_global_memory()


def test_limits_are_fitted_once_per_device_and_again_when_replaced():
    asked = []

    class Runtime(SynchronousRuntime):
        def processors(self, device):
            asked.append(device)
            return 8 if device.index == 1 else 64

    backend = CudaBackend()
    backend.__dict__["runtime"] = Runtime()
    first, second = torch.device("cuda", 0), torch.device("cuda", 1)
    fitted = backend.limits_for(first)
    assert backend.limits_for(first) is fitted and asked == [first]
    assert fitted.processors == 64 and fitted.programs == min(backend.limits.programs, 64 * 4)
    assert backend.limits_for(second).processors == 8 and asked == [first, second]
    backend.limits = dataclasses.replace(backend.limits, programs=100)  # type: ignore[misc]
    refitted = backend.limits_for(first)
    assert refitted.programs == 100 and refitted.processors == 64 and asked == [first, second, first]


# --- completion handles --------------------------------------------------------------


class ManualEvent:
    """An event that fires when the test says so (or when someone waits on it)."""

    def __init__(self) -> None:
        self.fired = False
        self.waits = 0

    def query(self) -> bool:
        return self.fired

    def synchronize(self) -> None:
        self.waits += 1
        self.fired = True


def test_a_completed_result_holds_nothing_its_host_step_held():
    """A bounced load's host step holds the pinned bounce buffer (the whole batch's size):
    a CopyResult kept after the copy completed must let it go, as it lets ``keep`` go."""
    event, bounce = ManualEvent(), torch.empty(1 << 20, dtype=torch.uint8)
    landed = torch.empty_like(bounce)
    completion = EventCompletion(event, keep=[landed], finish=functools.partial(landed.copy_, bounce))
    held = weakref.ref(bounce)
    del bounce
    assert held() is not None  # the host step still needs it
    event.fired = True
    completion.wait()
    assert held() is None and completion.keep == [] and completion.done()


def test_completion_is_done_only_after_the_event_and_the_host_step():
    event, steps = ManualEvent(), []
    buffer = torch.empty(4)
    completion = EventCompletion(event, keep=[buffer], finish=lambda: steps.append("host"))
    assert not completion.done() and steps == [] and completion.keep == [buffer]
    event.fired = True
    assert completion.done() and steps == ["host"] and completion.keep == []
    assert completion.done() and steps == ["host"]  # the host step runs once
    completion.wait()
    assert event.waits == 0 and steps == ["host"]


def test_wait_blocks_on_the_event_then_runs_the_host_step_once():
    event, steps = ManualEvent(), []
    completion = EventCompletion(event, finish=lambda: steps.append("host"))
    result = CopyResult(blocks=1, bytes_moved=8, backend="cuda", completion=completion)
    assert result.wait() is result
    assert event.waits == 1 and steps == ["host"] and result.done()
    result.wait()
    assert event.waits == 1 and steps == ["host"]


def test_a_dropped_handle_waits_for_its_copy_before_releasing_what_it_keeps():
    """The handle keeps the caller's buffers; dropped before done, it waits, runs the host step, then lets go."""
    event, steps = ManualEvent(), []
    buffer = torch.empty(4)
    kept = weakref.ref(buffer)
    completion = EventCompletion(event, keep=[buffer], finish=lambda: steps.append("host"))
    del buffer
    assert kept() is not None and event.waits == 0
    with pytest.warns(ResourceWarning, match="dropped before done") as warned:
        del completion
        gc.collect()
    assert event.waits == 1 and steps == ["host"] and kept() is None
    assert warned[0].filename == __file__  # the line that dropped it, not kvhost's


def test_a_handle_seen_done_goes_quietly():
    event = ManualEvent()
    completion = EventCompletion(event, keep=[torch.empty(2)])
    event.fired = True
    assert completion.done()
    with warnings.catch_warnings(record=True) as warned:  # recorded: an error raised in __del__ would be swallowed
        warnings.simplefilter("always")
        del completion
        gc.collect()
    assert warned == [] and event.waits == 0


def test_a_handle_whose_construction_failed_goes_quietly():
    """Its __del__ still runs; with nothing set up there is nothing to wait for or warn of."""
    unraisable: list[object] = []
    hook, sys.unraisablehook = sys.unraisablehook, unraisable.append
    try:
        with warnings.catch_warnings(record=True) as warned:
            warnings.simplefilter("always")
            with pytest.raises(TypeError):
                EventCompletion(ManualEvent(), keep=5)  # type: ignore[arg-type]  # not a sequence: __init__ fails
            gc.collect()
    finally:
        sys.unraisablehook = hook
    assert warned == [] and unraisable == []


class Stream:
    def __init__(self, name: str) -> None:
        self.name = name
        self.device = torch.device("cpu")


class OrderedRuntime(SynchronousRuntime):
    """Streams and events as a log: which stream is current, who waits for whom, where events are recorded."""

    def __init__(self) -> None:
        super().__init__()
        self.caller, self.side = Stream("caller"), Stream("side")
        self.current = self.caller
        self.log: list[tuple[str, ...]] = []
        self.events: list[ManualEvent] = []

    def current_stream(self, device):
        return self.current

    def side_stream(self, device):
        return self.side

    @contextlib.contextmanager
    def using(self, stream):
        previous, self.current = self.current, stream
        try:
            yield
        finally:
            self.current = previous

    def wait(self, waiter, producer):
        self.log.append(("wait", waiter.name, producer.name))

    def record(self, stream):
        self.log.append(("record", stream.name))
        self.events.append(ManualEvent())
        return self.events[-1]


class OrderedStandIn(AcceleratorBackend):
    name = "accelerator-on-cpu"
    device_types = ("cpu",)

    def triton_compilers(self) -> tuple[str, ...]:
        return ()

    @cached_property
    def runtime(self) -> DeviceRuntime:
        return OrderedRuntime()

    def copy_on_device(self, job, keep):
        self.runtime.log.append(("work", self.runtime.current.name))
        return super().copy_on_device(job, keep)


def test_copies_queue_behind_the_callers_stream_and_finish_through_an_event_on_theirs():
    """The side stream waits for the caller's first, does every step, then records the event the handle waits on."""
    src, dst = caches("KBNHC", "KBHNC", 12, 7), caches("KBNHC", "KBNHC", 10, 8)
    backend = OrderedStandIn(use_triton=False)
    result = kvhost.copy_blocks(src, dst, [3, 9, 1], [0, 7, 2], axes="KBNHC", non_blocking=True, backend=backend)
    log = backend.runtime.log
    work = [i for i, entry in enumerate(log) if entry[0] == "work"]
    assert work and all(log[i] == ("work", "side") for i in work)
    assert log.index(("wait", "side", "caller")) < work[0]  # sees what the caller queued before the call
    assert log.index(("record", "side")) > work[-1]  # the event follows every step
    assert not result.done()  # the device has not passed the event
    # Until then every tensor's member (its tensor and storage) is kept: a source re-pointed
    # (``set_``) meanwhile lets go of its old storage, which the side stream still reads.
    kept = {id(k) for k in result.completion.keep}
    assert all(id(member) in kept for pair in result.job.pairs for member in pair)
    backend.runtime.events[-1].fired = True
    assert result.done()


def test_a_bounced_load_reads_the_host_blocks_only_after_the_callers_queued_work():
    """The CPU reads a bounced load's host blocks at once, outside stream order: it first
    waits for the side stream to pass the caller's work (a non-blocking save into those
    blocks, say), which the direct and host-span ways read after on the stream."""
    host, device = caches("KBNHC", "KBNHC", 64, 3), caches("KBNHC", "KBNHC", 64, 70)
    src_ids, dst_ids = list(range(0, 64, 2)), list(range(32))  # 32 host spans: bounced
    job = host_job(host, device, "KBNHC", "KBNHC", src_ids, dst_ids, non_blocking=True)
    backend = OrderedStandIn(use_triton=False)
    backend.max_host_copies = 4
    runtime = backend.runtime
    host_copy = backend.host.copy

    def read_on_the_host(job):
        runtime.log.append(("host",))
        return host_copy(job)

    backend.host.copy = read_on_the_host  # type: ignore[method-assign]
    runtime.wait(runtime.side, runtime.caller)  # as ``copy`` does before
    with runtime.using(runtime.side):
        assert backend.copy_host(job, to_device=True, keep=[]) is None
    log = runtime.log
    read = log.index(("host",))
    records = [entry for entry in log[:read] if entry[0] == "record"]
    assert records == [("record", "side")] and runtime.events[0].waits == 1


def test_index_buffers_belong_to_one_stream():
    """The torch path's reused id buffer: a stream never refills or frees the one another stream reads."""
    current = ["A"]
    buffers = IndexBuffers(lambda device: current[0])
    meta = torch.device("meta")
    on_a = buffers(np.arange(5), meta)._base
    assert buffers(np.arange(9), meta)._base is on_a  # reused on its own stream
    current[0] = "B"
    assert buffers(np.arange(7), meta)._base is not on_a  # A's kernels may still read A's
    assert buffers(np.arange(5000), meta).numel() == 5000  # B grows its own
    current[0] = "A"
    assert buffers(np.arange(3), meta)._base is on_a  # A's was neither refilled nor freed


# --- host copies through the shared class, the CPU standing in for the device ------------


class CpuStandIn(AcceleratorBackend):
    """The CUDA/XPU class with the CPU as its device: torch ops (or kernels) on the device side."""

    name = "accelerator-on-cpu"
    device_types = ("cpu",)

    def triton_compilers(self) -> tuple[str, ...]:
        return ()

    @cached_property
    def runtime(self) -> DeviceRuntime:
        return SynchronousRuntime()


def test_uploaded_tables_each_start_on_a_16_byte_boundary():
    # Triton specializes a pointer on 16-byte alignment: a table placed after one of odd
    # length must keep it, or the kernels compile again whenever a batch's parity flips.
    arrays = [np.arange(3), np.arange(5) + 10, np.arange(2) + 20, np.arange(1) + 30]
    keep: list[object] = []
    tables = CpuStandIn()._upload(arrays, torch.device("cpu"), keep)
    assert [t.tolist() for t in tables] == [a.tolist() for a in arrays]
    assert [t.data_ptr() % 16 for t in tables] == [0, 0, 0, 0]
    assert all(t.dtype == torch.int64 for t in tables) and keep


def test_uploaded_tables_go_up_in_one_non_blocking_copy(monkeypatch):
    """The pinned staging of the tables goes up without blocking the calling thread: the
    kernel that reads the tables queues behind the copy on the same stream."""
    asked: list[tuple[torch.device, bool]] = []
    to = torch.Tensor.to

    def to_told(self, *args, **kwargs):
        asked.append((args[0], kwargs.get("non_blocking", False)))
        return to(self, *args, **kwargs)

    monkeypatch.setattr(torch.Tensor, "to", to_told)
    tables = CpuStandIn()._upload([np.arange(3), np.arange(4) + 7], torch.device("cpu", 0), [])
    monkeypatch.undo()
    assert asked == [(torch.device("cpu", 0), True)]
    assert [t.tolist() for t in tables] == [[0, 1, 2], [7, 8, 9, 10]]


def caches(axes: str, physical: str, blocks: int, seed: int, layers: int = 2) -> dict[str, torch.Tensor]:
    sizes = dict(K=2, B=blocks, N=8, H=2, C=16)
    out = {f"l{i}": make_cache(axes, physical, {a: sizes[a] for a in axes}) for i in range(layers)}
    for i, t in enumerate(out.values()):
        fill_random(t, seed + i)
    return out


def host_job(src, dst, src_axes, dst_axes, src_ids, dst_ids, non_blocking):
    return plan_copy_batch(CacheSet(src, src_axes), CacheSet(dst, dst_axes), src_ids, dst_ids, non_blocking).jobs[0]


@pytest.mark.parametrize("layouts", [("KBNHC", "KBHNC", "KBNHC", "KBNHC"), ("KBNHC", "KBNHC", "BKNHC", "BKNHC")])
def test_staged_save_lands_only_when_completed(layouts):
    device_axes, device_phys, host_axes, host_phys = layouts
    device, host = caches(device_axes, device_phys, 12, 1), caches(host_axes, host_phys, 9, 50)
    case = CopyCase(device, host, device_axes, host_axes)
    src_ids, dst_ids = [11, 2, 7, 3, 4], [0, 8, 5, 1, 2]
    job = host_job(device, host, device_axes, host_axes, src_ids, dst_ids, non_blocking=True)
    backend, keep = CpuStandIn(use_triton=False), []
    finish = backend.copy_host(job, to_device=False, keep=keep)
    assert finish is not None  # pageable host memory, non-blocking: staged
    assert all(
        torch.equal(raw(m.tensor), saved) for m, saved in zip(CacheSet(host, host_axes).members, case.dst_before)
    )
    finish()
    case.check(src_ids, dst_ids)
    bounce, staged = [k for k in keep if isinstance(k, torch.Tensor) and k.dim() > 2]
    assert bounce.shape[:2] == staged.shape[:2] == (8, 2)  # five blocks rounded up to eight, two layers


@pytest.mark.parametrize("non_blocking", [True, False])
def test_host_to_device_takes_runs_directly_or_stages(non_blocking):
    host, device = caches("KBNHC", "KBNHC", 12, 3), caches("KBNHC", "KBNHC", 10, 70)  # K strides differ
    case = CopyCase(host, device, "KBNHC", "KBNHC")
    src_ids, dst_ids = [0, 1, 2, 3, 8, 9], [4, 5, 6, 7, 0, 1]  # two runs, same layout both sides
    job = host_job(host, device, "KBNHC", "KBNHC", src_ids, dst_ids, non_blocking)
    backend, keep = CpuStandIn(use_triton=False), []
    assert backend.direct_copies(job) == 2 * 2 * 2  # layers x K x runs
    assert backend.copy_host(job, to_device=True, keep=keep) is None
    staged = [k for k in keep if isinstance(k, torch.Tensor) and k.dim() > 2]
    # Blocking: copy_ per run. Non-blocking from pageable memory: staged, so the call need not wait.
    assert len(staged) == (2 if non_blocking else 0)
    case.check(src_ids, dst_ids)


def test_direct_copies_are_one_non_blocking_copy_per_span(monkeypatch):
    """Each span crosses in its own ``copy_(non_blocking=True)`` on the side stream: the
    call returns before the bytes land, and the result's event says when they have."""
    host, device = caches("KBNHC", "KBNHC", 12, 68), caches("KBNHC", "KBNHC", 10, 69)
    case = CopyCase(host, device, "KBNHC", "KBNHC")
    src_ids, dst_ids = [0, 1, 2, 3, 8, 9], [4, 5, 6, 7, 0, 1]
    job = host_job(host, device, "KBNHC", "KBNHC", src_ids, dst_ids, non_blocking=False)
    asked: list[bool] = []
    copy_ = torch.Tensor.copy_

    def copy_told(self, other, non_blocking=False):
        asked.append(non_blocking)
        return copy_(self, other, non_blocking=non_blocking)

    monkeypatch.setattr(torch.Tensor, "copy_", copy_told)
    CpuStandIn(use_triton=False).copy_direct(job)
    monkeypatch.undo()
    assert asked == [True] * (2 * 2 * 2)  # layers x K x runs
    case.check(src_ids, dst_ids)


SPANS = {  # device ids, host ids, blocks of the staging buffer (rounded up to a power of two)
    "6 blocks": ([13, 2, 7, 9, 0, 4], [6, 7, 3, 4, 5, 8], 8),  # host runs 3..8 in a shuffled order
    # 12 device blocks, none next to another: 3 layers x K x 12 = 72 copies if each were its
    # own span, over max_host_copies; the host's 12 are one run, 6 copies.
    "12 blocks": ([22, 0, 4, 18, 8, 12, 2, 20, 10, 14, 6, 16], [11, 0, 4, 3, 2, 1, 10, 9, 5, 6, 8, 7], 16),
}


@pytest.mark.parametrize("ids", SPANS)
@pytest.mark.parametrize("layers", [1, 3])
@pytest.mark.parametrize("to_device", [True, False], ids=["load", "save"])
def test_scattered_device_blocks_and_host_runs_cross_as_host_spans(to_device, layers, ids):
    """The offload pattern: device blocks anywhere, host slots in runs, layouts differ (no direct way).
    The host's runs decide it, however scattered the device's blocks are."""
    device = caches("KBNHC", "KBHNC", 24, 20, layers=layers)
    host = caches("KBNHC", "KBNHC", 12, 30, layers=layers)
    device_ids, host_ids, blocks = SPANS[ids]
    src, dst = (host, device) if to_device else (device, host)
    src_ids, dst_ids = (host_ids, device_ids) if to_device else (device_ids, host_ids)
    case = CopyCase(src, dst, "KBNHC", "KBNHC")
    job = host_job(src, dst, "KBNHC", "KBNHC", src_ids, dst_ids, non_blocking=False)
    backend, keep = CpuStandIn(use_triton=False), []
    assert backend.direct_copies(job) > backend.max_run_copies
    assert backend.copy_host(job, to_device=to_device, keep=keep) is None
    staged = [k for k in keep if isinstance(k, torch.Tensor) and k.dim() > 2]
    assert [tuple(t.shape) for t in staged] == [(layers, 2, blocks, 8, 2, 16)]  # layers, then the host order K B N H C
    case.check(src_ids, dst_ids)


def test_direct_copies_need_the_same_block_bytes_on_both_sides():
    host, device = caches("KBNHC", "KBHNC", 12, 5), caches("KBNHC", "KBNHC", 12, 6)
    job = host_job(host, device, "KBNHC", "KBNHC", [0, 1], [0, 1], False)
    backend = CpuStandIn(use_triton=False)
    assert backend.direct_copies(job) > backend.max_run_copies
    keep: list[object] = []
    case = CopyCase(host, device, "KBNHC", "KBNHC")
    backend.copy_host(job, to_device=True, keep=keep)
    case.check([0, 1], [0, 1])


def test_copy_on_one_device_completes_through_an_event():
    src, dst = caches("KBNHC", "KBHNC", 12, 7), caches("KBNHC", "KBNHC", 10, 8)
    case = CopyCase(src, dst, "KBNHC", "KBNHC")
    result = kvhost.copy_blocks(src, dst, [3, 9, 1], [0, 7, 2], axes="KBNHC", non_blocking=True,
                                backend=CpuStandIn(use_triton=False))  # fmt: skip
    assert isinstance(result.completion, EventCompletion)  # one job: its completion as the backend gave it
    assert result.wait().done()
    case.check([3, 9, 1], [0, 7, 2])


class WayRecorder(CpuStandIn):
    """Records the way ``copy`` sends a job, by the devices the job names; moves nothing."""

    device_types = ("cuda",)

    def __init__(self) -> None:
        super().__init__(use_triton=False)
        self.ways: list[str] = []
        self.finished = 0  # host work run after the device was done (a bounced save's last step)

    def copy_on_device(self, job, keep):
        self.ways.append("on the device")

    def copy_host(self, job, *, to_device, keep):
        self.ways.append("host to device" if to_device else "device to host")
        return None if to_device else self.finish

    def finish(self) -> None:
        self.finished += 1

    def _copy_between_devices(self, job):
        self.ways.append("between devices")
        return Completion()


@pytest.mark.parametrize(
    ("src", "dst", "way"),
    [
        ("cpu", "cuda:0", "host to device"),
        ("cuda:1", "cpu", "device to host"),
        ("cuda:1", "cuda:1", "on the device"),
        ("cuda:0", "cuda:1", "between devices"),
    ],
)
def test_a_copy_goes_the_way_its_devices_say_and_keeps_the_callers_tensors_and_storages(src, dst, way):
    source, dest = caches("KBNHC", "KBNHC", 6, 1), caches("KBNHC", "KBNHC", 6, 2)
    job = host_job(source, dest, "KBNHC", "KBNHC", [1, 2], [4, 0], non_blocking=True)
    job = dataclasses.replace(job, src_device=torch.device(src), dst_device=torch.device(dst))
    backend = WayRecorder()
    completion = backend.copy(job)
    assert backend.ways == [way]
    if way == "between devices":
        return  # torch's peer copies, complete on return
    kept = {id(k) for k in completion.keep}  # each tensor's member: the tensor and its storage
    assert all(id(member) in kept for pair in job.pairs for member in pair)  # until the device is done
    assert backend.finished == 0
    completion.wait()
    assert completion.keep == [] and backend.finished == (1 if way == "device to host" else 0)


@pytest.mark.parametrize(("src", "dst"), [("cpu", "cuda:0"), ("cuda:1", "cpu"), ("cuda:1", "cuda:1")])
def test_a_blocking_copy_is_complete_when_copy_returns(src, dst):
    """Nothing held, and the host's share of a save already run: the front end does not wait on it."""
    source, dest = caches("KBNHC", "KBNHC", 6, 1), caches("KBNHC", "KBNHC", 6, 2)
    job = host_job(source, dest, "KBNHC", "KBNHC", [1, 2], [4, 0], non_blocking=False)
    job = dataclasses.replace(job, src_device=torch.device(src), dst_device=torch.device(dst))
    backend = WayRecorder()
    completion = backend.copy(job)
    assert completion.keep == [] and backend.finished == (1 if dst == "cpu" else 0)
    assert completion.done()


def test_a_copy_between_two_devices_of_its_type_is_done_on_return():
    """Two devices (``cpu:0`` and ``cpu:1`` for the stand-in): torch's peer copies, then both synchronized."""
    src, dst = caches("KBNHC", "KBHNC", 8, 44), caches("KBNHC", "KBNHC", 6, 45)
    case = CopyCase(src, dst, "KBNHC", "KBNHC")
    job = host_job(src, dst, "KBNHC", "KBNHC", [7, 0, 3], [5, 1, 2], non_blocking=True)
    job = dataclasses.replace(job, src_device=torch.device("cpu", 0), dst_device=torch.device("cpu", 1))
    backend = CpuStandIn(use_triton=False)
    given = []
    torch_copy = backend.torch_path.copy
    backend.torch_path.copy = lambda job: given.append(job.non_blocking) or torch_copy(job)  # type: ignore[method-assign]
    completion = backend.copy(job)
    assert type(completion) is Completion and completion.done()
    assert given == [False]  # a device's non-blocking completion dropped here would warn and wait
    case.check([7, 0, 3], [5, 1, 2])


def test_copies_on_the_device_are_direct_up_to_max_run_copies():
    """At most ``max_run_copies`` ``copy_`` calls go direct; one more and the kernel (here
    the torch path: no kernels on the stand-in) takes the whole job."""
    src, dst = caches("KBNHC", "KBNHC", 12, 46), caches("KBNHC", "KBNHC", 12, 47)
    src_ids, dst_ids = [0, 1, 5, 6], [2, 3, 8, 9]  # two runs
    for spare, direct in ((0, True), (-1, False)):
        job = host_job(src, dst, "KBNHC", "KBNHC", src_ids, dst_ids, non_blocking=False)
        backend = CpuStandIn(use_triton=False)
        calls = backend.direct_copies(job)
        assert calls == 2 * 2 * 2  # layers x K halves x runs
        backend.max_run_copies = calls + spare
        taken = []
        backend.copy_direct = lambda job, taken=taken: taken.append(job)  # type: ignore[method-assign]
        backend.torch_path.copy = lambda job, taken=taken: taken.append("torch path")  # type: ignore[method-assign]
        backend.copy_on_device(job, [])
        assert taken == ([job] if direct else ["torch path"])


def test_the_torch_path_on_the_device_copies_in_order_on_its_stream():
    """Without kernels, a non-blocking copy on the device is the torch path's in the caller's
    stream order: the caller's completion covers it, and a completion of its own (an event
    on a side stream) would be dropped unwaited, and then waited for at once."""
    src, dst = caches("KBNHC", "KBNHC", 12, 46), caches("KBNHC", "KBNHC", 12, 47)
    job = host_job(src, dst, "KBNHC", "KBNHC", [0, 5, 9], [2, 8, 4], non_blocking=True)
    backend = CpuStandIn(use_triton=False)
    backend.max_run_copies = 0
    asked = []
    copy = backend.torch_path.copy
    backend.torch_path.copy = lambda job: asked.append(job) or copy(job)  # type: ignore[method-assign]
    case = CopyCase(src, dst, "KBNHC", "KBNHC")
    backend.copy_on_device(job, [])
    assert [j.non_blocking for j in asked] == [False]
    assert asked[0].src_ids is job.src_ids and asked[0].group is job.group
    case.check([0, 5, 9], [2, 8, 4])


def test_host_copies_are_separate_calls_when_few_or_each_large():
    backend = CpuStandIn(use_triton=False)
    most, span = backend.max_host_copies, backend.direct_span_bytes
    assert backend.few_spans(0, most) and not backend.few_spans(0, most + 1)
    assert backend.few_spans((most + 1) * span, most + 1)  # each copy at least a span
    assert not backend.few_spans((most + 1) * span - 1, most + 1)


def test_host_blocks_that_are_not_one_span_each_cross_through_the_bounce_buffer():
    """Every other block of a host cache (its blocks are not back to back): a run of host ids
    is not one span, so the copy is staged whole, never read or written as spans."""
    device = caches("KBNHC", "KBHNC", 16, 40)
    whole = caches("KBNHC", "KBNHC", 24, 41)
    host = {name: t[:, ::2] for name, t in whole.items()}
    device_ids, host_ids = [13, 2, 7, 9, 0], [3, 4, 5, 9, 10]
    for to_device in (True, False):
        src, dst = (host, device) if to_device else (device, host)
        src_ids, dst_ids = (host_ids, device_ids) if to_device else (device_ids, host_ids)
        case = CopyCase(src, dst, "KBNHC", "KBNHC")
        whole_before = {name: raw(t).clone() for name, t in whole.items()}
        job = host_job(src, dst, "KBNHC", "KBNHC", src_ids, dst_ids, non_blocking=False)
        backend, keep = CpuStandIn(use_triton=False), []
        finish = backend.copy_host(job, to_device=to_device, keep=keep)
        if finish is not None:
            finish()
        case.check(src_ids, dst_ids)
        staged = [k for k in keep if isinstance(k, torch.Tensor) and k.dim() > 2]
        assert [tuple(t.shape[:2]) for t in staged] == [(8, 2), (8, 2)]  # bounce and device staging, block-major
        for name, t in whole.items():  # the blocks between the host's were never written
            assert torch.equal(raw(t)[:, 1::2], whole_before[name][:, 1::2])


class PinnedRecorder(SynchronousRuntime):
    """The stand-in's runtime, counting the buffers asked of its pinned host memory."""

    def __init__(self) -> None:
        self.pinned = 0

    def host_buffer(self, shape, dtype):
        self.pinned += 1
        return super().host_buffer(shape, dtype)


class StagingRecorder(CpuStandIn):
    """Records the device each staging buffer is made for (None: pinned host memory)."""

    def __init__(self) -> None:
        super().__init__(use_triton=False)
        self.devices: list[torch.device | None] = []

    @cached_property
    def runtime(self) -> DeviceRuntime:
        return PinnedRecorder()

    def staging(self, like, count, device, *, block_major=True):
        self.devices.append(device)
        return super().staging(like, count, device, block_major=block_major)


@pytest.mark.parametrize("way", ["_copy_host_spans", "_copy_bounced"])
@pytest.mark.parametrize("to_device", [True, False])
def test_staged_copies_stage_on_the_device_the_job_names(way, to_device):
    """The device side is the job's device (``cpu:0`` here, the host plain ``cpu``), not a
    device read back from a tensor, which the stand-in cannot tell from the host."""
    device, host = caches("KBNHC", "KBHNC", 12, 42), caches("KBNHC", "KBNHC", 8, 43)
    device_ids, host_ids = [9, 2, 5], [1, 2, 3]
    src, dst = (host, device) if to_device else (device, host)
    src_ids, dst_ids = (host_ids, device_ids) if to_device else (device_ids, host_ids)
    case = CopyCase(src, dst, "KBNHC", "KBNHC")
    job = host_job(src, dst, "KBNHC", "KBNHC", src_ids, dst_ids, non_blocking=False)
    named = torch.device("cpu", 0)
    job = dataclasses.replace(job, **{"dst_device" if to_device else "src_device": named})
    backend, keep = StagingRecorder(), []
    finish = getattr(backend, way)(_HostSides.of(job, to_device), keep)
    if finish is not None:
        finish()
    case.check(src_ids, dst_ids)
    assert backend.devices == ([named] if way == "_copy_host_spans" else [None, named])
    assert backend.runtime.pinned == (0 if way == "_copy_host_spans" else 1)  # the bounce buffer is pinned


@pytest.mark.parametrize(("most", "way"), [(4, "host spans"), (3, "bounced")])
def test_host_spans_count_one_copy_per_member_outer_index_and_span(most, way):
    """Two layers, K outer, one run of host ids: 2 x 2 x 1 = 4 copies across the bus. Up to
    ``max_host_copies`` the device side is staged in the host's order and crosses as spans;
    one fewer allowed, it goes through the pinned bounce buffer."""
    device, host = caches("KBNHC", "KBHNC", 12, 60), caches("KBNHC", "KBNHC", 8, 61)
    device_ids, host_ids = [9, 2, 5], [1, 2, 3]
    case = CopyCase(device, host, "KBNHC", "KBNHC")
    job = host_job(device, host, "KBNHC", "KBNHC", device_ids, host_ids, non_blocking=False)
    backend = StagingRecorder()
    backend.max_host_copies = most
    assert backend.direct_copies(job) > most  # the layouts differ: no direct way
    finish = backend.copy_host(job, to_device=False, keep=[])
    if finish is not None:
        finish()
    case.check(device_ids, host_ids)
    assert backend.devices == ([torch.device("cpu")] if way == "host spans" else [None, torch.device("cpu")])


class CrossingRecorder(CpuStandIn):
    """Records each ``copy_on_device`` call (the source and destination tensors of its pairs)."""

    def __init__(self) -> None:
        super().__init__(use_triton=False)
        self.on_device: list[tuple[list[torch.Tensor], list[torch.Tensor]]] = []

    def copy_on_device(self, job, keep):
        self.on_device.append(([s.tensor for s, _ in job.pairs], [d.tensor for _, d in job.pairs]))
        return super().copy_on_device(job, keep)


def _storage(tensor: torch.Tensor) -> int:
    return tensor.untyped_storage().data_ptr()


@pytest.mark.parametrize("way", ["_copy_host_spans", "_copy_bounced"])
@pytest.mark.parametrize("to_device", [True, False], ids=["load", "save"])
def test_staged_copies_cross_the_bus_without_blocking_and_touch_the_device_once(monkeypatch, way, to_device):
    """The staging buffer crosses to or from host memory (the host blocks, or the pinned
    bounce buffer) in non-blocking copies on the side stream, and the device side is one
    step: gathered into the staging buffer for a save, scattered out of it for a load."""
    device, host = caches("KBNHC", "KBHNC", 12, 62), caches("KBNHC", "KBNHC", 8, 63)
    device_ids, host_ids = [9, 2, 5, 11], [1, 2, 3, 6]
    src, dst = (host, device) if to_device else (device, host)
    src_ids, dst_ids = (host_ids, device_ids) if to_device else (device_ids, host_ids)
    case = CopyCase(src, dst, "KBNHC", "KBNHC")
    job = host_job(src, dst, "KBNHC", "KBNHC", src_ids, dst_ids, non_blocking=False)
    crossings: list[tuple[int, int, bool]] = []
    copy_ = torch.Tensor.copy_

    def copy_told(self, other, non_blocking=False):
        crossings.append((_storage(self), _storage(other), non_blocking))
        return copy_(self, other, non_blocking=non_blocking)

    monkeypatch.setattr(torch.Tensor, "copy_", copy_told)
    backend, keep = CrossingRecorder(), []
    finish = getattr(backend, way)(_HostSides.of(job, to_device), keep)
    monkeypatch.undo()
    if finish is not None:
        finish()
    case.check(src_ids, dst_ids)
    staged = keep[-1] if way == "_copy_bounced" else keep[0]  # the device staging buffer
    host_side = [_storage(keep[-2])] if way == "_copy_bounced" else [_storage(t) for t in host.values()]
    ends = {_storage(staged)}, set(host_side)
    bus = [blocking for into, out_of, blocking in crossings if {into, out_of} & ends[0] and {into, out_of} & ends[1]]
    assert bus and all(bus)  # every crossing non-blocking
    ((sources, dests),) = backend.on_device
    staged_side, device_side = (sources, dests) if to_device else (dests, sources)
    assert all(_storage(t) == _storage(staged) for t in staged_side)
    assert [_storage(t) for t in device_side] == [_storage(t) for t in device.values()]


def test_a_copy_between_two_devices_waits_for_both_before_returning():
    """Peer copies queue on the devices' current streams: an event on each, waited for."""
    src, dst = caches("KBNHC", "KBHNC", 8, 64), caches("KBNHC", "KBNHC", 6, 65)
    job = host_job(src, dst, "KBNHC", "KBNHC", [7, 0, 3], [5, 1, 2], non_blocking=True)
    job = dataclasses.replace(job, src_device=torch.device("cpu", 0), dst_device=torch.device("cpu", 1))
    backend = OrderedStandIn(use_triton=False)
    completion = backend.copy(job)
    assert type(completion) is Completion and completion.done()
    assert backend.runtime.log == [("record", "caller"), ("record", "caller")]  # one a device
    assert [event.waits for event in backend.runtime.events] == [1, 1]


def test_receive_on_the_torch_path_matches_the_sender():
    from kvhost.testing import ReceiveCase

    cache = caches("KBNHC", "KBNHC", 12, 9)
    case = ReceiveCase(cache, "KBNHC", seed=4)
    case.send("r", [5, 1, 8], "HNC", 2)
    stats = kvhost.receive(cache, {"r": [5, 1, 8]}, axes="KBNHC", remote_order="HNC", remote_block_size=2,
                           backend=CpuStandIn(use_triton=False))  # fmt: skip
    case.check()
    assert stats.backend == "accelerator-on-cpu"


def kernels_standing_in(call_for):
    """The kernels module as the backend uses it for a receive: its word types, and one
    launch per job, ``call_for(launch)`` (a stand-in that records instead of launching)."""
    return types.SimpleNamespace(
        TORCH_WORDS={1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64},
        receive_calls=lambda launch, **tables: [call_for(launch)],
    )


def test_a_device_short_of_memory_for_a_later_job_s_scratch_refuses_the_call_before_any_job_runs(monkeypatch):
    """Every job's tables and scratch are made before any job launches (kernels stood in
    for: their launches recorded): a device out of memory for the second job's scratch is
    a BackendError with nothing launched and no byte written. It had left the first job
    rearranged in place, which a second try would have rearranged again."""
    import kvhost_accelerator.backend as accelerator

    cache = caches("KBNHC", "KBNHC", 12, 9)
    before = [raw(t).clone() for t in cache.values()]
    backend, launched, scratches = CpuStandIn(), [], []
    backend.__dict__["kernels"] = kernels_standing_in(
        lambda launch: types.SimpleNamespace(
            launch=lambda: launched.append(launch), compile=lambda: None, compile_key=lambda: ()
        )
    )

    def short_of_memory(*args):
        """The scratch, where the second finds the device full."""
        scratches.append(args)
        if len(scratches) == 2:
            raise torch.OutOfMemoryError("out of memory: tried to allocate 256.00 MiB")
        return call_scratch(*args)

    class Larger:
        """A job's launch, asking for more scratch than the job's before it (which it cannot share)."""

        def __init__(self, launch, words):
            self.launch, self.scratch_words = launch, words

        def __getattr__(self, name):
            return getattr(self.launch, name)

    planned = accelerator.plan_receive_launch
    monkeypatch.setattr(accelerator, "call_scratch", short_of_memory)
    monkeypatch.setattr(
        accelerator, "plan_receive_launch", lambda *a, **k: Larger(planned(*a, **k), 64 * (len(scratches) + 1))
    )
    requests = {"a": kvhost.Incoming([1, 2], "HNC", 16), "b": kvhost.Incoming([5], "HNC", 4)}  # two transforms
    refusal = r"cpu: out of memory for a receive's tables and scratch .*256\.00 MiB"
    with pytest.raises(kvhost.BackendError, match=refusal):
        kvhost.receive(cache, requests, axes="KBNHC", backend=backend)
    assert len(scratches) == 2 and launched == []
    assert all(torch.equal(raw(t), b) for t, b in zip(cache.values(), before))
    monkeypatch.undo()
    stats = kvhost.receive(cache, requests, axes="KBNHC", backend=backend)  # room again: both jobs launch
    assert stats.groups == 2 and len(launched) == 2


def test_a_kernel_that_does_not_compile_for_a_later_job_refuses_the_call_before_any_job_runs():
    """Every job's kernels are compiled and loaded (Triton's warmup) before any launches: a
    compile or load failure for the second job's kernel (here the stand-in's, as Triton's
    OutOfResources for shared memory would be) is a BackendError with nothing launched and
    no byte written; the kernels it had already compiled are not compiled again."""
    cache = caches("KBNHC", "KBNHC", 12, 9)
    before = [raw(t).clone() for t in cache.values()]
    backend, launched, compiled = CpuStandIn(), [], []
    broken = {"parts": 1}  # the r = 2 job's kernel (the g = 2 job's, first, has two parts)

    def compile_call(launch):
        if launch.parts == broken.get("parts"):
            raise RuntimeError("out of resource: shared memory, Required: 264192, Hardware limit: 232448\nmore")
        compiled.append(launch.parts)

    backend.__dict__["kernels"] = kernels_standing_in(
        lambda launch: types.SimpleNamespace(
            launch=lambda: launched.append(launch.parts),
            compile=lambda: compile_call(launch),
            compile_key=lambda: (launch.parts,),
            kernel=types.SimpleNamespace(__name__="receive_kernel"),
        )
    )
    requests = {"a": kvhost.Incoming([1, 2], "HNC", 16), "b": kvhost.Incoming([5], "HNC", 4)}  # two transforms
    refusal = r"cpu: the kernel receive_kernel for this receive cannot run here: RuntimeError: out of .*: 232448$"
    with pytest.raises(kvhost.BackendError, match=refusal):
        kvhost.receive(cache, requests, axes="KBNHC", backend=backend)
    assert compiled == [2] and launched == []
    assert all(torch.equal(raw(t), b) for t, b in zip(cache.values(), before))
    broken.clear()
    for _ in range(3):
        stats = kvhost.receive(cache, requests, axes="KBNHC", backend=backend)
        assert stats.groups == 2
    assert compiled == [2, 1] and sorted(launched) == [1, 1, 1, 2, 2, 2]


def test_the_jobs_of_one_call_share_one_scratch(monkeypatch):
    """Every job's scratch is made before any job launches; the jobs launch in turn on one
    stream, so within a call (the jobs' ``shared`` dict) a job takes the scratch an earlier
    one made where it is large enough: a call holds one scratch at a time, not one per job."""
    cpu = torch.device("cpu")

    def scratch(shared, numel, dtype=torch.int64, name="accelerator scratch"):
        return call_scratch(shared, name, cpu, numel, dtype)

    assert scratch({}, 8) is not scratch({}, 8)  # two calls
    call: dict[object, object] = {}
    first = scratch(call, 8)
    assert first.numel() == 8 and first.dtype == torch.int64 and first.device == cpu
    assert scratch(call, 8) is first and scratch(call, 3) is first
    assert scratch(call, 3, torch.int32) is not first  # another word: another scratch
    assert scratch(call, 3, name="torch receive") is not first  # another backend's: its own
    grown = scratch(call, 9)
    assert grown.numel() == 9 and scratch(call, 8) is grown
    assert scratch({}, 2) is not grown  # another call: a scratch of its own
    # Through the front end: one receive call of two jobs (two layouts) makes one scratch.
    made: list[torch.Tensor] = []

    def counted(*args):
        made.append(call_scratch(*args))
        return made[-1]

    monkeypatch.setattr(accelerator_backend, "call_scratch", counted)
    backend = CpuStandIn()
    backend.__dict__["kernels"] = kernels_standing_in(
        lambda launch: types.SimpleNamespace(
            launch=lambda: None,
            compile=lambda: None,
            compile_key=lambda: (launch.parts,),
            kernel=types.SimpleNamespace(__name__="receive_kernel"),
        )
    )
    requests = {"a": kvhost.Incoming([1, 2], "HNC", 16), "b": kvhost.Incoming([5], "HNC", 4)}  # two transforms
    assert kvhost.receive(caches("KBNHC", "KBNHC", 12, 9), requests, axes="KBNHC", backend=backend).groups == 2
    assert len(made) == 2 and made[0] is made[1]


def test_a_call_while_the_stream_captures_a_graph_is_refused_before_anything_moves(monkeypatch):
    """A CUDA graph captured around a call would replay launches on tables and scratch the
    call freed when it ended: refused, nothing written, and the same call runs once capture ends."""
    backend = CpuStandIn()
    capturing = [True]
    monkeypatch.setattr(SynchronousRuntime, "capturing", lambda self: capturing[0])
    cache = caches("KBNHC", "KBNHC", 12, 9)
    other = {name: torch.zeros_like(t) for name, t in cache.items()}
    before = [raw(t).clone() for t in cache.values()]
    requests = {"a": kvhost.Incoming([1, 2], "HNC", 16)}
    for call in (
        lambda: kvhost.receive(cache, requests, axes="KBNHC", backend=backend),
        lambda: kvhost.copy_blocks(cache, other, [1, 3], [0, 2], axes="KBNHC", backend=backend),
    ):
        with pytest.raises(kvhost.BackendError, match=r"while the current stream captures a graph.*freed memory"):
            call()
    assert all(torch.equal(raw(t), b) for t, b in zip(cache.values(), before))
    assert not any(t.any() for t in other.values())
    capturing[0] = False
    assert kvhost.receive(cache, requests, axes="KBNHC", backend=backend).blocks == 2
    assert kvhost.copy_blocks(cache, other, [1, 3], [0, 2], axes="KBNHC", backend=backend).wait().blocks == 2


def test_a_copy_kernel_that_does_not_compile_is_a_backend_error_with_nothing_launched():
    """A copy's kernel is compiled and loaded before it launches: one that cannot be here
    (the stand-in's, as Triton's OutOfResources would be) is a BackendError naming it, not
    Triton's own exception, and a device short of memory for its tables one too."""
    import kvhost_accelerator.backend as accelerator

    src, launched = caches("KBNHC", "KBNHC", 12, 9), []
    dst = {name: torch.zeros_like(t) for name, t in src.items()}
    backend = CpuStandIn()
    backend.max_run_copies = 0  # every copy on the device by a kernel

    def fails() -> None:
        raise RuntimeError("out of resource: shared memory, Required: 264192, Hardware limit: 232448\nmore")

    backend.__dict__["kernels"] = types.SimpleNamespace(
        TORCH_WORDS={8: torch.int64},
        copy_call=lambda launch, **tables: types.SimpleNamespace(
            launch=lambda: launched.append(launch),
            compile=fails,
            compile_key=lambda: (),
            kernel=types.SimpleNamespace(__name__="copy_kernel"),
        ),
    )
    refusal = r"^cpu: the kernel copy_kernel for this copy cannot run here: RuntimeError: out of .*: 232448$"
    with pytest.raises(kvhost.BackendError, match=refusal):
        kvhost.copy_blocks(src, dst, [1, 3, 5], [0, 2, 4], axes="KBNHC", backend=backend)
    assert launched == [] and all(not t.any() for t in dst.values())

    def no_room(*args, **kwargs):
        raise torch.OutOfMemoryError("out of memory: tried to allocate 2.00 MiB\nmore")

    backend._upload = no_room  # type: ignore[method-assign]
    with pytest.raises(kvhost.BackendError, match=r"^cpu: out of memory for a copy's tables: out of memory: tried"):
        kvhost.copy_blocks(src, dst, [1, 3, 5], [0, 2, 4], axes="KBNHC", backend=backend)
    assert accelerator.OUT_OF_MEMORY is torch.OutOfMemoryError and launched == []

    def no_room_unsaid(*args, **kwargs):  # an allocator's error with no message is still said
        raise torch.OutOfMemoryError()

    backend._upload = no_room_unsaid  # type: ignore[method-assign]
    with pytest.raises(kvhost.BackendError, match=r"^cpu: out of memory for a copy's tables: $"):
        kvhost.copy_blocks(src, dst, [1, 3, 5], [0, 2, 4], axes="KBNHC", backend=backend)
    assert launched == []


def test_the_kernels_bounds_do_not_refuse_what_the_torch_path_does(monkeypatch):
    """Without kernels a unit past their 32-bit offsets is the torch path's, which has no such
    bound: the check before a batch refuses nothing then (the bound is lowered here so
    that a unit of a few blocks passes it)."""
    from kvhost_accelerator import launch

    from kvhost.testing import ReceiveCase

    monkeypatch.setattr(launch, "MAX_UNIT_WORDS", 100)
    launch._pieces.cache_clear()
    try:
        cache = caches("KBNHC", "KBNHC", 12, 9)
        plan = plan_receive(Layout.of(cache["l0"], "KBNHC"), "HNC", 16)
        with pytest.raises(kvhost.BackendError, match="the kernels index within a unit in 32 bits"):
            launch.plan_receive_launch(plan, members=2, outer=2, units=2, alignment=256, limits=Limits())
        case = ReceiveCase(cache, "KBNHC", seed=5)
        case.send("r", [4, 5, 6, 7], "HNC", 16)
        kvhost.receive(cache, {"r": [4, 5, 6, 7]}, axes="KBNHC", remote_order="HNC", remote_block_size=16,
                       backend=CpuStandIn(use_triton=False))  # fmt: skip
        case.check()
    finally:
        launch._pieces.cache_clear()


def test_gpu_check_measures_every_workload(capsys):
    """The GPU check's measurements on the CPU stand-in, at toy sizes: every row, sane numbers."""
    sizes = Sizes(layers=1, heads=2, channels=16, receive_units=8, staging_blocks=8, repeats=1)  # two requests
    emitted: list[object] = []
    rows = measure(torch.device("cpu"), {"torch": CpuStandIn(use_triton=False)}, sizes, emitted.append)
    assert emitted == rows  # each row handed out as it is measured (ci/gpu-check.sh streams them to $OUT)
    assert {row.agrees for row in rows if row.method != "memcpy"} == {"yes"}
    workloads = sorted({row.workload for row in rows})
    assert len(workloads) == 4 + 4  # three receives, one device copy, staging {runs, scattered} x {load, save}
    for workload in workloads:
        # kvhost's methods, then the engines' per-request path, checked against them too.
        assert [row.method for row in rows if row.workload == workload] == ["memcpy", "torch", "per-request"]
    first = next(row for row in rows if row.workload == "receive HND16->NHD64")
    assert first.bytes == 8 * (64 * 2 * 16 * 2) * 2  # units x region bytes x K, one layer
    assert all(row.seconds > 0 and row.fraction > 0 for row in rows)
    timed = [row for row in rows if row.method != "memcpy"]
    assert all(row.host_seconds > 0 and row.kernel_fraction == 0 for row in timed)  # neither path has kernels
    assert {row.bytes for row in rows if row.workload == first.workload} == {first.bytes}
    assert len(table(rows).splitlines()) == len(rows) + 1
    if not CUDA:
        for device in ("cuda", "cuda:0"):  # an index given too (it was a RuntimeError)
            assert gpucheck_main(["--device", device]) == 1
            assert "the cuda backend cannot run here" in capsys.readouterr().err
    for device in ("cpu", "nosuch:0"):
        with pytest.raises(SystemExit) as exit_info:
            gpucheck_main(["--device", device])
        assert exit_info.value.code == 2 and "--device must be cuda or xpu" in capsys.readouterr().err


def test_gpu_check_agreement_is_against_the_torch_path():
    reference = {"l0": torch.arange(8, dtype=torch.uint8)}
    other = {"l0": reference["l0"].clone()}
    other["l0"][5] += 1
    outputs = {"triton": reference, "torch": {"l0": reference["l0"].clone()}, "per-request": other}
    assert agreement(outputs) == {"triton": "yes", "torch": "yes", "per-request": "NO"}
    assert agreement({"per-request": other, "triton": reference}) == {"per-request": "yes", "triton": "NO"}


def test_gpu_check_profiles_a_one_request_receive():
    """The profile counts the calls it was asked for, not the warm-up: KVHost's receive, the
    backend's and the torch path's, three times each."""
    cpu = torch.device("cpu")
    receive = one_request_receive(cpu, CpuStandIn(use_triton=False), Sizes(layers=2, heads=2, channels=16))
    report = host_profile(receive, cpu, calls=3, top=10_000)
    assert "Ordered by: internal time" in report
    rows = [line.split() for line in report.splitlines() if line.rstrip().endswith("(receive)")]
    assert len(rows) >= 3 and all(row[0] == "3" for row in rows), report
    # Named as the repository names them (kvhost/api.py), not where this machine keeps it.
    assert "kvhost/api.py:" in report and str(Path(kvhost.__file__).parent) not in report, report
    assert relative_paths(f"{Path(kvhost.__file__).resolve().parents[1]}/kvhost/api.py:1(f)") == "kvhost/api.py:1(f)"
    assert (
        relative_paths("/opt/v/lib/python3.12/site-packages/triton/jit.py:5(run)")
        == "site-packages/triton/jit.py:5(run)"
    )
    assert relative_paths("/usr/lib/python3/dist-packages/numpy/x.py") == "site-packages/numpy/x.py"


# --- on a device ---------------------------------------------------------------------

DEVICES = [
    pytest.param("cuda", marks=[pytest.mark.cuda, pytest.mark.skipif(not CUDA, reason="no CUDA device")]),
    pytest.param("xpu", marks=[pytest.mark.xpu, pytest.mark.skipif(not XPU, reason="no XPU device")]),
]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("pinned", [True, False], ids=["pinned", "pageable"])
def test_non_blocking_copies_complete_through_events(device, pinned):
    host = caches("KBNHC", "KBNHC", 64, 11)
    if pinned:
        host = {name: t.pin_memory() for name, t in host.items()}
    on_device = {name: torch.zeros_like(t, device=device) for name, t in host.items()}
    src_ids = np.random.default_rng(0).permutation(64)[:40]
    dst_ids = np.random.default_rng(1).permutation(64)[:40]
    load = kvhost.copy_blocks(host, on_device, src_ids, dst_ids, axes="KBNHC", non_blocking=True)
    assert isinstance(load.completion, EventCompletion)
    load.wait()
    back = {name: torch.zeros_like(t) for name, t in host.items()}
    save = kvhost.copy_blocks(on_device, back, dst_ids, src_ids, axes="KBNHC", non_blocking=True)
    while not save.done():
        pass
    for name in host:
        assert torch.equal(raw(back[name])[:, src_ids], raw(host[name])[:, src_ids])


@pytest.mark.parametrize("device", DEVICES)
def test_the_torch_path_saves_scattered_blocks_to_the_host_without_blocking_and_whole(device):
    """Ids scattered on both sides (more runs than ``max_run_copies``): the torch path
    gathers on the device and scatters on the host, which must not read the gathered bytes
    while a non-blocking copy is still bringing them (the device kept busy meanwhile)."""
    blocks = 1024
    on_device = {name: t.to(device) for name, t in caches("KBNHC", "KBNHC", blocks, 13).items()}
    rng = np.random.default_rng(2)
    src_ids, dst_ids = rng.permutation(blocks)[:512], rng.permutation(blocks)[:512]
    for _ in range(3):
        busy = torch.randn(4096, 4096, device=device)
        for _ in range(8):
            busy = busy @ busy
            busy = busy / busy.norm()
        host = {name: torch.zeros_like(t, device="cpu") for name, t in on_device.items()}
        kvhost.copy_blocks(on_device, host, src_ids, dst_ids, axes="KBNHC", backend="torch", non_blocking=True).wait()
        for name, tensor in on_device.items():
            assert torch.equal(raw(host[name])[:, dst_ids], raw(tensor.cpu())[:, src_ids])


@pytest.mark.parametrize("device", DEVICES)
def test_device_backend_is_picked_and_says_its_path(device):
    backend = kvhost.get_backend(torch.device(device, 0))
    assert backend.name == device
    assert backend.describe().startswith("receive and scattered copies:")


def test_a_completion_seen_done_asks_the_device_no_more():
    """Polling a finished copy is free: no event query (a driver call) once done() has said yes."""
    queries = []

    class CountedEvent(ManualEvent):
        def query(self) -> bool:
            queries.append(self.fired)
            return self.fired

    event = CountedEvent()
    completion = EventCompletion(event)
    event.fired = True
    assert completion.done() and queries == [True]
    assert completion.done() and completion.done() and queries == [True]


def test_a_copy_without_id_tables_passes_a_table_of_the_same_type():
    """A side without ids (a staging buffer) gets the other side's id table, never None, as its
    placeholder: Triton would compile a None argument as a constant, a kernel of its own."""
    kernels = load_kernels()
    if kernels is None:
        pytest.skip("triton is not installed")
    cache = make_cache("KBNHC", "KBHNC", dict(K=2, B=4, N=16, H=2, C=8))
    staging = make_cache("KBNHC", "KBNHC", dict(K=2, B=4, N=16, H=2, C=8))
    plan = plan_copy(Layout.of(cache, "KBNHC"), Layout.of(staging, "KBNHC"))
    launch = plan_copy_launch(plan, pairs=1, blocks=2, alignment=256, limits=Limits())
    bases, ids = torch.zeros(1, dtype=torch.int64), torch.tensor([3, 1], dtype=torch.int64)
    for src_ids, dst_ids in ((ids, None), (None, ids)):
        call = kernels.copy_call(
            launch, src_bases=bases, dst_bases=bases, src_ids=src_ids, dst_ids=dst_ids,
            blocks=2, src_block_stride=1, dst_block_stride=1,
        )  # fmt: skip
        assert call.args[2] is ids and call.args[3] is ids
        assert call.constants["SRC_INDEXED"] is (src_ids is not None)
        assert call.constants["DST_INDEXED"] is (dst_ids is not None)


@pytest.mark.parametrize(
    ("src_ids", "dst_ids"),
    [([4, 7, 1], [5, 3, 9]), ([0, 1, 2], [5, 3, 9]), ([4, 7, 1], [0, 1, 2]), ([0, 1, 2], [0, 1, 2])],
)
def test_a_kernel_copy_uploads_the_id_table_only_of_a_side_not_0_to_n_minus_1(src_ids, dst_ids):
    """A staging buffer filled from its start is read or written without ids: its side's
    table is neither uploaded nor handed to the kernel (kernels stood in for: the call's
    arguments recorded)."""
    src, dst = caches("KBNHC", "KBHNC", 12, 66), caches("KBNHC", "KBNHC", 12, 67)
    job = host_job(src, dst, "KBNHC", "KBNHC", src_ids, dst_ids, non_blocking=False)
    backend, launched, uploaded = CpuStandIn(), [], []
    backend.__dict__["kernels"] = types.SimpleNamespace(
        copy_call=lambda launch, **args: types.SimpleNamespace(
            launch=lambda: launched.append(args), compile=lambda: None, compile_key=lambda: ()
        )
    )
    upload = backend._upload
    backend._upload = lambda arrays, device, keep: uploaded.append(arrays) or upload(arrays, device, keep)  # type: ignore[method-assign]
    assert backend.direct_copies(job) > backend.max_run_copies  # the layouts differ: the kernel's
    backend.copy_on_device(job, [])
    bases = [[t.data_ptr() for t in src.values()], [t.data_ptr() for t in dst.values()]]
    indexed = [ids for ids in (src_ids, dst_ids) if ids != [0, 1, 2]]
    (arrays,) = uploaded
    assert [a.tolist() for a in arrays] == bases + indexed
    (args,) = launched
    for side, ids in (("src_ids", src_ids), ("dst_ids", dst_ids)):
        assert (args[side] is None) if ids == [0, 1, 2] else (args[side].tolist() == ids)
    assert args["blocks"] == 3


# --- the runtime's device-generic calls, on the CPU's device module ---------------------


def test_runtime_keeps_one_side_stream_per_device_and_reads_an_explicit_index():
    runtime = DeviceRuntime("cpu")
    assert runtime.index(torch.device("cpu", 3)) == 3  # an explicit index: no question to the accelerator
    runtime.module = types.SimpleNamespace(current_device=lambda: 2)  # cuda's and xpu's name, in every torch
    assert runtime.index(torch.device("cpu")) == 2
    runtime.module = torch.cpu
    first = runtime.side_stream(torch.device("cpu", 0))
    assert runtime.side_stream(torch.device("cpu", 0)) is first
    assert runtime.side_stream(torch.device("cpu", 1)) is not first


def test_runtime_takes_the_device_modules_calls_before_torch_accelerator(monkeypatch):
    """torch < 2.6 (native XPU on 2.5): no torch.accelerator.set_stream, so the device module's calls."""
    assert DeviceRuntime("cpu").generic
    monkeypatch.delattr(torch.accelerator, "set_stream")
    assert not DeviceRuntime("cpu").generic


@pytest.mark.parametrize(
    ("properties", "count"),
    [
        (dict(multi_processor_count=132), 132),  # CUDA: streaming multiprocessors
        (dict(multi_processor_count=0, gpu_subslice_count=0, max_compute_units=96), 96),  # a zero is no answer
        (dict(gpu_subslice_count=64, max_compute_units=512), 64),  # XPU: Xe cores before execution units
        ({}, 64),  # nothing known: 64
    ],
)
def test_runtime_sizes_the_grid_from_the_first_count_the_device_gives(properties, count):
    runtime = DeviceRuntime("cpu")
    runtime.module = ModuleType("device")
    runtime.module.get_device_properties = lambda index: type("Properties", (), properties)()  # type: ignore[attr-defined]
    assert runtime.processors(torch.device("cpu", 0)) == count


def test_only_ids_0_to_n_minus_1_go_without_a_table():
    """A staging buffer filled from its start needs no id table on the device; any other ids do."""
    assert _is_arange(np.arange(5))
    assert not _is_arange(np.arange(1, 6)) and not _is_arange(np.array([0, 2, 3]))
    assert not _is_arange(np.array([0, 1, 1])) and not _is_arange(np.array([], dtype=np.int64))


# --- the hand-off check (kvhost_tools.device_checks.handoff): NIXL into the device's memory, here host memory ---

SMALL_BATCH = "--requests 4 --layers 2 --heads 2 --head-dim 16 --min-tokens 20 --max-tokens 200"


@needs_nixl
@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    "device", ["cpu", pytest.param("cuda", marks=[pytest.mark.cuda, pytest.mark.skipif(not CUDA, reason="no CUDA")])]
)
def test_handoff_check_verifies_then_times_every_way(device):
    from kvhost_tools.device_checks.handoff import measure as handoff

    rows = handoff(torch.device(device), SMALL_BATCH, repeats=1)
    ways = ["memcpy", "per-piece", "merged", "receive", "hand-off", "packed", "hand-off-packed", "hand-off-layered"]
    assert [row.way for row in rows] == [*ways, "span/64KiB", "span/1MiB", "span/layer"]
    by_way = {row.way: row for row in rows}
    assert len({row.bytes for row in rows}) == 1 and rows[0].bytes > 0
    # Allocator-like runs merge: fewer, larger descriptors than one per sender region.
    assert 0 < by_way["merged"].descriptors < by_way["per-piece"].descriptors
    assert by_way["hand-off"].descriptors == by_way["merged"].descriptors and by_way["receive"].descriptors == 0
    # Packed, each request's sender blocks are one run: only the receiver's runs cut
    # descriptors, one per run of receiver blocks for each layer and K/V (2 x 2 here).
    from kvhost_tools.bench.sender import Batch, Setting

    local_ids = Batch.of(Setting.parse(SMALL_BATCH)).local_ids
    local_runs = sum(1 + sum(b != a + 1 for a, b in itertools.pairwise(ids)) for ids in local_ids)
    assert by_way["packed"].descriptors == by_way["hand-off-packed"].descriptors == 2 * 2 * local_runs
    assert by_way["packed"].descriptors < by_way["merged"].descriptors
    # Layer by layer, merging stops at each layer's edge: at least as many descriptors.
    assert by_way["merged"].descriptors <= by_way["hand-off-layered"].descriptors < by_way["per-piece"].descriptors
    # The transport alone: the batch's bytes in 64 KiB pieces, at most 1 MiB, one per layer (2 here).
    layer_bytes = rows[0].bytes // 2
    assert by_way["span/64KiB"].descriptors == 2 * -(-layer_bytes // (64 << 10))
    assert by_way["span/1MiB"].descriptors == 2 * -(-layer_bytes // (1 << 20)) and by_way["span/layer"].descriptors == 2
    assert all(row.seconds > 0 and row.fraction > 0 for row in rows)


def runs_on_both_sides(batch, r):
    """Descriptors when whole sender blocks merge wherever both sides continue: the sender's
    ids run on, and the receiver's too where the next sender block starts a receiver block
    (r sender blocks to one)."""
    count = 0
    for remote, local in zip(batch.remote_ids, batch.local_ids):
        for k in range(len(remote)):
            joined = k > 0 and remote[k] == remote[k - 1] + 1 and (k % r or local[k // r] == local[k // r - 1] + 1)
            count += not joined
    return count


@needs_nixl
@pytest.mark.timeout(180)
def test_handoff_check_reads_a_cross_layer_batch_in_runs_of_blocks(tmp_path, capsys):
    """Both caches cross-layer (a block's layers back to back): one region per sender block holds
    every layer, so per-piece is a descriptor per sender block and merging joins runs of them,
    across receiver blocks too; every token checked as before. Each ``--demo`` is its own
    batch, measured in turn, its rows in the figures under its options."""
    from kvhost_tools.bench.sender import Batch, Setting
    from kvhost_tools.device_checks.handoff import main as handoff_main

    cross = SMALL_BATCH + " --cross-layer"
    argv = ["--device", "cpu", "--repeats", "1", "--demo", SMALL_BATCH, "--demo", cross, "--out", str(tmp_path)]
    assert handoff_main(argv) == 0
    printed = capsys.readouterr().out
    assert printed.count("batch: ") == 2 and "64 tokens, layers inside blocks" in printed
    rows = [json.loads(line) for line in (tmp_path / "handoff.jsonl").read_text().splitlines()]
    by_demo = {demo: {row["way"]: row for row in rows if row["demo"] == demo} for demo in (SMALL_BATCH, cross)}
    assert len(rows) == 22 and list(by_demo[SMALL_BATCH]) == list(by_demo[cross])
    batch = Batch.of(Setting.parse(cross))
    crossed = by_demo[cross]
    assert crossed["per-piece"]["descriptors"] == sum(len(ids) for ids in batch.remote_ids)
    assert crossed["merged"]["descriptors"] == runs_on_both_sides(batch, 64 // 16) < crossed["per-piece"]["descriptors"]
    assert crossed["merged"]["descriptors"] < by_demo[SMALL_BATCH]["merged"]["descriptors"]
    assert crossed["span/layer"]["descriptors"] == 1  # the layers share one span: one descriptor for it all


def test_handoff_check_refuses_no_repetitions(capsys):
    from kvhost_tools.device_checks.handoff import main as handoff_main

    with pytest.raises(SystemExit):
        handoff_main(["--device", "cpu", "--repeats", "0"])
    assert "--repeats must be at least 1, got 0" in capsys.readouterr().err


@needs_nixl
@pytest.mark.timeout(120)
def test_handoff_check_fails_when_the_receive_leaves_wire_bytes(monkeypatch):
    """The check is the tokens, not the transfer: landed bytes never rearranged fail it."""
    from kvhost_tools.device_checks.handoff import measure as handoff

    monkeypatch.setattr(kvhost.KVHost, "receive", lambda self, *args, **kwargs: None)
    with pytest.raises(AssertionError, match="do not hold the sender's tokens"):
        handoff(torch.device("cpu"), SMALL_BATCH, repeats=1)


def test_a_kernel_call_s_compile_warms_up_its_kernel_and_loads_it_onto_the_device():
    """Triton's warmup compiles without launching; its kernel is loaded (``_init_handles``,
    where Triton checks shared memory and threads) before any launch. The interpreter's
    warmup returns nothing to load."""
    from kvhost_accelerator.kernels import KernelCall

    seen, loaded = [], []
    compiled = types.SimpleNamespace(_init_handles=lambda: loaded.append(True))

    def warmup(*args, grid, **constants):
        seen.append((args, grid, constants))
        return compiled

    call = KernelCall(types.SimpleNamespace(warmup=warmup), (4,), (1, 2), {"TILE": 8})
    call.compile()
    assert seen == [((1, 2), (4,), {"TILE": 8})] and loaded == [True]
    KernelCall(types.SimpleNamespace(warmup=lambda *a, grid, **c: None), (4,), (1,), {}).compile()


def test_a_kernel_call_without_argument_names_keys_every_argument_by_its_value():
    """A kernel that does not name its arguments (no ``arg_names``): no argument is taken
    for a run-time count, so every one keys by its value (tensors by dtype and alignment)."""
    from kvhost_accelerator.kernels import KernelCall

    kernel = type("Unnamed", (), {"do_not_specialize": ["n"]})()
    aligned, shifted = torch.zeros(4, dtype=torch.int64), torch.zeros(5, dtype=torch.int64)[1:]
    keys = {
        KernelCall(kernel, (1,), (table, n), {"T": 8}).compile_key() for table in (aligned, shifted) for n in (3, 4)
    }
    assert len(keys) == 4
    assert KernelCall(kernel, (1,), (aligned, 3), {"T": 8}).compile_key() == (
        kernel,
        ((torch.int64, True), 3),
        ("T", 8),
    )


def test_the_modules_ci_gpu_check_runs_are_there_and_take_their_options():
    """ci/gpu-check.sh runs on a lent GPU, where a module it names that is not there costs
    the device time of a whole try: each is started here with ``--help``."""
    import re

    script = (Path(__file__).resolve().parents[1] / "ci" / "gpu-check.sh").read_text()
    modules = set(re.findall(r'"\$PYTHON" -m ([\w.]+)', script)) - {"pip", "pytest"}
    assert modules == {"kvhost_tools.device_checks.gpucheck", "kvhost_tools.device_checks.handoff"}
    for module in sorted(modules):
        shown = subprocess.run([sys.executable, "-m", module, "--help"], capture_output=True, text=True, timeout=120)
        assert shown.returncode == 0, (module, shown.stderr[-2000:])
        assert "--device" in shown.stdout
