"""The CPU backend: compiled kernels where numba is installed, torch ops where it is not.

The kernels (``kernels.py``) make one call per group for every layer at once and move
each byte once; the torch fallback works in cache-sized chunks (DESIGN.md: a whole-batch
temporary falls out of cache). numba is imported on first use, not with kvhost.
"""

from __future__ import annotations

import threading
from functools import cache, lru_cache
from types import ModuleType

import numpy as np

from kvhost.backend import Completion
from kvhost.batch import CopyJob, ReceiveJob
from kvhost.torch_backend import TorchBackend
from kvhost.transform import CopyPlan, Rearrangement

MAX_ITEM_BYTES = 1 << 21  # copies are split into items of at most this much, to share cores
# One kernel launch at a time: each launch already uses every core, and numba's fallback
# threading layer (workqueue, where no OpenMP or TBB is found) aborts on concurrent launches.
_launch = threading.Lock()


@cache
def load_kernels() -> ModuleType | str:
    """The compiled kernels module, or why it cannot load."""
    try:
        from kvhost_cpu import kernels
    except ImportError as err:
        return f"torch ops (numba unavailable: {err})"
    return kernels


class CpuBackend(TorchBackend):
    name = "cpu"
    device_types = ("cpu",)
    priority = 0

    def describe(self) -> str:
        kernels = load_kernels()
        return kernels if isinstance(kernels, str) else "numba kernels"

    def receive(self, job: ReceiveJob) -> None:
        kernels = load_kernels()
        if isinstance(kernels, str):
            return super().receive(job)
        params = _receive_params(job.rearrangement, job.layout.block_stride_bytes)
        kernel, threads = kernels.launcher("rearrange_units", job.bytes_moved)
        with _launch:
            kernel(job.members.addresses, job.layout.outer_offsets_bytes, job.unit_ids, params, threads)
        return None

    def copy(self, job: CopyJob) -> Completion:
        kernels = load_kernels()
        if isinstance(kernels, str) or job.src_device.type != "cpu" or job.dst_device.type != "cpu":
            return super().copy(job)
        params = _copy_params(job.plan)
        addresses = (job.group.sources.addresses, job.group.destinations.addresses)
        kernel, threads = kernels.launcher("copy_runs", job.bytes_moved)
        with _launch:
            kernel(*addresses, job.src_ids, job.dst_ids, params, threads)
        return Completion()


@lru_cache(maxsize=256)
def _receive_params(plan: Rearrangement, block_stride: int) -> np.ndarray:
    write_back = plan.write_back
    kernels = load_kernels()
    assert not isinstance(kernels, str)
    return kernels.receive_params(
        block_stride,
        plan.region_bytes,
        write_back.pieces,
        write_back.piece_bytes,
        write_back.part_stride,
        write_back.loops,
    )


@lru_cache(maxsize=256)
def _copy_params(plan: CopyPlan) -> np.ndarray:
    kernels = load_kernels()
    assert not isinstance(kernels, str)
    most_blocks = max(1, MAX_ITEM_BYTES // plan.block_bytes)
    return kernels.copy_params(plan.src_block_stride, plan.dst_block_stride, plan.merge_blocks, most_blocks, plan.loops)
