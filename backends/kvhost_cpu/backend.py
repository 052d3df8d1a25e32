"""The CPU backend: compiled kernels where numba is installed, torch ops where it is not.

The kernels (``kernels.py``) make one call per group for every layer at once, with a
memcpy's memory traffic while their scratch stays in cache; where numba is missing, or a
job's tensors are not host memory, the torch path runs (docs/design.md: on the host, in
cache-sized chunks). numba is imported on first
use, not with kvhost.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from contextlib import AbstractContextManager
from dataclasses import dataclass
from types import ModuleType

import numpy as np
from kvhost_torch.backend import TorchBackend

from kvhost.backend import Backend, Completion, OptionalKernels, check_sizes
from kvhost.batch import CopyJob, ReceiveJob
from kvhost.errors import ArgumentError, BackendError
from kvhost.transform import ChunkCycles, CopyPlan, Loops

MAX_ITEM_BYTES = 1 << 21  # copies are split into items of at most this much, to share cores
# A receive piece is rewritten in place by its cycles (each run read and written once, one
# run of scratch) where its runs are CYCLE_RUN_BYTES or longer, or it is CYCLE_PIECE_BYTES
# or larger (its copy in a scratch no longer fits a core's cache, and reads and writes each
# byte twice in memory) with runs of half that or longer; otherwise through a scratch copy
# of the piece, which shorter runs, a scatter of small copies for the cycles, favour.
# Measured here side by side (docs/performance.md): 1.2-2.4x the scratch's throughput for
# runs of 512 B to 256 KiB (pieces of 32 KiB to 8 MiB), 1.15-1.35x for runs of 256 B in
# pieces of 2 MiB; 0.8-0.85x for runs of 256 B in pieces of 32-512 KiB, where the scratch
# stays in cache.
CYCLE_PIECE_BYTES = 2 << 20
CYCLE_RUN_BYTES = 512
NO_CYCLES = ChunkCycles(0, np.zeros(0, dtype=np.int64), np.zeros(1, dtype=np.int64))
# The order a copy's loops walk in: "auto", the destination's unless that reads runs of the
# source of REORDER_MIN_RUN bytes or more less than SHORT_READ_STRIDE apart, where the
# source's (``walk_order``); or always the destination's or the source's.
COPY_WALKS = ("auto", "destination", "source")
SHORT_READ_STRIDE = 4096
REORDER_MIN_RUN = 128  # the kernels' STREAM_RUN: streamed runs, whose walks were measured
# One kernel launch at a time: each launch already uses every core, and numba's fallback
# threading layer (workqueue, where no OpenMP or TBB is found) aborts on concurrent launches.
# Re-entrant: a device copy's handle dropped while this thread holds it (the collector runs
# at any allocation, the scratch's included) finishes a bounced save with a copy here.
_launch = threading.RLock()
KERNELS = OptionalKernels("kvhost_cpu.kernels", lambda kernels: kernels.unusable())


class CpuBackend(Backend):
    name = "cpu"
    device_types = ("cpu",)
    priority = 0

    def __init__(
        self,
        *,
        cycle_piece_bytes: int = CYCLE_PIECE_BYTES,
        cycle_run_bytes: int = CYCLE_RUN_BYTES,
        copy_walk: str = COPY_WALKS[0],
    ) -> None:
        """``cycle_run_bytes``, ``cycle_piece_bytes``: receive pieces whose runs are that long,
        or that large with runs half that long, are rewritten in place by their cycles
        (``kvhost.transform.ChunkCycles``) rather than through a scratch of a whole piece.
        ``copy_walk``: the order copies walk in, one of ``COPY_WALKS``."""
        check_sizes(cycle_piece_bytes=cycle_piece_bytes, cycle_run_bytes=cycle_run_bytes)
        if copy_walk not in COPY_WALKS:
            raise ArgumentError(f"copy_walk must be one of {COPY_WALKS}, got {copy_walk!r}")
        self.torch_path = TorchBackend()
        self.cycle_piece_bytes = cycle_piece_bytes
        self.cycle_run_bytes = cycle_run_bytes
        self.copy_walk = copy_walk
        # What a group's launch is kept under: backends that choose other ways keep their own.
        options = (cycle_piece_bytes, cycle_run_bytes, copy_walk)
        defaults = (CYCLE_PIECE_BYTES, CYCLE_RUN_BYTES, COPY_WALKS[0])
        self._derived = "cpu" if options == defaults else "cpu/{}/{}/{}".format(*options)

    def describe(self) -> str:
        kernels = KERNELS.module
        if kernels is None:
            return f"torch ops (numba unavailable: {KERNELS.reason})"
        problem = kernels.threading_problem()
        return "numba kernels" if problem is None else f"numba kernels on the calling thread ({problem})"

    def exclusive(self) -> AbstractContextManager[object]:
        return _scratch.call()  # the scratch a call reserved stays until its last job has run

    def check_receive(self, job: ReceiveJob) -> None:
        """Reserve the job's scratch before any job of the call runs: a machine without room
        for it refuses the call with nothing written, not after earlier jobs rearranged theirs."""
        launch = self._receive_launch_of(job)
        if not isinstance(launch, _ReceiveLaunch):
            return self.torch_path.check_receive(job)
        _, threads = launch.kernels.launcher("rearrange_units", job.unit_ids.shape[0] * launch.unit_bytes)
        try:
            _scratch.rows(threads, launch.scratch_bytes)
        except MemoryError as err:
            raise BackendError(
                f"no memory for a receive's scratch of {threads} x {launch.scratch_bytes:,} bytes "
                f"({job.group.unit_bytes:,}-byte units; nothing was moved): {err}"
            ) from err

    def receive(self, job: ReceiveJob) -> None:
        launch = self._receive_launch_of(job)
        if not isinstance(launch, _ReceiveLaunch):  # the kernels need numba and host addresses
            return self.torch_path.receive(job)
        kernel, threads = launch.kernels.launcher("rearrange_units", job.unit_ids.shape[0] * launch.unit_bytes)
        with _launch:
            scratch = _scratch.rows(threads, launch.scratch_bytes)
            kernel(launch.addresses, launch.outer, job.unit_ids, launch.params, *launch.cycles, scratch, threads)
        return None

    def _receive_launch_of(self, job: ReceiveJob) -> _ReceiveLaunch | bool:
        launch = job.group.derived.get(self._derived)
        if launch is None:
            launch = job.group.derived[self._derived] = self._receive_launch(job)
        return launch  # type: ignore[return-value]

    def _receive_launch(self, job: ReceiveJob) -> _ReceiveLaunch | bool:
        kernels = KERNELS.module
        if kernels is None or job.device.type != "cpu":
            return False
        plan, write_back = job.rearrangement, job.rearrangement.write_back
        cycles = NO_CYCLES
        run = write_back.loops.run_bytes
        if run >= self.cycle_run_bytes or (
            write_back.piece_bytes >= self.cycle_piece_bytes and 2 * run >= self.cycle_run_bytes
        ):
            cycles = write_back.cycles
        params = kernels.receive_params(
            job.layout.block_stride_bytes,
            plan.region_bytes,
            write_back.pieces,
            write_back.piece_bytes,
            write_back.part_stride,
            write_back.loops,
            cycles.chunk_bytes,
        )
        addresses, outer = job.members.addresses, job.layout.outer_offsets_bytes
        return _ReceiveLaunch(
            kernels,
            params,
            (cycles.order, cycles.starts),
            kernels.scratch_bytes(params),
            job.group.unit_bytes,
            addresses,
            outer,
        )

    def copy(self, job: CopyJob) -> Completion:
        launch = job.group.derived.get(self._derived)
        if launch is None:
            launch = job.group.derived[self._derived] = self._copy_launch(job)
        if not isinstance(launch, _CopyLaunch):
            return self.torch_path.copy(job)
        nbytes = job.src_ids.size * launch.block_bytes
        params = launch.streamed_params if nbytes >= launch.kernels.STREAM_BYTES else launch.cached_params
        kernel, threads = launch.kernels.launcher("copy_runs", nbytes)
        with _launch:
            kernel(*launch.addresses, job.src_ids, job.dst_ids, params, threads)
        return Completion()

    def _copy_launch(self, job: CopyJob) -> _CopyLaunch | bool:
        kernels = KERNELS.module
        if kernels is None or job.src_device.type != "cpu" or job.dst_device.type != "cpu":
            return False
        group, loops = job.group, job.plan.loops  # plan_copy walks in the destination's order
        # Copies under STREAM_BYTES (cached stores) keep it: the walks were measured streamed.
        walked = walk_order(loops, self.copy_walk)
        addresses = (group.sources.addresses, group.destinations.addresses)
        cached, streamed = _copy_params(job.plan, loops, False), _copy_params(job.plan, walked, True)
        return _CopyLaunch(kernels, cached, streamed, group.block_bytes, addresses)


# What the kernels need from a receive or copy group, worked out on the group's first job
# and kept with the group (``derived``): a cold call pays a few microseconds for every
# attribute it looks up, and this runs on every call. False: the group takes the torch path.


@dataclass(frozen=True)
class _ReceiveLaunch:
    kernels: ModuleType
    params: np.ndarray
    cycles: tuple[np.ndarray, np.ndarray]  # ChunkCycles' order and starts; empty: through a scratch
    scratch_bytes: int
    unit_bytes: int  # the group's, kept here with the rest of the launch
    addresses: np.ndarray
    outer: np.ndarray


@dataclass(frozen=True)
class _CopyLaunch:
    kernels: ModuleType
    cached_params: np.ndarray
    streamed_params: np.ndarray  # for jobs of STREAM_BYTES or more
    block_bytes: int  # the group's, kept here with the rest of the launch
    addresses: tuple[np.ndarray, np.ndarray]


class _Scratch:
    """The receive kernels' scratch: one row per thread, owned here for the whole call.

    Reserved before a call's first job runs (``CpuBackend.check_receive``) and only grown
    while calls are under way (``call``), so no job of a call meets an allocation that can
    fail. Kept between calls (launches are serialised by ``_launch``), so that a steady
    stream of calls does not fault in fresh pages each time; let go when the last call under
    way ends having needed much less, so a single huge piece does not pin memory for ever.
    """

    KEEP_BYTES = 64 << 20

    def __init__(self) -> None:
        self._buffer = np.empty((0, 0), dtype=np.uint8)
        # The launches' lock, not one of its own: the collector may run at any allocation
        # made under it and finish a dropped save with a copy, which takes ``_launch``; a
        # second lock, taken in the other order by a receive's launch, deadlocked two threads.
        self._lock = _launch
        self._calls = 0  # calls under way
        self._needed = 0  # the most bytes a call under way, or a launch since the last let go, asked for

    def rows(self, threads: int, row_bytes: int) -> np.ndarray:
        """At least ``threads`` rows of at least ``row_bytes`` (the buffer grown to hold them)."""
        with self._lock:
            buffer = self._buffer
            self._needed = max(self._needed, threads * row_bytes)
            if buffer.shape[0] < threads or buffer.shape[1] < row_bytes:
                shape = (max(threads, buffer.shape[0]), max(row_bytes, buffer.shape[1]))
                buffer = self._buffer = np.empty(shape, dtype=np.uint8)
            return buffer

    @contextlib.contextmanager
    def call(self) -> Iterator[None]:
        """Held around a call: the last call under way to end lets go of a buffer more than
        four times what the calls needed (and more than ``KEEP_BYTES``)."""
        with self._lock:
            self._calls += 1
        try:
            yield
        finally:
            with self._lock:
                self._calls -= 1
                if self._calls == 0:
                    if self._buffer.size > max(self.KEEP_BYTES, 4 * self._needed):
                        self._buffer = np.empty((0, 0), dtype=np.uint8)  # a kernel running holds its own reference
                    self._needed = 0


_scratch = _Scratch()


def _copy_params(plan: CopyPlan, loops: Loops, stream: bool) -> np.ndarray:
    kernels = KERNELS.module
    assert kernels is not None
    most_blocks = max(1, MAX_ITEM_BYTES // plan.block_bytes)
    return kernels.copy_params(  # type: ignore[no-any-return]
        plan.src_block_stride, plan.dst_block_stride, plan.merge_blocks, most_blocks, loops, stream
    )


def walk_order(loops: Loops, walk: str = COPY_WALKS[0]) -> Loops:
    """``loops`` (walked in the destination's memory order) walked as ``walk`` says: "auto",
    in the source's order where the destination's walk would read runs of
    ``REORDER_MIN_RUN`` bytes or more out of order, less than ``SHORT_READ_STRIDE`` apart;
    "destination" or "source", always in that side's order.

    Measured here (``experiments/copy_walk.py``, docs/performance.md): where the
    destination's walk read the source 512 B to 2 KiB apart, 0.90-1.03 of memcpy against
    the source's walk's 0.95-1.18; 4 KiB or more apart, 1.13-1.38 against 0.94-1.15. Runs
    of 128-192 B, streamed, read 1-3 KiB apart: 0.72-1.21 against 0.81-1.25, the source's
    walk faster in 7 of 10 cases and within 0.05 in the others.
    """
    # A short source stride on the innermost loop: the destination's walk reads the source
    # out of order (plan_copy has merged into the run any dim contiguous on both sides).
    short_reads = bool(loops.shape) and loops.run_bytes >= REORDER_MIN_RUN and loops.src_strides[-1] < SHORT_READ_STRIDE
    if walk == "source" or (walk == "auto" and short_reads):
        return loops.reordered(sorted(range(len(loops.shape)), key=lambda d: -loops.src_strides[d]))
    return loops
