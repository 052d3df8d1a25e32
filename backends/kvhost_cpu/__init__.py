"""The CPU backend: compiled kernels where numba is installed, torch ops where it is not.

The kernels (``kernels.py``) make one call per group for every layer at once and move
each byte once; the torch fallback works in cache-sized chunks (DESIGN.md: a whole-batch
temporary falls out of cache). numba is imported on first use, not with kvhost.
"""

from __future__ import annotations

import threading
from functools import cache
from types import ModuleType

import numpy as np

from kvhost.backend import Completion
from kvhost.batch import CopyJob, ReceiveJob
from kvhost.torch_backend import TorchBackend

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
    chunk_bytes = 1 << 20

    def describe(self) -> str:
        kernels = load_kernels()
        return kernels if isinstance(kernels, str) else "numba kernels"

    def receive(self, job: ReceiveJob) -> None:
        kernels = load_kernels()
        if isinstance(kernels, str):
            return super().receive(job)
        plan, layout = job.rearrangement, job.layout
        write_back = plan.write_back
        loops = write_back.loops
        bases = np.array([m.tensor.data_ptr() for m in job.members], dtype=np.int64)
        addresses = (
            bases[:, None, None, None]
            + layout.outer_offsets_bytes[None, :, None, None]
            + job.unit_ids[None, None] * layout.block_stride_bytes
        ).reshape(-1, plan.parts)
        shape, src_strides, dst_strides = kernels.padded(loops.shape, loops.src_strides, loops.dst_strides)
        kernel, threads = kernels.launcher("rearrange_units", job.bytes_moved)
        with _launch:
            kernel(
                addresses,
                plan.region_bytes,
                write_back.pieces,
                write_back.piece_bytes,
                write_back.part_stride,
                shape,
                src_strides,
                dst_strides,
                loops.run_bytes,
                threads,
            )
        return None

    def copy(self, job: CopyJob) -> Completion:
        kernels = load_kernels()
        on_host = all(s.tensor.device.type == d.tensor.device.type == "cpu" for s, d in job.pairs)
        if isinstance(kernels, str) or not on_host:
            return super().copy(job)
        plan = job.plan
        src_start, dst_start, counts = _split_runs(job.runs, max(1, MAX_ITEM_BYTES // plan.block_bytes))
        src_bases = np.array([s.tensor.data_ptr() for s, _ in job.pairs], dtype=np.int64)
        dst_bases = np.array([d.tensor.data_ptr() for _, d in job.pairs], dtype=np.int64)
        src_addresses = (src_bases[:, None] + src_start[None, :] * plan.src_block_stride).reshape(-1)
        dst_addresses = (dst_bases[:, None] + dst_start[None, :] * plan.dst_block_stride).reshape(-1)
        item_counts = np.tile(counts, len(job.pairs))
        loops = plan.loops
        shape, src_strides, dst_strides = kernels.padded(loops.shape, loops.src_strides, loops.dst_strides)
        kernel, threads = kernels.launcher("copy_runs", job.bytes_moved)
        with _launch:
            kernel(
                src_addresses,
                dst_addresses,
                item_counts,
                plan.src_block_stride,
                plan.dst_block_stride,
                plan.merge_blocks,
                shape,
                src_strides,
                dst_strides,
                loops.run_bytes,
                threads,
            )
        return Completion()


def _split_runs(runs: np.ndarray, most: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Runs cut into pieces of at most ``most`` blocks: source starts, destination starts, counts."""
    pieces = -(-runs[:, 2] // most)
    run_of_piece = np.repeat(np.arange(runs.shape[0]), pieces)
    first_piece = np.cumsum(pieces) - pieces
    offset = (np.arange(run_of_piece.size) - first_piece[run_of_piece]) * most
    counts = np.minimum(runs[run_of_piece, 2] - offset, most)
    return runs[run_of_piece, 0] + offset, runs[run_of_piece, 1] + offset, counts
