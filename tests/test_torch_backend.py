"""The torch backend's completion of a non-blocking copy: an event on the caches' device.

``torch.Event(device="cuda:1")`` keeps only the device type, and ``record()`` with no
stream records on the current device's stream: with the caches on another device than the
current one, that event says nothing about the copy. On the host the event's stream is
checked on ``meta`` (which has neither streams nor events in torch, so both are stood in
for where noted); with two CUDA devices the real event is.
"""

from __future__ import annotations

import dataclasses
import types

import kvhost_torch.backend
import numpy as np
import pytest
import torch

import kvhost
from kvhost.backend import Completion, EventCompletion
from kvhost.batch import plan_copy_batch
from kvhost.caches import CacheSet
from kvhost.testing import fill_random, make_cache

SIZES = dict(K=2, B=8, N=8, H=2, C=4)
META = torch.device("meta")


class StreamsOfDevices:
    """Stands in for ``current_stream`` on ``meta``: a real ``torch.Stream`` object of its own
    per device asked about, and the devices asked about, in order."""

    def __init__(self) -> None:
        self.asked: list[torch.device] = []
        self.streams: dict[torch.device, torch.Stream] = {}

    def __call__(self, device: torch.device) -> torch.Stream:
        self.asked.append(device)
        return self.streams.setdefault(device, torch.Stream(device=META))


@pytest.fixture
def recorded(monkeypatch):
    """The stream each event made by the torch backend was recorded on (meta's own record
    raises: torch has no meta events), and the streams handed out."""
    streams = StreamsOfDevices()
    recorded: list[object] = []

    class RecordedEvent(torch.Event):
        def record(self, stream=None):
            recorded.append(stream)

    monkeypatch.setattr(kvhost_torch.backend, "current_stream", streams)
    monkeypatch.setattr(torch, "Event", RecordedEvent)
    return streams, recorded


def meta_copy_job(src: torch.device, dst: torch.device, non_blocking: bool = True):
    """A planned copy job between meta caches, given the devices it says its sides are on."""
    caches = CacheSet({"l": make_cache("KBNHC", "KBNHC", SIZES, device=META)}, "KBNHC")
    (job,) = plan_copy_batch(caches, caches, [1, 2], [3, 4], non_blocking).jobs
    return dataclasses.replace(job, src_device=src, dst_device=dst)


@pytest.mark.parametrize(
    ("src", "dst", "tracked"),
    [
        ("cpu", "meta:1", "meta:1"),  # to a device: its stream
        ("meta:1", "cpu", "meta:1"),  # to the host: the source device's
        ("meta:0", "meta:1", "meta:1"),  # between devices: the destination's, which waits for the copy
    ],
)
def test_a_non_blocking_copy_is_tracked_on_the_stream_of_its_device(recorded, src, dst, tracked):
    streams, events = recorded
    job = meta_copy_job(torch.device(src), torch.device(dst))
    completion = kvhost_torch.backend._completion(job)
    assert streams.asked == [torch.device(tracked)]  # the index kept, not the current device's
    assert len(events) == 1 and events[0] is streams.streams[torch.device(tracked)]
    assert isinstance(completion.event, torch.Event)
    # Its tensors and storages kept until the event (host memory pinned outside torch), and a
    # result dropped earlier waits for it: the accelerator backend's completion, shared.
    assert isinstance(completion, EventCompletion) and completion.keep == [job]


def test_torch_backend_copies_record_their_event_on_the_caches_stream(recorded):
    streams, events = recorded
    src = {"l": make_cache("KBNHC", "KBNHC", SIZES)}
    dst = {"l": make_cache("KBNHC", "KBNHC", SIZES, device=META)}
    result = kvhost.copy_blocks(src, dst, [1, 2], [3, 4], axes="KBNHC", non_blocking=True, backend="torch")
    assert result.backend == "torch"
    assert streams.asked == [META] and len(events) == 1 and events[0] is streams.streams[META]
    assert isinstance(result.completion.event, torch.Event)


def test_a_blocking_copy_or_one_on_the_host_needs_no_event(recorded):
    streams, events = recorded
    for job in (meta_copy_job(META, META, non_blocking=False), meta_copy_job(torch.device("cpu"), torch.device("cpu"))):
        assert kvhost_torch.backend._completion(job).done()
    assert streams.asked == [] and events == []


@pytest.mark.parametrize(
    ("axes", "src_ids", "dst_ids", "asynchronous"),
    [
        ("BKNHC", [1, 2], [3, 4], True),  # one run, each side a contiguous span: torch copies it as is
        ("KBNHC", [1, 2], [3, 4], False),  # a run of B inside K: torch makes each side contiguous first
        ("BKNHC", [1, 6, 3], [7, 0, 4], False),  # more runs than it copies one by one: gathered on the host
    ],
)
def test_between_host_and_device_only_copies_through_no_host_temporary_are_non_blocking(
    recorded, monkeypatch, axes, src_ids, dst_ids, asynchronous
):
    """torch bounces a non-contiguous side through pageable host memory it frees at once:
    CUDA finishes such a copy before returning, XPU's queue need not. Only a copy with no
    such temporary is left non-blocking (the caller's memory is kept until the event)."""
    asked: list[bool] = []
    copy_, to = torch.Tensor.copy_, torch.Tensor.to

    def copy_told(self, other, non_blocking=False):
        if self.device != other.device:
            asked.append(non_blocking)
        return copy_(self, other, non_blocking=non_blocking)

    def to_told(self, *args, **kwargs):
        if args and args[0] != self.device:
            asked.append(kwargs.get("non_blocking", False))
        return to(self, *args, **kwargs)

    monkeypatch.setattr(torch.Tensor, "copy_", copy_told)
    monkeypatch.setattr(torch.Tensor, "to", to_told)
    src = {"l": make_cache(axes, axes, SIZES)}
    dst = {"l": make_cache(axes, axes, SIZES, device=META)}
    backend = kvhost_torch.backend.TorchBackend(max_run_copies=2)
    kvhost.copy_blocks(src, dst, src_ids, dst_ids, axes=axes, non_blocking=True, backend=backend)
    assert asked and set(asked) == {asynchronous}


@pytest.mark.cuda  # what ci/cuda.sh and ci/gpu-check.sh select
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
def test_a_copy_on_the_second_gpu_is_done_only_when_that_gpu_is_done():
    """cuda:0 current and idle, cuda:1 busy: the copy on cuda:1 queues behind the busy work,
    and the result says so until cuda:1 has run it."""
    assert torch.cuda.current_device() == 0
    src = {"l": fill_random(make_cache("KBNHC", "KBNHC", SIZES, device="cuda:1"), 1)}
    dst = {"l": make_cache("KBNHC", "KBNHC", SIZES, device="cuda:1")}
    with torch.cuda.device(1):
        torch.cuda._sleep(1 << 30)  # about half a second of cuda:1's current stream
    result = kvhost.copy_blocks(src, dst, [1, 2], [3, 4], axes="KBNHC", non_blocking=True, backend="torch")
    assert result.completion.event.device == torch.device("cuda:1")
    assert not result.done()
    assert result.wait().done()
    assert torch.equal(dst["l"][:, 3:5], src["l"][:, 1:3])


class Accelerator:
    """Stands in for ``torch.accelerator``: the current accelerator's type, its streams."""

    def __init__(self, current: str | None) -> None:
        self.current = current

    def current_accelerator(self) -> torch.device | None:
        return None if self.current is None else torch.device(self.current)

    def current_stream(self, device: torch.device) -> tuple[str, torch.device]:
        return ("torch.accelerator", device)


@pytest.mark.parametrize(
    ("accelerator", "asked_of"),
    [
        (Accelerator("meta"), "torch.accelerator"),  # the current accelerator's type: asked of torch.accelerator
        (Accelerator("cuda"), "torch.meta"),  # another type's: of the device's module
        (Accelerator(None), "torch.meta"),  # no accelerator
        (None, "torch.meta"),  # a torch without torch.accelerator
    ],
)
def test_current_stream_asks_torch_accelerator_only_for_its_own_device_type(monkeypatch, accelerator, asked_of):
    monkeypatch.setattr(torch, "accelerator", accelerator)
    monkeypatch.setattr(torch, "meta", types.SimpleNamespace(current_stream=lambda d: ("torch.meta", d)), raising=False)
    device = torch.device("meta", 1)
    assert kvhost_torch.backend.current_stream(device) == (asked_of, device)  # the index passed on
    monkeypatch.delattr(torch, "meta")
    expected = ("torch.accelerator", device) if asked_of == "torch.accelerator" else None  # no module: no stream
    assert kvhost_torch.backend.current_stream(device) == expected


def test_index_buffers_on_a_device_hold_the_ids_of_each_call(monkeypatch):
    """A device's buffer is reused: each call's ids are copied into it (meta stood in for by
    host memory, filled with -1, where torch makes a device tensor)."""
    empty = torch.empty

    def on_the_host(*args, device=None, **kwargs):
        return empty(*args, **kwargs).fill_(-1) if device == META else empty(*args, device=device, **kwargs)

    monkeypatch.setattr(torch, "empty", on_the_host)
    buffers = kvhost_torch.backend.IndexBuffers(lambda device: "stream")
    first = buffers(np.array([5, 3, 9]), META)
    assert first.tolist() == [5, 3, 9]
    second = buffers(np.array([7, 1]), META)
    assert second.tolist() == [7, 1] and second._base is first._base  # refilled in place


def test_a_copy_between_two_devices_is_left_non_blocking_however_its_runs_lie(recorded, monkeypatch):
    """No host memory on either side: torch makes no host temporary, so every run's copy_
    stays non-blocking, contiguous or not (``meta:0`` and ``meta:1`` standing in)."""
    asked: list[tuple[bool, bool]] = []
    copy_ = torch.Tensor.copy_

    def copy_told(self, other, non_blocking=False):
        asked.append((non_blocking, self.is_contiguous() and other.is_contiguous()))
        return copy_(self, other, non_blocking=non_blocking)

    monkeypatch.setattr(torch.Tensor, "copy_", copy_told)
    job = meta_copy_job(torch.device("meta", 0), torch.device("meta", 1))  # KBNHC: a run of B inside K
    completion = kvhost_torch.backend.TorchBackend().copy(job)
    assert asked == [(True, False)]  # one run, one layer: non-contiguous and still non-blocking
    assert isinstance(completion, EventCompletion)


def test_without_an_event_for_the_device_the_copy_is_waited_for_before_returning(monkeypatch):
    """A stream that is not a ``torch.Stream`` (a torch whose device module has its own): no
    event is made on it; the device is synchronized instead, and the result is done."""
    recorded: list[object] = []
    synchronized: list[torch.device] = []

    class RecordedEvent(torch.Event):
        def record(self, stream=None):
            recorded.append(stream)

    monkeypatch.setattr(kvhost_torch.backend, "current_stream", lambda device: "not a torch.Stream")
    monkeypatch.setattr(torch, "Event", RecordedEvent)
    monkeypatch.setattr(torch.accelerator, "synchronize", synchronized.append)
    device = torch.device("meta", 1)
    assert kvhost_torch.backend._event_on_stream_of(device) is None and recorded == []
    completion = kvhost_torch.backend._completion(meta_copy_job(torch.device("cpu"), device))
    assert type(completion) is Completion and completion.done()
    assert synchronized == [device] and recorded == []


@pytest.mark.parametrize(
    "options",
    [dict(host_thread_bytes=8 << 20), dict(host_thread_bytes=1, host_chunk_bytes=1 << 20)],
    ids=["numpy-unit-at-a-time", "torch-passes"],
)
def test_a_machine_short_of_memory_for_a_later_job_s_scratch_refuses_the_torch_path_s_call_first(monkeypatch, options):
    """The torch path's passes go through one scratch the call's jobs share, made in their
    checks: no room for the second job's is a BackendError with no byte written. Its passes
    had allocated as they ran, leaving the first job rearranged and a RuntimeError; a second
    try rearranged it again."""
    from kvhost.testing import ReceiveCase

    caches = {"l0": make_cache("BNHC", "BNHC", dict(B=16, N=256, H=16, C=128), torch.bfloat16)}  # blocks of 1 MiB
    case = ReceiveCase(caches, "BNHC")
    case.send("a", [0, 1], "HNC", 64)  # r = 4: units of a block, a scratch of 2 MiB
    case.send("b", [2, 3], "HNC", 512)  # g = 2: units of two blocks, a scratch of 4 MiB
    requests = {n: kvhost.Incoming(w.block_ids, w.remote_order, w.remote_block_size) for n, w in case.requests.items()}
    saved, asked = case.snapshot(), []
    backend = kvhost_torch.backend.TorchBackend(**options)

    class ShortOfMemory:
        """torch, whose ``empty`` finds no room for more than 3 MiB."""

        def __getattr__(self, name):
            return getattr(torch, name)

        def empty(self, *shape, **kwargs):
            asked.append(shape)
            if np.prod(shape) > 3 << 20:
                raise RuntimeError("DefaultCPUAllocator: can't allocate memory")
            return torch.empty(*shape, **kwargs)

    monkeypatch.setattr(kvhost_torch.backend, "torch", ShortOfMemory())
    refusal = r"^cpu: no memory for a receive's scratch of 4,194,304 bytes .*nothing was moved\): RuntimeError: Default"
    with pytest.raises(kvhost.BackendError, match=refusal):
        kvhost.receive(caches, requests, axes="BNHC", backend=backend)
    assert asked == [(2 << 20,), (4 << 20,)] and case.same_as(saved)
    monkeypatch.setattr(kvhost_torch.backend, "torch", torch)
    kvhost.receive(caches, requests, axes="BNHC", backend=backend)
    case.check()


def test_the_jobs_of_a_call_share_one_scratch_made_in_their_checks(monkeypatch):
    """Made once, as large as the largest job needs (two passes: a unit at a time on numpy's
    way), in the checks; the runs ask for none. A job run without its check makes its own."""
    from kvhost.batch import plan_receive_batch
    from kvhost.caches import CacheSet
    from kvhost.testing import ReceiveCase

    caches = {"l0": make_cache("BNHC", "BNHC", dict(B=40, N=64, H=16, C=64), torch.bfloat16)}  # blocks of 128 KiB
    case = ReceiveCase(caches, "BNHC")
    case.send("a", list(range(8)), "HNC", 16)  # r = 4: units of a block, one at a time
    case.send("b", list(range(8, 16)), "HNC", 32)  # r = 2: as large
    case.send("c", list(range(16, 24)), "HNC", 128)  # g = 2: units of two blocks
    case.send("d", list(range(24, 32)), "HNC", 16)
    case.send("e", list(range(32, 40)), "HNC", 16)
    requests = {n: kvhost.Incoming(w.block_ids, w.remote_order, w.remote_block_size) for n, w in case.requests.items()}
    asked = []
    real_empty = torch.empty

    def empty(*shape, **kwargs):
        asked.append(shape)
        return real_empty(*shape, **kwargs)

    backend = kvhost_torch.backend.TorchBackend()
    monkeypatch.setattr(kvhost_torch.backend.torch, "empty", empty)
    kvhost.receive(caches, {"a": requests["a"], "b": requests["b"]}, axes="BNHC", backend=backend)
    assert asked == [(2 * 128 << 10,)]  # a's two units' worth; b's, as large, took it
    asked.clear()
    kvhost.receive(caches, {"c": requests["c"], "d": requests["d"]}, axes="BNHC", backend=backend)
    assert asked == [(2 * 256 << 10,)]  # c's, larger than d's
    asked.clear()
    job = plan_receive_batch(CacheSet(caches, "BNHC"), {"e": requests["e"]}, None, None).jobs[0]
    backend.receive(job)  # no check before it: it makes its own scratch
    assert asked == [(2 * 128 << 10,)]
    monkeypatch.setattr(kvhost_torch.backend.torch, "empty", real_empty)
    case.check()
