"""Tensor parallelism either way (kvhost.nixl.ranks): descriptors of several remote ranks into one local rank.

Every remote rank's cache is filled at random; each local rank's descriptor rows are moved
with ``memmove`` (what NIXL does with each pair), then ``kvhost.receive`` with the remote
order and block size must leave, in the local rank's blocks, the tokens of exactly its
heads, gathered from the remote ranks that hold them; no other block is written. The same
plans over real NIXL between processes are in test_xpyd.py.
"""

from __future__ import annotations

import contextlib
import dataclasses
import re
import time
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from test_ids import Liar as IdLiar
from test_nixl import (
    LOCAL_IDS,
    LOCAL_RUNS,
    REMOTE_IDS,
    REMOTE_RUNS,
    memmove_rows,
    needs_nixl,
    row_pairs,
    split_batch,
    untouched_blocks_same,
)

import kvhost
from kvhost.caches import CacheSet
from kvhost.errors import LayoutError, RequestError
from kvhost.nixl import RegionTable, Stream, ranks, region_table
from kvhost.nixl.ranks import HeadShare, head_shares, latent_source, plan_ranks
from kvhost.testing import block_letters, fill_random, make_cache, raw, read_tokens

# name: (axes, memory order). Head-major, token-major, K inside the block, heads as streams.
LAYOUTS = {
    "HND": ("KBNHC", "KBHNC"),
    "NHD": ("KBNHC", "KBNHC"),
    "blockfirst-NHD": ("BKNHC", "BKNHC"),
    "blockfirst-HND": ("BKNHC", "BKHNC"),
    "heads-outer": ("KBNHC", "KHBNC"),
    "blockfirst-heads-outer": ("BKNHC", "HBKNC"),
}
PAIRS = [
    ("HND", "NHD"),
    ("NHD", "NHD"),
    ("NHD", "HND"),
    ("HND", "HND"),
    ("blockfirst-NHD", "blockfirst-HND"),
    ("heads-outer", "heads-outer"),
]
# (remote block size, local block size, remote blocks in the request)
SIZES = {"r4": (4, 16, 7), "same": (8, 8, 3), "g2": (16, 8, 3), "g4": (32, 8, 2)}
# (remote TP, local TP) over 4 KV heads
TPS = [(1, 1), (2, 1), (4, 1), (4, 2), (2, 4), (1, 2), (1, 4)]
HEADS, CHANNELS = 4, 4


def engine_caches(axes, memory, heads, block_size, blocks, seed, layers=2, channels=CHANNELS):
    sizes = {"K": 2, "H": heads, "C": channels, "N": block_size, "B": blocks}
    return {
        f"l{i}": fill_random(make_cache(axes, memory, {a: sizes[a] for a in memory}), seed + i) for i in range(layers)
    }


def check_rank(local, axes, plan, local_ids, remote_caches, remote_ids, tokens, share_of):
    """The local rank's tokens are its heads' tokens, gathered from the remote ranks in head order."""
    for name in local:
        layout = CacheSet(local, axes).members[0].layout
        got = read_tokens(local[name], layout, local_ids)[:tokens]
        parts = []
        for source in plan.sources:
            remote = remote_caches[source.rank][name]
            remote_layout = CacheSet(remote_caches[source.rank], axes).members[0].layout
            truth = read_tokens(remote, remote_layout, remote_ids)
            h = 1 + block_letters(remote_layout).index("H")
            parts.append(truth.narrow(h, *share_of(source)))
        want = torch.cat(parts, dim=1 + block_letters(layout).index("H"))
        assert torch.equal(got, want), f"{name}: tokens differ from the remote ranks' heads"


@pytest.mark.parametrize("merge", [None, 1 << 40], ids=["per-piece", "merged"])
@pytest.mark.parametrize("tp", TPS, ids=lambda tp: f"P{tp[0]}D{tp[1]}")
@pytest.mark.parametrize("sizes_name", SIZES)
@pytest.mark.parametrize("pair", PAIRS, ids="->".join)
def test_every_local_rank_gets_its_heads_from_the_remote_ranks(pair, sizes_name, tp, merge):
    check_every_local_rank(pair, sizes_name, tp, merge, HEADS)


# 6 KV heads: shares of 2 and 3 heads, whose byte runs start inside a local region and cross its end.
@pytest.mark.parametrize("tp", [(3, 2), (2, 3), (6, 2), (2, 6), (3, 1)], ids=lambda tp: f"P{tp[0]}D{tp[1]}")
@pytest.mark.parametrize("sizes_name", SIZES)
@pytest.mark.parametrize("pair", [("HND", "NHD"), ("NHD", "HND"), ("heads-outer", "heads-outer")], ids="->".join)
def test_six_heads_shared_unevenly_across_ranks(pair, sizes_name, tp):
    check_every_local_rank(pair, sizes_name, tp, None, 6)


# Per-head streams on one side, head-major blocks or blocks of one head on the other: read
# head by head. Token-major blocks feed per-head streams only from ranks of one head (P4).
HEAD_BY_HEAD = [
    (pair, tp)
    for pair in (("HND", "heads-outer"), ("heads-outer", "NHD"), ("heads-outer", "HND"), ("NHD", "heads-outer"))
    for tp in ([*TPS, (4, 4)] if pair[0] != "NHD" else [(4, 1), (4, 2), (4, 4)])
]


@pytest.mark.parametrize("merge", [None, 1 << 40], ids=["per-piece", "merged"])
@pytest.mark.parametrize("sizes_name", SIZES)
@pytest.mark.parametrize(
    ("pair", "tp"), HEAD_BY_HEAD, ids=[f"{'->'.join(p)}-P{tp[0]}D{tp[1]}" for p, tp in HEAD_BY_HEAD]
)
def test_per_head_streams_pair_with_head_major_blocks_and_blocks_of_one_head(pair, sizes_name, tp, merge):
    check_every_local_rank(pair, sizes_name, tp, merge, HEADS)


# K inside the block: a head's region is KNC, whose r (or g) sub-blocks make no region of another
# block size; so a local region of several heads takes per-head streams at equal block sizes only.
K_INSIDE = [
    (("blockfirst-heads-outer", local), "same", tp) for local in ("blockfirst-NHD", "blockfirst-HND") for tp in TPS
] + [
    ((remote, "blockfirst-heads-outer"), sizes, tp)
    for remote in ("blockfirst-NHD", "blockfirst-HND")
    for sizes in SIZES
    for tp in [(4, 1), (4, 2), (4, 4)]
]


@pytest.mark.parametrize(
    ("pair", "sizes_name", "tp"), K_INSIDE, ids=[f"{'->'.join(p)}-{n}-P{t[0]}D{t[1]}" for p, n, t in K_INSIDE]
)
def test_per_head_streams_with_k_inside_the_block(pair, sizes_name, tp):
    check_every_local_rank(pair, sizes_name, tp, 1 << 40, HEADS)


def check_every_local_rank(pair, sizes_name, tp, merge, heads):
    remote_name, local_name = pair
    axes, remote_memory = LAYOUTS[remote_name]
    local_axes, local_memory = LAYOUTS[local_name]
    assert axes == local_axes
    remote_size, local_size, count = SIZES[sizes_name]
    remote_tp, local_tp = tp
    remote_caches = [
        engine_caches(axes, remote_memory, heads // remote_tp, remote_size, 16, seed=10 * q) for q in range(remote_tp)
    ]
    remote_tables = [region_table(c, axes) for c in remote_caches]
    # Merged descriptors on ids in runs (where pieces continue one another), per piece on scattered ones.
    all_local, all_remote = (LOCAL_IDS, REMOTE_IDS) if merge is None else (LOCAL_RUNS, REMOTE_RUNS)
    remote_ids = all_remote[:count]
    tokens = count * remote_size
    for rank in range(local_tp):
        local = engine_caches(axes, local_memory, heads // local_tp, local_size, 24, seed=100 + rank)
        before = {name: raw(t).clone() for name, t in local.items()}
        plan = plan_ranks(region_table(local, axes), rank, local_tp, remote_tables)
        local_ids = all_local[: plan.local_blocks_for(count)]
        moved = 0
        for source in plan.sources:
            local_rows, remote_rows = plan.rows(source, local_ids, remote_ids, max_bytes=merge)
            if merge is not None:
                assert local_rows.shape[0] <= plan.rows(source, local_ids, remote_ids)[0].shape[0]
            memmove_rows(local_rows, remote_rows)
            moved += int(local_rows[:, 1].sum())
        # Only this rank's heads move: tokens x heads x C x K x 2 layers x 2 bytes.
        assert moved == plan.bytes_for(count) == tokens * (heads // local_tp) * CHANNELS * 2 * 2 * 2
        assert {s.rank for s in plan.sources} == {s.remote_rank for s in head_shares(rank, local_tp, remote_tp, heads)}
        kvhost.receive(
            local, {"x": local_ids}, axes=axes, remote_order=plan.remote_order, remote_block_size=plan.remote_block_size
        )
        check_rank(
            local,
            axes,
            plan,
            local_ids,
            remote_caches,
            remote_ids,
            tokens,
            lambda s: (s.share.remote_first, s.share.count),
        )
        for name, tensor in local.items():
            assert untouched_blocks_same(tensor, before[name], CacheSet(local, axes).members[0].layout, local_ids)


@pytest.mark.parametrize("merge", [None, 3, 1 << 40], ids=["per-piece", "merged-3", "merged"])
@pytest.mark.parametrize("tp", TPS, ids=lambda tp: f"P{tp[0]}D{tp[1]}")
@pytest.mark.parametrize("sizes_name", SIZES)
@pytest.mark.parametrize("pair", PAIRS, ids="->".join)
def test_a_batch_of_requests_gets_each_requests_own_rows(pair, sizes_name, tp, merge):
    """``batch_rows`` of several requests (r or g phases, partial local blocks) are each
    request's ``rows`` back to back, for every source of every local rank; a batch naming one
    local block twice is refused."""
    remote_name, local_name = pair
    axes, remote_memory = LAYOUTS[remote_name]
    _, local_memory = LAYOUTS[local_name]
    remote_size, local_size, _ = SIZES[sizes_name]
    remote_tp, local_tp = tp
    remote_tables = [
        region_table(engine_caches(axes, remote_memory, HEADS // remote_tp, remote_size, 16, seed=q), axes)
        for q in range(remote_tp)
    ]
    for rank in range(local_tp):
        local = engine_caches(axes, local_memory, HEADS // local_tp, local_size, 80, seed=100 + rank)
        plan = plan_ranks(region_table(local, axes), rank, local_tp, remote_tables)
        requests = split_batch(plan, [3, 1, 5, 2], 80, 16, seed=rank + len(sizes_name))
        max_bytes = merge * plan.sources[0].parts[0].plan.chunk_bytes if merge == 3 else merge
        for source in plan.sources:
            alone = [plan.rows(source, *request, max_bytes=max_bytes) for request in requests]
            want = (np.concatenate([rows for rows, _ in alone]), np.concatenate([rows for _, rows in alone]))
            assert row_pairs(plan.batch_rows(source, requests, max_bytes=max_bytes)) == row_pairs(want)
            with pytest.raises(RequestError, match="same local block"):
                plan.batch_rows(source, [requests[0], requests[0]], max_bytes=max_bytes)
            check_layer_rows(plan, source, requests, max_bytes, local)


def check_layer_rows(plan, source, requests, max_bytes, local):
    """``layer_rows``: one entry per local layer in order, each row inside its layer's tensor,
    and together the batch's rows (layers apart in memory merge nothing across each other)."""
    layers = plan.layer_rows(source, requests, max_bytes=max_bytes)
    assert list(layers) == list(local)
    for name, (local_rows, _) in layers.items():
        start = raw(local[name]).data_ptr()
        end = start + raw(local[name]).nbytes
        assert (local_rows[:, 0] >= start).all() and (local_rows[:, 0] + local_rows[:, 1] <= end).all(), name
    together = (np.concatenate([r for r, _ in layers.values()]), np.concatenate([r for _, r in layers.values()]))
    assert row_pairs(together) == row_pairs(plan.batch_rows(source, requests, max_bytes=max_bytes))
    with pytest.raises(RequestError, match="same local block"):
        plan.layer_rows(source, [requests[0], requests[0]], max_bytes=max_bytes)


@pytest.mark.parametrize("tp", [(1, 2), (2, 1), (2, 4), (4, 2)], ids=lambda tp: f"P{tp[0]}D{tp[1]}")
@pytest.mark.parametrize("sizes_name", ["r4", "g2"])
def test_an_mla_latent_is_read_once_from_one_remote_rank(sizes_name, tp):
    remote_size, local_size, count = SIZES[sizes_name]
    remote_tp, local_tp = tp
    # Every remote rank holds the same latent.
    remote_caches = [
        {f"l{i}": fill_random(make_cache("BNC", "BNC", dict(B=16, N=remote_size, C=12)), 7 + i) for i in range(2)}
        for _ in range(remote_tp)
    ]
    remote_tables = [region_table(c, "BNC") for c in remote_caches]
    readers = []
    for rank in range(local_tp):
        local = {
            f"l{i}": fill_random(make_cache("BNC", "BNC", dict(B=24, N=local_size, C=12)), 50 + i) for i in range(2)
        }
        plan = plan_ranks(region_table(local, "BNC"), rank, local_tp, remote_tables)
        assert [s.rank for s in plan.sources] == [latent_source(rank, local_tp, remote_tp)]
        readers.append(plan.sources[0].rank)
        local_ids = LOCAL_IDS[: plan.local_blocks_for(count)]
        local_rows, remote_rows = plan.rows(plan.sources[0], local_ids, REMOTE_IDS[:count])
        memmove_rows(local_rows, remote_rows)
        assert int(local_rows[:, 1].sum()) == count * remote_size * 12 * 2 * 2  # the latent once
        layout = CacheSet(local, "BNC").members[0].layout
        for name in local:
            got = read_tokens(local[name], layout, local_ids)[: count * remote_size]
            assert torch.equal(got, read_tokens(remote_caches[0][name], layout, REMOTE_IDS[:count]))
    assert set(readers) == set(range(min(remote_tp, local_tp)))  # spread over the remote ranks


@pytest.mark.parametrize("remote_memory", ["BKNC", "KBNC"])
@pytest.mark.parametrize("sizes_name", ["r4", "g2"])
def test_an_mla_latent_with_a_k_of_size_1_is_read_into_a_cache_without_k(sizes_name, remote_memory):
    """A sender whose latent carries a K of size 1 (inside its blocks or outside) and a
    receiver whose cache has no K: the handshake's engine check accepts them, and so must the
    plan; the order ``kvhost.receive`` is told names no K (it would refuse a letter the cache lacks)."""
    remote_size, local_size, count = SIZES[sizes_name]
    sizes = dict(K=1, B=16, N=remote_size, C=12)
    remote = {f"l{i}": fill_random(make_cache("KBNC", remote_memory, sizes), 7 + i) for i in range(2)}
    local = {f"l{i}": fill_random(make_cache("BNC", "BNC", dict(B=24, N=local_size, C=12)), 50 + i) for i in range(2)}
    before = {name: raw(t).clone() for name, t in local.items()}
    plan = plan_ranks(region_table(local, "BNC"), 0, 1, [region_table(remote, "KBNC")])
    assert plan.remote_order == "NC"
    local_ids = LOCAL_IDS[: plan.local_blocks_for(count)]
    memmove_rows(*plan.rows(plan.sources[0], local_ids, REMOTE_IDS[:count]))
    kvhost.receive(local, {"x": local_ids}, axes="BNC", remote_order=plan.remote_order, remote_block_size=remote_size)
    remote_layout = CacheSet(remote, "KBNC").members[0].layout
    layout = CacheSet(local, "BNC").members[0].layout
    for name in local:
        got = read_tokens(local[name], layout, local_ids)[: count * remote_size]
        assert torch.equal(got, read_tokens(remote[name], remote_layout, REMOTE_IDS[:count]).reshape(got.shape))
        assert untouched_blocks_same(local[name], before[name], layout, local_ids)


def test_head_shares_cover_every_head_once():
    for remote_tp in (1, 2, 4, 8):
        for local_tp in (1, 2, 4, 8):
            covered = []
            for rank in range(local_tp):
                shares = head_shares(rank, local_tp, remote_tp, 8)
                assert sum(s.count for s in shares) == 8 // local_tp
                covered += [
                    s.remote_rank * (8 // remote_tp) + s.remote_first + i for s in shares for i in range(s.count)
                ]
            assert covered == list(range(8))
    assert head_shares(1, 2, 4, 8) == [HeadShare(2, 0, 0, 2), HeadShare(3, 2, 0, 2)]
    assert head_shares(3, 4, 2, 8) == [HeadShare(1, 0, 2, 2)]
    with pytest.raises(LayoutError, match="cannot be shared evenly"):
        head_shares(0, 3, 1, 8)


def test_ranks_that_do_not_match_are_refused():
    caches = engine_caches("KBNHC", "KBHNC", 2, 8, 4, seed=1)
    table = region_table(caches, "KBNHC")
    with pytest.raises(LayoutError, match="not the same KV heads"):
        plan_ranks(table, 0, 1, [table, table])  # 2 heads locally, 2 x 2 remotely
    mla = region_table({"l0": make_cache("BNC", "BNC", dict(B=4, N=8, C=4))}, "BNC")
    with pytest.raises(LayoutError, match="heads"):
        plan_ranks(table, 0, 1, [mla])
    odd = region_table(engine_caches("KBNHC", "KBHNC", 2, 12, 4, seed=1), "KBNHC")
    with pytest.raises(LayoutError, match="do not divide"):
        plan_ranks(table, 0, 1, [odd])


def test_a_gather_costs_one_descriptor_per_remote_block_and_stream_when_heads_lead():
    """Head-major senders give each local rank one run per remote block from each remote rank."""
    remote_tables = [region_table(engine_caches("KBNHC", "KBHNC", 1, 16, 8, seed=q), "KBNHC") for q in range(4)]
    local = region_table(engine_caches("KBNHC", "KBNHC", 4, 64, 8, seed=9), "KBNHC")
    plan = plan_ranks(local, 0, 1, remote_tables)
    assert len(plan.sources) == 4
    rows = [plan.rows(s, [3], [0, 1, 2, 3])[0] for s in plan.sources]
    streams = len(local.streams)
    assert [r.shape[0] for r in rows] == [4 * streams] * 4
    assert np.unique(np.concatenate(rows)[:, 0]).size == 16 * streams  # no byte written twice


def test_ranks_and_tp_out_of_range_are_refused():
    for local_rank, local_tp, remote_tp in ((0, 0, 1), (0, 1, 0), (0, -2, 1), (0, 1, -2), (0, 2048, 1), (0, 1, 2048)):
        with pytest.raises(LayoutError, match=r"TP -?[0-9]+: an engine has 1 to 1024 ranks"):
            head_shares(local_rank, local_tp, remote_tp, 1 << 16)
    with pytest.raises(LayoutError, match="TP 3"):
        head_shares(0, 3, 1, 8)  # in range, but not a divisor of the heads
    assert len(head_shares(0, 1, 1024, 1 << 16)) == 1024 and len(head_shares(0, 1024, 1, 1 << 16)) == 1
    assert head_shares(0, 1, 1, 1) == [HeadShare(0, 0, 0, 1)]  # one head: the least an engine has
    for heads in (0, -8, (1 << 16) + 1024, 1 << 40):  # the last made a share per rank, unbounded
        with pytest.raises(LayoutError, match="KV heads: an engine has 1 to 65536"):
            head_shares(0, 1, 1024, heads)
    for local_rank in (-1, 2, 3):
        with pytest.raises(LayoutError, match=f"local rank {local_rank} is not one of 2 ranks"):
            head_shares(local_rank, 2, 1, 8)
        with pytest.raises(LayoutError, match=f"local rank {local_rank} of 2"):
            latent_source(local_rank, 2, 1)
    for remote_tp in (0, -1):
        with pytest.raises(LayoutError, match=f"remote TP {remote_tp}"):
            latent_source(0, 2, remote_tp)
    assert [latent_source(rank, 4, 2) for rank in range(4)] == [0, 1, 0, 1]
    assert [latent_source(rank, 2, 4) for rank in range(2)] == [0, 1]


@pytest.mark.parametrize(
    ("call", "name", "value"),
    [
        (lambda v: head_shares(v, 2, 1, 8), "local_rank", True),
        (lambda v: head_shares(0, v, 1, 8), "local_tp", 2.0),
        (lambda v: head_shares(0, 2, v, 8), "remote_tp", np.float32(1)),
        (lambda v: head_shares(0, 2, 1, v), "kv_heads", "8"),
        (lambda v: latent_source(v, 2, 1), "local_rank", False),
        (lambda v: latent_source(0, v, 1), "local_tp", 2.5),
        (lambda v: plan_ranks(decode_table("KBNHC", 4), v, 2, peer_tables("HNC", 8, 16, 1)), "local_rank", True),
    ],
    ids=["bool rank", "float TP", "numpy float TP", "heads as text", "latent bool rank", "latent float TP", "plan"],
)
def test_ranks_and_sizes_that_are_not_ints_are_refused_naming_them(call, name, value):
    """``True`` is not rank 1 and ``2.0`` is no TP size: refused as what they are, never
    counted nor left to a TypeError of Python's."""
    with pytest.raises(LayoutError, match=re.escape(f"{name} must be an int, got {value!r} ({type(value).__name__})")):
        call(value)
    assert head_shares(np.int64(1), np.int32(2), 1, 8) == [HeadShare(0, 0, 4, 4)]  # numpy ints are ints


class Liar(IdLiar):
    """test_ids' int whose comparisons, hash and ``__index__`` lie, its arithmetic too."""

    def __mod__(self, other):
        return 0

    def __floordiv__(self, other):
        return 0


def test_an_int_subclass_counts_by_its_own_value_not_its_methods():
    """A rank or size given as an int subclass is read as the number it holds: its own
    comparisons would have let rank 5 of 2 through, its ``%`` any head count."""
    with pytest.raises(LayoutError, match="local rank 5 is not one of 2 ranks"):
        head_shares(Liar(5), 2, 1, 8)
    with pytest.raises(LayoutError, match="7 KV heads cannot be shared evenly by local TP 2"):
        head_shares(0, 2, 1, Liar(7))
    with pytest.raises(LayoutError, match="local rank 3 of 2, remote TP 1"):
        latent_source(Liar(3), 2, 1)
    shares = head_shares(Liar(1), Liar(2), Liar(1), Liar(8))
    assert shares == [HeadShare(0, 0, 4, 4)]
    assert all(type(value) is int for share in shares for value in vars(share).values())
    assert type(latent_source(Liar(1), 2, Liar(2))) is int


@pytest.mark.parametrize("sizes_name", SIZES)
def test_a_plan_knows_r_g_and_the_remote_order(sizes_name):
    remote_size, local_size, _ = SIZES[sizes_name]
    remote = [region_table(engine_caches("KBNHC", "KBHNC", 2, remote_size, 4, seed=q), "KBNHC") for q in range(2)]
    plan = plan_ranks(region_table(engine_caches("KBNHC", "KBNHC", 4, local_size, 4, seed=5), "KBNHC"), 0, 1, remote)
    assert (plan.r, plan.g) == (max(local_size // remote_size, 1), max(remote_size // local_size, 1))
    assert (plan.remote_order, plan.remote_block_size) == ("HNC", remote_size)
    assert plan.local_blocks_for(5) == (5 * plan.g if plan.g > 1 else -(-5 // plan.r))


def test_whole_regions_and_head_major_shares_take_one_plan_per_source():
    """Equal TP moves whole regions; a local rank holding a share of a head-major sender's
    heads reads one run per block; only what is left needs byte windows (a plan per placement)."""
    head_major = [region_table(engine_caches("KBNHC", "KBHNC", 4, 16, 4, seed=1), "KBNHC")]
    local = region_table(engine_caches("KBNHC", "KBNHC", 4, 16, 4, seed=2), "KBNHC")
    assert [len(s.parts) for s in plan_ranks(local, 0, 1, head_major).sources] == [1]
    token_major_whole = [region_table(engine_caches("KBNHC", "KBNHC", 4, 16, 4, seed=5), "KBNHC")]
    equal = plan_ranks(local, 0, 1, token_major_whole)
    (source,) = equal.sources
    rows = equal.rows(source, [0, 1], [2, 3])[0]  # a row per block and stream, not per token
    assert len(source.parts) == 1 and rows.shape[0] == 2 * len(local.streams)
    half = region_table(engine_caches("KBNHC", "KBNHC", 2, 64, 4, seed=3), "KBNHC")
    (source,) = plan_ranks(half, 1, 2, head_major).sources
    assert len(source.parts) == 1 and source.parts[0].phase is None
    assert source.share == HeadShare(0, 0, 2, 2)
    token_major = [region_table(engine_caches("KBNHC", "KBNHC", 4, 16, 4, seed=4), "KBNHC")]
    (source,) = plan_ranks(half, 1, 2, token_major).sources
    assert len(source.parts) == 4 and [p.phase for p in source.parts] == [0, 1, 2, 3]  # r = 4 sub-blocks


def test_merged_rows_of_runs_are_fewer_and_a_domain_of_minus_one_merges_nothing():
    """Equal TP: whole regions, and consecutive blocks continue one another on both sides
    (in one batch, and layer by layer)."""
    remote = [region_table(engine_caches("KBNHC", "KBHNC", 4, 16, 16, seed=1), "KBNHC")]
    plan = plan_ranks(region_table(engine_caches("KBNHC", "KBNHC", 4, 16, 16, seed=7), "KBNHC"), 0, 1, remote)
    local_ids, remote_ids = list(range(3, 9)), list(range(8, 14))  # whole regions, runs on both sides
    for source in plan.sources:
        per_piece = plan.rows(source, local_ids, remote_ids)[0]
        merged = plan.rows(source, local_ids, remote_ids, max_bytes=1 << 40)[0]
        assert merged.shape[0] < per_piece.shape[0] and merged[:, 1].sum() == per_piece[:, 1].sum()
        # Memory NIXL registered block by block (-1 on both sides): no descriptor may span two blocks.
        apart = [
            (np.full(len(p.plan.local.streams), -1), np.full(len(p.plan.remote.streams), -1)) for p in source.parts
        ]
        kept = plan.rows(source, local_ids, remote_ids, max_bytes=1 << 40, domains=apart)[0]
        assert np.array_equal(np.sort(kept, axis=0), np.sort(per_piece, axis=0))
        layers = plan.layer_rows(source, [(local_ids, remote_ids)], max_bytes=1 << 40, domains=apart)
        kept = np.concatenate([rows for rows, _ in layers.values()])
        assert np.array_equal(np.sort(kept, axis=0), np.sort(per_piece, axis=0))


def test_a_remote_id_beyond_the_smallest_remote_rank_is_refused():
    remote = [
        region_table(engine_caches("KBNHC", "KBHNC", 2, 16, blocks, seed=q), "KBNHC")
        for q, blocks in enumerate((16, 12))
    ]
    plan = plan_ranks(region_table(engine_caches("KBNHC", "KBNHC", 4, 16, 16, seed=7), "KBNHC"), 0, 1, remote)
    assert plan.remote_block_count == 12
    plan.rows(plan.sources[1], [0], [11])
    for source in plan.sources:
        with pytest.raises(RequestError, match="12"):
            plan.rows(source, [0], [12])


def test_a_rank_batch_refusal_names_the_request_and_the_block():
    """``RankPlan.batch_rows`` and ``layer_rows`` name the request at fault by its index in
    the batch, and a local block named twice with both requests."""
    remote = [region_table(engine_caches("KBNHC", "KBHNC", 2, 16, 8, seed=q), "KBNHC") for q in range(2)]
    plan = plan_ranks(region_table(engine_caches("KBNHC", "KBNHC", 4, 16, 8, seed=7), "KBNHC"), 0, 1, remote)
    for rows_of in (plan.batch_rows, plan.layer_rows):
        with pytest.raises(RequestError) as refused:
            rows_of(plan.sources[0], [([0, 1], [0, 1]), ([2], [2]), ([3, 1], [3, 4])])
        assert str(refused.value) == (
            "requests 0 and 2 of one transfer name the same local block 1: it would be written twice"
        )
        with pytest.raises(RequestError) as refused:
            rows_of(plan.sources[1], [([0], [0]), ([1], [8])])
        assert str(refused.value) == "request 1 of 2: remote_ids: block id 8 at position 0 is out of range [0, 8)"


def test_tables_that_cannot_share_heads_are_refused_naming_why():
    def table(memory, heads, block_size, channels=CHANNELS, axes="KBNHC"):
        return region_table(
            engine_caches(axes, memory, heads, block_size, 4, seed=0, layers=1, channels=channels), axes
        )

    local = table("KBNHC", 2, 8)
    with pytest.raises(LayoutError, match="no remote ranks"):
        plan_ranks(local, 0, 2, [])
    differs = re.escape("remote rank 1's table differs from rank 0's in sizes: {")
    with pytest.raises(LayoutError, match=differs) as refused:
        plan_ranks(local, 0, 2, [table("KBHNC", 4, 8), table("KBHNC", 4, 16)])
    assert "'N': 16" in str(refused.value) and "'N': 8" in str(refused.value)
    head_major = table("KBHNC", 2, 8)
    with pytest.raises(LayoutError, match="remote rank 2's table differs from rank 0's in order: 'NHC' against 'HNC'"):
        plan_ranks(local, 0, 1, [head_major, head_major, table("KBNHC", 2, 8), head_major])
    # Shares of heads go through byte windows, where the tables' block sizes no longer show.
    for remote_memory in ("KBHNC", "KBNHC"):  # a head-major share is one run; a token-major one, byte windows
        with pytest.raises(LayoutError, match=r"block sizes 8 \(local\) and 12 \(remote\) do not divide"):
            plan_ranks(local, 0, 2, [table(remote_memory, 4, 12)])
    # Per-head streams against token-major blocks of several heads: a head is no run of its own.
    with pytest.raises(
        LayoutError,
        match="heads are streams on one side only, and the remote's 'NHC' blocks of 2 heads do not hold each head",
    ):
        plan_ranks(table("KHBNC", 4, 8), 0, 1, [table("KBNHC", 2, 8)] * 2)
    k_inside = re.escape(
        "heads are streams on one side only, and a head's 'KNC' sub-blocks, whose tokens do not lead, "
        "make no block of 16 tokens from blocks of 8"
    )
    with pytest.raises(LayoutError, match=k_inside):
        plan_ranks(table("BKNHC", 2, 16, axes="BKNHC"), 0, 2, [table("HBKNC", 4, 8, axes="BKNHC")])
    with pytest.raises(LayoutError, match="token-run tables are not shared out by heads"):
        plan_ranks(table("KBHNC", 2, 8).token_runs(), 0, 2, [table("KBNHC", 1, 8)] * 4)
    with pytest.raises(LayoutError, match="differ beyond N and H"):
        plan_ranks(local, 0, 2, [table("KBNHC", 4, 8, channels=2 * CHANNELS)])
    # Tables made by hand are held to what a peer's must be (RegionTable.from_dict's checks).
    with pytest.raises(LayoutError, match="the remote rank 1's table has no streams"):
        plan_ranks(local, 0, 1, [head_major, dataclasses.replace(head_major, streams=())])
    with pytest.raises(LayoutError, match="the local's table has no streams"):
        plan_ranks(dataclasses.replace(local, streams=()), 0, 1, [head_major] * 2)
    per_head = table("KHBNC", 2, 8)
    with pytest.raises(
        LayoutError, match="remote rank 1's table differs from rank 0's in coordinates: 'KH' against 'K'"
    ):
        plan_ranks(
            local,
            0,
            1,
            [dataclasses.replace(head_major, order="NC"), dataclasses.replace(per_head, sizes=head_major.sizes)],
        )
    with pytest.raises(LayoutError, match="hold different letters"):
        plan_ranks(table("BKNHC", 2, 8, axes="BKNHC"), 0, 2, [table("KBNHC", 4, 8)])
    with pytest.raises(LayoutError, match="token-run tables are not shared out by heads"):
        plan_ranks(table("BKNHC", 2, 8, axes="BKNHC").token_runs(), 0, 2, [table("BKNHC", 4, 8, axes="BKNHC")])


def peer_tables(order, heads, block_size, tp, layers=2, channels=8):
    """A peer's rank tables as they arrive (bf16, K and V per layer, one block each, streams
    at made-up addresses): planning never touches the memory, so any block size is cheap."""
    run = block_size * heads * channels * 2
    sizes = {"K": 2, "N": block_size, "H": heads, "C": channels}
    return [
        RegionTable(
            "DRAM",
            0,
            order,
            "",
            sizes,
            2,
            1,
            tuple(
                Stream(f"l{layer}", (("K", k),), (1 << 40) + ((rank * layers + layer) * 2 + k) * run, run)
                for layer in range(layers)
                for k in range(2)
            ),
        )
        for rank in range(tp)
    ]


def decode_table(memory, heads, blocks=8):
    """A decode rank's table of bf16 blocks of 16 tokens, 8 channels, two layers; ``blocks``
    declared (a table of more blocks than the test allocates: planning reads none)."""
    caches = {f"l{i}": make_cache("KBNHC", memory, dict(K=2, B=8, N=16, H=heads, C=8)) for i in range(2)}
    return dataclasses.replace(region_table(caches, "KBNHC"), num_blocks=blocks)


def window_streams(plan):
    return sum(len(part.plan.local.streams) for source in plan.sources for part in source.parts)


@pytest.mark.timeout(20)  # before the bound, the first of these took minutes and gigabytes
@pytest.mark.parametrize(
    ("memory", "order", "local_tp", "remote_tp", "windows"),
    [("KBNHC", "NHC", 2, 1, "at least 16777216"), ("KBHNC", "HNC", 1, 2, "1048576")],
    ids=["token-major share", "head-major gather"],
)
def test_a_peer_block_size_that_needs_too_many_windows_is_refused_at_once(memory, order, local_tp, remote_tp, windows):
    """A peer's block of 2**24 tokens (what EngineSpec accepts) into blocks of 16, with heads
    shared across TP: one byte window per token (token-major) or per local block of the
    group (head-major), each of every stream. Counted from the sizes, and refused naming
    both block sizes, before any window is made."""
    local = decode_table(memory, 8 // local_tp, blocks=1 << 30)  # room for a group of 2**20 blocks
    remotes = peer_tables(order, 8 // remote_tp, 1 << 24, remote_tp)
    start = time.perf_counter()
    with pytest.raises(LayoutError) as refused:
        plan_ranks(local, 0, local_tp, remotes)
    assert time.perf_counter() - start < 0.5
    assert str(refused.value) == (
        f"remote blocks of 16777216 tokens into local blocks of 16 tokens: sharing the heads takes {windows} "
        f"byte windows of 4 streams, {int(windows.split()[-1]) * 4} streams a side, more than the 65536 a plan "
        "may hold"
    )


@pytest.mark.parametrize(
    ("memory", "order", "local_tp", "remote_tp", "remote_block", "placements", "counted"),
    [
        ("KBNHC", "NHC", 2, 1, 64, 64, "at least 64"),  # g = 4: a window per remote token, known from N
        ("KBNHC", "NHC", 2, 1, 16, 16, "16"),  # equal blocks: a window per token
        ("KBNHC", "NHC", 2, 1, 4, 16, "16"),  # r = 4: a window per remote token, per sub-block
        ("KBHNC", "HNC", 1, 2, 64, 4, "4"),  # g = 4 gathered: each source's run cut at two local blocks' ends
        ("KBNHC", "NHC", 1, 2, 32, 64, "at least 64"),  # g = 2 gathered token-major: a window per token and source
    ],
    ids=["token-major g4", "token-major equal", "token-major r4", "head-major gather g4", "token-major gather g2"],
)
def test_windows_are_counted_exactly_up_to_the_stream_budget(
    monkeypatch, memory, order, local_tp, remote_tp, remote_block, placements, counted
):
    """The count is what planning builds: at the budget the plan is made, one stream under it
    the same pair is refused, by the count from the sizes where that is reached ("at least",
    before any run is listed), else by the exact one."""
    local = decode_table(memory, 8 // local_tp)
    remotes = peer_tables(order, 8 // remote_tp, remote_block, remote_tp)
    monkeypatch.setattr(ranks, "MAX_STREAMS", placements * 4)
    plan = plan_ranks(local, 0, local_tp, remotes)
    assert window_streams(plan) == placements * 4
    monkeypatch.setattr(ranks, "MAX_STREAMS", placements * 4 - 1)
    with pytest.raises(LayoutError, match=f"takes {counted} byte windows of 4 streams, {placements * 4} streams"):
        plan_ranks(local, 0, local_tp, remotes)


def test_a_sender_of_one_head_per_rank_is_read_head_major_whatever_its_memory_order():
    """vLLM's default token-major cache with one KV head per prefill rank (TP = KV heads)
    holds the bytes of a head-major one: ``H`` of size 1 sits anywhere. Read as head-major,
    each remote rank's share is one run per block, as from a head-major sender, not one
    byte window per token (a peer's large blocks were refused past the stream budget); the
    tokens land right (``test_every_local_rank_gets_its_heads_from_the_remote_ranks``,
    P4D1 and P4D2 NHD->NHD)."""
    local = decode_table("KBNHC", 8)
    token_major, head_major = peer_tables("NHC", 1, 16, 8), peer_tables("HNC", 1, 16, 8)
    plans = [plan_ranks(local, 0, 1, remotes) for remotes in (token_major, head_major)]
    assert [plan.remote_order for plan in plans] == ["HNC", "HNC"]
    for plan in plans:  # a block: one run of each of the 4 streams from each of the 8 ranks
        assert window_streams(plan) == 8 * 4
        assert sum(plan.rows(source, [3], [0])[0].shape[0] for source in plan.sources) == 8 * 4
    # Equal TP shares nothing, and a token-major wire needs no post-process: left as it is.
    assert plan_ranks(decode_table("KBNHC", 1), 0, 8, token_major).remote_order == "NHC"
    # Blocks of 4096 tokens: a window per token would be 8 x 4096 x 4 streams, past the budget.
    local = decode_table("KBNHC", 8, blocks=1024)
    big = [plan_ranks(local, 0, 1, peer_tables(order, 1, 4096, 8)) for order in ("NHC", "HNC")]
    assert window_streams(big[0]) == window_streams(big[1]) < ranks.MAX_STREAMS
    for source, same in zip(big[0].sources, big[1].sources):  # the same rows, row by row
        for rows, same_rows in zip(big[0].rows(source, range(256), [0]), big[1].rows(same, range(256), [0])):
            assert np.array_equal(rows, same_rows)


def test_per_head_streams_read_one_head_ranks_one_run_per_head_and_block():
    """A decode cache whose heads lie outside its blocks (a stream per head) reads prefill
    ranks of one head each, token-major or head-major, as one run per head and block, and
    the other way round; the wire is then the local bytes (order ``NC``: no post-process).
    Head-major ranks of two heads give a run per head; token-major ones cannot be paired."""
    per_head = decode_table("KHBNC", 8)
    for order in ("NHC", "HNC"):
        plan = plan_ranks(per_head, 0, 1, peer_tables(order, 1, 16, 8))
        assert (plan.remote_order, plan.remote_block_size) == ("NC", 16)
        assert [s.rank for s in plan.sources] == list(range(8))
        # Each rank: its head's run in each of 2 layers x K/V, into that head's stream.
        assert [plan.rows(source, [3], [0])[0].shape[0] for source in plan.sources] == [4] * 8
        assert window_streams(plan) == 8 * 4
    one_head = decode_table("KBNHC", 1)
    for rank in (0, 5):  # the other way: a one-head decode rank picks its head's streams
        plan = plan_ranks(one_head, rank, 8, [per_head])
        assert plan.remote_order == "NC"
        assert [s.share for s in plan.sources] == [HeadShare(0, 0, rank, 1)]
        _, remote_rows = plan.rows(plan.sources[0], [3], [2])
        picked = [s for s in per_head.streams if dict(s.coords)["H"] == rank]
        assert sorted(remote_rows[:, 0].tolist()) == sorted(s.address + 2 * s.block_stride for s in picked)
    plan = plan_ranks(per_head, 0, 1, peer_tables("HNC", 2, 16, 4))
    assert [plan.rows(source, [3], [0])[0].shape[0] for source in plan.sources] == [8] * 4
    with pytest.raises(
        LayoutError,
        match="heads are streams on one side only, and the remote's 'NHC' blocks of 2 heads do not hold each head",
    ):
        plan_ranks(per_head, 0, 1, peer_tables("NHC", 2, 16, 4))


@pytest.mark.parametrize(("memory", "landed"), [("KBNHC", "HNC"), ("KBHNC", "HNC")], ids=["token-major", "head-major"])
def test_ranks_of_one_head_fill_larger_local_blocks_with_one_piece_per_run(memory, landed):
    """Eight ranks of one head, blocks of 4, into local blocks of 16 (r = 4): each rank's
    four blocks of a local block land one after another in that block's run of its head,
    so a run of remote ids is one descriptor a stream, where a virtual sender of blocks of
    4 puts them a region apart (four). The bytes land head-major of the local block size:
    token-major blocks are received from ``HNC``, head-major ones need nothing."""
    local = decode_table(memory, 8)
    remotes = [dataclasses.replace(t, num_blocks=64) for t in peer_tables("NHC", 1, 4, 8)]
    plan = plan_ranks(local, 0, 1, remotes)
    assert (plan.remote_order, plan.remote_block_size, plan.r) == (landed, 16, 4)
    assert local.order == ("HNC" if memory == "KBHNC" else "NHC")
    for source in plan.sources:
        per_piece = plan.rows(source, [3], [8, 9, 10, 11])[0]
        merged, _ = plan.rows(source, [3], [8, 9, 10, 11], max_bytes=1 << 20)
        assert (per_piece.shape[0], merged.shape[0]) == (16, 4)
        assert sorted(merged[:, 1].tolist()) == [4 * 4 * 8 * 2] * 4  # four blocks of 4 tokens x 8 channels, bf16
        scattered, _ = plan.rows(source, [3], [8, 20, 10, 30], max_bytes=1 << 20)
        assert scattered.shape[0] == 16
    # One head on both sides (equal TP): whole regions already merge, told as the ranks sent them.
    plan = plan_ranks(decode_table(memory, 1), 5, 8, remotes)
    assert (plan.remote_order, plan.remote_block_size, [s.rank for s in plan.sources]) == ("NHC", 4, [5])


def test_windows_are_counted_over_the_side_with_more_streams(monkeypatch):
    """Every window is made of every stream of both tables: a peer whose tables hold more
    streams than ours is counted by its own."""
    local = decode_table("KBNHC", 4)
    remotes = [
        dataclasses.replace(table, streams=table.streams + table.streams[:2]) for table in peer_tables("NHC", 8, 16, 1)
    ]
    monkeypatch.setattr(ranks, "MAX_STREAMS", 16 * 6 - 1)
    with pytest.raises(LayoutError, match="takes 16 byte windows of 6 streams, 96 streams a side"):
        plan_ranks(local, 0, 2, remotes)


def test_a_remote_block_larger_than_the_local_cache_is_refused():
    """A sender block spanning more local blocks than the cache holds can never be received:
    refused whatever moves it (byte windows, whole regions, an MLA latent)."""
    for memory, order, local_tp in (("KBNHC", "NHC", 2), ("KBNHC", "NHC", 1), ("KBHNC", "HNC", 1)):
        local = decode_table(memory, 8 // local_tp, blocks=8)
        assert len(plan_ranks(local, 0, local_tp, peer_tables(order, 8, 128, 1)).sources) == 1  # g = 8 fits
        with pytest.raises(
            LayoutError,
            match=r"^a remote block of 256 tokens spans 16 local blocks of 16 tokens, more than the 8 blocks of "
            r"the local cache$",
        ):
            plan_ranks(local, 0, local_tp, peer_tables(order, 8, 256, 1))
    latent = region_table({"l0": make_cache("BNC", "BNC", dict(B=4, N=16, C=4))}, "BNC")
    with pytest.raises(LayoutError, match="spans 8 local blocks of 16 tokens, more than the 4 blocks"):
        plan_ranks(latent, 0, 1, [dataclasses.replace(latent, sizes={"N": 128, "C": 4})])


@needs_nixl
@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    ("remote_memory", "local_memory"),
    [("KBHNC", "KBNHC"), ("KBNHC", "KHBNC")],
    ids=["head-major into token-major", "token-major into per-head streams"],
)
def test_rank_readers_gather_over_nixl_from_several_agents(remote_memory, local_memory):
    """Four prefill ranks (four agents, blocks of 16 of one head each) into two decode ranks
    (blocks of 64): each decode rank's read posts one transfer per source."""
    from kvhost.nixl import Agent, RankReader

    remote_caches = [engine_caches("KBNHC", remote_memory, 1, 16, 16, seed=q) for q in range(4)]
    with contextlib.ExitStack() as stack:
        senders = [stack.enter_context(Agent(f"ranks-prefill-{q}")) for q in range(4)]
        tables = [agent.register(c, "KBNHC") for agent, c in zip(senders, remote_caches)]
        for rank in range(2):
            receiver = stack.enter_context(Agent(f"ranks-decode-{rank}"))
            local = engine_caches("KBNHC", local_memory, 2, 64, 8, seed=90 + rank)
            plan = plan_ranks(receiver.register(local, "KBNHC"), rank, 2, tables)
            peers = {s.rank: receiver.add_peer(senders[s.rank].metadata()) for s in plan.sources}
            reader = RankReader(receiver, plan, peers)
            transfers = reader.read([5, 2], REMOTE_IDS[:7])
            assert len(transfers) == 2
            # A second step's two requests as one transfer per source.
            batch = reader.read_batch([([6], REMOTE_IDS[7:]), ([0, 1], REMOTE_IDS[2:8])])
            assert len(batch) == 2
            for transfer in transfers + batch:
                transfer.wait(timeout=30)
                transfer.release()
            assert sum(t.nbytes for t in transfers) == plan.bytes_for(7)
            assert sum(t.nbytes for t in batch) == plan.bytes_for(7)
            requests = {"x": [5, 2], "y": [6], "z": [0, 1]}
            order, size = plan.remote_order, plan.remote_block_size
            kvhost.receive(local, requests, axes="KBNHC", remote_order=order, remote_block_size=size)
            for local_ids, remote_ids in (([5, 2], REMOTE_IDS[:7]), ([6], REMOTE_IDS[7:]), ([0, 1], REMOTE_IDS[2:8])):
                tokens = len(remote_ids) * 16
                check_rank(
                    local, "KBNHC", plan, local_ids, remote_caches, remote_ids, tokens, lambda s: (0, s.share.count)
                )


@needs_nixl
@pytest.mark.timeout(120)
def test_rank_readers_read_layer_by_layer_from_several_agents(monkeypatch):
    """Two prefill ranks into one decode rank, layer by layer: each layer is yielded once both
    sources' transfers of it have landed (the next layer's already posted), and received then
    it holds the tokens of its heads. The batch and timeout are checked before anything is
    posted; a layer that does not land in time names every peer still owed; a loop left
    early releases both transfers in flight."""
    from kvhost.nixl import Agent, RankReader, Transfer, TransferError
    from kvhost.nixl.errors import InvalidTimeoutError

    remote_caches = [engine_caches("KBNHC", "KBHNC", 2, 16, 16, seed=40 + q, layers=3) for q in range(2)]
    released = []
    real_release = Transfer.release
    monkeypatch.setattr(Transfer, "release", lambda self: (released.append(self), real_release(self)))
    with contextlib.ExitStack() as stack:
        senders = [stack.enter_context(Agent(f"layers-prefill-{q}")) for q in range(2)]
        tables = [agent.register(c, "KBNHC") for agent, c in zip(senders, remote_caches)]
        receiver = stack.enter_context(Agent("layers-decode"))
        local = engine_caches("KBNHC", "KBNHC", 4, 64, 8, seed=95, layers=3)
        plan = plan_ranks(receiver.register(local, "KBNHC"), 0, 1, tables)
        peers = {s.rank: receiver.add_peer(senders[s.rank].metadata()) for s in plan.sources}
        requests = [([5, 2], REMOTE_IDS[:7]), ([0], REMOTE_IDS[7:10])]
        for bound in (None, 1 << 20):
            reader = RankReader(receiver, plan, peers, max_descriptor_bytes=bound)
            for timeout in (-1, float("inf"), True):
                with pytest.raises(InvalidTimeoutError, match=r"RankReader\.read_layers timeout"):
                    reader.read_layers(requests, timeout=timeout)
            with pytest.raises(RequestError, match="same local block"):
                reader.read_layers([requests[0], requests[0]], timeout=20)
            assert reader.descriptors == 0 and not released  # nothing posted
            for tensor in local.values():
                raw(tensor).fill_(0)
            host = kvhost.KVHost(local, axes="KBNHC")
            named = {"x": [5, 2], "y": [0]}
            order = []
            for name in reader.read_layers(requests, timeout=20):
                order.append(name)
                assert all(t.finished is not None for t in released[-2:])  # both sources of the layer
                host.receive(named, remote_order="HNC", remote_block_size=16, layers=[name])
                for local_ids, remote_ids in requests:
                    tokens = len(remote_ids) * 16
                    check_rank(
                        {name: local[name]},
                        "KBNHC",
                        plan,
                        local_ids,
                        [{name: c[name]} for c in remote_caches],
                        remote_ids,
                        tokens,
                        lambda s: (0, s.share.count),
                    )
            assert order == list(local)
            rows = [plan.layer_rows(s, requests, max_bytes=bound) for s in plan.sources]
            assert reader.descriptors == sum(layers[n][0].shape[0] for layers in rows for n in local)
            assert len({id(t) for t in released}) == 6 and all(t.finished is not None for t in released)
            released.clear()

        layers = reader.read_layers(requests, timeout=20)
        assert next(layers) == "l0"
        layers.close()  # left after one layer: both sources' second-layer transfers land, then are released
        assert len({id(t) for t in released}) == 4 and all(t.released for t in released)
        real_state, real_post = receiver.nixl.check_xfer_state, receiver.nixl.transfer
        monkeypatch.setattr(receiver.nixl, "check_xfer_state", lambda handle: "PROC")  # a link that went quiet
        monkeypatch.setattr(receiver.nixl, "transfer", lambda handle, *rest: (real_post(handle, *rest), "PROC")[1])
        released.clear()
        layers = reader.read_layers(requests, timeout=0.05)
        with pytest.raises(TransferError, match=r"did not finish within 0\.05 s") as caught:
            next(layers)
        assert caught.value.timed_out
        assert all(repr(peers[s.rank]) in str(caught.value) for s in plan.sources)
        assert str(caught.value).count("still in flight and cannot be cancelled") == 2
        assert len({id(t) for t in released}) == 2 and not any(t.released for t in released)  # kept
        monkeypatch.setattr(receiver.nixl, "check_xfer_state", real_state)
        for transfer in released[:2]:  # the link back: they land, and are freed
            transfer.wait(20)
            transfer.release()
        assert all(t.released for t in released) and receiver.posted == set()


@needs_nixl
@pytest.mark.timeout(120)
def test_a_rank_reader_checks_its_peers_memory_and_bound_and_lets_go_on_a_failure(monkeypatch):
    """Refused when made: a source without an agent, memory nobody registered (either side),
    a bad descriptor bound. Counted: the rows it posts. A failure while posting the second
    source's transfer releases the first's."""
    from kvhost.nixl import Agent, RankReader, TransferError
    from kvhost.nixl import ranks as ranks_module

    remote_caches = [engine_caches("KBNHC", "KBHNC", 2, 16, 16, seed=q) for q in range(2)]
    with contextlib.ExitStack() as stack:
        senders = [stack.enter_context(Agent(f"guard-prefill-{q}")) for q in range(2)]
        tables = [agent.register(c, "KBNHC") for agent, c in zip(senders, remote_caches)]
        receiver = stack.enter_context(Agent("guard-decode"))
        local = engine_caches("KBNHC", "KBNHC", 4, 16, 16, seed=70)
        plan = plan_ranks(receiver.register(local, "KBNHC"), 0, 1, tables)
        peers = {s.rank: receiver.add_peer(senders[s.rank].metadata()) for s in plan.sources}
        with pytest.raises(LayoutError, match=r"no agent for remote rank\(s\) \[1\]"):
            RankReader(receiver, plan, {0: peers[0]})
        for bad in (0, -1, True):
            with pytest.raises(TransferError, match="max_descriptor_bytes"):
                RankReader(receiver, plan, peers, max_descriptor_bytes=bad)
        stranger = region_table(engine_caches("KBNHC", "KBNHC", 4, 16, 16, seed=71), "KBNHC")
        with pytest.raises(TransferError, match="local table names memory this agent has not registered"):
            RankReader(receiver, plan_ranks(stranger, 0, 1, tables), peers)
        unregistered = region_table(engine_caches("KBNHC", "KBHNC", 2, 16, 16, seed=72), "KBNHC")
        with pytest.raises(TransferError, match="has not registered"):
            RankReader(receiver, plan_ranks(plan.local, 0, 1, [tables[0], unregistered]), peers)

        per_piece = RankReader(receiver, plan, peers, max_descriptor_bytes=None)
        merged = RankReader(receiver, plan, peers)
        assert per_piece.domains == {} and sorted(merged.domains) == [0, 1]
        local_ids, remote_ids = [3, 4, 5], [8, 9, 10]
        for reader, bound in ((per_piece, None), (merged, merged.max_descriptor_bytes)):
            transfers = reader.read(local_ids, remote_ids)
            want = [plan.rows(s, local_ids, remote_ids, max_bytes=bound)[0].shape[0] for s in plan.sources]
            assert [t.descriptors for t in transfers] == want and reader.descriptors == sum(want)
            for transfer in transfers:
                transfer.wait(timeout=30)
                transfer.release()

        posted = []
        real_post = ranks_module.post_rows

        def post_then_fail(*args, **kwargs):
            if posted:
                raise TransferError("the link went down (injected)")
            posted.append(real_post(*args, **kwargs))
            return posted[-1]

        monkeypatch.setattr(ranks_module, "post_rows", post_then_fail)
        with pytest.raises(TransferError, match="injected"):
            merged.read(local_ids, remote_ids)
        assert len(posted) == 1 and posted[0].released

        # A registered local tensor re-pointed since: every read is refused before it posts.
        posted.clear()
        moved = next(iter(local.values()))
        moved.set_(torch.zeros_like(moved))
        refused = r"agent 'guard-decode': registered memory changed"
        with pytest.raises(LayoutError, match=refused):
            merged.read_batch([(local_ids, remote_ids)])
        with pytest.raises(LayoutError, match=refused):
            next(merged.read_layers([(local_ids, remote_ids)], timeout=5))
        assert not posted


def head_major_offer(heads, tp, per_layer, layers=8):
    """An offer's head-major (HNC) rank tables of ``heads`` heads and ``per_layer`` streams a
    layer each (as ``parse_offer`` allows: one budget of streams for the whole offer, ``#``
    places up to 1,023; every rank's arrays at the same bytes), bf16 blocks of 16 tokens x 8
    channels."""
    run = heads * 16 * 8 * 2
    streams = tuple(
        Stream(f"l{layer}", (("#", j),), (1 << 20) + (layer * per_layer + j) * run, run)
        for layer in range(layers)
        for j in range(per_layer)
    )
    return [RegionTable("DRAM", 0, "HNC", "", {"H": heads, "N": 16, "C": 8}, 2, 4, streams)] * tp


def per_head_decode(heads, per_layer, layers=8):
    """A decode rank's table of the same places with each of its ``heads`` a stream of its own."""
    streams = tuple(
        Stream(f"l{layer}", (("#", j), ("H", h)), (1 << 40) + ((layer * per_layer + j) * heads + h) * 256, 256)
        for layer in range(layers)
        for j in range(per_layer)
        for h in range(heads)
    )
    return RegionTable("DRAM", 0, "NC", "", {"H": heads, "N": 16, "C": 8}, 2, 4, streams)


def apart_counted(monkeypatch):
    """The streams each ``RegionTable.heads_apart`` call makes, as they are made."""
    made = []
    heads_apart = RegionTable.heads_apart

    def counted(table):
        apart = heads_apart(table)
        made.append(0 if apart is table else len(apart.streams))
        return apart

    monkeypatch.setattr(RegionTable, "heads_apart", counted)
    return made


@pytest.mark.timeout(20)  # before the bound, these built 262,400 and 524,800 streams (4 s, 425 MB)
@pytest.mark.parametrize(("kv_heads", "tp", "streams"), [(32, 4, 1 << 15), (64, 8, 1 << 16)])
def test_head_major_ranks_read_head_by_head_are_held_to_the_stream_budget_in_all(monkeypatch, kv_heads, tp, streams):
    """Each table of an offer may hold up to ``MAX_STREAMS / H`` head-major streams, so each
    is within the bound head by head, but a decode rank fed by every rank would make ``TP``
    times the bound: counted over all the ranks read from, and refused before any is made."""
    remotes = head_major_offer(kv_heads // tp, tp, streams // tp // 8)
    local = per_head_decode(kv_heads, 1)  # only its sizes are read before the refusal
    made = apart_counted(monkeypatch)
    start = time.perf_counter()
    with pytest.raises(LayoutError) as refused:
        plan_ranks(local, 0, 1, remotes)
    assert time.perf_counter() - start < 0.1
    assert made == []
    assert str(refused.value) == (
        f"reading the heads of remote ranks {list(range(tp))} one by one makes their {streams} streams "
        f"{streams * kv_heads // tp}, more than the 65536 a plan may hold"
    )


@pytest.mark.timeout(60)
def test_only_the_ranks_that_feed_a_decode_rank_are_read_head_by_head(monkeypatch):
    """A decode rank of per-head streams reads its heads from the one head-major rank that
    holds them (equal TP): that rank alone is read head by head, up to the whole budget
    (65,536 streams: 8,192 of 8 heads), and it plans; the three others are never seen."""
    remotes = head_major_offer(8, 4, 1024)  # 32,768 streams in the offer
    made = apart_counted(monkeypatch)
    plan = plan_ranks(per_head_decode(8, 1024), 1, 4, remotes)  # decode rank 1 of 4: heads 8..15
    assert made == [1 << 16, 0]  # remote rank 1's, then the local table's (its heads are streams already)
    assert [source.rank for source in plan.sources] == [1]
    assert (plan.remote_order, plan.remote_block_size) == ("NC", 16)
    assert window_streams(plan) == 1 << 16
    local_rows, remote_rows = plan.rows(plan.sources[0], [2], [3])
    assert local_rows.shape[0] == remote_rows.shape[0] == 1 << 16
    run = 8 * 16 * 8 * 2
    expected = sorted(s.address + 3 * run + h * 256 for s in remotes[1].streams for h in range(8))
    assert sorted(remote_rows[:, 0].tolist()) == expected


def test_ranks_read_head_by_head_are_counted_exactly_up_to_the_stream_budget(monkeypatch):
    """At the budget the plan is made; one stream under it, the same pair is refused."""
    local = decode_table("KHBNC", 8)
    remotes = peer_tables("HNC", 2, 16, 4)  # 4 streams of 2 heads a rank: 8 streams head by head
    monkeypatch.setattr(ranks, "MAX_STREAMS", 4 * 8)
    assert [source.rank for source in plan_ranks(local, 0, 1, remotes).sources] == [0, 1, 2, 3]
    assert [source.rank for source in plan_ranks(decode_table("KHBNC", 4), 1, 2, remotes).sources] == [2, 3]
    monkeypatch.setattr(ranks, "MAX_STREAMS", 4 * 8 - 1)
    with pytest.raises(
        LayoutError, match=r"ranks \[0, 1, 2, 3\] one by one makes their 16 streams 32, more than the 31"
    ):
        plan_ranks(local, 0, 1, remotes)
    monkeypatch.setattr(ranks, "MAX_STREAMS", 2 * 8)  # two ranks feed a decode rank of TP 2
    assert [source.rank for source in plan_ranks(decode_table("KHBNC", 4), 1, 2, remotes).sources] == [2, 3]


class BlockByBlockNixl:
    """NIXL's ``prep_xfer_dlist`` where this agent registered its memory whole and the peer
    block by block: a peer's row outside one of its blocks is refused, as NIXL refuses it."""

    def __init__(self, remote_tables):
        self.blocks = {}
        for table in remote_tables:
            for stream in table.streams:
                for block in range(table.num_blocks):
                    self.blocks[stream.address + block * stream.block_stride] = table.run_bytes
        self.starts = np.array(sorted(self.blocks), dtype=np.uint64)
        self.refused = 0

    def prep_xfer_dlist(self, owner, rows, memory):
        if owner != "NIXL_INIT_AGENT":
            for address, length, _ in rows.tolist():
                i = int(np.searchsorted(self.starts, np.uint64(address), side="right")) - 1
                if i < 0 or address + length > int(self.starts[i]) + self.blocks[int(self.starts[i])]:
                    self.refused += 1
                    raise RuntimeError("NIXL_ERR_NOT_FOUND")
        return SimpleNamespace(release=lambda: None)


def test_a_rank_reader_s_refused_probes_are_bounded_whatever_the_parts_a_peer_s_block_size_makes():
    """One part of a plan per local block of a group: a peer of blocks of 16,384 tokens makes
    1,024 of them. Their probes of a peer that registered block by block share one bound
    (each refusal is an error line in NIXL's log): 64 in all, not 64 a part."""
    from kvhost.nixl.agent import MAX_REFUSED_PROBES
    from kvhost.nixl.ranks import RankReader

    local = decode_table("KBNHC", 4, blocks=4096)
    remotes = [dataclasses.replace(t, num_blocks=4) for t in peer_tables("NHC", 8, 16384, 1)]
    plan = plan_ranks(local, 0, 2, remotes)
    assert sum(len(source.parts) for source in plan.sources) == 1024
    nixl = BlockByBlockNixl(remotes)
    reader = RankReader(SimpleNamespace(nixl=nixl), plan, {0: "prefill-r0"})
    assert nixl.refused == MAX_REFUSED_PROBES
    assert all((remote == -1).all() for _, remote in reader.domains[0][1:])  # given up on: they merge less


def test_counts_a_rank_plan_is_asked_of_are_ints_and_tp_is_bounded():
    """A rank plan's counts of blocks are ints >= 0 (a string was repeated, -1 gave negative
    bytes, 2.5 a fraction of a block); an MLA latent's ranks are bounded."""
    from test_nixl import check_block_counts

    local = region_table(engine_caches("KBNHC", "KBNHC", 4, 64, 8, seed=1), "KBNHC")
    remote = region_table(engine_caches("KBNHC", "KBHNC", 4, 16, 8, seed=2), "KBNHC")
    check_block_counts(plan_ranks(local, 0, 1, [remote]))
    assert latent_source(3, 1024, 1024) == 3 and latent_source(1023, 1024, 1) == 0
    for local_tp, remote_tp in ((2**63, 2), (2, 2**63), (2048, 1), (1, 2048), (1025, 1), (1, 1025)):
        with pytest.raises(LayoutError, match="an engine has 1 to 1024 ranks"):
            latent_source(0, local_tp, remote_tp)


def test_a_rank_reader_refuses_a_plan_peers_or_a_peer_name_of_the_wrong_kind():
    """Checked before the agent is asked anything (it stands in here as nothing at all)."""
    from kvhost.errors import ArgumentError
    from kvhost.nixl.ranks import RankReader

    local = decode_table("KBNHC", 4, blocks=8)
    plan = plan_ranks(local, 0, 1, peer_tables("NHC", 4, 16, 1))
    nothing = SimpleNamespace()  # an agent with nothing: any use of it would raise AttributeError
    for bad_plan, peers in ((None, {0: "p"}), (plan, [(0, "p")]), (plan, None)):
        with pytest.raises(ArgumentError, match="a RankReader takes a RankPlan"):
            RankReader(nothing, bad_plan, peers)  # type: ignore[arg-type]
    for name in (True, None, b"p"):
        with pytest.raises(ArgumentError, match="a peer is named by the text add_peer returned"):
            RankReader(nothing, plan, {0: name})  # type: ignore[dict-item]
