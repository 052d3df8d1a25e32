"""Transforms derived from axis letters: the receive rearrangement and the copy plan.

Receive. A *unit* is the set of local block regions one remote sender block touches:
one region when the local block is r >= 1 times the remote one, a group of g regions
when the remote block is g > 1 times the local one. Seen as one byte space (the unit's
regions back to back) the wire bytes and the wanted local bytes are two orders of the
same elements; the token axis ``N`` splits into ``P`` (sub-block or part, size r or g)
and ``n`` (the smaller block's tokens):

    local = r x remote:  wire  [P, remote order with N -> n]
                         local [local order with N -> P n]
    remote = g x local:  wire  [remote order with N -> P n]
                         local [P, local order with N -> n]

One permutation between the two, with size-1 axes dropped and neighbours merged, is the
whole transform; when it is the identity nothing is copied. The same mechanism covers
every layout pair, so there is no case per pair.

Copy. Block ``dst_ids[i]`` receives block ``src_ids[i]``, both read through their own
layouts; the plan is a strided copy over the letters other than ``B``.

Plans only read shapes and strides, never tensor data, and are cached.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property, lru_cache
from math import prod
from typing import NamedTuple

import numpy as np

from kvhost.errors import KVHostError, LayoutError, RequestError
from kvhost.layout import Layout, checked_letters, contiguous_strides

# Region letters (L K H N C) with N split in two: no loop nest a plan makes is deeper.
# Kernels that take loop shapes in fixed-size arrays pad them to this many dims.
MAX_LOOP_DIMS = 6
PART = "P"  # the split-off share of the token axis: which sub-block (r) or part (g)
TOKENS = "n"  # the tokens of the smaller of the two block sizes


@dataclass(frozen=True)
class Loops:
    """A strided byte copy: for every index of ``shape``, copy ``run_bytes`` bytes."""

    shape: tuple[int, ...]
    src_strides: tuple[int, ...]
    dst_strides: tuple[int, ...]
    run_bytes: int

    def reordered(self, dims: Sequence[int]) -> Loops:
        """The same copy walked in the order ``dims`` (a permutation of all its dims, the
        first outermost). Any order moves the same bytes: a copy's runs never overlap in its
        destination, nor the bytes it reads those it writes."""
        return Loops(
            tuple(self.shape[d] for d in dims),
            tuple(self.src_strides[d] for d in dims),
            tuple(self.dst_strides[d] for d in dims),
            self.run_bytes,
        )


@dataclass(frozen=True)
class Rearrangement:
    """Turns the wire bytes of one unit into the local layout, in place.

    ``src_shape`` is the unit's wire bytes as an array of elements (dims merged);
    destination dim ``i`` is source dim ``perm[i]``. With ``parts > 1`` destination dim 0
    is the part: which of the unit's ``parts`` local regions the rest lands in.
    """

    parts: int
    region_bytes: int
    itemsize: int
    src_shape: tuple[int, ...]
    perm: tuple[int, ...]

    @property
    def unit_bytes(self) -> int:
        return self.parts * self.region_bytes

    @cached_property
    def write_back(self) -> WriteBack:
        """The byte loops that turn a unit's wire bytes, copied to a scratch, into local bytes.

        Leading dims that both orders share cut the unit into independent pieces, each
        rearranged within its own bytes: a smaller scratch that stays in cache.
        """
        common = 0
        while common < len(self.perm) and self.perm[common] == common:
            common += 1
        pieces = prod(self.src_shape[:common])
        src_shape = self.src_shape[common:]
        perm = [p - common for p in self.perm[common:]]
        dst_shape = [src_shape[p] for p in perm]
        src_contig = contiguous_strides(src_shape)
        shape = list(dst_shape)
        src = [src_contig[p] * self.itemsize for p in perm]
        dst = [s * self.itemsize for s in contiguous_strides(tuple(dst_shape))]
        part_stride = 0
        if self.parts > 1 and common == 0:
            part_stride = src.pop(0)
            shape.pop(0)
            dst.pop(0)
        run = self.itemsize
        if shape and src[-1] == self.itemsize:
            run = shape.pop() * self.itemsize
            src.pop()
            dst.pop()
        return WriteBack(
            pieces=pieces,
            piece_bytes=self.unit_bytes // pieces,
            loops=Loops(tuple(shape), tuple(src), tuple(dst), run),
            part_stride=part_stride,
        )


@dataclass(frozen=True)
class WriteBack:
    """Execution form of a Rearrangement for kernels that work on raw bytes.

    A unit is ``pieces`` pieces of ``piece_bytes``, piece ``i`` being bytes
    ``[i * piece_bytes, (i + 1) * piece_bytes)`` of the unit's regions back to back, and
    each piece is rearranged within itself: copy it to a scratch, then run ``loops``
    from the scratch to the piece's bytes. A piece larger than a region (one piece, g
    regions) is written region by region, region ``k`` from scratch offset
    ``k * part_stride``.
    """

    pieces: int
    piece_bytes: int
    loops: Loops
    part_stride: int

    @cached_property
    def cycles(self) -> ChunkCycles:
        """The same rewrite of a piece as cycles of its runs, done in place with one run of
        scratch instead of the whole piece: one read and one write of each run that moves,
        where the copy to a scratch reads and writes each byte twice (outside the cache, for
        a piece larger than a core's cache, such as a block region holding every layer)."""
        loops = self.loops
        run = loops.run_bytes
        # The wire offset of every run of the piece, in the order the runs are written: the
        # loops write a region's runs back to back, region k from k * part_stride on.
        sources = np.zeros(1, dtype=np.int64)
        for size, stride in zip(loops.shape, loops.src_strides, strict=True):
            sources = (sources[:, None] + np.arange(size, dtype=np.int64) * stride).ravel()
        regions = self.piece_bytes // (sources.size * run)  # more than one: a piece of g regions
        sources = (np.arange(regions, dtype=np.int64)[:, None] * self.part_stride + sources).ravel()
        return ChunkCycles.of(run, (sources // run).tolist())


class ChunkCycles(NamedTuple):
    """A piece's rewrite as a permutation of its ``chunk_bytes`` chunks, cycle by cycle.

    Cycle ``i`` is ``order[starts[i]:starts[i + 1]]``, chunk indices ``c0, c1, ..., ck``
    within the piece: ``c0`` takes the bytes of ``c1``, ``c1`` those of ``c2``, ..., and
    ``ck`` those ``c0`` held (kept aside first). Chunks that stay put are in no cycle.
    """

    chunk_bytes: int
    order: np.ndarray
    starts: np.ndarray

    @classmethod
    def of(cls, chunk_bytes: int, sources: list[int]) -> ChunkCycles:
        """``sources[i]``: the chunk whose bytes chunk ``i`` takes (a permutation)."""
        order: list[int] = []
        starts = [0]
        done = [source == chunk for chunk, source in enumerate(sources)]
        for first in range(len(sources)):
            chunk = first
            while not done[chunk]:
                done[chunk] = True
                order.append(chunk)
                chunk = sources[chunk]
            if len(order) > starts[-1]:
                starts.append(len(order))
        return cls(chunk_bytes, np.array(order, dtype=np.int64), np.array(starts, dtype=np.int64))


def block_ratio(local_size: int, remote_size: int, error: type[KVHostError] = LayoutError) -> tuple[int, int]:
    """(r, g): the remote blocks one local block holds, and the local blocks one remote block
    spans (one of them is 1); block sizes that do not divide one another are an ``error``."""
    if local_size % remote_size == 0:
        return local_size // remote_size, 1
    if remote_size % local_size == 0:
        return 1, remote_size // local_size
    raise error(f"block sizes {local_size} (local) and {remote_size} (remote) do not divide one another")


# Plans kept for the process: an engine meets a few (layout, sender order, sender size)
# keys, and a plan for a sender whose blocks span thousands of ours holds its write-back
# cycles (up to a few MiB), so the bound is counted in those.
RECEIVE_PLANS_KEPT = 64


@lru_cache(maxsize=RECEIVE_PLANS_KEPT)
def plan_receive(layout: Layout, remote_order: str, remote_block_size: int) -> Rearrangement | None:
    """The rearrangement from the sender's bytes to ``layout``; None when nothing changes."""
    region = layout.region
    remote_order = checked_letters(remote_order, what="remote order")
    # A letter of size 1 here (one head per rank, say) may lie inside the sender's region and
    # outside ours, or the other way round: its place moves no byte. N never: block sizes differ.
    single = {a for a in layout.axes if a not in "BN" and layout.size(a) == 1}
    if set(remote_order) - single != set(region) - single:  # each letter once: just checked
        raise RequestError(
            f"remote order {remote_order!r} does not match the local block region "
            f"{region!r} (local physical order {layout.physical!r}): it must use the same letters"
            + (f" (those of size 1, {''.join(sorted(single))}, may be left out)" if single else "")
        )
    local_size = layout.block_size
    if remote_block_size <= 0:
        raise RequestError(f"remote block size {remote_block_size} must be positive")
    r, g = block_ratio(local_size, remote_block_size, RequestError)
    if g == 1:
        parts, split, tokens = 1, r, remote_block_size
    else:
        parts = split = g
        tokens = local_size
    sizes = {a: layout.size(a) for a in {*region, *remote_order} if a != "N"} | {PART: split, TOKENS: tokens}

    def with_tokens(order: str, token_axes: list[str]) -> list[str]:
        return [x for a in order for x in (token_axes if a == "N" else [a])]

    if parts == 1:
        src = [PART, *with_tokens(remote_order, [TOKENS])]
        dst = with_tokens(region, [PART, TOKENS])
    else:
        src = with_tokens(remote_order, [PART, TOKENS])
        dst = [PART, *with_tokens(region, [TOKENS])]
    src = [a for a in src if sizes[a] > 1]
    dst = [a for a in dst if sizes[a] > 1]
    if src == dst:
        return None

    # Merge axes that are neighbours in both orders; with parts the part axis stays alone
    # because it selects a region, not an offset inside one.
    groups: list[list[str]] = [[dst[0]]]
    for axis in dst[1:]:
        previous = groups[-1][-1]
        keep_apart = parts > 1 and PART in (axis, previous)
        if src.index(axis) == src.index(previous) + 1 and not keep_apart:
            groups[-1].append(axis)
        else:
            groups.append([axis])
    src_groups = sorted(groups, key=lambda g: src.index(g[0]))
    return Rearrangement(
        parts=parts,
        region_bytes=layout.region_bytes,
        itemsize=layout.itemsize,
        src_shape=tuple(prod(sizes[a] for a in g) for g in src_groups),
        perm=tuple(src_groups.index(g) for g in groups),
    )


@dataclass(frozen=True)
class CopyPlan:
    """Per block pair, a strided byte copy over the letters other than ``B``.

    ``merge_blocks``: every block is one run at the same stride on both sides, so a run
    of consecutive ids is a single copy of ``count * run_bytes`` per loop index.
    """

    loops: Loops
    src_block_stride: int
    dst_block_stride: int
    merge_blocks: bool

    @property
    def block_bytes(self) -> int:
        return prod(self.loops.shape) * self.loops.run_bytes


@lru_cache(maxsize=1024)
def plan_copy(src: Layout, dst: Layout) -> CopyPlan:
    """The copy from blocks in layout ``src`` to blocks in layout ``dst``."""
    if _moving_sizes(src) != _moving_sizes(dst):
        raise LayoutError(
            f"source axes {src.axes!r} sizes {src.logical_sizes()} do not match destination "
            f"axes {dst.axes!r} sizes {dst.logical_sizes()} (letters of size 1 may be left out)"
        )
    if src.itemsize != dst.itemsize:
        raise LayoutError(f"source item size {src.itemsize} != destination item size {dst.itemsize}")
    item = src.itemsize
    # Walk in the destination's memory order so writes are sequential.
    letters = [a for a in dst.physical if a != "B" and dst.size(a) > 1]
    shape: list[int] = []
    src_strides: list[int] = []
    dst_strides: list[int] = []
    for letter in letters:
        size, s, d = dst.size(letter), src.stride(letter) * item, dst.stride(letter) * item
        if shape and src_strides[-1] == s * size and dst_strides[-1] == d * size:
            shape[-1] *= size
            src_strides[-1], dst_strides[-1] = s, d
        else:
            shape.append(size)
            src_strides.append(s)
            dst_strides.append(d)
    run = item
    if shape and src_strides[-1] == item and dst_strides[-1] == item:
        run = shape.pop() * item
        src_strides.pop()
        dst_strides.pop()
    src_block, dst_block = src.block_stride_bytes, dst.block_stride_bytes
    inner = [i for i in range(len(shape)) if src_strides[i] < src_block or dst_strides[i] < dst_block]
    merge = not inner and run == src_block == dst_block
    return CopyPlan(
        loops=Loops(tuple(shape), tuple(src_strides), tuple(dst_strides), run),
        src_block_stride=src_block,
        dst_block_stride=dst_block,
        merge_blocks=merge,
    )


def _moving_sizes(layout: Layout) -> dict[str, int]:
    """A block's letters that move bytes, with their sizes: a letter of size 1 (one head, say)
    has no place to move, so two layouts may differ by such letters and copy alike."""
    return {a: n for a, n in layout.logical_sizes().items() if n > 1}
