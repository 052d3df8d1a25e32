"""Region tables: where every block region (or run of tokens) of a layer dict lives.

A connector registers its layer dict with an ``Agent`` (or calls ``region_table``) and
gets a ``RegionTable``: per stream (one outer index of one layer: ``K`` of a
FlashAttention cache, a head of a per-head cache) the address of block 0's run and the
stride between blocks, and the letters of the region's layout. Two engines swap tables;
``kvhost.nixl.plans`` pairs them. A peer's table arrives as data (``RegionTable.from_dict``)
and is checked field by field: what it costs is bounded by what it holds.

Tables cut at the token axis (``RegionTable.token_runs``) hold runs of tokens instead of
regions; a receiver rank holding a share of the sender's heads (heterogeneous tensor
parallelism) narrows the sender's table first (``RegionTable.heads``).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from functools import cached_property
from math import prod
from operator import attrgetter
from typing import Any

import numpy as np
import torch

from kvhost.backend import check_sizes
from kvhost.caches import CacheSet, Layer
from kvhost.errors import LayoutError, shown
from kvhost.ids import integer_value
from kvhost.layout import AXIS_LETTERS, ITEM_SIZES, Layout
from kvhost.memory import byte_extent
from kvhost.nixl.errors import ProtocolError
from kvhost.nixl.fields import U64_MAX, Fields

# Letters that may index a stream: outer letters, letters cut from the region, and "#" for
# the place in a layer's tuple when that place is not K.
COORD_LETTERS = "#LKHNC"
WINDOW_RUN = "W"  # the coordinate a window's streams add, after those of COORD_LETTERS
MEMORY_OF_DEVICE = {"cpu": "DRAM", "cuda": "VRAM"}
# Streams a peer's table may declare. Each costs a Python object here (~0.3 KB) and a
# descriptor per block in every transfer, so the cap is what models need, not what fits:
# 128 layers x K/V x 256 heads of per-head streams.
MAX_STREAMS = 1 << 16


@dataclass(frozen=True, slots=True)
class Stream:
    """The runs of one outer index of one layer: block ``b``'s run is at ``address + b * block_stride``.

    ``coords`` are ``(letter, index)`` pairs in ``COORD_LETTERS`` order; ``#`` is the place
    in a layer's tuple when it does not stand for ``K``. A window of a table (the runs at
    some offsets of each block, ``ranks._window``) adds ``WINDOW_RUN`` last: which run.
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

    def check_fields(self, side: str) -> None:
        """Refuse (LayoutError) fields of a kind or range no table ``region_table`` or
        ``from_dict`` makes holds: a table made by hand is planned from its numbers, which
        become descriptor addresses and lengths."""
        where = f"{side} table"
        _check_memory(self.memory, f"{where}: memory", LayoutError)
        for name, value, least in (("device_id", self.device_id, 0), ("num_blocks", self.num_blocks, 1)):
            if type(value) is not int or value < least:
                raise LayoutError(f"{where}: {name} must be an int of at least {least}, got {shown(value)}")
        if type(self.itemsize) is not int or self.itemsize not in ITEM_SIZES:
            raise LayoutError(f"{where}: item size {shown(self.itemsize)} is not 1, 2, 4 or 8")
        if not isinstance(self.sizes, dict) or not all(
            type(n) is int and n >= 1 and isinstance(a, str) for a, n in self.sizes.items()
        ):
            raise LayoutError(f"{where}: sizes must map letters to ints of at least 1, got {shown(self.sizes)}")
        for letters, name in ((self.order, "order"), (self.split, "split")):
            if not isinstance(letters, str) or any(a not in self.sizes for a in letters):
                raise LayoutError(f"{where}: {name} {shown(letters)} must be letters that have sizes")
        if "N" not in self.sizes or "N" not in self.order:
            raise LayoutError(f"{where}: order {self.order!r} and sizes must name the tokens (N)")
        if not isinstance(self.streams, tuple):
            raise LayoutError(f"{where}: streams must be a tuple of Streams, got {shown(self.streams)}")
        # A table may hold 65,536 streams: each check below is one pass in C, not a loop here.
        streams = self.streams
        plain = set(map(type, streams)) <= {Stream}
        numbers = [*map(attrgetter("address"), streams), *map(attrgetter("block_stride"), streams)] if plain else []
        if not plain or (numbers and (set(map(type, numbers)) != {int} or min(numbers) < 0 or max(numbers) > U64_MAX)):
            bad = next(s for s in streams if not _plain_stream(s))
            raise LayoutError(f"{where}: a stream must be a Stream of int address and stride, got {shown(bad)}")

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
    def coordinates(self) -> str:
        """The letters that index the streams (each stream has them all), in ``COORD_LETTERS`` order."""
        return "".join(letter for letter, _ in self.streams[0].coords)

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

    def without_unit_letters(self) -> RegionTable:
        """The same memory with the letters of size 1 but ``N`` left out of its order, cut
        and stream coordinates: such a letter moves no byte wherever it sits (a K of one
        latent outside the blocks on one side and inside on the other, one head per rank
        token-major here and head-major there), so two tables that differ only in where
        they put one describe the same bytes. ``N`` stays: block sizes may differ."""
        units = {a for a, n in self.sizes.items() if n == 1 and a != "N"}
        if not units:
            return self
        streams = self.streams
        if units & set(self.coordinates if streams else ""):
            streams = tuple(replace(s, coords=tuple(c for c in s.coords if c[0] not in units)) for s in streams)
        return replace(
            self,
            order="".join(a for a in self.order if a not in units),
            split="".join(a for a in self.split if a not in units),
            sizes={a: n for a, n in self.sizes.items() if a not in units},
            streams=streams,
        )

    def token_runs(self) -> RegionTable:
        """The same memory with the letters before ``N`` in the region made into streams.

        Each block of each stream is then one run of tokens (``N`` and what follows it), so
        pairing two such tables in one order moves tokens, not regions: bytes land in the
        local order. A region that begins with ``N`` is its own token runs; two tables in
        two orders pair as regions (``TransferPlan.in_local_layout`` is False).
        """
        cut = self.order[: self.order.index("N")]
        if not cut or self.split:
            return self
        count = len(self.streams) * prod(self.sizes[a] for a in cut)
        if count > MAX_STREAMS:  # each a Python object: a peer's table may say 2^16 heads
            raise LayoutError(
                f"token runs of {len(self.streams)} streams cut at {cut!r} ({self.sizes}) are {count} streams, "
                f"more than the {MAX_STREAMS} a table may hold"
            )
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
        first_head, head_count = integer_value(first), integer_value(count)
        if first_head is None or head_count is None:
            raise LayoutError(f"heads: first and count must be ints, got {shown(first)} and {shown(count)}")
        first, count = first_head, head_count
        if count < 1 or first < 0 or first + count > total:
            raise LayoutError(f"heads {first}..{first + count - 1} are not within the {total} heads of this table")
        if "H" in self.coordinates:
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
                "a table narrows only to heads kept apart (head-major blocks, HND); plan_ranks reads such a "
                "share as byte windows"
            )
        return replace(self, sizes=self.sizes | {"H": count}, streams=streams)

    @property
    def streams_apart(self) -> int:
        """The streams of ``heads_apart``, counted from the sizes before any is made: one per
        stream and head, or the table's own where its heads already are streams."""
        if "H" in self.coordinates:
            return len(self.streams)
        return len(self.streams) * self.sizes.get("H", 1)

    def heads_apart(self) -> RegionTable:
        """The same memory with each head a stream of its own (``H`` named by the streams).

        Possible where a head's bytes are one run of the region: heads that lead the run
        (head-major blocks) or a region of one head (a letter of size 1 moves no byte,
        so a rank's token-major blocks of one head are head-major too). Each stream of the
        table becomes one per head, at the head's offset; at most ``MAX_STREAMS`` of them.
        """
        if "H" in self.coordinates:
            return self
        heads = self.sizes.get("H")
        if heads is None:
            raise LayoutError("this table has no heads (H) to read apart")
        if "H" not in self.order:  # a table made by hand; from_dict refuses it
            raise LayoutError(f"{heads} heads (H) are neither in the region {self.order!r} nor stream coordinates")
        if not (heads == 1 or self.run_order.startswith("H")):
            raise LayoutError(
                f"the heads of a {self.run_order!r} region are not runs of their own: "
                "only head-major blocks or blocks of one head can be read head by head"
            )
        if self.streams_apart > MAX_STREAMS:
            raise LayoutError(
                f"{len(self.streams)} streams of {heads} heads are {self.streams_apart} streams "
                f"head by head, more than the {MAX_STREAMS} a table may hold"
            )
        step = self.stride_bytes("H")
        streams = tuple(
            Stream(s.layer, _canonical(dict(s.coords) | {"H": h}), s.address + h * step, s.block_stride)
            for s in self.streams
            for h in range(heads)
        )
        return replace(self, order=self.order.replace("H", ""), streams=streams)

    def to_dict(self) -> dict[str, Any]:
        """The table as data for ``framing.encode`` (``from_dict`` reads it back,
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
            "coords": self.coordinates if self.streams else "",
            "streams": {
                "layer": np.array([number[s.layer] for s in self.streams], dtype=np.uint32),
                "coords": np.array([i for s in self.streams for _, i in s.coords], dtype=np.uint32),
                "address": np.array([s.address for s in self.streams], dtype=np.uint64),
                "stride": np.array([s.block_stride for s in self.streams], dtype=np.uint64),
            },
        }

    @classmethod
    def from_dict(
        cls,
        data: Any,
        where: str = "table",
        arrays: bytes | bytearray | memoryview = b"",
        *,
        max_streams: int = MAX_STREAMS,
        check: Callable[[RegionTable], None] | None = None,
    ) -> RegionTable:
        """A table sent by a peer (``arrays``: the frame's array bytes); anything malformed is
        a ProtocolError naming the field. What it costs is bounded by what it holds: at most
        ``max_streams`` streams (a message of several tables shares one budget: their arrays
        may all point at the same bytes), and nothing per declared block. ``check`` is given
        the table without its streams, before they are read (it raises to refuse it)."""
        check_sizes(max_streams=max_streams)  # NaN would bound nothing
        fields = Fields(data, where, arrays)
        memory = fields.text("memory")
        _check_memory(memory, f"{where}.memory:", ProtocolError)
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
        if itemsize not in ITEM_SIZES:
            raise ProtocolError(f"{where}.itemsize: {itemsize} is not 1, 2, 4 or 8")
        num_blocks = fields.integer("num_blocks", minimum=1, maximum=1 << 32)
        device_id = fields.integer("device_id", maximum=1 << 16)
        shell = cls(memory, device_id, order, split, sizes, itemsize, num_blocks, ())
        if check is not None:
            check(shell)
        layers = fields.texts("layers", max_items=MAX_STREAMS, distinct=True)
        letters = _coord_letters(fields, shell)
        streams = _streams(fields.fields("streams"), shell, layers, letters, max_streams)
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


def _plain_stream(stream: object) -> bool:
    return isinstance(stream, Stream) and all(
        type(v) is int and 0 <= v <= U64_MAX for v in (stream.address, stream.block_stride)
    )


def _check_memory(memory: object, what: str, error: type[Exception]) -> None:
    if memory not in MEMORY_OF_DEVICE.values():
        raise error(f"{what} {shown(memory)} is not one of {sorted(MEMORY_OF_DEVICE.values())}")


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


def _streams(
    fields: Fields, table: RegionTable, layers: list[str], letters: str, max_streams: int
) -> tuple[Stream, ...]:
    """The streams of a peer's table from its arrays, every value checked (vectorised where
    it can be; one Python object per stream, at most ``max_streams``)."""
    where = fields.where
    layer = fields.array("layer", maximum=max(len(layers) - 1, 0), max_length=max_streams)
    count = layer.size
    if not count:
        raise ProtocolError(f"{where}: empty")
    if not layers:
        raise ProtocolError(f"{where}.layer: {count} streams but no layer names")
    coords = fields.array("coords", max_length=max_streams * len(COORD_LETTERS))
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
            flat = bad * len(letters) + j  # the array is stream after stream, a value per letter
            raise ProtocolError(f"{where}.coords[{flat}]: stream {bad}'s coordinate {letter}: {expected}, got {got}")
    address = fields.array("address", minimum=1, max_length=max_streams)
    stride = fields.array("stride", minimum=table.run_bytes, maximum=1 << 48, max_length=max_streams)
    for name, values in (("address", address), ("stride", stride)):
        if values.size != count:
            raise ProtocolError(f"{where}.{name}: {values.size} values for {count} streams")
    last_block, run = table.num_blocks - 1, table.run_bytes  # once: run_bytes is worked out on each read
    streams: list[Stream] = []
    seen: set[tuple[str, tuple[tuple[str, int], ...]]] = set()
    shared: dict[tuple[tuple[str, int], ...], tuple[tuple[str, int], ...]] = {}
    for i, (number, index, base, step) in enumerate(
        zip(layer.tolist(), columns.tolist(), address.tolist(), stride.tolist())
    ):
        # Python ints: nothing overflows. An end of exactly 2**64 would wrap to 0 where
        # ends are kept as uint64 (merge domains).
        if base + last_block * step + run >= 1 << 64:
            raise ProtocolError(f"{where}[{i}]: blocks run past the end of the address space")
        pairs = tuple(zip(letters, index))
        coords_key = shared.setdefault(pairs, pairs)  # one tuple per distinct coordinate
        stream = Stream(layers[number], coords_key, base, step)
        if stream.key in seen:
            raise ProtocolError(f"{where}[{i}]: {stream.describe()} appears twice")
        seen.add(stream.key)
        streams.append(stream)
    return tuple(streams)


def as_cache_set(caches: Mapping[str, Layer] | CacheSet, axes: str | None) -> CacheSet:
    """A layer dict (with its ``axes``, as for ``kvhost.receive``) as a validated cache set."""
    if isinstance(caches, CacheSet):
        return caches
    if axes is None:
        raise LayoutError("axes are required with a layer dict (as for kvhost.receive)")
    return CacheSet(caches, axes)


def _canonical(coords: Mapping[str, int]) -> tuple[tuple[str, int], ...]:
    return tuple((a, coords[a]) for a in COORD_LETTERS if a in coords)


def region_table(caches: Mapping[str, Layer] | CacheSet, axes: str | None = None) -> RegionTable:
    """The table of a layer dict (``axes`` as for ``kvhost.receive``): where its regions live."""
    cache_set = as_cache_set(caches, axes)
    device = cache_set.device
    memory = MEMORY_OF_DEVICE.get(device.type)
    if memory is None:
        raise LayoutError(
            f"NIXL reaches host and CUDA memory, not {device}: stage through a host buffer with kvhost.copy_blocks"
        )
    first = cache_set.layout
    tuple_is_k = cache_set.tuple_is_k
    sizes = first.logical_sizes()
    counts = {len(members) for members in cache_set.layers.values()}
    if len(counts) > 1:
        raise LayoutError(f"{cache_set.role}: layers hold different numbers of tensors {sorted(counts)}")
    if tuple_is_k:
        sizes["K"] = counts.pop()
    streams = []
    for member in cache_set.members:
        layout = member.layout
        if _sized_letters(layout, layout.region) != _sized_letters(first, first.region):
            raise LayoutError(
                f"{cache_set.role}: layer {member.layer!r} has block region {layout.region!r} but layer "
                f"{cache_set.members[0].layer!r} has {first.region!r}; one table needs one region order"
            )
        base: dict[str, int] = {}
        if tuple_is_k:
            base["K"] = member.index
        elif len(cache_set.layers[member.layer]) > 1:
            base["#"] = member.index
        # A letter of size 1 moves no byte wherever it sits: it indexes streams as the first
        # layer's does (index 0), in or out of this layer's region.
        outer = [a for a in layout.outer if a not in first.region]
        base |= {a: 0 for a in first.outer if a not in outer}
        for index in itertools.product(*(range(layout.size(a)) for a in outer)):
            offset = sum(i * layout.stride(a) * layout.itemsize for a, i in zip(outer, index))
            coords = _canonical(base | dict(zip(outer, index)))
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


def _sized_letters(layout: Layout, letters: str) -> str:
    """``letters`` without those of size 1 but the tokens: the bytes' order they name."""
    return "".join(a for a in letters if a == "N" or layout.size(a) > 1)


def memory_spans(tensors: Sequence[torch.Tensor]) -> list[tuple[int, int]]:
    """(start, length) byte spans covering every tensor, overlaps merged (layers may share memory)."""
    spans = sorted((tensor.data_ptr(), byte_extent(tensor)) for tensor in tensors if tensor.numel())
    merged: list[tuple[int, int]] = []
    for start, length in spans:
        if merged and start <= merged[-1][0] + merged[-1][1]:
            first, covered = merged[-1]
            merged[-1] = (first, max(covered, start + length - first))
        else:
            merged.append((start, length))
    return merged
