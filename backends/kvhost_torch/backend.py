"""The pure-torch backend: device-generic tensor ops, for any device type.

Receive is gather -> permute -> scatter on a view of each tensor in physical order
(outer axes, ``B``, region). Copies move runs of consecutive ids with one ``copy_`` each,
or gather/scatter when ids are scattered. On the host, copies, gathers, scatters and
receive units under a MiB go through numpy on the calling thread instead of waking
torch's threads. Bytes are moved as integers of the same size (``kvhost.raw``), so fp8 and
NaN payloads pass through untouched.

It is the fallback where no device backend is installed, the reference the others are
tested against, and the path device backends hand work to where their kernels cannot
run (they hold one, configured for their device: composition, not inheritance).
"""

from __future__ import annotations

import contextlib
import math
import threading
from collections.abc import Callable
from functools import cached_property
from typing import NamedTuple

import numpy as np
import torch

from kvhost.backend import Backend, Completion, EventCompletion, check_sizes, next_power_of_two
from kvhost.batch import CopyJob, ReceiveJob
from kvhost.errors import BackendError, brief
from kvhost.ids import find_runs_list
from kvhost.layout import Layout, contiguous_strides, view_as_letters
from kvhost.raw import as_raw
from kvhost.transform import Rearrangement


def current_stream(device: torch.device) -> object:
    """The stream that work for ``device`` queues on now; None where torch gives it no streams."""
    accelerator = getattr(torch, "accelerator", None)
    with contextlib.suppress(RuntimeError, AttributeError, TypeError, ValueError):
        if accelerator is not None and accelerator.current_accelerator().type == device.type:
            return accelerator.current_stream(device)
    module = getattr(torch, device.type, None)
    with contextlib.suppress(RuntimeError, AttributeError, TypeError, ValueError):
        return module.current_stream(device)  # type: ignore[union-attr]
    return None


def call_scratch(
    shared: dict[object, object], name: str, device: torch.device, numel: int, dtype: torch.dtype
) -> torch.Tensor:
    """A receive's scratch of at least ``numel`` elements: the one the call holds under
    ``name`` (``shared``: its jobs' own dict) where it is as large, else a new one kept there.
    A call's jobs run in turn, so one scratch serves them all: a call holds one, not one per
    job, until it runs."""
    key = (name, device, dtype)
    held = shared.get(key)
    if isinstance(held, torch.Tensor) and held.numel() >= numel:
        return held
    scratch = torch.empty(numel, dtype=dtype, device=device)
    shared[key] = scratch
    return scratch


class IndexBuffers:
    """Index tensors on a device: grow-only buffers, one per thread and stream, reused across calls.

    Host ids are used in place (zero-copy). On a device a buffer belongs to one stream: it
    is made, refilled and dropped only while that stream is current, and the kernels that
    read it queue on that stream too. So a refill queues behind every earlier read of it,
    and a buffer that is replaced (grown) goes back to the caching allocator on the stream
    that read it, which hands it out again only to later work on that stream. A call on
    another stream (the caller switched streams, or another thread) takes another buffer:
    one stream never overwrites or frees what another may still be reading. Work that
    outlives the call (a non-blocking copy) takes a fresh tensor.
    """

    def __init__(self, stream_of: Callable[[torch.device], object] = current_stream) -> None:
        self._local = threading.local()
        self._stream_of = stream_of

    def __call__(self, ids: np.ndarray, device: torch.device) -> torch.Tensor:
        host = torch.from_numpy(ids)
        if device.type == "cpu":
            return host
        buffers: dict[tuple[torch.device, object], torch.Tensor] = self._local.__dict__.setdefault("buffers", {})
        key = (device, self._stream_of(device))
        buffer = buffers.get(key)
        if buffer is None or buffer.numel() < ids.size:
            capacity = max(1024, next_power_of_two(int(ids.size)))
            buffer = buffers[key] = torch.empty(capacity, dtype=torch.int64, device=device)
        view = buffer[: ids.size]
        view.copy_(host)
        return view


class TorchBackend(Backend):
    """Torch ops on any device.

    ``host_chunk_bytes``/``device_chunk_bytes``: bytes per gather/scatter pass of a receive
    (on the host a whole-batch temporary falls out of cache, docs/design.md "Backends";
    the device's default, None, takes a group in one pass; None given here keeps the
    default); ``max_run_copies``: up to this many runs of ids on one
    side, a copy is one call per run and layer (``index_select`` into a destination run,
    ``index_copy_`` from a source run, ``copy_`` where both run alike),
    beyond it one gather/scatter; ``host_thread_bytes``: on the host, a gather of packed
    blocks, a scatter, a ``copy_`` or a receive unit of fewer bytes runs on the calling
    thread, through numpy (torch's op would wake its parked threads, 50-300 us on the VMs
    measured (docs/design.md), more than a second thread saves below 1-8 MiB; a small gather then makes no
    torch call at all, each 10-35 us cold); ``host_split_bytes``: on the host, a gather whose
    slices under the dims before ``B`` are dense goes one call per index of those dims where
    each such call moves at least this many bytes (a ``memcpy`` per id, where a gather along
    ``B`` copies each id in a strided loop; but each call is a parallel region, a wake of the
    parked workers); one whose slices are not dense (a buffer in another layout) always
    does, 2-3x faster.
    """

    name = "torch"
    device_types = ("*",)
    priority = -100
    host_chunk_bytes: int = 1 << 20
    device_chunk_bytes: int | None = None
    max_run_copies: int = 64
    host_thread_bytes: int = 1 << 20
    host_split_bytes: int = 8 << 20

    def __init__(
        self,
        *,
        host_chunk_bytes: int | None = None,
        device_chunk_bytes: int | None = None,
        max_run_copies: int | None = None,
        host_thread_bytes: int | None = None,
        host_split_bytes: int | None = None,
    ) -> None:
        options = {
            "host_chunk_bytes": host_chunk_bytes,
            "device_chunk_bytes": device_chunk_bytes,
            "max_run_copies": max_run_copies,
            "host_thread_bytes": host_thread_bytes,
            "host_split_bytes": host_split_bytes,
        }
        given = {name: value for name, value in options.items() if value is not None}  # None: the default
        check_sizes(**given)
        for name, value in given.items():
            setattr(self, name, value)

    @cached_property
    def index_buffers(self) -> IndexBuffers:
        return IndexBuffers()

    def check_receive(self, job: ReceiveJob) -> None:
        """Make the scratch the job's passes need before any job of the call runs (one for
        the call's jobs, as large as the largest needs): a machine without room for it
        refuses the call with nothing written, not after earlier jobs rearranged theirs."""
        self._receive_scratch(job)

    def _receive_scratch(self, job: ReceiveJob) -> torch.Tensor:
        """Bytes for two passes of the job (a pass's wire bytes, then its rearranged ones),
        the call's scratch where it is as large; each member views it in its own dtype."""
        plan = job.rearrangement
        pass_bytes = job.group.member_unit_bytes * self._units_a_pass(job)
        needed = -(-2 * pass_bytes // 8) * 8  # whole words: a member may view it as 8-byte integers
        try:
            return call_scratch(job.shared, "torch receive", job.device, needed, torch.uint8)
        except RuntimeError as err:  # torch's allocators (the host's, OutOfMemoryError on devices)
            raise BackendError(
                f"{job.device}: no memory for a receive's scratch of {needed:,} bytes "
                f"({plan.unit_bytes:,}-byte units; nothing was moved): {brief(err)}"
            ) from None

    def _units_a_pass(self, job: ReceiveJob) -> int:
        """Units a pass of the job moves: one at a time on the host's numpy way, else as many
        as the host's or the device's chunk holds (all, where the device's is unbounded)."""
        if self._numpy_way(job):
            return 1
        units = int(job.unit_ids.shape[0])
        pass_bytes = self.host_chunk_bytes if job.device.type == "cpu" else self.device_chunk_bytes
        return units if pass_bytes is None else min(units, max(1, pass_bytes // job.group.member_unit_bytes))

    def _numpy_way(self, job: ReceiveJob) -> bool:
        """Whether the job's units go one by one through numpy on the calling thread: host
        units of fewer than ``host_thread_bytes`` (over the dims outside a block)."""
        return job.device.type == "cpu" and job.group.member_unit_bytes < self.host_thread_bytes

    def receive(self, job: ReceiveJob) -> None:
        """Gather each pass's units, permute, scatter them back, in torch ops, through the
        scratch ``check_receive`` made. On the host, units of fewer than ``host_thread_bytes``
        (over the dims outside a block) go one by one through two halves of the scratch that
        stay in cache, in numpy on the calling thread: torch's ops there wake its threads
        three times a pass, and the bench's receive ran at 0.15 of memcpy, slower than
        vLLM's per-request way on one thread."""
        plan = job.rearrangement
        layout = job.layout
        outer = len(layout.outer)
        host = job.device.type == "cpu"
        scratch = self._receive_scratch(job)
        if self._numpy_way(job):  # numpy's calls: no index tensor to make
            halves = scratch.numpy()
            for member in job.members:
                view, src_shape, region_shape = _receive_view(member.tensor, layout, plan, widen=True)
                blocks = view.detach().numpy()
                _receive_units(
                    blocks, job.unit_ids, outer, src_shape, plan.perm, region_shape, halves.view(blocks.dtype)
                )
            return
        ids = self.index_buffers(job.unit_ids.reshape(-1), job.device)
        units = job.unit_ids.shape[0]
        step = self._units_a_pass(job)
        dims = list(range(outer + 1)) + [outer + 1 + p for p in plan.perm]
        passes: dict[tuple[object, ...], tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]] = {}
        for member in job.members:
            view, src_shape, region_shape = _receive_view(member.tensor, layout, plan, widen=host)
            for start in range(0, units, step):
                count = min(step, units - start)
                chunk = ids[start * plan.parts : (start + count) * plan.parts]
                shape = (count, view.dtype, *view.shape)  # a member may not widen where another does
                if shape not in passes:  # views of the scratch, made once a shape
                    outer_shape = view.shape[:outer]
                    gathered = (*outer_shape, count * plan.parts, *view.shape[outer + 1 :])
                    size = math.prod(gathered)
                    typed = scratch.view(view.dtype)
                    wire = typed[:size].view(gathered)
                    permuted = wire.view(*outer_shape, count, *src_shape).permute(dims)
                    local = typed[size : 2 * size].view(permuted.shape)
                    passes[shape] = wire, permuted, local, local.view(*outer_shape, count * plan.parts, *region_shape)
                wire, permuted, local, rearranged = passes[shape]
                torch.index_select(view, outer, chunk, out=wire)
                local.copy_(permuted)
                view.index_copy_(outer, chunk, rearranged)

    def copy(self, job: CopyJob) -> Completion:
        """The fewest calls that move every block in one pass (``_index_runs`` says which).
        Per run of one side: gathered straight into a destination run (``index_select(out=)``,
        a staging buffer filling in order) or scattered straight from a source run
        (``index_copy_``, loading it back). Otherwise, up to ``max_run_copies`` runs
        consecutive on both sides, one ``copy_`` each; beyond that (both sides scattered), a
        gather then a scatter. On the host, a call that moves fewer than ``host_thread_bytes``
        is numpy's instead, on the calling thread: ``take`` for a gather (where each side's
        blocks lie back to back under each index before ``B``), index assignment for a
        scatter, ``copyto`` for a run."""
        dst_runs, src_runs = self._index_runs(job)
        gathers = _RunIds(job.src_ids, job.src_device, dst_runs)
        scatters = _RunIds(job.dst_ids, job.dst_device, src_runs)
        runs: list[list[int]] | None = None  # found where a pair needs them
        indices: tuple[torch.Tensor, torch.Tensor] | None = None  # each side's ids on its device, once a job
        for pair in _pair_views(job):
            if pair.apart and dst_runs:
                self._gather_into_runs(pair, dst_runs, gathers)
            elif pair.apart and src_runs:
                self._scatter_from_runs(pair, src_runs, scatters)
            else:
                runs = job.runs.tolist() if runs is None else runs
                if len(runs) <= self.max_run_copies:
                    self._copy_runs(job, pair, runs)
                    continue
                if indices is None:
                    indices = (
                        torch.from_numpy(job.src_ids).to(job.src_device),
                        torch.from_numpy(job.dst_ids).to(job.dst_device),
                    )
                _gather_and_scatter(job, pair, *indices)
        return _completion(job)

    def _gather_into_runs(self, pair: _PairViews, dst_runs: list[tuple[int, int, int]], gathers: _RunIds) -> None:
        """Each destination run filled in order from the source blocks its ids name."""
        source, dest, b = pair.source, pair.dest, pair.b
        arrays, block_bytes, before_b = pair.arrays, pair.block_bytes, pair.before_b
        for n, (_, d0, count) in enumerate(dst_runs):
            if arrays is not None and pair.packed and count * block_bytes < self.host_thread_bytes:
                # numpy's take, a memcpy per id on this thread; "clip" because "raise" sends
                # the output through a temporary (the front end has checked every id)
                ids = gathers.array(n)
                for at in before_b:
                    np.take(arrays[0][at], ids, axis=0, out=arrays[1][at][d0 : d0 + count], mode="clip")
            elif arrays is not None and (
                not pair.dense or count * block_bytes >= self.host_split_bytes * len(before_b)
            ):
                # per index before B: a memcpy per id over the threads where the slices are
                # dense; where they are not, a strided copy per id, 2-3x faster than along B
                for at in before_b:
                    torch.index_select(source[at], 0, gathers.tensor(n), out=dest[at].narrow(0, d0, count))
            else:
                torch.index_select(source, b, gathers.tensor(n), out=dest.narrow(b, d0, count))

    def _scatter_from_runs(self, pair: _PairViews, src_runs: list[tuple[int, int, int]], scatters: _RunIds) -> None:
        """Each source run written, block by block, to the destination blocks its ids name."""
        source, dest, b, arrays = pair.source, pair.dest, pair.b, pair.arrays
        for n, (_, s0, count) in enumerate(src_runs):
            if arrays is not None and count * pair.block_bytes < self.host_thread_bytes:
                arrays[1][_span(b, scatters.array(n))] = arrays[0][_span(b, s0, count)]
            else:
                dest.index_copy_(b, scatters.tensor(n), source.narrow(b, s0, count))

    def _copy_runs(self, job: CopyJob, pair: _PairViews, runs: list[list[int]]) -> None:
        """One copy for each run of blocks consecutive on both sides."""
        source, dest, b, arrays = pair.source, pair.dest, pair.b, pair.arrays
        for s0, d0, count in runs:
            if arrays is not None and count * pair.block_bytes < self.host_thread_bytes:
                np.copyto(arrays[1][_span(b, d0, count)], arrays[0][_span(b, s0, count)])
                continue
            into, out_of = dest.narrow(b, d0, count), source.narrow(b, s0, count)
            into.copy_(out_of, non_blocking=job.non_blocking and _no_host_temporary(job, into, out_of))

    def _index_runs(self, job: CopyJob) -> tuple[list[tuple[int, int, int]], list[tuple[int, int, int]]]:
        """(destination runs to gather into, source runs to scatter from), at most one of
        them and at most ``max_run_copies`` runs: on one device, the side whose ids form
        fewer runs than both sides' together.

        Where both sides run alike, ``copy_`` per run, on the host too: it splits a large
        copy over torch's threads, which ``index_select`` does per block (docs/design.md
        "Backends" has the measurements).
        """
        if job.src_device != job.dst_device or len(job.runs) == 1:
            return [], []  # one copy_ a layer
        dst_runs = _runs(job.dst_ids)
        if len(dst_runs) <= self.max_run_copies and len(dst_runs) < len(job.runs):
            return dst_runs, []
        src_runs = _runs(job.src_ids)
        if len(src_runs) <= self.max_run_copies and len(src_runs) < len(job.runs):
            return [], src_runs
        return [], []


def _gather_and_scatter(job: CopyJob, pair: _PairViews, src_index: torch.Tensor, dst_index: torch.Tensor) -> None:
    """Both sides scattered: every source block gathered, then scattered where it goes."""
    # Into host memory the scatter reads the gathered bytes on this thread at once: a
    # non-blocking copy there would still be landing (into pinned memory torch made).
    # Out of it, the gathered bytes are a temporary freed on return (_no_host_temporary).
    landing = job.non_blocking and "cpu" not in (job.src_device.type, job.dst_device.type)
    gathered = pair.source.index_select(pair.b, src_index).to(job.dst_device, non_blocking=landing)
    pair.dest.index_copy_(pair.b, dst_index, gathered)


class _PairViews(NamedTuple):
    """A member pair as the copy ops take it (``_pair_views``)."""

    source: torch.Tensor
    dest: torch.Tensor
    b: int  # the B dim
    apart: bool  # not one storage
    arrays: tuple[np.ndarray, np.ndarray] | None  # (source, dest) as numpy arrays, on the host
    block_bytes: int  # one block of one member: the bytes a call moves per id
    before_b: list[tuple[int, ...]]  # each index of the dims before B (a gather split per index: a call each)
    dense: bool  # a block's bytes under one index of the dims before B are one run on both sides
    packed: bool  # all blocks under one such index are one run, on both sides (else numpy's take copies first)


def _pair_views(job: CopyJob) -> list[_PairViews]:
    """For each member pair: source and destination as raw views in the destination's memory
    order (the index ops then write a dense tensor: 4.5x faster than in shape order for an
    HND cache on the host), the ``B`` dim, whether the two are apart in memory, and on the
    host the same views as numpy arrays.

    Worked out once per copy group and kept with it (a call with 16 layers would otherwise
    spend most of a small copy making views), where every tensor is plain memory with an
    address: XLA's views are not kept across calls.
    """
    known = job.group.derived.get("torch views")
    if known is not None:
        return known  # type: ignore[return-value]
    host = job.src_device.type == job.dst_device.type == "cpu"
    views = []
    for src, dst in job.pairs:
        source = view_as_letters(as_raw(src.tensor), src.layout.axes, dst.layout.physical)
        dest = dst.layout.physical_view(as_raw(dst.tensor))
        # A copy within one cache reads and writes one storage: kept off the one-pass index
        # ops (whose behaviour on shared memory torch does not promise).
        apart = src.tensor.untyped_storage().data_ptr() != dst.tensor.untyped_storage().data_ptr()
        if host:
            source, dest = _widened(source, dest)
        arrays = (source.detach().numpy(), dest.detach().numpy()) if host else None
        block_bytes = dst.layout.region_bytes * dst.layout.outer_count
        b = dst.layout.physical.index("B")
        before_b = list(np.ndindex(*dest.shape[:b]))
        dense = all(_dense_after(view, b) for view in (source, dest))
        packed = all(_dense_after(view, b - 1) for view in (source, dest))  # the dims from B on
        views.append(_PairViews(source, dest, b, apart, arrays, block_bytes, before_b, dense, packed))
    if all(src.address and dst.address for src, dst in job.pairs):
        job.group.derived["torch views"] = views
    return views


def _receive_view(
    tensor: torch.Tensor, layout: Layout, plan: Rearrangement, widen: bool
) -> tuple[torch.Tensor, tuple[int, ...], tuple[int, ...]]:
    """A member as a raw view in memory order ``[outer..., B, *region]``, with a unit's wire
    shape and the region's shape in its elements: 8-byte integers where ``widen``, the
    innermost dim stays innermost and torch can view it so (as ``_widened``)."""
    view = layout.physical_view(as_raw(tensor))
    src_shape = plan.src_shape
    region_shape = tuple(layout.size(a) for a in layout.region)
    width = 8 // layout.itemsize
    if not widen or width < 2 or plan.perm[-1] != len(plan.perm) - 1:
        return view, src_shape, region_shape
    if src_shape[-1] % width or region_shape[-1] % width:
        return view, src_shape, region_shape
    try:
        view = view.view(torch.int64)
    except RuntimeError:  # a padded stride
        return view, src_shape, region_shape
    return view, (*src_shape[:-1], src_shape[-1] // width), (*region_shape[:-1], region_shape[-1] // width)


def _receive_units(
    blocks: np.ndarray,
    unit_ids: np.ndarray,
    outer: int,
    src_shape: tuple[int, ...],
    perm: tuple[int, ...],
    region_shape: tuple[int, ...],
    scratch: np.ndarray,
) -> None:
    """Each unit: its blocks' wire bytes copied out to one half of ``scratch`` (a unit's
    elements twice over, of ``blocks``' dtype), rearranged into the other, copied back;
    ``blocks`` is ``[outer..., B, *region]``, a unit's wire bytes are its blocks' regions
    back to back under each outer index."""
    outer_shape = blocks.shape[:outer]
    parts = unit_ids.shape[1]
    shape = (*outer_shape, parts, *region_shape)
    size = math.prod(shape)
    wire, local = scratch[:size].reshape(shape), scratch[size : 2 * size].reshape(shape)
    rearranged = wire.reshape(*outer_shape, *src_shape).transpose(*range(outer), *(outer + p for p in perm))
    local_groups = local.reshape(rearranged.shape)  # both dense: views, never copies
    for row in unit_ids.tolist():
        for part, block in enumerate(row):
            np.copyto(wire[_span(outer, part)], blocks[_span(outer, block)])
        np.copyto(local_groups, rearranged)
        for part, block in enumerate(row):
            np.copyto(blocks[_span(outer, block)], local[_span(outer, part)])


def _dense_after(tensor: torch.Tensor, dim: int) -> bool:
    """Whether the dims after ``dim`` are one dense run of memory (a dim of one may have any stride)."""
    shape = tuple(tensor.shape[dim + 1 :])
    strides = zip(shape, tensor.stride()[dim + 1 :], contiguous_strides(shape), strict=True)
    return all(size == 1 or stride == dense for size, stride, dense in strides)


def _widened(source: torch.Tensor, dest: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Both views as 8-byte integers where torch can view them so (their last dims dense and
    a multiple of 8 bytes): ``index_copy_`` on the host moves one element at a time (a
    32-request load went from 0.44 to 0.65 of memcpy, docs/design.md "Backends")."""
    try:
        return source.view(torch.int64), dest.view(torch.int64)
    except RuntimeError:
        return source, dest


def _span(b: int, first: int | np.ndarray, count: int | None = None) -> tuple[slice | int | np.ndarray, ...]:
    """A numpy index of dim ``b``: blocks ``first .. first + count - 1``, or the ids ``first``."""
    block = first if count is None else slice(first, first + count)
    return (slice(None),) * b + (block,)


def _runs(ids: np.ndarray) -> list[tuple[int, int, int]]:
    """Runs of consecutive ids in one list: (position in the list, first id, count)."""
    runs, position = [], 0
    for first, _, count in find_runs_list(ids):
        runs.append((position, first, count))
        position += count
    return runs


class _RunIds:
    """Per run of the other side (``runs``: position in ``ids``, first id, count), the ids
    it reads or writes here: numpy views where numpy moves the bytes, tensors on ``device``
    where torch does, made at the first such call, one transfer for all (each torch call
    costs 10-35 us cold in a one-request copy: a host copy that numpy does makes none)."""

    def __init__(self, ids: np.ndarray, device: torch.device, runs: list[tuple[int, int, int]]) -> None:
        self.ids = ids
        self.device = device
        self.runs = runs
        self._tensors: list[torch.Tensor] | None = None

    def array(self, n: int) -> np.ndarray:
        at, _, count = self.runs[n]
        return self.ids[at : at + count]

    def tensor(self, n: int) -> torch.Tensor:
        if self._tensors is None:
            index = torch.from_numpy(self.ids)
            if self.device.type != "cpu":
                index = index.to(self.device)
            self._tensors = [index[at : at + count] for at, _, count in self.runs]
        return self._tensors[n]


def _no_host_temporary(job: CopyJob, into: torch.Tensor, out_of: torch.Tensor) -> bool:
    """Whether torch copies ``out_of`` into ``into`` without a host temporary of its own.

    Between host and device, torch first makes a non-contiguous side contiguous in pageable
    host memory it frees on return. CUDA finishes a copy with pageable memory before it
    returns; XPU's queue need not, and would read or write that memory after it is freed:
    such a copy is made blocking (on CUDA it was blocking in effect already).
    """
    if "cpu" not in (job.src_device.type, job.dst_device.type):
        return True
    return into.is_contiguous() and out_of.is_contiguous() and into.dtype == out_of.dtype


def _completion(job: CopyJob) -> Completion:
    """A non-blocking copy on an accelerator finishes later: track it with a device event."""
    if not job.non_blocking:
        return Completion()
    # The destination's stream when it is a device: a copy between two devices ends with the
    # destination's current stream waiting for it, and the scatter after a gather queues there.
    device = job.dst_device if job.dst_device.type != "cpu" else job.src_device
    if device.type == "cpu":
        return Completion()
    event = _event_on_stream_of(device)
    if event is None:
        # No event for this device in this torch: let the device finish before returning.
        with contextlib.suppress(RuntimeError, AttributeError):
            torch.accelerator.synchronize(device)
        return Completion()
    # The job kept until the event: its members hold the caller's tensors and storages, which a
    # host buffer pinned outside torch (one registered with NIXL) needs: torch records no event
    # for such memory. A result dropped early waits for its copy first.
    return EventCompletion(event, [job])


def _event_on_stream_of(device: torch.device) -> torch.Event | None:
    """An event recorded now on ``device``'s current stream, or None where torch has none.

    The stream is passed explicitly: ``torch.Event(device=...)`` keeps only the device type,
    and ``record()`` with no stream records on the current device's stream, which is
    another device's when the caches are not on the current one.
    """
    stream = current_stream(device)
    if not isinstance(stream, torch.Stream):  # device modules' streams (torch.cuda.Stream) subclass it
        return None
    try:
        event = torch.Event(device=device)
        event.record(stream)
    except (RuntimeError, AttributeError, TypeError):
        return None
    return event
