"""Where a cache's bytes lie, and whether two pieces of it are the same memory.

kvhost's kernels write through raw addresses, so before a call moves a byte every byte it
writes must be owned once: no two block regions of the caches it rewrites may share a
byte, and no byte a copy writes may be one it reads. Memory is described here by *lanes*:
a lane is one outer index of one tensor, whose block ``b`` is the region of ``length``
bytes at ``start + b * stride`` (docs/design.md, "Block region"). Addresses are absolute,
so two tensors over one buffer (two torch storages made from one pointer) are caught as
surely as two names for one tensor.

The checks are exact, and cheap in the usual case: lanes whose spans (first to last byte)
do not meet cannot overlap; interleaved lanes with one block stride (layers laid out block
by block in one buffer) are compared by arithmetic, not by listing their blocks.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

# Interleaved lanes with different strides are compared block by block, up to this many
# blocks in all; beyond it the memory is refused as too irregular to check.
MAX_LISTED_BLOCKS = 1 << 22


def byte_extent(tensor: torch.Tensor) -> int:
    """Bytes from a tensor's first element to the end of its last (0 when it is empty)."""
    return strided_extent(tensor.shape, tensor.stride(), tensor.element_size())


def strided_extent(shape: Sequence[int], strides: Sequence[int], itemsize: int) -> int:
    """Bytes from the first element of a strided array to the end of its last (0 when empty)."""
    if 0 in shape:
        return 0
    last = sum((size - 1) * stride for size, stride in zip(shape, strides))
    return (last + 1) * itemsize


@dataclass(frozen=True)
class Lane:
    """Block ``b`` (``0 <= b < count``) of this lane is bytes ``[start + b * stride, ... + length)``.

    ``owner`` says whose memory it is, for messages (a layer and its outer index).
    """

    start: int
    stride: int
    count: int
    length: int
    owner: str

    @property
    def end(self) -> int:
        return self.start + (self.count - 1) * self.stride + self.length


@dataclass(frozen=True)
class Overlap:
    """Two lanes share memory: block ``first_block`` of ``first`` meets ``second_block`` of ``second``."""

    first: Lane
    first_block: int
    second: Lane
    second_block: int

    def describe(self) -> str:
        return f"{self.first.owner} block {self.first_block} and {self.second.owner} block {self.second_block}"


def find_overlap(lanes: Sequence[Lane]) -> Overlap | None:
    """The first pair of block regions, in any lanes, that share a byte; None when there is none."""
    for lane in lanes:
        if lane.count > 1 and lane.stride < lane.length:
            return Overlap(lane, 0, lane, 1)
    order = sorted(range(len(lanes)), key=lambda i: lanes[i].start)
    cluster: list[Lane] = []
    reach = -1
    for i in order:
        lane = lanes[i]
        if lane.start >= reach and cluster:
            found = _overlap_in_cluster(cluster) if len(cluster) > 1 else None  # one lane: checked above
            if found is not None:
                return found
            cluster = []
        cluster.append(lane)
        reach = max(reach, lane.end)
    return _overlap_in_cluster(cluster) if len(cluster) > 1 else None


def _overlap_in_cluster(cluster: list[Lane]) -> Overlap | None:
    """Lanes whose spans chain together: every pair, compared by arithmetic at once where
    their strides agree (or one lane has one block), block by block where they do not.

    Blocks ``i`` of lane a and ``j`` of lane b meet when ``t = i - j`` has
    ``b.start - a.start - a.length < t * stride < b.start - a.start + b.length``; the
    smallest such t within range is found, if there is one.
    """
    start, stride, count, length = (np.array([getattr(lane, f) for lane in cluster], dtype=np.int64) for f in _FIELDS)
    a, b = np.triu_indices(len(cluster), k=1)
    end = start + (count - 1) * stride + length
    meet = (end[a] > start[b]) & (end[b] > start[a])
    arithmetic = (stride[a] == stride[b]) | (count[a] == 1) | (count[b] == 1)
    step = np.maximum(np.where(count[a] > 1, stride[a], stride[b]), 1)
    delta = start[b] - start[a]
    t = np.maximum((delta - length[a]) // step + 1, -(count[b] - 1))
    hit = np.flatnonzero(meet & arithmetic & (t <= count[a] - 1) & (t * step < delta + length[b]))
    if hit.size:
        first = int(hit[0])
        j = max(0, -int(t[first]))
        return Overlap(cluster[a[first]], int(t[first]) + j, cluster[b[first]], j)
    for pair in np.flatnonzero(meet & ~arithmetic).tolist():
        overlap = _listed_overlap(cluster[a[pair]], cluster[b[pair]])
        if overlap is not None:
            return overlap
    return None


_FIELDS = ("start", "stride", "count", "length")


def _listed_overlap(x: Lane, y: Lane) -> Overlap | None:
    """Interleaved lanes with different strides: list both lanes' blocks and sweep."""
    if x.count + y.count > MAX_LISTED_BLOCKS:
        from kvhost.errors import LayoutError

        raise LayoutError(
            f"{x.owner} and {y.owner} interleave with different block strides ({x.stride} and {y.stride} "
            f"bytes) over {x.count + y.count} blocks: too irregular to check that no two blocks share memory"
        )
    return first_shared(
        x, np.arange(x.count, dtype=np.int64), y, np.arange(y.count, dtype=np.int64), same_lane_by_ids=False
    )


def first_shared(
    x: Lane, x_blocks: np.ndarray, y: Lane, y_blocks: np.ndarray, *, same_lane_by_ids: bool = True
) -> Overlap | None:
    """The first block of ``x_blocks`` in lane x that shares a byte with one of ``y_blocks`` in lane y.

    Blocks are listed (the cost is proportional to the blocks named): used for the blocks
    a copy reads against those it writes, where only the named blocks matter.
    ``same_lane_by_ids``: where x and y are one lane, whose blocks lie apart (a layout
    checked), two blocks share bytes only where their ids are equal.
    """
    if x == y and same_lane_by_ids:
        common = np.intersect1d(x_blocks, y_blocks)
        return Overlap(x, int(common[0]), y, int(common[0])) if common.size else None
    if x.end <= y.start or y.end <= x.start or not x_blocks.size or not y_blocks.size:
        return None
    y_order = np.argsort(y_blocks * y.stride, kind="stable")
    y_starts = y.start + y_blocks[y_order] * y.stride
    y_ends_max = np.maximum.accumulate(y_starts + y.length)
    x_starts = x.start + x_blocks * x.stride
    # For each block of x: y blocks starting before it ends; the furthest any of them reaches.
    before = np.searchsorted(y_starts, x_starts + x.length, side="left")
    hit = np.flatnonzero((before > 0) & (y_ends_max[np.maximum(before - 1, 0)] > x_starts))
    if not hit.size:
        return None
    first = int(hit[0])
    candidates = y_order[: before[first]]
    meets = (y.start + y_blocks[candidates] * y.stride + y.length) > x_starts[first]
    return Overlap(x, int(x_blocks[first]), y, int(y_blocks[candidates[np.argmax(meets)]]))
