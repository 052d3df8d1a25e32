"""KVHost is safe to call from two threads on disjoint blocks."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import threading

import pytest

import kvhost
from kvhost.testing import ReceiveCase, make_cache


def test_two_threads_receive_disjoint_blocks(target):
    sizes = dict(K=2, B=64, N=16, H=4, C=32)
    caches = {f"l{i}": make_cache("KBNHC", "KBNHC", sizes, device=target.device) for i in range(4)}
    host = kvhost.KVHost(caches, axes="KBNHC", backend=target.backend)
    case = ReceiveCase(caches, "KBNHC", seed=3)
    halves = {"even": list(range(0, 64, 2)), "odd": list(range(1, 64, 2))}
    for thread_name, ids in halves.items():
        for i in range(0, len(ids), 4):
            case.send(f"{thread_name}{i}", ids[i : i + 4], "HNC", 4)
    errors: list[BaseException] = []
    barrier = threading.Barrier(2)

    def work(thread_name: str) -> None:
        try:
            barrier.wait()
            for i in range(0, 32, 4):
                host.receive(
                    {f"{thread_name}{i}": halves[thread_name][i : i + 4]}, remote_order="HNC", remote_block_size=4
                )
        except BaseException as err:  # surfaced below
            errors.append(err)

    threads = [threading.Thread(target=work, args=(name,)) for name in halves]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert errors == []
    case.check()


def test_a_call_on_registered_caches_holds_the_backends_exclusive_lock_throughout():
    """Where a device cannot read a tensor's facts while another thread updates it (XLA),
    the check of the caches and the backend's work run under its lock, for every call."""
    import contextlib

    from kvhost_torch.backend import TorchBackend

    events: list[str] = []

    class Recording(TorchBackend):
        @contextlib.contextmanager
        def exclusive(self):  # type: ignore[no-untyped-def, override]
            events.append("enter")
            yield
            events.append("exit")

        def receive(self, job):  # type: ignore[no-untyped-def]
            events.append("receive")
            super().receive(job)

        def copy(self, job):  # type: ignore[no-untyped-def]
            events.append("copy")
            return super().copy(job)

    sizes = dict(K=2, B=8, N=8, H=2, C=4)
    caches = {"l0": make_cache("KBNHC", "KBNHC", sizes)}
    host_buffer = {"l0": make_cache("KBNHC", "KBNHC", sizes)}
    host = kvhost.KVHost(caches, axes="KBNHC", backend=Recording())
    checks = []
    original = host.caches.check_current

    def check_current() -> None:
        checks.append(events[-1])
        original()

    host.caches.check_current = check_current  # type: ignore[method-assign]
    host.receive({"r": [1, 2]}, remote_order="HNC", remote_block_size=4)
    host.copy_to(host_buffer, [1, 2], [0, 1]).wait()
    host.copy_from(host_buffer, [0, 1], [3, 4]).wait()
    assert events == ["enter", "exit", "enter", "receive", "exit", "enter", "copy", "exit", "enter", "copy", "exit"]
    assert checks == ["enter", "enter", "enter"]  # each check inside the lock, before the work
    # (the first enter/exit: registering reads the tensors under the lock too)


def test_every_call_reads_the_tensors_inside_the_lock_of_the_backend_that_does_the_work(monkeypatch):
    """One-off calls and copies with a peer on another device read the tensors' facts
    (data addresses, which XLA cannot give mid-update) only once the lock of the backend
    that will move the bytes is held: the backend is chosen from the first tensor's device."""
    import contextlib

    from kvhost_torch.backend import TorchBackend

    import kvhost.api
    from kvhost.caches import CacheSet

    held: list[str] = []  # the locks held now, innermost last
    reads: list[tuple[str, tuple[str, ...]]] = []

    def locking(backend: kvhost.Backend, tag: str) -> kvhost.Backend:
        @contextlib.contextmanager
        def exclusive():  # type: ignore[no-untyped-def]
            held.append(tag)
            try:
                yield
            finally:
                held.pop()

        monkeypatch.setattr(backend, "exclusive", exclusive)
        return backend

    class Recorded(CacheSet):
        def __init__(self, caches, axes, *, role="caches"):  # type: ignore[no-untyped-def]
            reads.append((role, tuple(held)))
            super().__init__(caches, axes, role=role)

    monkeypatch.setattr(kvhost.api, "CacheSet", Recorded)
    sizes = dict(K=2, B=8, N=8, H=2, C=4)
    caches = {"l0": make_cache("KBNHC", "KBNHC", sizes)}
    other = {"l0": make_cache("KBNHC", "KBNHC", sizes)}
    given = locking(TorchBackend(), "given")
    kvhost.receive(caches, {"r": [1]}, axes="KBNHC", remote_order="HNC", remote_block_size=4, backend=given)
    kvhost.copy_blocks(caches, other, [1], [2], axes="KBNHC", backend=given).wait()
    assert reads == [("caches", ("given",)), ("src", ("given",)), ("dst", ("given",))]
    reads.clear()
    pairs = {"l0": tuple(caches["l0"].unbind(0))}  # K and V kept apart: the first tensor is in a tuple
    kvhost.receive(pairs, {"r": [1]}, axes="KBNHC", remote_order="HNC", remote_block_size=4, backend=given)
    assert reads == [("caches", ("given",))]  # read once, inside

    # Host caches registered, the peer on another device: its backend does the copy, and
    # its lock (not the registered backend's) covers reading the peer.
    reads.clear()
    host = kvhost.KVHost(caches, axes="KBNHC", backend=locking(TorchBackend(), "registered"))
    meta_peer = {"l0": make_cache("KBNHC", "KBNHC", sizes, device="meta")}
    locking(kvhost.get_backend("meta"), "meta")
    host.copy_to(meta_peer, [1], [2]).wait()
    with pytest.raises(kvhost.LayoutError, match="is on meta: it has no bytes to copy"):  # the read is what counts
        host.copy_from(meta_peer, [2], [1])
    host.copy_to(other, [1], [2]).wait()
    assert reads == [("caches", ("registered",)), ("dst", ("meta",)), ("src", ("meta",)), ("dst", ("registered",))]
    assert held == []


def test_layers_on_two_devices_are_named_without_reading_a_tensor_outside_a_lock(monkeypatch):
    """A named backend that does not serve the first layer's device: the refusal names layers
    on two devices from each tensor's device alone, reading no tensor's memory facts (which
    torch_xla cannot give while another thread updates the tensor) outside a backend's lock."""
    import kvhost.api

    built: list[str] = []

    class Recorded(kvhost.api.CacheSet):  # type: ignore[misc,name-defined]
        def __init__(self, caches, axes, *, role="caches"):  # type: ignore[no-untyped-def]
            built.append(role)
            super().__init__(caches, axes, role=role)

    monkeypatch.setattr(kvhost.api, "CacheSet", Recorded)
    sizes = dict(K=2, B=8, N=8, H=2, C=4)
    caches = {"zz": make_cache("KBNHC", "KBNHC", sizes, device="meta"), "l0": make_cache("KBNHC", "KBNHC", sizes)}
    with pytest.raises(kvhost.LayoutError, match=r"caches: layer 'l0' is on cpu but layer 'zz' is on meta"):
        kvhost.receive(caches, {"r": [1]}, axes="KBNHC", remote_order="HNC", remote_block_size=4, backend="cpu")
    with pytest.raises(kvhost.LayoutError, match=r"dst: layer 'l0' is on cpu but layer 'zz' is on meta"):
        kvhost.copy_blocks({"l0": caches["l0"]}, caches, [0], [1], axes="KBNHC", backend="cpu")
    assert built == []


COLLECTOR_IN_THE_SCRATCH = """
import gc, os, sys, threading
import torch
import kvhost
from kvhost.backend import EventCompletion
from kvhost.batch import plan_copy_batch
from kvhost.caches import CacheSet
from kvhost.testing import make_cache

cpu = kvhost.get_backend("cpu")
sizes = dict(K=2, B=8, N=16, H=2, C=8)
pair = [CacheSet({"l0": make_cache("KBNHC", "KBNHC", sizes)}, "KBNHC", role=role) for role in ("src", "dst")]
into_host = plan_copy_batch(*pair, [0], [1], False).jobs[0]  # a bounced save's last step: a CPU copy

def collected_in_rows(phase, info):
    frame = sys._getframe()
    while frame is not None and not (frame.f_code.co_name == "rows" and "kvhost_cpu" in frame.f_code.co_filename):
        frame = frame.f_back
    if phase == "start" and threading.current_thread().name == "growing" and frame is not None:
        hits.append(1)
        save = EventCompletion(type("Fired", (), {"query": lambda s: True, "synchronize": lambda s: None})(),
                               [], lambda: cpu.copy(into_host).wait())
        cycle = {"result": save}
        cycle["self"] = cycle  # dropped in a cycle: the collector finishes it, in this thread
        del save, cycle

hits = []
big = dict(K=2, B=64, N=64, H=8, C=128)
two_groups = {f"l{i}": make_cache("KBNHC", "KBNHC", big, torch.bfloat16) for i in range(2)}
requests = {"a": [0, 1, 2, 3], "b": kvhost.Incoming([8, 9, 10, 11], "HNC", 32)}
stop = threading.Event()

def two_launches_a_call():
    while not stop.is_set():
        kvhost.receive(two_groups, requests, axes="KBNHC", remote_order="HNC", remote_block_size=16)

def growing():  # its scratch grows each call: an allocation under the scratch's lock
    for k in range(6):
        caches = {"l0": make_cache("KBNHC", "KBNHC", dict(K=2, B=8, N=64, H=8, C=128 * (k + 2)), torch.bfloat16)}
        kvhost.receive(caches, {"r": [0, 1]}, axes="KBNHC", remote_order="HNC", remote_block_size=16)
    stop.set()

kvhost.receive(two_groups, requests, axes="KBNHC", remote_order="HNC", remote_block_size=16)  # compiled first
gc.callbacks.append(collected_in_rows)
gc.set_threshold(1)
threads = [threading.Thread(target=f, name=f.__name__, daemon=True) for f in (two_launches_a_call, growing)]
for thread in threads:
    thread.start()
for thread in threads:
    thread.join(30)
gc.callbacks.clear()
print("alive", sum(t.is_alive() for t in threads), "collections in rows", len(hits), flush=True)
os._exit(0)
"""


@pytest.mark.timeout(200)
def test_a_dropped_save_finished_by_the_collector_inside_the_scratch_deadlocks_no_thread():
    """The collector runs at any allocation, the CPU scratch's (under its lock) included, and
    finishes a dropped staged save there with a CPU copy (which takes the launch lock); a
    receive of two groups takes the launch lock, then the scratch's. With two locks the two
    threads deadlocked; the scratch now uses the launch lock."""
    import subprocess
    import sys

    if kvhost.get_backend("cpu").describe() != "numba kernels":
        pytest.skip("the scratch belongs to the numba kernels")
    run = subprocess.run([sys.executable, "-c", COLLECTOR_IN_THE_SCRATCH], capture_output=True, text=True, timeout=180)
    words = run.stdout.split()
    assert run.returncode == 0 and words[:2] == ["alive", "0"], run.stdout + run.stderr[-2000:]
    assert int(words[-1]) >= 1  # the collector did start inside the scratch's allocation


CHECKED_CALLS = r"""
import kvhost
from kvhost.testing import CopyCase, ReceiveCase, make_cache

def receive_and_copy(seed):
    sizes = dict(K=2, B=64, N=16, H=8, C=128)  # 4 MiB a layer: the kernels' parallel launches
    caches = {f"l{i}": make_cache("KBNHC", "KBNHC", sizes) for i in range(2)}
    case = ReceiveCase(caches, "KBNHC", seed=seed)
    ids = list(range(seed % 2, 64, 2))
    case.send("r", ids, "HNC", 16)
    kvhost.receive(caches, {"r": ids}, axes="KBNHC", remote_order="HNC", remote_block_size=16, backend="cpu")
    case.check()
    host = {name: make_cache("KBNHC", "KBHNC", sizes) for name in caches}
    copy = CopyCase(caches, host, "KBNHC", "KBNHC")
    kvhost.copy_blocks(caches, host, ids, ids[::-1], axes="KBNHC", backend="cpu")
    copy.check(ids, ids[::-1])
"""


FORKED = (
    CHECKED_CALLS
    + r"""
import os, signal, sys, time
import numba
import torch

def in_child(seed):
    child = os.fork()
    if child == 0:
        torch.set_num_threads(1)  # torch's own GNU OpenMP hangs in a forked child otherwise
        receive_and_copy(seed)
        if seed == 2:
            in_child(3)  # a child of a child: a pool's worker forking again
        os._exit(0)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        done, status = os.waitpid(child, os.WNOHANG)
        if done:
            if status:
                sys.exit(f"the forked child ended with status {status}")
            return
        time.sleep(0.05)
    os.kill(child, signal.SIGKILL)
    sys.exit("the forked child hung")

receive_and_copy(1)
print("layer", numba.threading_layer(), flush=True)
in_child(2)
receive_and_copy(4)  # and the parent still works
print("children done", flush=True)
"""
)


@pytest.mark.parametrize("layer", [None, "omp", "workqueue"])
def test_a_process_forked_after_parallel_kernels_ran_runs_them_too(layer, tmp_path):
    """A pool's worker forked from a process that has already used kvhost. GNU OpenMP
    cannot start threads in such a child (numba ends it at its first parallel launch:
    "fork() called from a process already using GNU OpenMP"): there, the kernels run on
    the calling thread. Other threading layers start their threads again."""
    pytest.importorskip("numba")
    env = {k: v for k, v in os.environ.items() if k != "NUMBA_THREADING_LAYER"}
    if layer is not None:
        env["NUMBA_THREADING_LAYER"] = layer
    env["NUMBA_NUM_THREADS"] = "2"
    script = tmp_path / "forked.py"
    script.write_text(FORKED)
    run = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "children done" in run.stdout
    assert f"layer {layer or 'omp'}" in run.stdout  # numba's default where no TBB is installed


NUMBA_SETTINGS = (
    CHECKED_CALLS
    + r"""
receive_and_copy(1)
print("cpu ->", kvhost.get_backend("cpu").describe())
"""
)


@pytest.mark.parametrize(
    ("setting", "said"),
    [
        ({"NUMBA_THREADING_LAYER": "bogus"}, "numba kernels on the calling thread (The threading layer requested"),
        ({"NUMBA_THREADING_LAYER": "safe"}, "numba kernels on the calling thread (No threading layer could be loaded"),
        ({"NUMBA_DISABLE_JIT": "1"}, "torch ops (numba unavailable: NUMBA_DISABLE_JIT is set: numba compiles nothing)"),
        ({"NUMBA_THREADING_LAYER": "workqueue"}, "numba kernels"),
    ],
)
def test_numba_settings_that_rule_out_its_threads_or_its_compiler_leave_every_call_working(setting, said, tmp_path):
    """An operator's numba settings: a threading layer that cannot load (TBB absent, a
    typo) failed every job of 1 MiB or more, for the life of the process, while smaller
    ones ran; under NUMBA_DISABLE_JIT every call failed (the kernels' intrinsics have no
    Python form) while ``info`` said "numba kernels". Now the kernels run on the calling
    thread, or the torch path runs, and ``describe`` says which and why."""
    pytest.importorskip("numba")
    if setting.get("NUMBA_THREADING_LAYER") == "safe" and importlib.util.find_spec("tbb") is not None:
        pytest.skip("TBB is installed here: the safe layer loads")
    env = {k: v for k, v in os.environ.items() if k not in ("NUMBA_THREADING_LAYER", "NUMBA_DISABLE_JIT")} | setting
    script = tmp_path / "settings.py"
    script.write_text(NUMBA_SETTINGS)
    run = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout + run.stderr
    assert f"cpu -> {said}" in run.stdout
    if said == "numba kernels":
        assert run.stdout.strip().endswith("cpu -> numba kernels")
