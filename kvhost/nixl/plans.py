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

``TransferPlan.merged_pairs`` hands NIXL fewer, larger descriptors: pairs whose pieces
continue one another on both sides (runs of block ids, the r sub-blocks of one receiver
block, layers laid out block by block in one buffer) become one pair, up to
``MAX_DESCRIPTOR_BYTES``. The bytes that land are exactly those of ``descriptor_pairs``;
only how many operations the transport posts changes (docs/design.md, "Transfers").
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import cached_property

import numpy as np

from kvhost.errors import ArgumentError, LayoutError, RequestError, shown
from kvhost.ids import Ids, checked_ids, integer_value
from kvhost.nixl.tables import RegionTable, Stream
from kvhost.transform import block_ratio

# The most bytes one merged descriptor moves. Larger descriptors save the transport's
# per-operation cost (a few microseconds each over UCX); a bound keeps a transfer several
# operations long, so a transport with several lanes or workers can still spread it, and
# a transfer's first bytes land before its last are read.
MAX_DESCRIPTOR_BYTES = 1 << 20


def block_count(value: object) -> int:
    """A count of blocks as a plain int >= 0 (not a bool, a float or a string to repeat)."""
    count = integer_value(value)
    if count is None or count < 0:
        raise ArgumentError(f"a count of blocks must be an int >= 0, got {shown(value)}")
    return count


def _check_max_bytes(max_bytes: object) -> None:
    """A merge's bound on one descriptor's bytes: an int of at least 1 (NaN would bound nothing)."""
    if isinstance(max_bytes, bool) or not isinstance(max_bytes, int) or max_bytes < 1:
        raise ArgumentError(f"max_bytes must be an integer of at least 1, got {shown(max_bytes)}")


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

    @property
    def in_local_layout(self) -> bool:
        """Whether the bytes land in the local layout itself, with nothing for
        ``kvhost.receive`` to do: both sides in one order, and each block one run that
        begins at its tokens (``token_runs()`` tables, or regions that begin with ``N``)
        or blocks of one size. Tables in two orders pair as regions, whatever made them."""
        same_blocks = self.local.block_size == self.remote.block_size
        return self.local.order == self.remote.order and (same_blocks or self.local.run_order.startswith("N"))

    def local_blocks_for(self, remote_blocks: int) -> int:
        """Local blocks that hold ``remote_blocks`` sender blocks (whole groups when g > 1)."""
        return -(-block_count(remote_blocks) * self.remote_parts // self.local_parts)

    def bytes_for(self, remote_blocks: int) -> int:
        """Bytes one request of ``remote_blocks`` sender blocks moves."""
        return block_count(remote_blocks) * self.remote_parts * self.chunk_bytes * len(self.local.streams)

    def descriptor_pairs(self, local_ids: Ids, remote_ids: Ids) -> tuple[np.ndarray, np.ndarray]:
        """The (address, length, device id) rows that move one request: local and remote, pair by pair.

        Built from the request's blocks alone (streams x chunks rows a side), so what a table
        declares costs nothing until a request names it. Rows go stream by stream, each
        stream's chunks in the request's block order; ``remote`` streams in the local order.
        Each list is checked as ``kvhost.ids`` checks ids (in range, each block once) and
        may not be empty.
        """
        return self._pairs(*self._checked(local_ids, remote_ids))

    def _pairs(self, local: np.ndarray, remote: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        chunks = np.arange(remote.size * self.remote_parts, dtype=np.int64)
        return (
            self._rows(self.local, self._local_streams, local, self.local_parts, chunks),
            self._rows(self.remote, self._remote_streams, remote, self.remote_parts, chunks),
        )

    def merged_pairs(
        self,
        local_ids: Ids,
        remote_ids: Ids,
        *,
        max_bytes: int = MAX_DESCRIPTOR_BYTES,
        local_domains: np.ndarray | None = None,
        remote_domains: np.ndarray | None = None,
    ) -> tuple[np.ndarray, np.ndarray]:
        """``descriptor_pairs`` with pairs that continue one another on both sides merged.

        Two pairs merge when the second's local and remote bytes start where the first's
        end, both lie in one merge domain on their side, and the merged pair moves at most
        ``max_bytes`` (a single piece larger than that stays whole). Every byte lands where
        ``descriptor_pairs`` puts it, no other byte is touched. Pieces of two streams merge
        only where the streams share a domain and their blocks interleave (layers laid out
        block by block in one buffer); otherwise each stream's pieces merge in the request's
        order, found from the ids alone, and rows go stream by stream.

        A domain is memory one descriptor may span: ``local_domains[i]`` labels local stream
        ``i``, ``remote_domains[j]`` remote stream ``j`` (in ``remote.streams`` order);
        streams with one label may merge with one another, a negative label merges nothing.
        By default each stream is its own domain: a stream is one outer index of one tensor,
        which its owner registers whole (``Reader`` checks that with NIXL, and finds the
        streams that share registered memory, such as layers laid out in one buffer).
        """
        return self.merged_batch(
            [(local_ids, remote_ids)], max_bytes=max_bytes, local_domains=local_domains, remote_domains=remote_domains
        )

    def merged_batch(
        self,
        requests: Sequence[tuple[Ids, Ids]],
        *,
        max_bytes: int = MAX_DESCRIPTOR_BYTES,
        local_domains: np.ndarray | None = None,
        remote_domains: np.ndarray | None = None,
    ) -> tuple[np.ndarray, np.ndarray]:
        """``merged_pairs`` of several requests (``(local_ids, remote_ids)`` each) as one pair
        of lists, for one transfer: what each request's own rows would move, worked out with
        a fixed number of numpy calls for the whole batch instead of that many per request.

        Each request is checked as ``descriptor_pairs`` checks it, and no local block may
        be named by two requests (it would be written twice); a remote block may (two
        requests reading one shared prefix). Pieces merge within a request, never across
        two, except where streams interleave (then every piece is sorted, as for one).
        """
        (rows,) = self._merged(requests, max_bytes, local_domains, remote_domains, [self._all_streams])
        return rows

    def merged_layers(
        self,
        requests: Sequence[tuple[Ids, Ids]],
        *,
        max_bytes: int = MAX_DESCRIPTOR_BYTES,
        local_domains: np.ndarray | None = None,
        remote_domains: np.ndarray | None = None,
    ) -> dict[str, tuple[np.ndarray, np.ndarray]]:
        """``merged_batch``'s rows, local layer by local layer (in the local table's order):
        what lands in each layer, so that each may go as its own transfer and be
        post-processed as soon as it is done while later layers are still in flight.

        No row spans two layers. Where streams of several layers share a domain and
        interleave (layers laid out block by block in one buffer), each layer's pieces are
        merged among themselves, so such a batch takes more descriptors than as one whole.
        Checked as ``merged_batch`` checks, once for every layer.
        """
        layers = self._layer_streams
        rows = self._merged(requests, max_bytes, local_domains, remote_domains, list(layers.values()))
        return dict(zip(layers, rows))

    def _merged(
        self,
        requests: Sequence[tuple[Ids, Ids]],
        max_bytes: int,
        local_domains: np.ndarray | None,
        remote_domains: np.ndarray | None,
        groups: list[np.ndarray],
    ) -> list[tuple[np.ndarray, np.ndarray]]:
        """Merged rows of the batch's pieces in each group of local streams (indices into
        ``local.streams``), pieces merging only with pieces of their own group."""
        _check_max_bytes(max_bytes)
        checked, local = checked_batch(requests, self._checked)
        remote = checked[0][1] if len(checked) == 1 else np.concatenate([c[1] for c in checked])
        kinds = self._merge_kinds(local_domains, remote_domains)
        if kinds is None:
            # Streams that share a domain interleave (layers laid out block by block): pieces
            # of different streams may continue one another, found by sorting every piece.
            local_labels, remote_labels = self._stream_labels(local_domains, remote_domains)
            pairs = [self._pairs(lo, re) for lo, re in checked]
            streams = len(self.local.streams)
            counts = [rows.shape[0] // streams for rows, _ in pairs]

            def pieces(side: int, group: np.ndarray) -> np.ndarray:
                return np.concatenate([pair[side].reshape(streams, -1, 3)[group].reshape(-1, 3) for pair in pairs])

            def labels(of_stream: np.ndarray) -> np.ndarray:
                return np.concatenate([np.repeat(of_stream, count) for count in counts])

            return [
                merge_rows(
                    pieces(0, group),
                    pieces(1, group),
                    max_bytes,
                    labels(local_labels[group]),
                    labels(remote_labels[group]),
                )
                for group in groups
            ]
        sizes = None if len(checked) == 1 else np.array([[lo.size, re.size] for lo, re in checked], dtype=np.int64)
        return self._merged_in_streams(local, remote, sizes, max(1, max_bytes // self.chunk_bytes), kinds, groups)

    def descriptor_batch(self, requests: Sequence[tuple[Ids, Ids]]) -> tuple[np.ndarray, np.ndarray]:
        """``descriptor_pairs`` of several requests back to back, for one transfer, checked
        as ``merged_batch`` checks them."""
        checked, _ = checked_batch(requests, self._checked)
        pairs = [self._pairs(local, remote) for local, remote in checked]
        return np.concatenate([rows for rows, _ in pairs]), np.concatenate([rows for _, rows in pairs])

    def _stream_labels(
        self, local_domains: np.ndarray | None, remote_domains: np.ndarray | None
    ) -> tuple[np.ndarray, np.ndarray]:
        """Each local stream's domain, and its remote partner's (in the local streams' order)."""
        local_labels = _labels(local_domains, len(self.local.streams), "local_domains")
        remote_labels = _labels(remote_domains, len(self.remote.streams), "remote_domains")
        return local_labels, remote_labels[list(self.remote_streams)]

    def _merge_kinds(self, local_domains: np.ndarray | None, remote_domains: np.ndarray | None) -> list[_Kind] | None:
        """The streams grouped by how their pieces continue one another: (streams, dense
        locally, dense remotely, may merge); None where streams that share a domain on a side
        interleave in memory, so that pieces of two streams may continue one another.

        Streams that share a domain but lie apart (K and V of one tensor) are merged each
        on its own: two of their pieces continue one another only at a stream's last block,
        and missing that merge moves the same bytes in one more descriptor. Kept per pair
        of domain lists (a reader asks with the same two every time).
        """
        local_labels, remote_labels = self._stream_labels(local_domains, remote_domains)  # checked first
        key = (local_labels.tobytes(), remote_labels.tobytes())
        if key in self._kinds_cache:
            return self._kinds_cache[key]
        (local_bases, local_strides), (remote_bases, remote_strides) = self._local_streams, self._remote_streams
        kinds: list[_Kind] | None = None
        if not (
            _interleave(local_labels, local_bases, local_strides, self.local)
            or _interleave(remote_labels, remote_bases, remote_strides, self.remote)
        ):
            local_dense = local_strides == np.uint64(self.local_parts * self.chunk_bytes)
            remote_dense = remote_strides == np.uint64(self.remote_parts * self.chunk_bytes)
            merging = (local_labels >= 0) & (remote_labels >= 0)
            code = local_dense * 4 + remote_dense * 2 + merging
            kinds = []
            for kind in sorted(set(code.tolist())):
                streams = np.flatnonzero(code == kind)
                kinds.append(
                    _Kind(
                        streams,
                        (local_bases[streams, None], local_strides[streams, None]),
                        (remote_bases[streams, None], remote_strides[streams, None]),
                        bool(kind & 4),
                        bool(kind & 2),
                        bool(kind & 1),
                    )
                )
        self._kinds_cache[key] = kinds
        return kinds

    @cached_property
    def _kinds_cache(self) -> dict[tuple[object, object], list[_Kind] | None]:
        return {}

    def _checked(self, local_ids: Ids, remote_ids: Ids) -> tuple[np.ndarray, np.ndarray]:
        return checked_request_ids(
            local_ids, remote_ids, self.local, self.remote.num_blocks, self.remote.block_size, self.local_blocks_for
        )

    def _merged_in_streams(
        self,
        local: np.ndarray,
        remote: np.ndarray,
        sizes: np.ndarray | None,
        per: int,
        kinds: list[_Kind],
        groups: list[np.ndarray],
    ) -> list[tuple[np.ndarray, np.ndarray]]:
        """Merged rows when pieces merge only within their stream, found from the ids alone.

        ``local`` and ``remote`` are the requests' ids back to back, ``sizes[k]`` request
        ``k``'s (local, remote) id counts (None: one request). Piece ``c`` of request ``k``
        is chunk ``c`` of its blocks on each side. A new row starts where a request starts,
        and where a side starts a block whose blocks are not dense (block stride > run) or
        whose id is not one more than the one before; runs longer than ``per`` pieces are
        cut every ``per``.
        That depends on the stream only through its kind (dense locally, dense remotely,
        may merge), so the cuts are found once per kind, from the places where ids stop
        counting up, and rows are made for the merged pieces only: a fixed number of numpy
        calls for the whole batch, none over every piece. Rows go kind by kind, stream by
        stream, for each group of streams in turn (one list of rows per group).
        """
        chunk = self.chunk_bytes
        total = remote.size * self.remote_parts
        first_piece = np.zeros(1, dtype=np.int64)
        sides = (_Side(self.local, local, self.local_parts, None), _Side(self.remote, remote, self.remote_parts, None))
        if sizes is not None:
            first_piece = _starts(sizes[:, 1] * self.remote_parts)  # each request's pieces
            sides = (
                _Side(self.local, local, self.local_parts, _starts(sizes[:, 0])),
                _Side(self.remote, remote, self.remote_parts, _starts(sizes[:, 1])),
            )
        out: list[list[list[np.ndarray]]] = [[[], []] for _ in groups]
        for kind in kinds:
            if kind.merges:
                starts = np.zeros(total + 1, dtype=bool)
                starts[first_piece] = True
                starts[total] = True
                for side, dense in zip(sides, (kind.local_dense, kind.remote_dense)):
                    ids = side.ids
                    breaks = np.flatnonzero(ids[1:] != ids[:-1] + 1) + 1 if dense else np.arange(1, ids.size)
                    if side.request_starts is None:
                        starts[side.parts * breaks] = True
                        continue
                    # A block's first piece: its request's first piece, then parts per block
                    # before it in the request (every block of a request holds a piece of it).
                    request = np.searchsorted(side.request_starts, breaks, side="right") - 1
                    starts[first_piece[request] + side.parts * (breaks - side.request_starts[request])] = True
                bounds = np.flatnonzero(starts)
            else:
                bounds = np.arange(total + 1, dtype=np.int64)
            first, pieces = _split(bounds, per)
            lengths = pieces.astype(np.uint64) * np.uint64(chunk)
            row_request = None if sizes is None else np.searchsorted(first_piece, first, side="right") - 1
            chosen = [np.isin(kind.streams, group) for group in groups]
            for index, (side, (bases, strides)) in enumerate(zip(sides, (kind.local, kind.remote))):
                # Each row's first piece as a chunk of its side: block, then part of the block.
                at = first
                if row_request is not None and side.request_starts is not None:
                    at = first - first_piece[row_request] + side.parts * side.request_starts[row_request]
                address = bases + side.ids[at if side.parts == 1 else at // side.parts].astype(np.uint64) * strides
                if side.parts > 1:
                    address += (at % side.parts).astype(np.uint64) * np.uint64(chunk)
                rows = np.empty((bases.shape[0], first.size, 3), dtype=np.uint64)
                rows[:, :, 0] = address
                rows[:, :, 1] = lengths
                rows[:, :, 2] = side.table.device_id
                for lists, streams in zip(out, chosen):
                    lists[index].append((rows if streams.all() else rows[streams]).reshape(-1, 3))
        return [(_joined(lists[0]), _joined(lists[1])) for lists in out]

    @cached_property
    def _all_streams(self) -> np.ndarray:
        return np.arange(len(self.local.streams), dtype=np.int64)

    @cached_property
    def _layer_streams(self) -> dict[str, np.ndarray]:
        """Each local layer's streams (indices into ``local.streams``), in the table's order."""
        layers: dict[str, list[int]] = {}
        for index, stream in enumerate(self.local.streams):
            layers.setdefault(stream.layer, []).append(index)
        return {name: np.array(indices, dtype=np.int64) for name, indices in layers.items()}

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


def checked_request_ids(
    local_ids: Ids,
    remote_ids: Ids,
    local: RegionTable,
    remote_blocks: int,
    remote_block_size: int,
    local_blocks_for: Callable[[int], int],
) -> tuple[np.ndarray, np.ndarray]:
    """One request's id lists checked (``kvhost.ids``: in range, each block once, not
    empty), and the local list the length the remote one needs: local, remote."""
    remote = checked_ids(remote_ids, "remote_ids", remote_blocks, allow_empty=False)
    checked = checked_ids(local_ids, "local_ids", local.num_blocks, allow_empty=False)
    want = local_blocks_for(remote.size)
    if checked.size != want:
        raise RequestError(
            f"{remote.size} remote blocks of {remote_block_size} tokens need {want} local blocks of "
            f"{local.block_size} tokens, got {checked.size} local block ids"
        )
    return checked, remote


def checked_batch(
    requests: Sequence[tuple[Ids, Ids]], check: Callable[[Ids, Ids], tuple[np.ndarray, np.ndarray]]
) -> tuple[list[tuple[np.ndarray, np.ndarray]], np.ndarray]:
    """Each request of a batch checked (``check``: its local and remote ids), and the local
    ids back to back: no block may be named by two requests (it would be written twice).
    Requests are named by their index in the batch (a batch of one needs no name)."""
    if not isinstance(requests, (list, tuple)):  # a set has no order, an iterator no length
        raise RequestError(f"a batch is a list or tuple of (local ids, remote ids) pairs, got {shown(requests)}")
    if not requests:
        raise RequestError("a transfer needs at least one request")
    for index, request in enumerate(requests):
        if not isinstance(request, (tuple, list)) or len(request) != 2:
            raise RequestError(
                f"request {index} of {len(requests)}: expected (local ids, remote ids), got {shown(request)}"
            )
    if len(requests) == 1:
        checked = [check(*requests[0])]
        return checked, checked[0][0]
    checked = []
    for index, (local_ids, remote_ids) in enumerate(requests):
        try:
            checked.append(check(local_ids, remote_ids))
        except RequestError as err:
            raise RequestError(f"request {index} of {len(requests)}: {err}") from None
    local = np.concatenate([ids for ids, _ in checked])
    twice = _claimed_twice(local, [ids.size for ids, _ in checked])
    if twice is not None:
        first, second, block = twice
        raise RequestError(
            f"requests {first} and {second} of one transfer name the same local block {block}: "
            "it would be written twice"
        )
    return checked, local


def _claimed_twice(local: np.ndarray, sizes: Sequence[int]) -> tuple[int, int, int] | None:
    """The first local block (in batch order) that a request names after an earlier one did:
    the two requests' indices (``sizes``: each request's ids in ``local``) and the block;
    None when each block is named once. One sort, as ``np.unique`` would take."""
    order = np.argsort(local, kind="stable")  # stable: a block's positions stay in batch order
    ranked = local[order]
    again = np.flatnonzero(ranked[1:] == ranked[:-1])
    if not again.size:
        return None
    repeat = again[np.argmin(order[again + 1])]  # the repeat that comes first in the batch
    first, second = np.searchsorted(np.cumsum(sizes), order[[repeat, repeat + 1]], side="right")
    return int(first), int(second), int(ranked[repeat])


def plan_transfer(local: RegionTable, remote: RegionTable) -> TransferPlan:
    """Pair two tables: same streams, same letters and sizes but ``N``, block sizes dividing.

    With region tables the bytes land as wire bytes (``kvhost.receive`` finishes the job);
    with ``token_runs()`` tables in one order they land in the local layout itself
    (``TransferPlan.in_local_layout`` says which).
    Letters of size 1 (but ``N``) may sit anywhere on either side: they are left out
    (``RegionTable.without_unit_letters``), and so out of the plan's ``remote_order``.
    """
    for side, table in (("local", local), ("remote", remote)):
        if not isinstance(table, RegionTable):
            raise ArgumentError(f"plan_transfer takes two RegionTables, got {shown(table)} as the {side} one")
        table.check_fields(side)
    return pair_tables(local, remote)


def pair_tables(local: RegionTable, remote: RegionTable) -> TransferPlan:
    """``plan_transfer`` of tables made here from checked ones (``kvhost.nixl.ranks``' head
    shares and windows): their fields are not checked again."""
    local, remote = local.without_unit_letters(), remote.without_unit_letters()
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
    block_ratio(local.block_size, remote.block_size)  # sizes that divide one another, or an error
    for side, table in (("local", local), ("remote", remote)):
        if len(table.by_key) != len(table.streams):  # a table made by hand; from_dict refuses it
            raise LayoutError(f"{side} {_named_twice(table).describe()} appears twice in its table")
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


def _named_twice(table: RegionTable) -> Stream:
    """The first stream of ``table`` whose key an earlier one has."""
    seen = set()
    for stream in table.streams:
        if stream.key in seen:
            return stream
        seen.add(stream.key)
    raise AssertionError("no stream is named twice")


def merge_rows(
    local_rows: np.ndarray,
    remote_rows: np.ndarray,
    max_bytes: int,
    local_labels: np.ndarray,
    remote_labels: np.ndarray,
) -> tuple[np.ndarray, np.ndarray]:
    """Pairs of rows of one length, merged where they continue one another on both sides.

    ``*_labels`` give each row's merge domain (negative: merges with nothing). Rows are
    sorted by local address first: pieces that continue one another locally are then
    neighbours, whatever order the plan built them in (a local byte is written once). A
    run of mergeable pairs is cut every ``max_bytes // length`` rows. Vectorised: a few
    numpy passes over the rows.
    """
    _check_max_bytes(max_bytes)
    count = local_rows.shape[0]
    if count == 0:
        return local_rows, remote_rows
    length = int(local_rows[0, 1])
    if not ((local_rows[:, 1] == length).all() and (remote_rows[:, 1] == length).all()):
        raise ArgumentError("merge_rows takes rows of one length")
    per = max(1, max_bytes // length)
    if per == 1 or count == 1:
        return local_rows, remote_rows
    order = np.argsort(local_rows[:, 0], kind="stable")
    local_at, remote_at = local_rows[order, 0], remote_rows[order, 0]
    local_label, remote_label = local_labels[order], remote_labels[order]
    step = np.uint64(length)
    follows = (
        (local_at[1:] == local_at[:-1] + step)
        & (remote_at[1:] == remote_at[:-1] + step)
        & (local_label[1:] == local_label[:-1])
        & (remote_label[1:] == remote_label[:-1])
        & (local_label[1:] >= 0)
        & (remote_label[1:] >= 0)
    )
    first, counts = _cut(follows, per)
    pieces = counts.astype(np.uint64)
    merged = []
    for rows, at in ((local_rows, local_at), (remote_rows, remote_at)):
        out = np.empty((first.size, 3), dtype=np.uint64)
        out[:, 0] = at[first]
        out[:, 1] = pieces * step
        out[:, 2] = rows[order[first], 2]
        merged.append(out)
    return merged[0], merged[1]


def _joined(rows: list[np.ndarray]) -> np.ndarray:
    return rows[0] if len(rows) == 1 else np.concatenate(rows)


def _cut(follows: np.ndarray, per: int) -> tuple[np.ndarray, np.ndarray]:
    """Where merged rows start, and how many pieces each holds: a new row wherever a piece
    does not follow the one before it (``follows[i]``: piece i + 1 follows piece i), and
    every ``per`` pieces of a run."""
    starts = np.ones(follows.size + 2, dtype=bool)
    starts[1:-1] = ~follows
    return _split(np.flatnonzero(starts), per)


def _split(bounds: np.ndarray, per: int) -> tuple[np.ndarray, np.ndarray]:
    """Runs of pieces ``bounds[i]:bounds[i + 1]`` cut every ``per`` pieces: where each row
    starts, and how many pieces it holds."""
    first, lengths = bounds[:-1], bounds[1:] - bounds[:-1]
    if lengths.size == 0 or int(lengths.max()) <= per:
        return first, lengths
    rows = (lengths + per - 1) // per
    before = _starts(rows)
    index = np.arange(int(rows.sum()), dtype=np.int64)
    run = np.repeat(np.arange(rows.size), rows)
    starts = first[run] + (index - before[run]) * per
    return starts, np.minimum(per, bounds[1:][run] - starts)


@dataclass(frozen=True)
class _Side:
    """One side of a batch: its table, the requests' ids back to back, chunks per block,
    and where each request's ids start."""

    table: RegionTable
    ids: np.ndarray
    parts: int
    request_starts: np.ndarray | None  # None: one request


def _starts(counts: np.ndarray) -> np.ndarray:
    """Where each of several runs of ``counts`` items starts, laid back to back."""
    starts: np.ndarray = np.cumsum(counts) - counts
    return starts


@dataclass(frozen=True)
class _Kind:
    """Streams whose pieces continue one another alike: which they are, each side's (bases,
    block strides) as columns, whether each side's blocks are dense (stride = run), whether they merge."""

    streams: np.ndarray  # indices into the local table's streams
    local: tuple[np.ndarray, np.ndarray]
    remote: tuple[np.ndarray, np.ndarray]
    local_dense: bool
    remote_dense: bool
    merges: bool


def _interleave(labels: np.ndarray, bases: np.ndarray, strides: np.ndarray, table: RegionTable) -> bool:
    """Whether two streams of one domain (a label of 0 or more) overlap in memory: their
    blocks interleave, so a piece of one may continue a piece of the other."""
    ends = bases + strides * np.uint64(table.num_blocks - 1) + np.uint64(table.run_bytes)
    for label in set(labels[labels >= 0].tolist()):
        members = np.flatnonzero(labels == label)
        if members.size > 1:
            order = members[np.argsort(bases[members], kind="stable")]
            if (bases[order[1:]] < ends[order[:-1]]).any():
                return True
    return False


def _labels(domains: np.ndarray | None, streams: int, name: str) -> np.ndarray:
    """Per-stream merge domains: as given (one per stream), or each stream its own."""
    if domains is None:
        return np.arange(streams, dtype=np.int64)
    try:
        given = np.asarray(domains)
    except (ValueError, TypeError) as err:  # ragged, or what numpy cannot hold
        raise ArgumentError(f"{name}: expected integer labels, got {shown(domains)}: {err}") from None
    # Integers only, never coerced: 0.4 and 0.6 are not one domain, nor True a label.
    if given.dtype.kind not in "iu" or (given.dtype.kind == "u" and given.size and int(given.max()) >= 1 << 63):
        raise ArgumentError(f"{name}: expected integer labels (64-bit), got {shown(domains)} ({given.dtype})")
    labels = given.astype(np.int64, copy=False)
    if labels.shape != (streams,):
        raise ArgumentError(f"{name}: expected one label for each of {streams} streams, got shape {labels.shape}")
    return labels


def _bases_and_strides(streams: Sequence[Stream]) -> tuple[np.ndarray, np.ndarray]:
    return (
        np.array([s.address for s in streams], dtype=np.uint64),
        np.array([s.block_stride for s in streams], dtype=np.uint64),
    )


def stream_extents(table: RegionTable) -> np.ndarray:
    """One (address, length, device id) row per stream: from its first block's run to the end
    of its last block's run."""
    bases, strides = _bases_and_strides(table.streams)
    rows = np.empty((bases.size, 3), dtype=np.uint64)
    rows[:, 0] = bases
    rows[:, 1] = strides * np.uint64(table.num_blocks - 1) + np.uint64(table.run_bytes)
    rows[:, 2] = table.device_id
    return rows


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
