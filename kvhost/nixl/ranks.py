"""Tensor parallelism either way: which remote ranks feed a local rank, and the plans that move their bytes.

Rank ``i`` of an engine of ``tp`` ranks holds the KV heads ``i * per_rank .. (i + 1) *
per_rank - 1`` (``per_rank = kv_heads / tp``). A local rank's heads come from every
remote rank whose heads overlap them (``head_shares``): one whole rank when both sides
have the same TP, a share of one rank when the local TP is larger, several whole ranks
when it is smaller (the local rank gathers its heads from several remote ranks into each
of its blocks). An MLA cache is not split by heads: every rank holds the whole latent, so
each local rank reads it once, from one remote rank (``latent_source``).

The bytes land as they would from one *virtual sender*: an engine with the remote ranks'
region order and block size that holds exactly this rank's heads. So the wire model of
docs/design.md holds unchanged and one ``kvhost.receive`` with the plan's ``remote_order``
and ``remote_block_size`` finishes the job, whatever the ranks. Where heads move head by
head (``_head_by_head``: per-head streams on one side, or ranks of one head into larger
local blocks), each head's blocks land in that head's run of the local blocks as the wire
model says for the remote's per-head regions (a local region of several heads is then
written head-major of the local block size, so that a rank's run of blocks lands as one
piece). Otherwise each remote rank contributes byte runs of its
region (one run when heads lead the region, one per token when tokens do) to runs of the
virtual sender's region, which land in the local blocks as the wire model says: the
virtual region ``k`` of a request is sub-block ``k mod r`` of local block ``k // r``, or
spans the group of ``g`` local blocks ``k * g ..``. ``plan_ranks`` turns each of these
placements into a ``TransferPlan`` made by ``plan_transfer`` (over byte windows of both
tables where a share is not a whole region), so every descriptor row comes from
``TransferPlan.descriptor_pairs``. ``RankReader`` posts one NIXL transfer per remote rank
that feeds the local one. Windows grow with a peer's block size, so they are counted from
the tables' sizes first and held to ``MAX_STREAMS`` streams a side, as an offer's tables are;
so are the streams of the remote ranks read head by head (only those that feed the local
rank are seen), which grow with a rank's heads.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, replace
from functools import partial
from math import prod
from typing import Literal, NamedTuple, TypeVar

import numpy as np

from kvhost.errors import ArgumentError, LayoutError, shown
from kvhost.ids import Ids, integer_value
from kvhost.nixl.agent import (
    NIXL_LOCAL_AGENT,
    Agent,
    Probes,
    Transfer,
    check_descriptor_bound,
    check_peer_name,
    check_registered,
    layer_by_layer,
    merge_domains,
    post_all,
    post_rows,
)
from kvhost.nixl.engine import MAX_HEADS, MAX_RANKS
from kvhost.nixl.fields import check_seconds
from kvhost.nixl.plans import (
    MAX_DESCRIPTOR_BYTES,
    TransferPlan,
    block_count,
    checked_batch,
    checked_request_ids,
    pair_tables,
)
from kvhost.nixl.tables import MAX_STREAMS, WINDOW_RUN, RegionTable, Stream
from kvhost.transform import block_ratio

Rows = tuple[np.ndarray, np.ndarray]  # (address, length, device id) rows: local and remote
Domains = tuple[np.ndarray | None, np.ndarray | None]  # a part's merge domains: local and remote
Run = tuple[int, int, int]  # a share's byte run: offset in the remote region, in the virtual region, length
# How a share of the heads moves (``_share_way``); only "windows" costs more as blocks grow.
ShareWay = Literal["whole regions", "head streams", "head run", "windows"]
T = TypeVar("T")


@dataclass(frozen=True)
class HeadShare:
    """Heads ``local_first ..`` of the local rank are heads ``remote_first ..`` of ``remote_rank``."""

    remote_rank: int
    local_first: int
    remote_first: int
    count: int


def head_shares(local_rank: int, local_tp: int, remote_tp: int, kv_heads: int) -> list[HeadShare]:
    """The remote ranks that hold some of this local rank's heads, and which, in head order."""
    local_rank, local_tp, remote_tp, kv_heads = _counts(
        local_rank=local_rank, local_tp=local_tp, remote_tp=remote_tp, kv_heads=kv_heads
    )
    if not 1 <= kv_heads <= MAX_HEADS:
        raise LayoutError(f"{kv_heads} KV heads: an engine has 1 to {MAX_HEADS}")
    for name, tp in (("local", local_tp), ("remote", remote_tp)):
        if not 1 <= tp <= MAX_RANKS:
            raise LayoutError(f"{name} TP {tp}: an engine has 1 to {MAX_RANKS} ranks")
        if kv_heads % tp:
            raise LayoutError(f"{kv_heads} KV heads cannot be shared evenly by {name} TP {tp}")
    if not 0 <= local_rank < local_tp:
        raise LayoutError(f"local rank {local_rank} is not one of {local_tp} ranks")
    mine, theirs = kv_heads // local_tp, kv_heads // remote_tp
    low, high = local_rank * mine, (local_rank + 1) * mine
    shares = []
    for rank in range(low // theirs, -(-high // theirs)):
        first, last = max(low, rank * theirs), min(high, (rank + 1) * theirs)
        shares.append(HeadShare(rank, first - low, first - rank * theirs, last - first))
    return shares


def latent_source(local_rank: int, local_tp: int, remote_tp: int) -> int:
    """The remote rank a local rank reads an MLA latent from: each reads it once, the local
    ranks spread over the remote ones."""
    local_rank, local_tp, remote_tp = _counts(local_rank=local_rank, local_tp=local_tp, remote_tp=remote_tp)
    if not 0 <= local_rank < local_tp <= MAX_RANKS or not 1 <= remote_tp <= MAX_RANKS:
        raise LayoutError(
            f"local rank {local_rank} of {local_tp}, remote TP {remote_tp} (an engine has 1 to {MAX_RANKS} ranks)"
        )
    return local_rank % remote_tp


def _counts(**counts: object) -> list[int]:
    """Ranks and sizes as plain ints, in the order given (``True`` is not rank 1; a float is
    no rank at all; an int subclass counts by its own value, not by its comparisons)."""
    values = []
    for name, value in counts.items():
        number = integer_value(value)
        if number is None:
            raise LayoutError(f"{name} must be an int, got {shown(value)} ({type(value).__name__})")
        values.append(number)
    return values


@dataclass(frozen=True)
class Part:
    """One ``TransferPlan`` of a source and the blocks of a request it moves.

    ``phase`` None: all of them (the plan pairs whole regions, any block sizes). Otherwise,
    with a local block r >= 1 times the remote one, remote blocks ``phase, phase + r, ..``
    into sub-block ``phase`` of the local blocks in order; with a remote block g > 1 times
    the local one, every remote block into local block ``phase`` of its group.
    """

    plan: TransferPlan
    phase: int | None = None


@dataclass(frozen=True)
class Source:
    """A remote rank that feeds the local one: which heads (None: all, or an MLA latent) and how."""

    rank: int
    share: HeadShare | None
    parts: tuple[Part, ...]


@dataclass(frozen=True)
class RankPlan:
    """How one local rank's blocks receive a request's bytes from the remote ranks that hold them.

    ``remote_order`` and ``remote_block_size`` are what ``kvhost.receive`` is told (on a
    ``TransferPlan`` the remote table's own, here not always); the remote ranks' block
    size, which their block ids count, is ``sender_block_size``.
    """

    local: RegionTable
    remotes: tuple[RegionTable, ...]  # every remote rank's table, by rank
    sources: tuple[Source, ...]
    # What ``kvhost.receive`` must be told the bytes landed in: the remote ranks' region
    # order and block size, their per-head order (heads moved head by head into streams or
    # a region of one head), or that order behind H with the local block size (head by head
    # into a region of several heads).
    remote_order: str
    remote_block_size: int

    @property
    def sender_block_size(self) -> int:
        """The remote ranks' block size: what their block ids count."""
        return self.remotes[0].block_size

    @property
    def r(self) -> int:
        return block_ratio(self.local.block_size, self.sender_block_size)[0]

    @property
    def g(self) -> int:
        return block_ratio(self.local.block_size, self.sender_block_size)[1]

    def local_blocks_for(self, remote_blocks: int) -> int:
        """Local blocks that hold ``remote_blocks`` sender blocks (whole groups when g > 1)."""
        remote_blocks = block_count(remote_blocks)
        return remote_blocks * self.g if self.g > 1 else -(-remote_blocks // self.r)

    def bytes_for(self, remote_blocks: int) -> int:
        """Bytes one request of ``remote_blocks`` sender blocks moves into this rank, from all sources."""
        remote_blocks = block_count(remote_blocks)
        return sum(p.plan.bytes_for(self._count(p, remote_blocks)) for s in self.sources for p in s.parts)

    def rows(
        self,
        source: Source,
        local_ids: Ids,
        remote_ids: Ids,
        *,
        max_bytes: int | None = None,
        domains: Sequence[Domains] | None = None,
    ) -> tuple[np.ndarray, np.ndarray]:
        """The (address, length, device id) rows that move ``source``'s part of one request: local and remote.

        ``max_bytes`` None: one row per piece; otherwise pieces that continue one another
        merged up to it (``TransferPlan.merged_pairs``), with ``domains[i]`` the (local,
        remote) merge domains of ``source.parts[i]`` (None: each stream its own).
        """
        return self.batch_rows(source, [(local_ids, remote_ids)], max_bytes=max_bytes, domains=domains)

    def batch_rows(
        self,
        source: Source,
        requests: Sequence[tuple[Ids, Ids]],
        *,
        max_bytes: int | None = None,
        domains: Sequence[Domains] | None = None,
    ) -> tuple[np.ndarray, np.ndarray]:
        """``rows`` of several requests (``(local_ids, remote_ids)`` each) for one transfer,
        each part planned for the whole batch at once (``TransferPlan.merged_batch``). No
        local block may be named by two requests."""

        def part_rows(part: Part, chosen: list[tuple[np.ndarray, np.ndarray]], part_domains: Domains) -> Rows:
            if max_bytes is None:
                return part.plan.descriptor_batch(chosen)
            local_domains, remote_domains = part_domains
            return part.plan.merged_batch(
                chosen, max_bytes=max_bytes, local_domains=local_domains, remote_domains=remote_domains
            )

        return _joined(self._by_part(source, requests, domains, part_rows))

    def layer_rows(
        self,
        source: Source,
        requests: Sequence[tuple[Ids, Ids]],
        *,
        max_bytes: int | None = None,
        domains: Sequence[Domains] | None = None,
    ) -> dict[str, Rows]:
        """``batch_rows``, local layer by local layer (in the local table's order), from
        ``TransferPlan.merged_layers``: what one transfer of each layer posts towards
        ``source``. ``max_bytes`` None: one row per piece."""

        def part_rows(
            part: Part, chosen: list[tuple[np.ndarray, np.ndarray]], part_domains: Domains
        ) -> dict[str, Rows]:
            local_domains, remote_domains = part_domains
            return part.plan.merged_layers(
                chosen,
                max_bytes=max_bytes or part.plan.chunk_bytes,  # a bound of one piece merges nothing
                local_domains=local_domains,
                remote_domains=remote_domains,
            )

        by_part = self._by_part(source, requests, domains, part_rows)
        return {layer: _joined([rows[layer] for rows in by_part]) for layer in by_part[0]}

    def _by_part(
        self,
        source: Source,
        requests: Sequence[tuple[Ids, Ids]],
        domains: Sequence[Domains] | None,
        part_rows: Callable[[Part, list[tuple[np.ndarray, np.ndarray]], Domains], T],
    ) -> list[T]:
        """``part_rows(part, ids, part_domains)`` of each part of ``source`` that moves some of
        the requests' blocks (``ids``: what it moves of each; ``part_domains``: the part's
        entry of ``domains``, (None, None) without), the batch checked first."""
        checked, _ = checked_batch(requests, self._checked)
        found = []
        for index, part in enumerate(source.parts):
            chosen = [pair for pair in (self._chosen(part, lo, re) for lo, re in checked) if pair[1].size]
            if chosen:
                found.append(part_rows(part, chosen, domains[index] if domains is not None else (None, None)))
        return found

    def _checked(self, local_ids: Ids, remote_ids: Ids) -> tuple[np.ndarray, np.ndarray]:
        return checked_request_ids(
            local_ids, remote_ids, self.local, self.remote_block_count, self.sender_block_size, self.local_blocks_for
        )

    def _chosen(self, part: Part, local: np.ndarray, remote: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The ids of one request that ``part`` moves: all of them, or its phase of r or g."""
        if part.phase is None:
            return local, remote
        if self.g == 1:
            picked = remote[part.phase :: self.r]
            return local[: picked.size], picked
        return local[part.phase :: self.g], remote

    @property
    def remote_block_count(self) -> int:
        return min(t.num_blocks for t in self.remotes)

    def _count(self, part: Part, remote_blocks: int) -> int:
        if part.phase is None or self.g > 1:
            return remote_blocks
        return len(range(part.phase, remote_blocks, self.r))


def _joined(pairs: Sequence[Rows]) -> Rows:
    """Parts' (local, remote) rows as one pair of lists."""
    return np.concatenate([p[0] for p in pairs]), np.concatenate([p[1] for p in pairs])


def plan_ranks(local: RegionTable, local_rank: int, local_tp: int, remotes: Sequence[RegionTable]) -> RankPlan:
    """Pair one local rank's table with the tables of every rank of a remote engine (by rank).

    Heads are shared as ``head_shares`` says when both tables have them (``H``); without
    (MLA) the local rank reads the whole latent from ``latent_source``. Tables must agree
    but in ``N`` and ``H`` (``plan_transfer``'s checks); block sizes must divide.
    """
    if not remotes:
        raise LayoutError("no remote ranks to read from")
    for name, table in (("local", local), *((f"remote rank {q}", t) for q, t in enumerate(remotes))):
        if not isinstance(table, RegionTable):
            raise ArgumentError(f"plan_ranks takes RegionTables, got {shown(table)} as the {name}'s")
        if not table.streams:  # a table made by hand; from_dict refuses it
            raise LayoutError(f"the {name}'s table has no streams")
        table.check_fields(name)
    first = remotes[0]
    for rank, table in enumerate(remotes):
        for field in ("order", "split", "sizes", "coordinates"):  # the sizes hold the block size (N)
            if getattr(table, field) != getattr(first, field):
                raise LayoutError(
                    f"remote rank {rank}'s table differs from rank 0's in {field}: "
                    f"{getattr(table, field)!r} against {getattr(first, field)!r}"
                )
    _, group = block_ratio(local.block_size, first.block_size)
    if group > local.num_blocks:  # such a block could never be received: refused before anything is planned
        raise LayoutError(
            f"a remote block of {first.block_size} tokens spans {group} local blocks of {local.block_size} "
            f"tokens, more than the {local.num_blocks} blocks of the local cache"
        )
    remote_tp = len(remotes)
    if "H" not in local.sizes and "H" not in first.sizes:
        rank = latent_source(local_rank, local_tp, remote_tp)
        plan = pair_tables(local, remotes[rank])  # its remote order names no letter of size 1
        latent = Source(rank, None, (Part(plan),))
        return RankPlan(local, tuple(remotes), (latent,), plan.remote_order, first.block_size)
    if "H" not in local.sizes or "H" not in first.sizes:
        raise LayoutError("one side's tables have heads (H) and the other's do not")
    kv_heads = local.sizes["H"] * local_tp
    if first.sizes["H"] * remote_tp != kv_heads:
        raise LayoutError(
            f"local {local.sizes['H']} heads x TP {local_tp} and remote {first.sizes['H']} heads x TP "
            f"{remote_tp} are not the same KV heads"
        )
    shares = head_shares(local_rank, local_tp, remote_tp, kv_heads)
    fed = [share.remote_rank for share in shares]  # the remote ranks read from, in order: only they are seen
    views = _head_by_head(local, remotes, fed)
    if views is None:  # the tables as they are, a one-head rank's read as head-major
        leading = local.sizes["H"] != first.sizes["H"]
        remote_views = {rank: _heads_leading(remotes[rank]) if leading else remotes[rank] for rank in fed}
        views = HeadViews(local, remote_views, remote_views[fed[0]].order, first.block_size)
    local_view, remote_views = views.local, views.remotes
    ways = [_share_way(local_view, remote_views[share.remote_rank], share) for share in shares]
    windowed = [(remote_views[share.remote_rank], share) for share, way in zip(shares, ways) if way == "windows"]
    runs = dict(zip((share for _, share in windowed), _window_runs(local_view, windowed)))
    sources = tuple(
        Source(
            share.remote_rank,
            share,
            _parts(local_view, remote_views[share.remote_rank], share, way, runs.get(share, [])),
        )
        for share, way in zip(shares, ways)
    )
    return RankPlan(local, tuple(remotes), sources, views.order, views.block_size)


def _heads_are_streams(table: RegionTable) -> bool:
    return "H" in table.coordinates


class HeadViews(NamedTuple):
    """The tables as planning reads them, and what ``kvhost.receive`` is then told."""

    local: RegionTable
    remotes: dict[int, RegionTable]  # by rank: only the remote ranks that feed the local one
    order: str  # the order the bytes land in
    block_size: int  # and its block size


def _head_by_head(local: RegionTable, remotes: Sequence[RegionTable], fed: Sequence[int]) -> HeadViews | None:
    """Both sides seen with each head a stream (``RegionTable.heads_apart``), and the order
    and block size the bytes then land in, where heads are better moved head by head; None
    where the ways of ``_share_way`` serve. Only the remote ranks ``fed`` from (which hold
    some of the local rank's heads) are seen, and the streams their views hold are counted
    from the sizes first and held to ``MAX_STREAMS`` in all (``_check_heads_apart``).

    Head by head serves where one side's heads are streams and the other's are runs of its
    blocks (head-major, or one head a block), and ranks of one head whose blocks are smaller
    than the local ones: there a rank's run of blocks lands as one piece in each local
    block's run of that head, where a virtual sender of the remote block size puts them a
    region apart. A local region of several heads is then written as if head-major (``H``
    first, of the local block size: one region per local block holds each head's tokens in
    order when the remote regions hold their tokens first), which ``kvhost.receive`` puts in
    the local order; head-major local blocks need nothing. A local region of one head, or a
    local cache whose heads are streams, takes the remote regions as the wire model says.
    """
    remote = remotes[0]
    local_streams, remote_streams = _heads_are_streams(local), _heads_are_streams(remote)
    if (local_streams and remote_streams) or local.split or remote.split:
        return None
    one_head_into_larger = remote.sizes["H"] == 1 < local.sizes["H"] and local.block_size > remote.block_size
    if not (local_streams or remote_streams or one_head_into_larger):
        return None
    if not (remote_streams or remote.sizes["H"] == 1 or remote.run_order.startswith("H")):
        return None  # a share of token-major blocks of several heads: refused by _share_way
    _check_heads_apart(remotes, fed)
    remote_views = {rank: remotes[rank].heads_apart() for rank in fed}
    per_head = remote_views[fed[0]].order
    if local_streams or local.sizes["H"] == 1:
        return HeadViews(local.heads_apart(), remote_views, per_head, remote.block_size)
    if per_head[0] != "N" and local.block_size != remote.block_size:
        return None  # sub-blocks of a head would not make one region of the local block size
    if not local.run_order.startswith("H"):  # written head-major, received into the local order
        local = _head_major(local)
    return HeadViews(local.heads_apart(), remote_views, "H" + per_head, local.block_size)


def _check_heads_apart(remotes: Sequence[RegionTable], fed: Sequence[int]) -> None:
    """Refuse remote ranks ``fed`` whose heads, one stream each, would be more than
    ``MAX_STREAMS`` streams in all: each is a Python object, and a peer's offer holds that
    many streams over all its tables, which head by head would be as many times more as a
    rank has heads. Counted from the sizes (``RegionTable.streams_apart``) before any is made."""
    count = sum(remotes[rank].streams_apart for rank in fed)
    if count > MAX_STREAMS:
        streams = sum(len(remotes[rank].streams) for rank in fed)
        raise LayoutError(
            f"reading the heads of remote ranks {list(fed)} one by one makes their {streams} streams {count}, "
            f"more than the {MAX_STREAMS} a plan may hold"
        )


def _heads_leading(table: RegionTable) -> RegionTable:
    """``table`` with a region of one head read as head-major: ``H`` of size 1 moves no byte
    wherever it sits, so a token-major region (vLLM's default) holds the same bytes as a
    head-major one. Read token-major, a rank's share would move as one window per token of
    each block (16-64 times the descriptors, and past ``MAX_STREAMS`` refused); read
    head-major, it is one run per block, and ``kvhost.receive`` puts the tokens in order."""
    if table.sizes["H"] != 1 or "H" not in table.run_order or table.run_order.startswith("H"):
        return table
    return _head_major(table)


def _head_major(table: RegionTable) -> RegionTable:
    """``table`` with ``H`` put first in its order: the same memory, read as head-major."""
    return replace(table, order="H" + table.order.replace("H", ""))


def _share_way(local: RegionTable, remote: RegionTable, share: HeadShare) -> ShareWay:
    """How one remote rank's share of the heads moves into the local rank's blocks: whole
    regions (equal TP), heads that are streams on both sides picked, one run of a head-major
    region, or byte windows of the share's runs (``_window_parts``)."""
    local_coord, remote_coord = _heads_are_streams(local), _heads_are_streams(remote)
    if local_coord != remote_coord:
        raise LayoutError(_one_sided(local, remote))
    if share.count == local.sizes["H"] == remote.sizes["H"]:
        return "whole regions"
    if local_coord:
        return "head streams"
    if share.count == local.sizes["H"] and remote.run_order.startswith("H"):
        return "head run"
    return "windows"


def _one_sided(local: RegionTable, remote: RegionTable) -> str:
    """Why heads that are streams on one side only could not be moved head by head."""
    if local.split or remote.split:
        return "token-run tables are not shared out by heads across ranks; pair region tables"
    if _heads_are_streams(local):  # the remote's heads are no runs of their own
        return (
            f"heads are streams on one side only, and the remote's {remote.run_order!r} blocks of "
            f"{remote.sizes['H']} heads do not hold each head as one run"
        )
    per_head = remote.run_order.replace("H", "")
    return (
        f"heads are streams on one side only, and a head's {per_head!r} sub-blocks, whose tokens do not "
        f"lead, make no block of {local.block_size} tokens from blocks of {remote.block_size}"
    )


def _parts(
    local: RegionTable, remote: RegionTable, share: HeadShare, way: ShareWay, runs: list[Run]
) -> tuple[Part, ...]:
    """The plans that move one remote rank's share of the heads into the local rank's blocks
    (``runs``: the share's runs, when it moves by byte windows)."""
    if way == "whole regions":
        return (Part(pair_tables(local, remote)),)
    count = share.count
    if way == "head streams":  # pick and renumber the heads on both sides
        return (Part(pair_tables(local.heads(share.local_first, count), remote.heads(share.remote_first, count))),)
    if way == "head run":  # a share of a head-major region: one run
        return (Part(pair_tables(local, remote.heads(share.remote_first, count))),)
    return _window_parts(local, remote, runs)


def _window_runs(local: RegionTable, windowed: Sequence[tuple[RegionTable, HeadShare]]) -> list[list[Run]]:
    """The runs of each share that moves by byte windows, once their windows are known to
    fit in ``MAX_STREAMS`` streams a side.

    Each placement of a run becomes a window of every stream, and a peer's block size sets
    how many placements there are (one run per token of a token-major block; one placement
    per local block of a group): counted from the tables' sizes before any run or window is
    made, so a peer cannot make this rank build more than an offer's streams. Refused with a
    LayoutError naming both block sizes.
    """
    if not windowed:
        return []
    for table, _ in windowed:
        _check_window_tables(local, table)
    remote = windowed[0][0]  # every remote rank's table has rank 0's order, block size and sizes
    streams = max(len(local.streams), *(len(table.streams) for table, _ in windowed))
    # Each run is placed once per local sub-block where the local block is the larger (the
    # count, exactly), else at least once: known from the sizes, before any run is listed.
    order = remote.run_order
    runs_of_a_share = prod(remote.sizes[a] for a in order[: order.index("H")])  # one per index before H
    per_run = max(local.block_size // remote.block_size, 1)
    larger_local = local.block_size >= remote.block_size
    _check_windows(local, remote, len(windowed) * runs_of_a_share * per_run, streams, exact=larger_local)
    runs = [_share_runs(remote, share, local.sizes["H"]) for remote, share in windowed]
    if not larger_local:  # each run is cut at the ends of the g local regions it crosses
        region = local.run_bytes
        pieces = sum((at + length - 1) // region - at // region + 1 for share in runs for _, at, length in share)
        _check_windows(local, remote, pieces, streams, exact=True)
    return runs


def _check_window_tables(local: RegionTable, remote: RegionTable) -> None:
    """Tables whose runs can be cut into byte windows: region tables holding the same letters
    and sizes but ``N`` and ``H``."""
    if local.split or remote.split:
        raise LayoutError("token-run tables are not shared out by heads across ranks; pair region tables")
    if sorted(local.run_order) != sorted(remote.run_order):
        raise LayoutError(f"local region {local.order!r} and remote region {remote.order!r} hold different letters")
    others = {a: n for a, n in local.sizes.items() if a not in "NH"}
    if others != {a: n for a, n in remote.sizes.items() if a not in "NH"}:
        raise LayoutError(f"local sizes {local.sizes} and remote sizes {remote.sizes} differ beyond N and H")


def _check_windows(local: RegionTable, remote: RegionTable, placements: int, streams: int, *, exact: bool) -> None:
    """Refuse ``placements`` windows of ``streams`` streams (a lower bound unless ``exact``)
    past ``MAX_STREAMS`` a side: each is a Python object on both sides, and a plan per placement."""
    if placements * streams > MAX_STREAMS:
        raise LayoutError(
            f"remote blocks of {remote.block_size} tokens into local blocks of {local.block_size} tokens: "
            f"sharing the heads takes {'' if exact else 'at least '}{placements} byte windows of {streams} "
            f"streams, {placements * streams} streams a side, more than the {MAX_STREAMS} a plan may hold"
        )


def _window_parts(local: RegionTable, remote: RegionTable, runs: Sequence[Run]) -> tuple[Part, ...]:
    """A share that is runs of the remote region into runs of the virtual sender's: one plan
    per placement (sub-block, or part of a group) and run length, over byte windows."""
    virtual = remote.run_bytes // remote.sizes["H"] * local.sizes["H"]  # one region of the virtual sender
    n_remote, n_local = remote.block_size, local.block_size
    placements: list[tuple[int, int, int, int]] = []  # (phase, local offset, remote offset, length)
    if n_local >= n_remote:
        for phase in range(n_local // n_remote):
            placements += [(phase, phase * virtual + at, start, length) for start, at, length in runs]
    else:
        region = local.run_bytes  # a group of g local regions holds one virtual region: cut runs at their ends
        for start, at, length in runs:
            while length:
                phase, offset = divmod(at, region)
                piece = min(length, region - offset)
                placements.append((phase, offset, start, piece))
                start, at, length = start + piece, at + piece, length - piece
    groups: dict[tuple[int, int], list[tuple[int, int]]] = {}
    for phase, local_offset, remote_offset, length in placements:
        groups.setdefault((phase, length), []).append((local_offset, remote_offset))
    return tuple(
        Part(
            pair_tables(
                _window(local, [o for o, _ in offsets], length), _window(remote, [o for _, o in offsets], length)
            ),
            phase,
        )
        for (phase, length), offsets in groups.items()
    )


def _share_runs(remote: RegionTable, share: HeadShare, local_heads: int) -> list[Run]:
    """(offset in the remote region, offset in the virtual region, length) of the share's byte
    runs: one per index of the letters before H in the region. Two runs never continue one
    another on both sides: that takes a share of every head of both sides, which ``_parts``
    moves as whole regions."""
    order = remote.run_order
    remote_sizes = {a: remote.sizes[a] for a in order}
    virtual_sizes = {**remote_sizes, "H": local_heads}

    def strides(sizes: Mapping[str, int]) -> dict[str, int]:
        return {a: prod(sizes[b] for b in order[i + 1 :]) * remote.itemsize for i, a in enumerate(order)}

    remote_strides, virtual_strides = strides(remote_sizes), strides(virtual_sizes)
    head = remote_strides["H"]  # bytes of one head's inner letters, alike on both sides
    before = order[: order.index("H")]
    runs: list[Run] = []
    for index in itertools.product(*(range(remote_sizes[a]) for a in before)):
        start = sum(i * remote_strides[a] for a, i in zip(before, index)) + share.remote_first * head
        at = sum(i * virtual_strides[a] for a, i in zip(before, index)) + share.local_first * head
        runs.append((start, at, share.count * head))
    return runs


def _window(table: RegionTable, offsets: Sequence[int], length: int) -> RegionTable:
    """The runs ``offset .. offset + length`` of every block of every stream, one stream per
    offset: a table of bytes (letters ``NC``, one token of ``length`` bytes), for pairing
    with a window of the same offsets' count and length on the other side."""
    streams = tuple(
        Stream(s.layer, (*s.coords, (WINDOW_RUN, i)), s.address + offset, s.block_stride)
        for s in table.streams
        for i, offset in enumerate(offsets)
    )
    sizes = {"N": 1, "C": length // table.itemsize}
    return RegionTable(table.memory, table.device_id, "NC", "", sizes, table.itemsize, table.num_blocks, streams)


class RankReader:
    """A ``RankPlan`` towards the agents of the remote ranks it reads from (``peers``: rank ->
    agent name): each read posts one NIXL transfer per source. Every table's extents are
    checked against registered memory when it is made, as ``Reader`` does; pieces that
    continue one another go as one descriptor of up to ``max_descriptor_bytes`` (None: one
    per piece), within the memory NIXL says one descriptor may span (``merge_domains``)."""

    def __init__(
        self,
        agent: Agent,
        plan: RankPlan,
        peers: Mapping[int, str],
        *,
        max_descriptor_bytes: int | None = MAX_DESCRIPTOR_BYTES,
    ) -> None:
        check_descriptor_bound(max_descriptor_bytes)
        if not isinstance(plan, RankPlan) or not isinstance(peers, Mapping):
            raise ArgumentError(
                f"a RankReader takes a RankPlan (plan_ranks') and a mapping of rank to peer, got "
                f"{type(plan).__name__} and {type(peers).__name__}"
            )
        self.agent = agent
        self.plan = plan
        missing = [s.rank for s in plan.sources if s.rank not in peers]
        if missing:
            raise LayoutError(f"no agent for remote rank(s) {missing}")
        self.peers = {s.rank: peers[s.rank] for s in plan.sources}
        for peer in self.peers.values():
            check_peer_name(peer)
        self.descriptors = 0  # rows posted so far, a side
        check_registered(agent, plan.local, None)
        for source in plan.sources:
            check_registered(agent, plan.remotes[source.rank], self.peers[source.rank])
        self.max_descriptor_bytes = max_descriptor_bytes
        self.domains: dict[int, list[Domains]] = {}
        if max_descriptor_bytes is not None:
            # One count of refused probes per owner: the parts are as many as a peer's block size makes them.
            mine = Probes()
            for source in plan.sources:
                theirs = Probes()
                self.domains[source.rank] = [
                    (
                        merge_domains(agent.nixl, NIXL_LOCAL_AGENT, part.plan.local, mine),
                        merge_domains(agent.nixl, self.peers[source.rank], part.plan.remote, theirs),
                    )
                    for part in source.parts
                ]

    def read(self, local_ids: Ids, remote_ids: Ids) -> list[Transfer]:
        """Start pulling the request's ``remote_ids`` of every source into ``local_ids``."""
        return self.read_batch([(local_ids, remote_ids)])

    def read_batch(self, requests: Sequence[tuple[Ids, Ids]]) -> list[Transfer]:
        """Start pulling several requests (``(local_ids, remote_ids)`` each): one transfer per
        source for the whole batch, planned at once (``RankPlan.batch_rows``) before any is
        posted."""
        self.agent.check_memory()
        return self._post(self._planned(self.plan.batch_rows, requests))

    def read_layers(self, requests: Sequence[tuple[Ids, Ids]], *, timeout: float) -> Iterator[str]:
        """Pull several requests layer by layer, as ``Reader.read_layers`` does: yields each
        local layer's name once every source's transfer of it has landed (within
        ``timeout`` seconds of the wait for it), the next layer's already posted. Every
        source's rows of every layer (``RankPlan.layer_rows``) are planned, and so the batch
        checked, before the first is posted; leaving the loop early releases the transfers
        in flight (a TransferError names those still in flight, which cannot be)."""
        seconds = check_seconds(timeout, "RankReader.read_layers timeout")
        self.agent.check_memory()
        rows = self._planned(self.plan.layer_rows, requests)
        names = list(next(iter(rows.values())))  # every source moves every layer
        return layer_by_layer(lambda name: self._post({rank: rows[rank][name] for rank in rows}), names, seconds)

    def _planned(self, rows_of: Callable[..., T], requests: Sequence[tuple[Ids, Ids]]) -> dict[int, T]:
        """``rows_of`` (``RankPlan.batch_rows`` or ``layer_rows``) of every source, by rank,
        with this reader's bound and merge domains."""
        return {
            source.rank: rows_of(
                source, requests, max_bytes=self.max_descriptor_bytes, domains=self.domains.get(source.rank)
            )
            for source in self.plan.sources
        }

    def _post(self, rows: Mapping[int, Rows]) -> list[Transfer]:
        """One transfer per source rank of ``rows``; where one cannot be posted, those posted
        before it are released."""
        return post_all(partial(self._post_rank, rank, *rank_rows) for rank, rank_rows in rows.items())

    def _post_rank(self, rank: int, local_rows: np.ndarray, remote_rows: np.ndarray) -> list[Transfer]:
        """One transfer from source ``rank``, its descriptors counted."""
        self.descriptors += local_rows.shape[0]
        memory = (self.plan.local.memory, self.plan.remotes[rank].memory)
        return [post_rows(self.agent, self.peers[rank], "READ", local_rows, remote_rows, memory)]
