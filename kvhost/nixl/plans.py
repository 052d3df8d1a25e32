"""Transfer plans: two tables paired, and the NIXL descriptor rows that move a request.

``plan_transfer(local, remote)`` turns a request's block ids on both sides into NIXL
descriptors so that the bytes land as the wire model (docs/design.md) says: per outer
index, the request's local regions back to back hold the sender's regions back to back.
Regions are cut into chunks of the smaller of the two region sizes, so a local block r
times larger takes r sub-block descriptors and a remote block g times larger takes g chunk
descriptors; ``kvhost.receive`` then rearranges the wire bytes in place.

Paired ``token_runs()`` tables move runs of tokens instead: when both sides share a
region order, the bytes then land in the receiver's own layout at its own block size,
with no post-process, at the price of more, smaller descriptors (for HND 16 -> 64, 8x as
many; ``kvhost demo --via-host`` keeps the regions whole instead and lets
``kvhost.receive`` rearrange).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property

import numpy as np

from kvhost.errors import LayoutError, RequestError
from kvhost.ids import Ids, checked_ids
from kvhost.nixl.tables import RegionTable, Stream


@dataclass(frozen=True)
class TransferPlan:
    """How requests' remote blocks land in their local blocks, as two NIXL descriptor lists.

    Every run is cut into chunks of ``chunk_bytes`` (the smaller run): ``local_parts`` per
    local block, ``remote_parts`` per remote block. Per stream, a request's local chunks in
    block order receive its remote chunks in block order. ``remote_descriptors`` lists the
    remote streams in the local streams' order, so one stream index serves both lists.
    """

    local: RegionTable
    remote: RegionTable
    chunk_bytes: int
    local_parts: int
    remote_parts: int
    remote_streams: tuple[int, ...]  # partner in remote.streams of each local stream

    @property
    def remote_order(self) -> str:
        """The order ``kvhost.receive`` must be told the wire bytes arrived in."""
        return self.remote.order

    @property
    def remote_block_size(self) -> int:
        return self.remote.block_size

    def local_blocks_for(self, remote_blocks: int) -> int:
        """Local blocks that hold ``remote_blocks`` sender blocks (whole groups when g > 1)."""
        return -(-remote_blocks * self.remote_parts // self.local_parts)

    def bytes_for(self, remote_blocks: int) -> int:
        """Bytes one request of ``remote_blocks`` sender blocks moves."""
        return remote_blocks * self.remote_parts * self.chunk_bytes * len(self.local.streams)

    def descriptor_pairs(self, local_ids: Ids, remote_ids: Ids) -> tuple[np.ndarray, np.ndarray]:
        """The (address, length, device id) rows that move one request: local and remote, pair by pair.

        Built from the request's blocks alone (streams x chunks rows a side), so what a table
        declares costs nothing until a request names it. Rows go stream by stream, each
        stream's chunks in the request's block order; ``remote`` streams in the local order.
        Each list is checked as ``kvhost.ids`` checks ids (in range, each block once) and
        may not be empty.
        """
        remote = checked_ids(remote_ids, "remote_ids", self.remote.num_blocks, allow_empty=False)
        local = checked_ids(local_ids, "local_ids", self.local.num_blocks, allow_empty=False)
        want = self.local_blocks_for(remote.size)
        if local.size != want:
            raise RequestError(
                f"{remote.size} remote blocks of {self.remote.block_size} tokens need {want} local blocks of "
                f"{self.local.block_size} tokens, got {local.size} local block ids"
            )
        chunks = np.arange(remote.size * self.remote_parts, dtype=np.int64)
        return (
            self._rows(self.local, self._local_streams, local, self.local_parts, chunks),
            self._rows(self.remote, self._remote_streams, remote, self.remote_parts, chunks),
        )

    @cached_property
    def _local_streams(self) -> tuple[np.ndarray, np.ndarray]:
        return _bases_and_strides(self.local.streams)

    @cached_property
    def _remote_streams(self) -> tuple[np.ndarray, np.ndarray]:
        return _bases_and_strides([self.remote.streams[i] for i in self.remote_streams])

    def _rows(
        self,
        table: RegionTable,
        streams: tuple[np.ndarray, np.ndarray],
        ids: np.ndarray,
        parts: int,
        chunks: np.ndarray,
    ) -> np.ndarray:
        """Chunk ``c`` of the request, in every stream: block ``ids[c // parts]``, part ``c % parts``."""
        bases, strides = streams
        blocks = ids[chunks // parts].astype(np.uint64)
        offsets = (chunks % parts).astype(np.uint64) * np.uint64(self.chunk_bytes)
        addresses = bases[:, None] + blocks[None, :] * strides[:, None] + offsets[None, :]
        rows = np.empty((addresses.size, 3), dtype=np.uint64)
        rows[:, 0] = addresses.reshape(-1)
        rows[:, 1] = self.chunk_bytes
        rows[:, 2] = table.device_id
        return rows


def plan_transfer(local: RegionTable, remote: RegionTable) -> TransferPlan:
    """Pair two tables: same streams, same letters and sizes but ``N``, block sizes dividing.

    With region tables the bytes land as wire bytes (``kvhost.receive`` finishes the job);
    with ``token_runs()`` tables in one order they land in the local layout itself.
    """
    if local.itemsize != remote.itemsize:
        raise LayoutError(f"local item size {local.itemsize} != remote item size {remote.itemsize}")
    others = {a: n for a, n in local.sizes.items() if a != "N"}
    remote_others = {a: n for a, n in remote.sizes.items() if a != "N"}
    if others != remote_others:
        raise LayoutError(f"local sizes {local.sizes} and remote sizes {remote.sizes} differ beyond N")
    if sorted(local.order) != sorted(remote.order):
        raise LayoutError(
            f"local block region {local.order!r} and remote region {remote.order!r} hold different letters: "
            "the outer letters (those before B) must match"
        )
    if local.split != remote.split or (local.split and local.order != remote.order):
        raise LayoutError(
            f"token runs pair only tables cut the same way in one order: local {local.order!r} cut "
            f"{local.split!r}, remote {remote.order!r} cut {remote.split!r}"
        )
    big, small = max(local.block_size, remote.block_size), min(local.block_size, remote.block_size)
    if big % small:
        raise LayoutError(f"block sizes {local.block_size} (local) and {remote.block_size} (remote) do not divide")
    partner = []
    for stream in local.streams:
        index = remote.by_key.get(stream.key)
        if index is None:
            raise LayoutError(f"local {stream.describe()} has no partner among the remote streams")
        partner.append(index)
    if len(remote.streams) != len(local.streams):
        missing = next(s for s in remote.streams if s.key not in local.by_key)
        raise LayoutError(f"remote {missing.describe()} has no partner among the local streams")
    chunk = min(local.run_bytes, remote.run_bytes)
    return TransferPlan(local, remote, chunk, local.run_bytes // chunk, remote.run_bytes // chunk, tuple(partner))


def _bases_and_strides(streams: Sequence[Stream]) -> tuple[np.ndarray, np.ndarray]:
    return (
        np.array([s.address for s in streams], dtype=np.uint64),
        np.array([s.block_stride for s in streams], dtype=np.uint64),
    )


def extent_rows(table: RegionTable) -> np.ndarray:
    """Two (address, length, device id) rows per stream: the run of its first and of its last
    block. NIXL accepting them means the table's ends lie in registered memory."""
    bases, strides = _bases_and_strides(table.streams)
    last = bases + strides * np.uint64(table.num_blocks - 1)
    rows = np.empty((2 * bases.size, 3), dtype=np.uint64)
    rows[0::2, 0], rows[1::2, 0] = bases, last
    rows[:, 1] = table.run_bytes
    rows[:, 2] = table.device_id
    return rows
