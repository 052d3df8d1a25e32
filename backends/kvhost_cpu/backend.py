"""The CPU backend: compiled kernels where numba is installed, torch ops where it is not.

The kernels (``kernels.py``) make one call per group for every layer at once and move
each byte once; where numba is missing, or a job's tensors are not host memory, the torch
path runs (docs/design.md: on the host, in cache-sized chunks). numba is imported on first
use, not with kvhost.
"""

from __future__ import annotations

import threading
from functools import lru_cache

import numpy as np

from kvhost.backend import Backend, Completion, OptionalKernels
from kvhost.batch import CopyJob, ReceiveJob
from kvhost.torch_backend import TorchBackend
from kvhost.transform import CopyPlan, Rearrangement

MAX_ITEM_BYTES = 1 << 21  # copies are split into items of at most this much, to share cores
# One kernel launch at a time: each launch already uses every core, and numba's fallback
# threading layer (workqueue, where no OpenMP or TBB is found) aborts on concurrent launches.
_launch = threading.Lock()
KERNELS = OptionalKernels("kvhost_cpu.kernels")


class CpuBackend(Backend):
    name = "cpu"
    device_types = ("cpu",)
    priority = 0

    def __init__(self) -> None:
        self.torch_path = TorchBackend()

    def describe(self) -> str:
        return "numba kernels" if KERNELS.module is not None else f"torch ops (numba unavailable: {KERNELS.reason})"

    def receive(self, job: ReceiveJob) -> None:
        kernels = KERNELS.module
        if kernels is None or job.device.type != "cpu":  # the kernels need host addresses
            return self.torch_path.receive(job)
        params = _receive_params(job.rearrangement, job.layout.block_stride_bytes)
        kernel, threads = kernels.launcher("rearrange_units", job.bytes_moved)
        with _launch:
            scratch = _scratch.rows(threads, kernels.scratch_bytes(params))
            kernel(job.members.addresses, job.layout.outer_offsets_bytes, job.unit_ids, params, scratch, threads)
        return None

    def copy(self, job: CopyJob) -> Completion:
        kernels = KERNELS.module
        if kernels is None or job.src_device.type != "cpu" or job.dst_device.type != "cpu":
            return self.torch_path.copy(job)
        nbytes = job.bytes_moved
        params = _copy_params(job.plan, nbytes >= kernels.STREAM_BYTES)
        addresses = (job.group.sources.addresses, job.group.destinations.addresses)
        kernel, threads = kernels.launcher("copy_runs", nbytes)
        with _launch:
            kernel(*addresses, job.src_ids, job.dst_ids, params, threads)
        return Completion()


class _Scratch:
    """The receive kernels' scratch: one row per thread, owned here for the whole call.

    Kept between calls (launches are serialised by ``_launch``), so that a steady stream
    of calls does not fault in fresh pages each time; grown when a call needs more, and
    let go when one needs much less, so a single huge piece does not pin memory for ever.
    """

    KEEP_BYTES = 64 << 20

    def __init__(self) -> None:
        self._buffer = np.empty((0, 0), dtype=np.uint8)

    def rows(self, threads: int, row_bytes: int) -> np.ndarray:
        buffer = self._buffer
        if (
            buffer.shape[0] < threads
            or buffer.shape[1] < row_bytes
            or buffer.size > max(self.KEEP_BYTES, 4 * threads * row_bytes)
        ):
            buffer = self._buffer = np.empty((threads, row_bytes), dtype=np.uint8)
        return buffer


_scratch = _Scratch()


@lru_cache(maxsize=256)
def _receive_params(plan: Rearrangement, block_stride: int) -> np.ndarray:
    write_back = plan.write_back
    kernels = KERNELS.module
    assert kernels is not None
    return kernels.receive_params(  # type: ignore[no-any-return]
        block_stride,
        plan.region_bytes,
        write_back.pieces,
        write_back.piece_bytes,
        write_back.part_stride,
        write_back.loops,
    )


@lru_cache(maxsize=256)
def _copy_params(plan: CopyPlan, stream: bool) -> np.ndarray:
    kernels = KERNELS.module
    assert kernels is not None
    most_blocks = max(1, MAX_ITEM_BYTES // plan.block_bytes)
    return kernels.copy_params(  # type: ignore[no-any-return]
        plan.src_block_stride, plan.dst_block_stride, plan.merge_blocks, most_blocks, plan.loops, stream
    )
