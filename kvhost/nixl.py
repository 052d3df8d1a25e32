"""NIXL for KV blocks: block tables, transfer descriptors, and an agent that moves them.

A connector registers its layer dict with an ``Agent`` and gets a ``RegionTable``: where
every block region of every layer lives, and the letters of its layout. Two engines swap
tables and agent metadata; ``plan_transfer(local, remote)`` then turns a request's block
ids on both sides into NIXL descriptors so that the bytes land as the wire model (docs/design.md)
says: per outer index, the request's local regions back to back hold the sender's regions
back to back. Regions are cut into chunks of the smaller of the two region sizes, so a
local block r times larger takes r sub-block descriptors and a remote block g times larger
takes g chunk descriptors; ``kvhost.receive`` then rearranges the wire bytes in place.
A receiver rank holding a share of the sender's heads (heterogeneous tensor parallelism)
narrows the sender's table first (``RegionTable.heads``).

Tables cut at the token axis (``RegionTable.token_runs``) pair runs of tokens instead of
regions: when both sides share a region order, the bytes then land in the receiver's own
layout at its own block size, with no post-process, at the price of more, smaller
descriptors (for HND 16 -> 64, 8x as many; ``kvhost demo --via-host`` keeps the regions
whole instead and lets ``kvhost.receive`` rearrange).

NIXL is imported on first use (``load_nixl``), never with kvhost: the ``nixl`` meta
package when installed, else ``nixl_cu13`` or ``nixl_cu12``.
"""

from __future__ import annotations

import contextlib
import importlib
import itertools
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from functools import cache, cached_property
from math import prod
from types import ModuleType
from typing import Any

import numpy as np
import torch

from kvhost.caches import CacheSet, Layer
from kvhost.errors import BackendError, KVHostError, LayoutError, RequestError
from kvhost.layout import AXIS_LETTERS
from kvhost.wire_protocol import Fields, InvalidTimeoutError, ProtocolError, check_seconds

# The ``nixl`` meta package forwards ``nixl._api`` to whichever CUDA build is installed.
NIXL_MODULES = ("nixl._api", "nixl_cu13._api", "nixl_cu12._api")
# Letters that may index a stream: outer letters, letters cut from the region, and "#" for
# the place in a layer's tuple when that place is not K.
COORD_LETTERS = "#LKHNC"
MEMORY_OF_DEVICE = {"cpu": "DRAM", "cuda": "VRAM"}
# Streams a peer's table may declare. Each costs a Python object here (~0.3 KB) and a
# descriptor per block in every transfer, so the cap is what models need, not what fits:
# 128 layers x K/V x 256 heads of per-head streams.
MAX_STREAMS = 1 << 16


class NixlUnavailableError(BackendError):
    """NIXL (or the transfer backend asked for) cannot be loaded here."""


class TransferError(KVHostError, RuntimeError):
    """A transfer could not be prepared, failed, or did not finish in time.

    ``timed_out`` tells a deadline from a failure the transport reported.
    """

    def __init__(self, message: str, *, timed_out: bool = False) -> None:
        super().__init__(message)
        self.timed_out = timed_out


@cache
def load_nixl() -> ModuleType:
    """The NIXL Python API module (``nixl_agent``, ``nixl_agent_config``)."""
    reasons = []
    for name in NIXL_MODULES:
        try:
            return importlib.import_module(name)
        except ImportError as err:
            reasons.append(f"{name}: {err}")
    raise NixlUnavailableError(
        f"NIXL is not installed ({'; '.join(reasons)}); install it with pip install 'kvhost[nixl]'"
    )


# --- tables -------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Stream:
    """The runs of one outer index of one layer: block ``b``'s run is at ``address + b * block_stride``.

    ``coords`` are ``(letter, index)`` pairs in ``COORD_LETTERS`` order; ``#`` is the place
    in a layer's tuple when it does not stand for ``K``.
    """

    layer: str
    coords: tuple[tuple[str, int], ...]
    address: int
    block_stride: int

    @property
    def key(self) -> tuple[str, tuple[tuple[str, int], ...]]:
        return self.layer, self.coords

    def describe(self) -> str:
        return self.layer + "".join(f"[{letter}={i}]" for letter, i in self.coords)


@dataclass(frozen=True)
class RegionTable:
    """Where every block region (or token run) of a cache set lives, and its layout in letters.

    Each block of each stream holds one run of ``run_bytes``: the region, in memory order
    ``order``, less the letters in ``split`` that index streams instead. Built by
    ``region_table`` (or ``Agent.register``), sent to the peer as ``to_dict()``.
    """

    memory: str  # NIXL memory type: DRAM or VRAM
    device_id: int
    order: str  # the region's letters in memory order
    split: str  # letters of ``order`` cut out into streams
    sizes: dict[str, int]  # every letter but B
    itemsize: int
    num_blocks: int
    streams: tuple[Stream, ...]

    @property
    def block_size(self) -> int:
        return self.sizes["N"]

    @property
    def run_order(self) -> str:
        return "".join(a for a in self.order if a not in self.split)

    @property
    def run_bytes(self) -> int:
        return prod(self.sizes[a] for a in self.run_order) * self.itemsize

    @property
    def region_bytes(self) -> int:
        return prod(self.sizes[a] for a in self.order) * self.itemsize

    @property
    def outer(self) -> str:
        """Letters indexing streams that are not cut from the region, in ``COORD_LETTERS`` order."""
        letters = {letter for letter, _ in self.streams[0].coords}
        return "".join(a for a in COORD_LETTERS if a in letters and a not in self.split and a != "#")

    def stride_bytes(self, letter: str) -> int:
        """Byte stride of a region letter: the region is dense in ``order``."""
        after = self.order[self.order.index(letter) + 1 :]
        return prod(self.sizes[a] for a in after) * self.itemsize

    @cached_property
    def by_key(self) -> dict[tuple[str, tuple[tuple[str, int], ...]], int]:
        return {stream.key: i for i, stream in enumerate(self.streams)}

    def token_runs(self) -> RegionTable:
        """The same memory with the letters before ``N`` in the region made into streams.

        Each block of each stream is then one run of tokens (``N`` and what follows it), so
        pairing two such tables moves tokens, not regions: bytes land in the local order.
        """
        cut = self.order[: self.order.index("N")]
        if not cut or self.split:
            return self
        streams = []
        for stream in self.streams:
            for index in itertools.product(*(range(self.sizes[a]) for a in cut)):
                offset = sum(i * self.stride_bytes(a) for a, i in zip(cut, index))
                coords = _canonical(dict(stream.coords) | dict(zip(cut, index)))
                streams.append(Stream(stream.layer, coords, stream.address + offset, stream.block_stride))
        return RegionTable(
            self.memory, self.device_id, self.order, cut, self.sizes, self.itemsize, self.num_blocks, tuple(streams)
        )

    def heads(self, first: int, count: int) -> RegionTable:
        """The same memory narrowed to heads ``first .. first + count - 1``.

        Heterogeneous tensor parallelism: a receiver rank that holds ``count`` of this
        sender's heads reads only those, and they land as a sender with ``count`` heads
        would have sent them. Heads must be streams of their own (per-head regions, token
        runs) or lead the run (head-major blocks): token-major blocks scatter a share of
        the heads over every token.
        """
        total = self.sizes.get("H")
        if total is None:
            raise LayoutError("this table has no heads (H) to share out")
        if count < 1 or first < 0 or first + count > total:
            raise LayoutError(f"heads {first}..{first + count - 1} are not within the {total} heads of this table")
        if "H" in dict(self.streams[0].coords):
            streams = tuple(
                replace(s, coords=_canonical(dict(s.coords) | {"H": dict(s.coords)["H"] - first}))
                for s in self.streams
                if first <= dict(s.coords)["H"] < first + count
            )
        elif self.run_order.startswith("H"):
            offset = first * self.stride_bytes("H")
            streams = tuple(replace(s, address=s.address + offset) for s in self.streams)
        else:
            raise LayoutError(
                f"a share of the heads of a {self.run_order!r} region is scattered over its tokens: "
                "a sender that shares out its heads must keep them apart (head-major blocks, HND)"
            )
        return replace(self, sizes=self.sizes | {"H": count}, streams=streams)

    def to_dict(self) -> dict[str, Any]:
        """The table as data for ``wire_protocol.encode`` (``from_dict`` reads it back,
        checking every field): the per-stream numbers are integer arrays, which travel as
        binary, so a table costs the peer memory in proportion to its size."""
        layers = list(dict.fromkeys(s.layer for s in self.streams))
        number = {name: i for i, name in enumerate(layers)}
        return {
            "memory": self.memory,
            "device_id": self.device_id,
            "order": self.order,
            "split": self.split,
            "sizes": dict(self.sizes),
            "itemsize": self.itemsize,
            "num_blocks": self.num_blocks,
            "layers": layers,
            "coords": "".join(a for a, _ in self.streams[0].coords) if self.streams else "",
            "streams": {
                "layer": np.array([number[s.layer] for s in self.streams], dtype=np.uint32),
                "coords": np.array([i for s in self.streams for _, i in s.coords], dtype=np.uint32),
                "address": np.array([s.address for s in self.streams], dtype=np.uint64),
                "stride": np.array([s.block_stride for s in self.streams], dtype=np.uint64),
            },
        }

    @classmethod
    def from_dict(cls, data: Any, where: str = "table", arrays: bytes | bytearray | memoryview = b"") -> RegionTable:
        """A table sent by a peer (``arrays``: the frame's array bytes); anything malformed is
        a ProtocolError naming the field. What it costs is bounded by what it holds: at most
        ``MAX_STREAMS`` streams, and nothing per declared block."""
        fields = Fields(data, where, arrays)
        memory = fields.text("memory")
        if memory not in MEMORY_OF_DEVICE.values():
            raise ProtocolError(f"{where}.memory: {memory!r} is not one of {sorted(MEMORY_OF_DEVICE.values())}")
        sizes_field = fields.fields("sizes")
        sizes = {}
        for letter in sizes_field.data:
            if len(letter) != 1 or letter not in AXIS_LETTERS or letter == "B":
                raise ProtocolError(f"{where}.sizes: unknown letter {letter!r} (letters are {AXIS_LETTERS!r} but B)")
            sizes[letter] = sizes_field.integer(letter, minimum=1, maximum=1 << 24)
        order = _letters(fields.text("order", max_length=8), f"{where}.order", sizes)
        for letter in "NC":
            if letter not in order:
                raise ProtocolError(f"{where}.order: {order!r} lacks {letter}")
        split = fields.data.get("split", "")
        if split not in ("", order[: order.index("N")]):
            raise ProtocolError(f"{where}.split: {split!r:.20} must be empty or {order[: order.index('N')]!r}")
        itemsize = fields.integer("itemsize", minimum=1, maximum=8)
        if itemsize not in (1, 2, 4, 8):
            raise ProtocolError(f"{where}.itemsize: {itemsize} is not 1, 2, 4 or 8")
        num_blocks = fields.integer("num_blocks", minimum=1, maximum=1 << 32)
        device_id = fields.integer("device_id", maximum=1 << 16)
        shell = cls(memory, device_id, order, split, sizes, itemsize, num_blocks, ())
        layers = fields.texts("layers", max_items=MAX_STREAMS)
        if len(set(layers)) != len(layers):
            twice = next(name for i, name in enumerate(layers) if name in layers[:i])
            raise ProtocolError(f"{where}.layers: {twice!r} appears twice")
        letters = _coord_letters(fields, shell)
        streams = _streams(fields.fields("streams"), shell, layers, letters)
        coordinates = set(letters)
        if not set(split) <= coordinates:
            raise ProtocolError(f"{where}.streams: split letters {split!r} must index the streams")
        covered = set(order) | coordinates - {"#"}
        if covered != set(sizes):
            raise ProtocolError(
                f"{where}: sizes name {''.join(sorted(sizes))} but order and stream coordinates name "
                f"{''.join(sorted(covered))}"
            )
        return cls(memory, device_id, order, split, sizes, itemsize, num_blocks, streams)


def _letters(value: str, where: str, sizes: Mapping[str, int]) -> str:
    if len(set(value)) != len(value) or any(a not in sizes for a in value):
        raise ProtocolError(f"{where}: {value!r} must be distinct letters that have sizes")
    return value


def _coord_letters(fields: Fields, table: RegionTable) -> str:
    """The letters every stream is indexed by, in ``COORD_LETTERS`` order."""
    where = f"{fields.where}.coords"
    letters = fields.data.get("coords")
    if not isinstance(letters, str) or len(letters) > len(COORD_LETTERS):
        raise ProtocolError(f"{where}: expected a string of coordinate letters, got {letters!r:.60}")
    for letter in letters:
        if letter not in COORD_LETTERS:
            raise ProtocolError(f"{where}: bad coordinate {letter!r} (coordinates are {COORD_LETTERS!r})")
        if letter != "#" and letter not in table.sizes:
            raise ProtocolError(f"{where}: coordinate {letter} has no size")
        if letter in table.run_order:
            raise ProtocolError(f"{where}: coordinate {letter} lies inside the run {table.run_order!r}")
    if letters != "".join(a for a in COORD_LETTERS if a in letters):
        raise ProtocolError(f"{where}: {letters!r} must be distinct letters in {COORD_LETTERS!r} order")
    return letters


def _streams(fields: Fields, table: RegionTable, layers: list[str], letters: str) -> tuple[Stream, ...]:
    """The streams of a peer's table from its arrays, every value checked (vectorised where
    it can be; one Python object per stream, at most ``MAX_STREAMS``)."""
    where = fields.where
    layer = fields.array("layer", maximum=max(len(layers) - 1, 0), max_length=MAX_STREAMS)
    count = layer.size
    if not count:
        raise ProtocolError(f"{where}: empty")
    if not layers:
        raise ProtocolError(f"{where}.layer: {count} streams but no layer names")
    coords = fields.array("coords", max_length=MAX_STREAMS * len(COORD_LETTERS))
    if coords.size != count * len(letters):
        raise ProtocolError(f"{where}.coords: {coords.size} values for {count} streams of {len(letters)} coordinates")
    columns = coords.reshape(count, len(letters))
    for j, letter in enumerate(letters):
        limit = table.sizes.get(letter, 1 << 10) - 1
        column = columns[:, j]
        if int(column.max()) > limit:
            bad = int(np.argmax(column > limit))
            got = int(column[bad])
            expected = f"expected an integer in [0, {limit}]"
            raise ProtocolError(f"{where}.coords[{bad}]: coordinate {letter}: {expected}, got {got}")
    address = fields.array("address", minimum=1, max_length=MAX_STREAMS)
    stride = fields.array("stride", minimum=table.run_bytes, maximum=1 << 48, max_length=MAX_STREAMS)
    for name, values in (("address", address), ("stride", stride)):
        if values.size != count:
            raise ProtocolError(f"{where}.{name}: {values.size} values for {count} streams")
    streams: list[Stream] = []
    seen: set[tuple[str, tuple[tuple[str, int], ...]]] = set()
    shared: dict[tuple[tuple[str, int], ...], tuple[tuple[str, int], ...]] = {}
    for i, (number, index, base, step) in enumerate(
        zip(layer.tolist(), columns.tolist(), address.tolist(), stride.tolist())
    ):
        if base + (table.num_blocks - 1) * step + table.run_bytes > 1 << 64:
            raise ProtocolError(f"{where}[{i}]: blocks run past the end of the address space")
        pairs = tuple(zip(letters, index))
        coords_key = shared.setdefault(pairs, pairs)  # one tuple per distinct coordinate
        stream = Stream(layers[number], coords_key, base, step)
        if stream.key in seen:
            raise ProtocolError(f"{where}[{i}]: {stream.describe()} appears twice")
        seen.add(stream.key)
        streams.append(stream)
    return tuple(streams)


def _cache_set(caches: Mapping[str, Layer], axes: str | None) -> CacheSet:
    if axes is None:
        raise LayoutError("axes are required with a layer dict (as for kvhost.receive)")
    return CacheSet(caches, axes)


def _canonical(coords: Mapping[str, int]) -> tuple[tuple[str, int], ...]:
    return tuple((a, coords[a]) for a in COORD_LETTERS if a in coords)


def region_table(caches: Mapping[str, Layer] | CacheSet, axes: str | None = None) -> RegionTable:
    """The table of a layer dict (``axes`` as for ``kvhost.receive``): where its regions live."""
    cache_set = caches if isinstance(caches, CacheSet) else _cache_set(caches, axes)
    device = cache_set.device
    memory = MEMORY_OF_DEVICE.get(device.type)
    if memory is None:
        raise LayoutError(
            f"NIXL reaches host and CUDA memory, not {device}: stage through a host buffer with kvhost.copy_blocks"
        )
    first = cache_set.layout
    tuple_is_k = "K" in cache_set.axes and "K" not in cache_set.member_axes
    sizes = first.logical_sizes()
    counts = {len(members) for members in cache_set.layers.values()}
    if len(counts) > 1:
        raise LayoutError(f"{cache_set.role}: layers hold different numbers of tensors {sorted(counts)}")
    if tuple_is_k:
        sizes["K"] = counts.pop()
    streams = []
    for member in cache_set.members:
        layout = member.layout
        if layout.region != first.region:
            raise LayoutError(
                f"{cache_set.role}: layer {member.layer!r} has block region {layout.region!r} but layer "
                f"{cache_set.members[0].layer!r} has {first.region!r}; one table needs one region order"
            )
        base: dict[str, int] = {}
        if tuple_is_k:
            base["K"] = member.index
        elif len(cache_set.layers[member.layer]) > 1:
            base["#"] = member.index
        for index in itertools.product(*(range(layout.size(a)) for a in layout.outer)):
            offset = sum(i * layout.stride(a) * layout.itemsize for a, i in zip(layout.outer, index))
            coords = _canonical(base | dict(zip(layout.outer, index)))
            streams.append(Stream(member.layer, coords, member.tensor.data_ptr() + offset, layout.block_stride_bytes))
    return RegionTable(
        memory=memory,
        device_id=device.index or 0,
        order=first.region,
        split="",
        sizes=sizes,
        itemsize=first.itemsize,
        num_blocks=first.num_blocks,
        streams=tuple(streams),
    )


# --- plans --------------------------------------------------------------------------


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

    def descriptor_pairs(
        self, local_ids: Sequence[int] | np.ndarray, remote_ids: Sequence[int] | np.ndarray
    ) -> tuple[np.ndarray, np.ndarray]:
        """The (address, length, device id) rows that move one request: local and remote, pair by pair.

        Built from the request's blocks alone (streams x chunks rows a side), so what a table
        declares costs nothing until a request names it. Rows go stream by stream, each
        stream's chunks in the request's block order; ``remote`` streams in the local order.
        """
        remote = _ids(remote_ids, "remote block ids", self.remote.num_blocks)
        local = _ids(local_ids, "local block ids", self.local.num_blocks)
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


def _ids(ids: Sequence[int] | np.ndarray, what: str, limit: int) -> np.ndarray:
    array = np.asarray(ids)
    if array.size == 0:
        raise RequestError(f"{what}: empty")
    if array.dtype.kind not in "iu" or array.ndim != 1:
        raise RequestError(f"{what}: expected a flat sequence of integers, got {array.dtype} {array.shape}")
    array = array.astype(np.int64)
    bad = np.flatnonzero((array < 0) | (array >= limit))
    if bad.size:
        raise RequestError(f"{what}: id {int(array[bad[0]])} at position {int(bad[0])} is out of range [0, {limit})")
    if np.unique(array).size != array.size:
        values, counts = np.unique(array, return_counts=True)
        raise RequestError(f"{what}: block id {int(values[np.argmax(counts > 1)])} appears twice")
    return array


# --- agents -------------------------------------------------------------------------


class Agent:
    """A NIXL agent and the caches it exposes: what one engine holds for its lifetime.

    ``register`` pins a layer dict (tensors are kept alive until ``close``) and returns its
    table; ``metadata()`` is what the peer needs to reach it; ``reader`` reads or writes
    the requests of a plan towards one peer.
    """

    def __init__(self, name: str, *, backends: Sequence[str] = ("UCX",)) -> None:
        module = load_nixl()
        try:
            config = module.nixl_agent_config(backends=list(backends))
            self._nixl: Any = module.nixl_agent(name, config)
        except Exception as err:  # NIXL raises its own exception types from C++
            raise NixlUnavailableError(f"could not start NIXL agent {name!r}: {type(err).__name__}: {err}") from None
        missing = [b for b in backends if b not in self._nixl.backends]
        if missing:
            plugins = ", ".join(self._nixl.get_plugin_list())
            raise NixlUnavailableError(f"NIXL backend(s) {missing} unavailable (plugins: {plugins})")
        self.name = name
        self._registered: list[tuple[Any, list[torch.Tensor]]] = []
        self._peers: set[str] = set()
        self._readers: list[Reader] = []
        self.closed = False

    def register(self, caches: Mapping[str, Layer] | CacheSet, axes: str | None = None) -> RegionTable:
        """Register every tensor of a layer dict with NIXL; returns its table."""
        self._check_open()
        cache_set = caches if isinstance(caches, CacheSet) else _cache_set(caches, axes)
        table = region_table(cache_set)
        tensors = [m.tensor for m in cache_set.members]
        spans = memory_spans(tensors)
        rows = [(start, length, table.device_id, "") for start, length in spans]
        try:
            descs = self._nixl.register_memory(rows, table.memory)
        except Exception as err:
            raise TransferError(f"agent {self.name!r}: registering {len(rows)} memory spans failed: {err}") from None
        self._registered.append((descs, tensors))
        return table

    def metadata(self) -> bytes:
        """This agent's metadata (connection info and registered memory) for its peers."""
        self._check_open()
        return bytes(self._nixl.get_agent_metadata())

    def add_peer(self, metadata: bytes) -> str:
        """Load a peer's metadata; returns its agent name. Bad metadata is a ProtocolError."""
        self._check_open()
        try:
            name = self._nixl.add_remote_agent(metadata)
        except Exception as err:
            raise ProtocolError(f"peer agent metadata ({len(metadata)} bytes) rejected by NIXL: {err}") from None
        peer = name.decode(errors="replace") if isinstance(name, bytes) else str(name)
        self._peers.add(peer)
        return peer

    def remove_peer(self, peer: str) -> None:
        if peer in self._peers:
            self._peers.discard(peer)
            with contextlib.suppress(Exception):  # a peer that died may already be gone
                self._nixl.remove_remote_agent(peer)

    def reader(self, plan: TransferPlan, peer: str) -> Reader:
        """Prepared descriptor lists of ``plan`` towards ``peer``, to read (or write) requests."""
        self._check_open()
        if peer not in self._peers:
            raise TransferError(f"agent {self.name!r} has no peer {peer!r}: add_peer its metadata first")
        reader = Reader(self, plan, peer)
        self._readers.append(reader)
        return reader

    def close(self) -> None:
        """Release descriptor lists, drop peers, deregister memory. Safe to call twice."""
        if self.closed:
            return
        self.closed = True
        for reader in self._readers:
            reader.close()
        for peer in list(self._peers):
            self.remove_peer(peer)
        for descs, _ in self._registered:
            with contextlib.suppress(Exception):  # nothing more to undo if this fails
                self._nixl.deregister_memory(descs)
        self._registered.clear()

    def __enter__(self) -> Agent:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _check_open(self) -> None:
        if self.closed:
            raise TransferError(f"agent {self.name!r} is closed")


class Reader:
    """One plan towards one peer; starts one transfer per call.

    Each transfer's descriptor lists are built for its request's blocks alone (NIXL
    ``initialize_xfer``), never for every block a table declares, so a peer's table that
    declares billions of blocks costs nothing until a request names them, and then only
    those. When the reader is made, both tables' extents (the first and last block of every
    stream) are checked against the memory NIXL knows to be registered: a peer's table that
    names memory its agent has not registered is refused here, not at its first read.
    """

    def __init__(self, agent: Agent, plan: TransferPlan, peer: str) -> None:
        self.agent = agent
        self.plan = plan
        self.peer = peer
        nixl = agent._nixl
        for side, table, owner in (("local", plan.local, "NIXL_INIT_AGENT"), ("remote", plan.remote, peer)):
            try:
                nixl.prep_xfer_dlist(owner, extent_rows(table), table.memory).release()
            except Exception as err:
                if side == "local":
                    raise TransferError(f"the local table names memory this agent has not registered: {err}") from None
                raise TransferError(
                    f"preparing the descriptors of peer {peer!r} failed ({err}): "
                    f"its table names memory it has not registered ({len(table.streams)} streams of "
                    f"{table.num_blocks} blocks of {table.run_bytes} bytes)"
                ) from None
        self.closed = False

    def read(
        self, local_ids: Sequence[int] | np.ndarray, remote_ids: Sequence[int] | np.ndarray, *, notify: bytes = b""
    ) -> Transfer:
        """Start pulling the peer's ``remote_ids`` into ``local_ids``; ``notify`` reaches the peer when done."""
        return self._start("READ", local_ids, remote_ids, notify)

    def write(
        self, local_ids: Sequence[int] | np.ndarray, remote_ids: Sequence[int] | np.ndarray, *, notify: bytes = b""
    ) -> Transfer:
        """Start pushing ``local_ids`` to the peer's ``remote_ids`` (the same pairing, the other way)."""
        return self._start("WRITE", local_ids, remote_ids, notify)

    def _start(
        self, op: str, local_ids: Sequence[int] | np.ndarray, remote_ids: Sequence[int] | np.ndarray, notify: bytes
    ) -> Transfer:
        if self.closed:
            raise TransferError(f"reader towards {self.peer!r} is closed")
        local_rows, remote_rows = self.plan.descriptor_pairs(local_ids, remote_ids)
        nbytes = local_rows.shape[0] * self.plan.chunk_bytes
        nixl = self.agent._nixl
        try:
            local = nixl.get_xfer_descs(local_rows, self.plan.local.memory)
            remote = nixl.get_xfer_descs(remote_rows, self.plan.remote.memory)
            handle = nixl.initialize_xfer(op, local, remote, self.peer, notify)
        except Exception as err:
            raise TransferError(f"{op} from {self.peer!r}: creating the transfer failed: {err}") from None
        transfer = Transfer(self, handle, nbytes, op)
        try:
            state = nixl.transfer(handle)
        except Exception as err:
            transfer.release()
            raise TransferError(f"{op} from {self.peer!r}: posting the transfer failed: {err}") from None
        transfer._note(state)
        return transfer

    def close(self) -> None:
        self.closed = True


@dataclass
class Transfer:
    """One posted transfer: ``poll()`` until True, or ``wait(timeout)``; ``release()`` when done."""

    reader: Reader
    handle: Any = field(repr=False)
    nbytes: int
    op: str
    started: float = field(default_factory=time.perf_counter)
    finished: float | None = None
    released: bool = False

    def poll(self) -> bool:
        """True once every byte has landed; raises TransferError when the transport failed."""
        if self.finished is not None:
            return True
        if self.released:
            raise TransferError(f"{self.op} from {self.reader.peer!r} was released before it finished")
        try:
            state = self.reader.agent._nixl.check_xfer_state(self.handle)
        except Exception as err:
            raise TransferError(f"{self.op} from {self.reader.peer!r} failed: {err}") from None
        return self._note(state)

    def wait(self, timeout: float, *, interval: float = 1e-4) -> None:
        """Block until done; TransferError(timed_out=True) after ``timeout`` seconds.

        ``timeout`` must be a finite number of seconds (``wire_protocol.check_seconds``):
        NaN, infinity, a negative number or a bool is an InvalidTimeoutError, never a wait
        without end. ``interval`` (between polls) is in (0, 1].
        """
        seconds = check_seconds(timeout, "Transfer.wait timeout")
        pause = check_seconds(interval, "Transfer.wait interval", positive=True)
        if pause > 1:
            raise InvalidTimeoutError(f"Transfer.wait interval: expected at most 1 s between polls, got {pause:g}")
        deadline = time.monotonic() + seconds
        while not self.poll():
            if time.monotonic() > deadline:
                raise TransferError(
                    f"{self.op} from {self.reader.peer!r} did not finish within {seconds:g} s", timed_out=True
                )
            time.sleep(pause)

    @property
    def seconds(self) -> float:
        return (self.finished or time.perf_counter()) - self.started

    def release(self) -> None:
        """Free the handle; an unfinished transfer is cancelled where the transport allows."""
        if not self.released:
            self.released = True
            with contextlib.suppress(Exception):  # cancelling towards a dead peer can fail
                self.handle.release()

    def _note(self, state: str) -> bool:
        if state == "DONE":
            self.finished = time.perf_counter()
            return True
        if state == "PROC":
            return False
        raise TransferError(f"{self.op} from {self.reader.peer!r} failed: transport state {state!r}")


def memory_spans(tensors: Sequence[torch.Tensor]) -> list[tuple[int, int]]:
    """(start, length) byte spans covering every tensor, overlaps merged (layers may share memory)."""
    spans = []
    for tensor in tensors:
        if tensor.numel() == 0:
            continue
        extent = sum((size - 1) * stride for size, stride in zip(tensor.shape, tensor.stride())) + 1
        spans.append((tensor.data_ptr(), extent * tensor.element_size()))
    spans.sort()
    merged: list[tuple[int, int]] = []
    for start, length in spans:
        if merged and start <= merged[-1][0] + merged[-1][1]:
            first, covered = merged[-1]
            merged[-1] = (first, max(covered, start + length - first))
        else:
            merged.append((start, length))
    return merged
