"""kvhost.nixl: descriptors checked against the wire model, tables, and real NIXL agents.

Descriptor tests move bytes with ``memmove`` row by row (what NIXL does with each pair)
and compare the local caches with ``kvhost.testing.write_wire``, the oracle written from
docs/design.md; then ``kvhost.receive`` must turn them into the sender's tokens. The agent
tests move the same bytes with NIXL over UCX between two agents in this process.
"""

from __future__ import annotations

import ctypes
import importlib.util
import subprocess
import sys
import time
from dataclasses import replace

import numpy as np
import pytest
import torch

import kvhost
from kvhost.caches import CacheSet
from kvhost.errors import ArgumentError, LayoutError, RequestError
from kvhost.nixl import (
    MAX_DESCRIPTOR_BYTES,
    NIXL_MODULES,
    InvalidTimeoutError,
    NixlUnavailableError,
    ProtocolError,
    RegionTable,
    Transfer,
    TransferError,
    decode,
    encode,
    extent_rows,
    memory_spans,
    merge_rows,
    plan_ranks,
    plan_transfer,
    region_table,
    stream_extents,
    tables,
)
from kvhost.nixl.tables import Stream
from kvhost.testing import block_letters, fill_random, make_cache, raw, read_tokens, write_wire

# (axes, remote memory order, local memory order, sizes but B and N)
LAYOUT_PAIRS = {
    "HND->NHD": ("KBNHC", "KBHNC", "KBNHC", dict(K=2, H=2, C=4)),
    "NHD->HND": ("KBNHC", "KBNHC", "KBHNC", dict(K=2, H=3, C=4)),
    "HND->HND": ("KBNHC", "KBHNC", "KBHNC", dict(K=2, H=2, C=8)),
    "blockfirst": ("BKNHC", "BKHNC", "BKNHC", dict(K=2, H=2, C=4)),
    "per-head": ("BHNC", "HBNC", "HBNC", dict(H=3, C=4)),
    "MLA": ("BNC", "BNC", "BNC", dict(C=12)),
    "layers-in-one": ("LBHNC", "BLHNC", "BLNHC", dict(L=2, H=2, C=4)),
}
# (remote block size, local block size, remote blocks in the request)
SIZES = {"r4": (4, 16, 8), "r2-partial": (8, 16, 5), "same": (8, 8, 3), "g4": (32, 8, 2), "g2": (16, 8, 3)}
REMOTE_IDS = [7, 3, 12, 0, 5, 9, 1, 14]
LOCAL_IDS = [20, 2, 11, 4, 17, 6, 22, 8, 1, 13, 15, 3]
# Block ids as allocators hand them out: runs of consecutive ids.
REMOTE_RUNS = [3, 4, 5, 6, 10, 11, 0, 1]
LOCAL_RUNS = [5, 6, 7, 1, 2, 3, 12, 13, 14, 15, 20, 21]
IDS = {"scattered": (LOCAL_IDS, REMOTE_IDS), "runs": (LOCAL_RUNS, REMOTE_RUNS)}
# How descriptors are cut: one per piece (None), merged up to 3 pieces, merged without a bound.
MERGES = {"per-piece": None, "merged-3": 3, "merged": 1 << 40}


def caches_for(axes, memory, sizes, block_size, blocks, seed, layers=2):
    full = dict(sizes, N=block_size, B=blocks)
    return {f"l{i}": fill_random(make_cache(axes, memory, full), seed + i) for i in range(layers)}


def memmove_rows(local_rows, remote_rows):
    """What NIXL does with a READ: for each pair, the remote row's bytes into the local row."""
    assert local_rows.shape == remote_rows.shape
    assert (local_rows[:, 1] == remote_rows[:, 1]).all()
    for (dst, length, _), (src, _, _) in zip(local_rows.tolist(), remote_rows.tolist()):
        ctypes.memmove(dst, src, length)


def pairs(plan, local_ids, remote_ids, merge):
    """The descriptor rows of a request: per piece (``merge`` None), or merged up to ``merge``
    pieces, checked to be exactly the per-piece pairs, merged."""
    local_rows, remote_rows = plan.descriptor_pairs(local_ids, remote_ids)
    if merge is None:
        return local_rows, remote_rows
    bound = merge * plan.chunk_bytes if merge < 1 << 20 else merge
    merged = plan.merged_pairs(local_ids, remote_ids, max_bytes=bound)
    assert_same_pairs((local_rows, remote_rows), merged, plan.chunk_bytes)
    assert (merged[0][:, 1] <= max(bound, plan.chunk_bytes)).all()
    return merged


def assert_same_pairs(per_piece, merged, chunk):
    """Merged rows, cut back into pieces of ``chunk`` bytes, are the per-piece pairs (any order)."""
    (local_rows, remote_rows), (merged_local, merged_remote) = per_piece, merged
    assert (merged_local[:, 1] == merged_remote[:, 1]).all() and (merged_local[:, 1] % chunk == 0).all()
    assert (merged_local[:, 2] == local_rows[0, 2]).all() and (merged_remote[:, 2] == remote_rows[0, 2]).all()
    want = sorted(zip(local_rows[:, 0].tolist(), remote_rows[:, 0].tolist()))
    assert pieces_of(merged, chunk) == want
    assert len(merged_local) <= len(local_rows)


def pieces_of(rows, chunk):
    """The (local address, remote address) of every chunk that merged rows move."""
    counts = (rows[0][:, 1] // np.uint64(chunk)).astype(np.int64)
    steps = np.arange(int(counts.sum())) - np.repeat(np.cumsum(counts) - counts, counts)
    cut = [np.repeat(side[:, 0], counts) + steps.astype(np.uint64) * np.uint64(chunk) for side in rows]
    return sorted(zip(cut[0].tolist(), cut[1].tolist()))


def outer_streams(tensor, layout, ids):
    """Per outer index, the regions of ``ids`` back to back, as bytes (what the wire model speaks of)."""
    physical = raw(tensor).permute([layout.axes.index(a) for a in layout.physical])
    return [
        torch.cat([physical[outer][b].reshape(-1).view(torch.uint8) for b in ids])
        for outer in np.ndindex(*[layout.size(a) for a in layout.outer])
    ]


def untouched_blocks_same(tensor, before, layout, ids):
    b = layout.axes.index("B")
    others = [i for i in range(layout.num_blocks) if i not in set(ids)]
    index = torch.tensor(others)
    return torch.equal(raw(tensor).index_select(b, index), before.index_select(b, index))


@pytest.mark.parametrize("merge", MERGES)
@pytest.mark.parametrize("ids", IDS)
@pytest.mark.parametrize("sizes_name", SIZES)
@pytest.mark.parametrize("pair", LAYOUT_PAIRS)
def test_descriptors_land_wire_bytes(pair, sizes_name, ids, merge):
    """Per piece or merged, the descriptors leave the wire model's bytes, and nothing else."""
    axes, remote_memory, local_memory, sizes = LAYOUT_PAIRS[pair]
    all_local, all_remote = IDS[ids]
    remote_size, local_size, count = SIZES[sizes_name]
    remote = caches_for(axes, remote_memory, sizes, remote_size, 16, seed=1)
    local = caches_for(axes, local_memory, sizes, local_size, 24, seed=50)
    before = {name: raw(t).clone() for name, t in local.items()}
    plan = plan_transfer(region_table(local, axes), region_table(remote, axes))
    remote_ids = all_remote[:count]
    local_ids = all_local[: plan.local_blocks_for(count)]
    assert plan.local_parts == max(local_size // remote_size, 1)
    assert plan.remote_parts == max(remote_size // local_size, 1)
    assert len(local_ids) * local_size >= count * remote_size > (len(local_ids) - 1) * local_size

    local_rows, remote_rows = pairs(plan, local_ids, remote_ids, MERGES[merge])
    memmove_rows(local_rows, remote_rows)
    assert int(local_rows[:, 1].sum()) == plan.bytes_for(count)

    remote_set, local_set = CacheSet(remote, axes), CacheSet(local, axes)
    tokens = count * remote_size
    for r, lo in zip(remote_set.members, local_set.members):
        truth = read_tokens(r.tensor, r.layout, remote_ids)
        # The oracle fills whole local blocks: pad the truth, then hold only the sender's prefix to it.
        pad = fill_random(torch.empty((len(local_ids) * local_size - tokens, *truth.shape[1:]), dtype=truth.dtype), 9)
        expected = before[lo.layer].clone()
        write_wire(expected, lo.layout, local_ids, torch.cat([truth, pad]), plan.remote_order, remote_size)
        sent = count * r.layout.region_bytes
        got_streams = outer_streams(lo.tensor, lo.layout, local_ids)
        want_streams = outer_streams(expected, lo.layout, local_ids)
        old_streams = outer_streams(before[lo.layer], lo.layout, local_ids)
        for got, want, old in zip(got_streams, want_streams, old_streams):
            assert torch.equal(got[:sent], want[:sent]), f"{lo.layer}: wire bytes differ from the oracle"
            assert torch.equal(got[sent:], old[sent:]), f"{lo.layer}: bytes past the sender's were written"
        assert untouched_blocks_same(lo.tensor, before[lo.layer], lo.layout, local_ids)

    kvhost.receive(local, {"x": local_ids}, axes=axes, remote_order=plan.remote_order, remote_block_size=remote_size)
    for r, lo in zip(remote_set.members, local_set.members):
        got = read_tokens(lo.tensor, lo.layout, local_ids)[:tokens]
        assert torch.equal(got, read_tokens(r.tensor, r.layout, remote_ids))


@pytest.mark.parametrize("merge", MERGES)
@pytest.mark.parametrize("ids", IDS)
@pytest.mark.parametrize(("remote_size", "local_size", "count"), [(4, 16, 7), (32, 8, 2), (8, 8, 3)])
@pytest.mark.parametrize("memory", ["KBHNC", "KBNHC"])
def test_token_runs_land_in_the_local_layout(memory, remote_size, local_size, count, ids, merge):
    """Tables cut at N pair token runs: the bytes arrive already in local order, no post-process."""
    sizes = dict(K=2, H=3, C=4)
    remote = caches_for("KBNHC", memory, sizes, remote_size, 16, seed=3)
    local = caches_for("KBNHC", memory, sizes, local_size, 24, seed=30)
    before = {name: raw(t).clone() for name, t in local.items()}
    local_table, remote_table = region_table(local, "KBNHC").token_runs(), region_table(remote, "KBNHC").token_runs()
    assert local_table.split == ("H" if memory == "KBHNC" else "")
    plan = plan_transfer(local_table, remote_table)
    all_local, all_remote = IDS[ids]
    local_ids, remote_ids = all_local[: plan.local_blocks_for(count)], all_remote[:count]
    memmove_rows(*pairs(plan, local_ids, remote_ids, MERGES[merge]))
    tokens = count * remote_size
    for r, lo in zip(CacheSet(remote, "KBNHC").members, CacheSet(local, "KBNHC").members):
        got = read_tokens(lo.tensor, lo.layout, local_ids)
        assert torch.equal(got[:tokens], read_tokens(r.tensor, r.layout, remote_ids))
        old = read_tokens(before[lo.layer], lo.layout, local_ids)
        assert torch.equal(got[tokens:], old[tokens:])
        assert untouched_blocks_same(lo.tensor, before[lo.layer], lo.layout, local_ids)


# (axes, remote memory order, local memory order, sizes but B and N): a letter of size 1
# placed apart on the two sides, outside the blocks on one and inside on the other.
UNIT_LETTERS_APART = {
    "K of one latent outer->inner": ("KBNC", "KBNC", "BKNC", dict(K=1, C=8)),
    "K of one latent inner->outer": ("KBNC", "BNKC", "KBNC", dict(K=1, C=8)),
    "one head per-head->NHD": ("BNHC", "HBNC", "BNHC", dict(H=1, C=8)),
    "one head HND->per-head": ("BNHC", "BHNC", "HBNC", dict(H=1, C=8)),
    "one head per-head->KBNHC": ("KBNHC", "HKBNC", "KBNHC", dict(K=2, H=1, C=8)),
}


@pytest.mark.parametrize("runs", [False, True], ids=["regions", "token-runs"])
@pytest.mark.parametrize(("remote_size", "local_size", "count"), [(4, 16, 5), (16, 4, 2), (8, 8, 3)])
@pytest.mark.parametrize("pair", UNIT_LETTERS_APART)
def test_letters_of_size_1_placed_apart_pair_and_land(pair, remote_size, local_size, count, runs):
    """Tables that differ only in where a letter of size 1 sits describe the same bytes: the
    plan pairs them, names no such letter in its remote order, and the sender's tokens land
    (token runs: as they are; regions: once ``kvhost.receive`` has rearranged them)."""
    axes, remote_memory, local_memory, sizes = UNIT_LETTERS_APART[pair]
    remote = caches_for(axes, remote_memory, sizes, remote_size, 16, seed=4)
    local = caches_for(axes, local_memory, sizes, local_size, 24, seed=40)
    before = {name: raw(t).clone() for name, t in local.items()}
    local_table, remote_table = region_table(local, axes), region_table(remote, axes)
    assert local_table.order != remote_table.order or local_table.coordinates != remote_table.coordinates
    if runs:
        local_table, remote_table = local_table.token_runs(), remote_table.token_runs()
    plan = plan_transfer(local_table, remote_table)
    assert not {a for a, n in sizes.items() if n == 1} & set(plan.remote_order)
    local_ids, remote_ids = LOCAL_IDS[: plan.local_blocks_for(count)], REMOTE_IDS[:count]
    memmove_rows(*plan.merged_pairs(local_ids, remote_ids))
    if not runs:
        order, size = plan.remote_order, remote_size
        kvhost.receive(local, {"x": local_ids}, axes=axes, remote_order=order, remote_block_size=size)
    tokens = count * remote_size
    for r, lo in zip(CacheSet(remote, axes).members, CacheSet(local, axes).members):
        got = read_tokens(lo.tensor, lo.layout, local_ids)
        assert torch.equal(got[:tokens], read_tokens(r.tensor, r.layout, remote_ids))
        if runs:  # nothing past the sender's tokens is written
            assert torch.equal(got[tokens:], read_tokens(before[lo.layer], lo.layout, local_ids)[tokens:])
        assert untouched_blocks_same(lo.tensor, before[lo.layer], lo.layout, local_ids)


def test_leaving_out_letters_of_size_1_rebuilds_only_what_names_them():
    """Every plan leaves them out: a table without such letters is itself, and one whose
    streams do not name them keeps its streams (a peer's table may hold 2^16); a table
    without streams has no coordinates to look at."""
    caches = caches_for("KBNHC", "KBHNC", dict(K=2, H=2, C=8), 4, 6, seed=1)
    table = region_table(caches, "KBNHC")
    assert table.without_unit_letters() is table
    one_head = region_table(caches_for("KBNHC", "KBHNC", dict(K=2, H=1, C=8), 4, 6, seed=1), "KBNHC")
    left = one_head.without_unit_letters()
    assert (left.order, left.sizes) == ("NC", dict(K=2, N=4, C=8)) and left.streams is one_head.streams
    per_head = region_table(caches_for("BNHC", "HBNC", dict(H=1, C=8), 4, 6, seed=1), "BNHC")
    assert per_head.coordinates == "H" and per_head.without_unit_letters().coordinates == ""
    empty = replace(one_head, streams=()).without_unit_letters()
    assert (empty.order, empty.streams) == ("NC", ())


def test_merged_descriptors_follow_runs_up_to_the_bound():
    """HND 4 -> NHD 16 (r = 4), 2 layers x K/V: 8 consecutive sender blocks into 2 consecutive
    receiver blocks are 8 pieces per stream that continue one another on both sides."""
    sizes = dict(K=2, H=2, C=4)
    remote = caches_for("KBNHC", "KBHNC", sizes, 4, 16, seed=1)
    local = caches_for("KBNHC", "KBNHC", sizes, 16, 8, seed=2)
    plan = plan_transfer(region_table(local, "KBNHC"), region_table(remote, "KBNHC"))
    chunk, streams = plan.chunk_bytes, 4
    per_piece = plan.descriptor_pairs([3, 4], list(range(8, 16)))
    assert per_piece[0].shape[0] == 8 * streams
    for bound, per_stream in (
        (chunk, 8),
        (chunk - 1, 8),
        (3 * chunk, 3),
        (3 * chunk + 5, 3),
        (8 * chunk, 1),
        (1 << 30, 1),
    ):
        merged = plan.merged_pairs([3, 4], list(range(8, 16)), max_bytes=bound)
        assert merged[0].shape[0] == per_stream * streams, bound
        assert_same_pairs(per_piece, merged, chunk)
    # A break on either side ends a descriptor: sender blocks 8..11 then 13..16; receiver 3, 5.
    assert plan.merged_pairs([3, 4], [8, 9, 10, 11, 13, 14, 15, 12])[0].shape[0] == 3 * streams
    assert plan.merged_pairs([3, 5], list(range(8, 16)))[0].shape[0] == 2 * streams
    # Streams never merge by default; a negative domain merges nothing.
    assert plan.merged_pairs([3, 4], list(range(8, 16)), local_domains=np.full(4, -1))[0].shape[0] == 8 * streams
    with pytest.raises(ArgumentError, match="one label for each of 4 streams"):
        plan.merged_pairs([3, 4], list(range(8, 16)), remote_domains=np.zeros(3, dtype=np.int64))
    # Labels are integers, never coerced: 0.4 and 0.6 were both domain 0, and merged.
    for labels in (np.array([0.4, 0.6, 1.4, 1.6]), [True, False, True, False], ["0", "1", "2", "3"], [None, 0, 1, 2]):
        with pytest.raises(ArgumentError, match="local_domains: expected integer labels"):
            plan.merged_pairs([3, 4], list(range(8, 16)), local_domains=labels)
    with pytest.raises(ArgumentError, match=r"remote_domains: expected integer labels \(64-bit\)"):
        plan.merged_pairs([3, 4], list(range(8, 16)), remote_domains=[2**70, 0, 0, 0])
    with pytest.raises(ArgumentError, match=r"remote_domains: expected integer labels \(64-bit\)"):
        plan.merged_pairs([3, 4], list(range(8, 16)), remote_domains=np.full(4, 1 << 63, dtype=np.uint64))
    assert plan.merged_pairs([3, 4], list(range(8, 16)), local_domains=(5, 5, 5, 5))[0].shape[0] == streams
    for labels in (np.array([3, 3, 3, 3], dtype=np.uint8), np.full(4, (1 << 63) - 1, dtype=np.uint64)):
        assert plan.merged_pairs([3, 4], list(range(8, 16)), remote_domains=labels)[0].shape[0] == streams
    with pytest.raises(ArgumentError, match=r"local_domains: expected integer labels, got \[\[0\], \[1, 2\], 0, 0\]"):
        plan.merged_pairs([3, 4], list(range(8, 16)), local_domains=[[0], [1, 2], 0, 0])  # ragged
    with pytest.raises(ArgumentError, match="at least 1"):
        plan.merged_pairs([3, 4], list(range(8, 16)), max_bytes=0)
    with pytest.raises(ArgumentError, match="one length"):
        rows = per_piece[0].copy()
        rows[0, 1] = 1
        merge_rows(rows, per_piece[1], 1 << 20, np.zeros(len(rows)), np.zeros(len(rows)))


@pytest.mark.parametrize("bound", [1, 3, 1 << 40])
@pytest.mark.parametrize("sizes_name", SIZES)
@pytest.mark.parametrize("pair", LAYOUT_PAIRS)
def test_merging_stream_by_stream_finds_what_merge_rows_finds(pair, sizes_name, bound):
    """When no two streams share a domain, ``merged_pairs`` finds its cuts from the ids alone:
    on ids in ascending runs it gives the rows ``merge_rows`` makes of the per-piece pairs."""
    axes, remote_memory, local_memory, sizes = LAYOUT_PAIRS[pair]
    remote_size, local_size, count = SIZES[sizes_name]
    remote = caches_for(axes, remote_memory, sizes, remote_size, 16, seed=1)
    local = caches_for(axes, local_memory, sizes, local_size, 24, seed=50)
    plan = plan_transfer(region_table(local, axes), region_table(remote, axes))
    remote_ids = [3, 4, 5, 6, 10, 11, 12, 0][:count]
    local_ids = [5, 6, 7, 1, 2, 3, 12, 13, 14, 15, 20, 21][: plan.local_blocks_for(count)]
    max_bytes = bound * plan.chunk_bytes if bound < 1 << 20 else bound
    fast = plan.merged_pairs(local_ids, remote_ids, max_bytes=max_bytes)
    per_piece = plan.descriptor_pairs(local_ids, remote_ids)
    labels = np.repeat(np.arange(len(plan.local.streams)), per_piece[0].shape[0] // len(plan.local.streams))
    slow = merge_rows(*per_piece, max_bytes, labels, labels)
    for got, want in zip(fast, slow):
        assert sorted(map(tuple, got.tolist())) == sorted(map(tuple, want.tolist()))


def split_batch(plan, remote_counts, local_pool, remote_pool, seed):
    """Requests of ``remote_counts`` remote blocks each, ids drawn without repeats on the
    local side (runs of 1..3 and single blocks mixed), repeats allowed across requests remotely."""
    rng = np.random.default_rng(seed)
    local_free = [int(b) for b in rng.permutation(local_pool)]
    requests = []
    for count in remote_counts:
        want = plan.local_blocks_for(count)
        start = int(rng.integers(0, local_pool - want)) if rng.random() < 0.5 else None
        if start is not None and all(b in local_free for b in range(start, start + want)):
            local_ids = list(range(start, start + want))
        else:
            local_ids = local_free[:want]
        local_free = [b for b in local_free if b not in local_ids]
        remote_start = int(rng.integers(0, remote_pool - count + 1))
        remote_ids = list(range(remote_start, remote_start + count)) if rng.random() < 0.5 else None
        if remote_ids is None:
            remote_ids = [int(b) for b in rng.choice(remote_pool, count, replace=False)]
        requests.append((local_ids, remote_ids))
    return requests


def row_pairs(rows):
    return sorted(zip(map(tuple, rows[0].tolist()), map(tuple, rows[1].tolist())))


# The layout pairs, and layers laid out block by block in one buffer on both sides, whose
# streams interleave where they share a merge domain.
BATCH_PAIRS = [*LAYOUT_PAIRS, "cross-layer"]


@pytest.mark.parametrize("bound", [None, 1, 3, 1 << 40])
@pytest.mark.parametrize("domains", ["own", "shared", "mixed"])
@pytest.mark.parametrize("sizes_name", SIZES)
@pytest.mark.parametrize("pair", BATCH_PAIRS)
def test_a_batch_plans_what_its_requests_plan_one_by_one(pair, sizes_name, domains, bound):
    """``merged_batch`` (and ``descriptor_batch``) of several requests, each with its own count
    of blocks (partial local blocks included), make exactly the rows of each request planned
    alone, back to back: whatever the layouts, r or g, bound and merge domains."""
    plan, labels, six = batch_of_six(pair, sizes_name, domains)
    for requests in (six, six[2:4]):
        if bound is None:
            alone = [plan.descriptor_pairs(*request) for request in requests]
            together = plan.descriptor_batch(requests)
        else:
            max_bytes = bound * plan.chunk_bytes if bound < 1 << 20 else bound
            kwargs = dict(max_bytes=max_bytes, local_domains=labels, remote_domains=labels)
            alone = [plan.merged_pairs(*request, **kwargs) for request in requests]
            together = plan.merged_batch(requests, **kwargs)
        want = (np.concatenate([rows for rows, _ in alone]), np.concatenate([rows for _, rows in alone]))
        if plan._merge_kinds(labels, labels) is None and bound is not None:
            # Interleaved streams sort every piece of the batch at once: pieces of two requests
            # may merge, so compare the bytes each local byte receives instead of the rows.
            assert together[0].shape[0] <= want[0].shape[0]
            assert pieces_of(together, plan.chunk_bytes) == pieces_of(want, plan.chunk_bytes)
        else:
            assert row_pairs(together) == row_pairs(want)


@pytest.mark.parametrize("bound", [1, 3, 1 << 40])
@pytest.mark.parametrize("domains", ["own", "shared", "mixed"])
@pytest.mark.parametrize("sizes_name", SIZES)
@pytest.mark.parametrize("pair", BATCH_PAIRS)
def test_layer_by_layer_moves_what_the_batch_moves(pair, sizes_name, domains, bound):
    """``merged_layers`` gives every local layer, in the table's order, rows that land in that
    layer alone; together they move each piece ``merged_batch`` moves, once, and where no
    streams interleave they are exactly its rows."""
    plan, labels, six = batch_of_six(pair, sizes_name, domains)
    max_bytes = bound * plan.chunk_bytes if bound < 1 << 20 else bound
    kwargs = dict(max_bytes=max_bytes, local_domains=labels, remote_domains=labels)
    whole = plan.merged_batch(six, **kwargs)
    layers = plan.merged_layers(six, **kwargs)
    assert list(layers) == list(dict.fromkeys(s.layer for s in plan.local.streams)) == ["l0", "l1"]
    extents = stream_extents(plan.local)
    for name, (local_rows, _) in layers.items():
        ours = [i for i, s in enumerate(plan.local.streams) if s.layer == name]
        starts, ends = extents[ours, 0], extents[ours, 0] + extents[ours, 1]
        inside = (local_rows[:, :1] >= starts) & (local_rows[:, :1] + local_rows[:, 1:2] <= ends)
        assert inside.any(axis=1).all(), name
    together = tuple(np.concatenate([rows[side] for rows in layers.values()]) for side in (0, 1))
    assert pieces_of(together, plan.chunk_bytes) == pieces_of(whole, plan.chunk_bytes)
    if plan._merge_kinds(labels, labels) is None:  # layers interleave: merged each on its own
        assert together[0].shape[0] >= whole[0].shape[0]
    else:
        assert row_pairs(together) == row_pairs(whole)


def batch_of_six(pair, sizes_name, domains):
    """A plan of ``LAYOUT_PAIRS[pair]`` at ``SIZES[sizes_name]``, merge domains as ``domains``
    says (each stream its own, one for all, or every other stream merging nothing), and a
    batch of six requests of 1 to 5 remote blocks."""
    remote_size, local_size, _ = SIZES[sizes_name]
    if pair == "cross-layer":
        axes = "KBNHC"
        remote = layer_views(fill_random(torch.empty(16, 2, 2, remote_size, 2, 4, dtype=torch.bfloat16), 1))
        local = layer_views(fill_random(torch.empty(80, 2, 2, local_size, 2, 4, dtype=torch.bfloat16), 50))
    else:
        axes, remote_memory, local_memory, sizes = LAYOUT_PAIRS[pair]
        remote = caches_for(axes, remote_memory, sizes, remote_size, 16, seed=1)
        local = caches_for(axes, local_memory, sizes, local_size, 80, seed=50)
    plan = plan_transfer(region_table(local, axes), region_table(remote, axes))
    streams = len(plan.local.streams)
    labels = {
        "own": None,
        "shared": np.zeros(streams, dtype=np.int64),
        "mixed": np.array([-1 if i % 2 else 0 for i in range(streams)], dtype=np.int64),
    }[domains]
    return plan, labels, split_batch(plan, [1, 3, 2, 5, 1, 4], 80, 16, seed=len(pair) + len(sizes_name))


def test_a_batch_is_checked_whole():
    """Every request of a batch is checked, with the request's own words; no local block may
    be named by two requests; a remote block may; an empty batch is refused."""
    plan = plan_transfer(fake_table([0], 64, 8), fake_table([1000], 64, 8))
    for plan_batch in (plan.merged_batch, plan.descriptor_batch):
        with pytest.raises(RequestError, match="at least one request"):
            plan_batch([])
        one = ((1, 2), (0, 1))
        for not_a_list in (5, (r for r in [one]), {one}, {one: one}, np.array([one]), None, object()):
            with pytest.raises(RequestError, match=r"a batch is a list or tuple of \(local ids, remote ids\) pairs"):
                plan_batch(not_a_list)
        for not_a_pair in (5, ((1,), (0,), (2,)), "ab"):
            with pytest.raises(RequestError, match=r"^request 1 of 2: expected \(local ids, remote ids\), got "):
                plan_batch([one, not_a_pair])
        with pytest.raises(RequestError, match="same local block"):
            plan_batch([([1, 2], [0, 1]), ([3, 2], [4, 5])])
        with pytest.raises(RequestError, match="out of range"):
            plan_batch([([1], [0]), ([2], [8])])
        shared = plan_batch([([1, 2], [0, 1]), ([3, 4], [0, 1])])
        assert pieces_of(shared, 64) == [(64, 1000), (128, 1064), (192, 1000), (256, 1064)]
    with pytest.raises(ArgumentError, match="max_bytes"):
        plan.merged_batch([([1], [0])], max_bytes=True)


def test_a_batch_refusal_names_the_request_and_the_block():
    """A refused batch says which request (its index in the batch) is at fault, and for a
    local block named twice, the block and both requests; a batch of one needs no index."""
    plan = plan_transfer(fake_table([0], 64, 8), fake_table([1000], 64, 8))
    for plan_batch in (plan.merged_batch, plan.descriptor_batch, plan.merged_layers):
        with pytest.raises(RequestError) as refused:
            plan_batch([([1, 2], [0, 1]), ([3, 4], [2, 3]), ([5, 6, 4], [4, 5, 6]), ([7, 1], [6, 7])])
        assert str(refused.value) == (  # the first repeat in batch order, not the smallest block repeated
            "requests 1 and 2 of one transfer name the same local block 4: it would be written twice"
        )
        with pytest.raises(RequestError) as refused:  # block 5 repeats later in the batch than block 1 does
            plan_batch([([5, 1], [0, 1]), ([1, 7], [2, 3]), ([5], [4])])
        assert str(refused.value).startswith("requests 0 and 1 of one transfer name the same local block 1:")
        with pytest.raises(RequestError) as refused:
            plan_batch([([1], [0]), ([2], [1]), ([3], [9])])
        assert str(refused.value) == "request 2 of 3: remote_ids: block id 9 at position 0 is out of range [0, 8)"
        with pytest.raises(RequestError) as refused:
            plan_batch([([1], [0]), ([2, 3], [1])])
        assert str(refused.value) == (
            "request 1 of 2: 1 remote blocks of 1 tokens need 1 local blocks of 1 tokens, got 2 local block ids"
        )
        with pytest.raises(RequestError) as refused:
            plan_batch([([8], [0])])
        assert str(refused.value) == "local_ids: block id 8 at position 0 is out of range [0, 8)"


def layer_views(buffer):
    """Per-layer ``KBNHC`` views of one block-major ``[B, L, K, N, H, C]`` buffer: the layers of a
    block lie back to back (a cross-layer layout)."""
    return {f"l{i}": buffer[:, i].permute(1, 0, 2, 3, 4) for i in range(buffer.shape[1])}


@pytest.mark.parametrize("bound", [1 << 30, 600])
def test_layers_in_one_buffer_merge_across_layers(bound):
    """Layers laid out block by block in one buffer, on both sides: where NIXL holds each side
    as one region (one domain), a run of blocks moves as one descriptor for every layer."""
    remote_buffer = fill_random(torch.empty(12, 3, 2, 8, 2, 4, dtype=torch.bfloat16), 3)
    local_buffer = fill_random(torch.empty(10, 3, 2, 8, 2, 4, dtype=torch.bfloat16), 4)
    expected = local_buffer.clone()
    remote, local = layer_views(remote_buffer), layer_views(local_buffer)
    plan = plan_transfer(region_table(local, "KBNHC"), region_table(remote, "KBNHC"))
    assert plan.chunk_bytes == 2 * 8 * 2 * 4 * 2 and len(plan.local.streams) == 3
    local_ids, remote_ids = [4, 5, 6, 1], [7, 8, 9, 2]
    one = np.zeros(3, dtype=np.int64)
    merged = plan.merged_pairs(local_ids, remote_ids, max_bytes=bound, local_domains=one, remote_domains=one)
    per_piece = plan.descriptor_pairs(local_ids, remote_ids)
    assert_same_pairs(per_piece, merged, plan.chunk_bytes)
    if bound > 1 << 20:  # by local address: block 1 of every layer, then blocks 4..6 of every layer
        assert merged[0][:, 1].tolist() == [3 * plan.chunk_bytes, 3 * 3 * plan.chunk_bytes]
    else:  # two layer regions at most: block 1 as 2 + 1, blocks 4..6 as 2 + 2 + 2 + 2 + 1
        assert merged[0][:, 1].tolist() == [512, 256, 512, 512, 512, 512, 256]
    memmove_rows(*merged)
    for local_block, remote_block in zip(local_ids, remote_ids):
        expected[local_block] = remote_buffer[remote_block]
    assert torch.equal(raw(local_buffer), raw(expected))


# (axes, sender memory order, receiver memory order, sizes but B, N and H); the sender's 4
# heads are shared out to 2 receiver ranks of 2 heads each.
HEAD_SHARES = {
    "HND->NHD": ("KBNHC", "KBHNC", "KBNHC", dict(K=2, C=4), False),
    "HND->HND": ("KBNHC", "KBHNC", "KBHNC", dict(K=2, C=4), False),
    "per-head": ("BHNC", "HBNC", "HBNC", dict(C=4), False),
    "HND token runs": ("KBNHC", "KBHNC", "KBHNC", dict(K=2, C=4), True),
}


def heads_of(tokens, layout, first, count):
    """``[tokens, *block_letters]`` cut to heads ``first .. first + count - 1``."""
    h = 1 + block_letters(layout).index("H")
    return tokens.narrow(h, first, count)


@pytest.mark.parametrize("merge", MERGES)
@pytest.mark.parametrize("ids", IDS)
@pytest.mark.parametrize(("remote_size", "local_size", "count"), [(4, 16, 7), (32, 8, 2), (8, 8, 3)])
@pytest.mark.parametrize("share", HEAD_SHARES)
def test_each_receiver_rank_reads_its_share_of_the_heads(share, remote_size, local_size, count, ids, merge):
    """Heterogeneous tensor parallelism: every rank's blocks end up with the sender's tokens of its heads."""
    axes, remote_memory, local_memory, sizes, token_runs = HEAD_SHARES[share]
    remote = caches_for(axes, remote_memory, dict(sizes, H=4), remote_size, 16, seed=4)
    remote_table = region_table(remote, axes)
    all_local, all_remote = IDS[ids]
    remote_ids = all_remote[:count]
    for rank in range(2):
        local = caches_for(axes, local_memory, dict(sizes, H=2), local_size, 24, seed=40 + rank)
        before = {name: raw(t).clone() for name, t in local.items()}
        local_table, share_table = region_table(local, axes), remote_table.heads(2 * rank, 2)
        if token_runs:
            local_table, share_table = local_table.token_runs(), remote_table.token_runs().heads(2 * rank, 2)
        plan = plan_transfer(local_table, share_table)
        local_ids = all_local[: plan.local_blocks_for(count)]
        local_rows, remote_rows = pairs(plan, local_ids, remote_ids, MERGES[merge])
        memmove_rows(local_rows, remote_rows)
        # Only the share moves: tokens x 2 heads x C x K x 2 layers x 2 bytes.
        assert (
            int(local_rows[:, 1].sum())
            == plan.bytes_for(count)
            == count * remote_size * 2 * sizes["C"] * (sizes.get("K", 1) * 2 * 2)
        )
        if not token_runs:
            kvhost.receive(
                local, {"x": local_ids}, axes=axes, remote_order=plan.remote_order, remote_block_size=remote_size
            )
        tokens = count * remote_size
        for r, lo in zip(CacheSet(remote, axes).members, CacheSet(local, axes).members):
            got = read_tokens(lo.tensor, lo.layout, local_ids)
            want = heads_of(read_tokens(r.tensor, r.layout, remote_ids), r.layout, 2 * rank, 2)
            assert torch.equal(got[:tokens], want), f"rank {rank}, {lo.layer}"
            if token_runs:  # no post-process: the last block's tokens past the sender's stay
                assert torch.equal(got[tokens:], read_tokens(before[lo.layer], lo.layout, local_ids)[tokens:])
            assert untouched_blocks_same(lo.tensor, before[lo.layer], lo.layout, local_ids)


def test_a_share_of_heads_needs_them_apart_and_in_range():
    sizes = dict(K=2, H=4, C=4, N=8, B=4)
    token_major = region_table({"l": make_cache("KBNHC", "KBNHC", sizes)}, "KBNHC")
    scattered = r"heads of a 'NHC' region is scattered over its tokens: .*plan_ranks reads such a share as byte"
    with pytest.raises(LayoutError, match=scattered):
        token_major.heads(0, 2)
    head_major = region_table({"l": make_cache("KBNHC", "KBHNC", sizes)}, "KBNHC")
    with pytest.raises(LayoutError, match=r"heads 3..4 are not within the 4 heads"):
        head_major.heads(3, 2)
    with pytest.raises(LayoutError, match=r"heads 0..-1"):
        head_major.heads(0, 0)
    assert head_major.heads(0, 4) == head_major
    mla = region_table({"l": make_cache("BNC", "BNC", dict(B=4, N=8, C=12))}, "BNC")
    with pytest.raises(LayoutError, match="no heads"):
        mla.heads(0, 1)
    # A rank's share does not pair with a receiver holding every head.
    with pytest.raises(LayoutError, match="differ beyond N"):
        plan_transfer(head_major, head_major.heads(0, 2))
    # A table made by hand that names a stream twice (from_dict refuses one from a peer).
    twice = replace(head_major, streams=(*head_major.streams, head_major.streams[1]))
    for local, remote, side in ((twice, head_major, "local"), (head_major, twice, "remote")):
        with pytest.raises(LayoutError, match=rf"^{side} l\[K=1\] appears twice in its table$"):
            plan_transfer(local, remote)


def test_heads_apart_makes_each_head_a_stream_where_its_bytes_are_one_run(monkeypatch):
    """``heads_apart``: each stream becomes one per head, at the head's offset in the block,
    with ``H`` named by the streams instead of the region; only head-major regions and
    regions of one head can, a table whose heads are streams is itself, and the streams
    made are held to ``MAX_STREAMS``."""
    sizes = dict(K=2, H=1, C=4, N=8, B=4)
    for memory, order in (("KBNHC", "NHC"), ("KBHNC", "HNC")):  # one head: anywhere
        table = region_table({"l": make_cache("KBNHC", memory, sizes)}, "KBNHC")
        assert table.order == order
        apart = table.heads_apart()
        assert (apart.order, apart.split, apart.run_bytes, apart.sizes) == ("NC", "", table.run_bytes, table.sizes)
        assert [s.coords for s in apart.streams] == [(("K", 0), ("H", 0)), (("K", 1), ("H", 0))]
        assert (table.coordinates, apart.coordinates) == ("K", "KH")
        assert [(s.address, s.block_stride) for s in apart.streams] == [
            (s.address, s.block_stride) for s in table.streams
        ]
    head_major = region_table({"l": make_cache("KBNHC", "KBHNC", sizes | {"H": 3})}, "KBNHC")
    apart = head_major.heads_apart()
    run = 8 * 4 * 2  # a head's tokens: N x C, 2 bytes
    assert apart.run_bytes == run and apart.order == "NC"
    assert [(s.coords, s.address - head_major.streams[0].address, s.block_stride) for s in apart.streams] == [
        ((("K", k), ("H", h)), k * 3 * run * 4 + h * run, 3 * run) for k in range(2) for h in range(3)
    ]
    per_head = region_table({"l": make_cache("KBNHC", "KHBNC", sizes | {"H": 2})}, "KBNHC")
    assert per_head.heads_apart() is per_head and per_head.coordinates == "KH"
    assert region_table({"l": make_cache("BNC", "BNC", dict(B=4, N=8, C=12))}, "BNC").coordinates == ""  # one stream
    with pytest.raises(LayoutError, match="the heads of a 'NHC' region are not runs of their own"):
        region_table({"l": make_cache("KBNHC", "KBNHC", sizes | {"H": 2})}, "KBNHC").heads_apart()  # token-major
    with pytest.raises(LayoutError, match=r"this table has no heads \(H\) to read apart"):
        region_table({"l": make_cache("BNC", "BNC", dict(B=4, N=8, C=12))}, "BNC").heads_apart()
    nowhere = replace(head_major, order="NC", sizes=head_major.sizes | {"H": 1})  # made by hand
    with pytest.raises(LayoutError, match=r"1 heads \(H\) are neither in the region 'NC' nor stream coordinates"):
        nowhere.heads_apart()
    # Counted from the sizes before any is made: one per stream and head, or the table's own.
    assert (head_major.streams_apart, per_head.streams_apart) == (6, len(per_head.streams))
    no_heads = region_table({"l": make_cache("KBNC", "KBNC", dict(K=2, B=4, N=8, C=12))}, "KBNC")
    assert no_heads.streams_apart == len(no_heads.streams) == 2  # no H: as many as it has (heads_apart refuses it)
    monkeypatch.setattr(tables, "MAX_STREAMS", 6)
    assert len(head_major.heads_apart().streams) == 6
    monkeypatch.setattr(tables, "MAX_STREAMS", 5)
    with pytest.raises(LayoutError, match="2 streams of 3 heads are 6 streams head by head, more than the 5"):
        head_major.heads_apart()


def test_k_as_tuple_pairs_with_k_as_axis():
    """A sender with one [2, B, H, N, C] tensor per layer, a receiver with (K, V) tensors per layer."""
    sizes = dict(H=2, C=4)
    remote = caches_for("KBNHC", "KBHNC", dict(sizes, K=2), 4, 12, seed=5)
    local = {
        name: tuple(fill_random(make_cache("BNHC", "BNHC", dict(sizes, N=8, B=10)), 60 + k) for k in range(2))
        for name in remote
    }
    plan = plan_transfer(region_table(local, "KBNHC"), region_table(remote, "KBNHC"))
    memmove_rows(*plan.descriptor_pairs([6, 2], [9, 4, 1, 7]))
    kvhost.receive(local, {"x": [6, 2]}, axes="KBNHC", remote_order="HNC", remote_block_size=4)
    for name, tensor in remote.items():
        layout = CacheSet({name: tensor}, "KBNHC").layout
        truth = read_tokens(tensor, layout, [9, 4, 1, 7])  # [tokens, K, H, C]
        for k, member in enumerate(local[name]):
            member_layout = CacheSet({name: member}, "BNHC").layout
            assert torch.equal(read_tokens(member, member_layout, [6, 2]), truth[:, k])


def test_tables_and_plans_reject_mismatches():
    small = dict(K=2, H=2, C=4)
    hnd = region_table(caches_for("KBNHC", "KBHNC", small, 4, 8, seed=0), "KBNHC")
    nhd16_caches = caches_for("KBNHC", "KBNHC", small, 16, 8, seed=0)
    nhd16 = region_table(nhd16_caches, "KBNHC")
    with pytest.raises(LayoutError, match=r"sizes .* differ beyond N"):
        plan_transfer(region_table(caches_for("KBNHC", "KBNHC", dict(K=2, H=3, C=4), 16, 8, seed=0), "KBNHC"), hnd)
    with pytest.raises(LayoutError, match="do not divide"):
        plan_transfer(region_table(caches_for("KBNHC", "KBNHC", small, 6, 8, seed=0), "KBNHC"), hnd)
    with pytest.raises(LayoutError, match="hold different letters"):
        plan_transfer(region_table(caches_for("BKNHC", "BKNHC", small, 16, 8, seed=0), "BKNHC"), hnd)
    with pytest.raises(LayoutError, match="token runs pair only"):
        plan_transfer(nhd16, hnd.token_runs())
    with pytest.raises(LayoutError, match="no partner"):
        renamed = caches_for("KBNHC", "KBNHC", small, 16, 8, seed=0)
        plan_transfer(region_table({"other": renamed["l0"], "l1": renamed["l1"]}, "KBNHC"), hnd)
    # The first remote stream left over is named (l0's streams have their partners).
    with pytest.raises(LayoutError, match=r"^remote l1\[K=0\] has no partner among the local streams$"):
        plan_transfer(region_table({"l0": nhd16_caches["l0"]}, "KBNHC"), hnd)
    with pytest.raises(LayoutError, match="item size"):
        plan_transfer(
            region_table({"l0": make_cache("KBNHC", "KBNHC", dict(small, N=16, B=8), torch.float32)}, "KBNHC"),
            region_table({"l0": make_cache("KBNHC", "KBHNC", dict(small, N=4, B=8))}, "KBNHC"),
        )
    plan = plan_transfer(nhd16, hnd)
    with pytest.raises(RequestError, match="need 1 local blocks"):
        plan.descriptor_pairs([1, 2], [0, 1])
    with pytest.raises(RequestError, match="out of range"):
        plan.descriptor_pairs([1], [0, 8])
    with pytest.raises(RequestError, match="appears twice"):
        plan.descriptor_pairs([1], [3, 3])
    with pytest.raises(RequestError, match="empty"):
        plan.descriptor_pairs([], [])
    with pytest.raises(LayoutError, match="not meta"):
        region_table({"l": make_cache("KBNHC", "KBNHC", dict(small, N=4, B=2), device="meta")}, "KBNHC")


def test_token_runs_are_held_to_the_streams_a_table_may_have():
    """A head-major table cut into runs of tokens has a stream per head: a peer's table of
    2^15 heads in two streams would make 65,538 (one Python object each)."""
    cache = make_cache("KBNHC", "KBHNC", dict(K=2, B=2, N=4, H=1 << 15, C=4))  # 4 MiB
    table = region_table({"l": cache}, "KBNHC")
    with pytest.raises(LayoutError, match=r"token runs of 2 streams cut at 'H' .* are 65538 streams, more than"):
        replace(table, sizes=dict(table.sizes, H=(1 << 15) + 1)).token_runs()
    assert len(table.token_runs().streams) == 1 << 16


def test_table_round_trip_and_strict_parsing():
    caches = caches_for("KBNHC", "KBHNC", dict(K=2, H=2, C=4), 4, 8, seed=0)
    table = region_table(caches, "KBNHC")
    again = RegionTable.from_dict(table.to_dict())
    assert again == table
    assert RegionTable.from_dict(table.token_runs().to_dict()) == table.token_runs()
    assert table.outer == "K" and table.order == "HNC" and table.block_size == 4
    assert len(table.streams) == 2 * 2  # layers x K
    data = table.to_dict()
    data["streams"]["coords"][1] = data["streams"]["coords"][0]  # layer 0's V stream is now its K stream
    with pytest.raises(ProtocolError, match=r"table\.streams\[1\]: l0\[K=0\] appears twice"):
        RegionTable.from_dict(data)
    # Over the wire: the per-stream numbers travel as arrays and come back the same.
    message = decode(encode("table", {"table": table.to_dict()}))
    assert RegionTable.from_dict(message.header["table"], "table", message.arrays) == table


def test_memory_spans_merge_shared_memory():
    whole = torch.zeros(4, 2, 8, 3, dtype=torch.float16)  # one tensor, layers along dim 0
    layers = list(whole.unbind(0))
    spans = memory_spans(layers)
    assert spans == [(whole.data_ptr(), whole.numel() * 2)]
    apart = [torch.zeros(10), torch.zeros(10)]
    assert sorted(memory_spans(apart)) == sorted((t.data_ptr(), 40) for t in apart)
    permuted = torch.zeros(2, 3, 5).permute(2, 0, 1)
    assert memory_spans([permuted]) == [(permuted.data_ptr(), 30 * 4)]


def test_importing_kvhost_does_not_import_nixl():
    code = (
        "import sys, kvhost, kvhost.nixl, kvhost_tools.demo.cli\n"
        "print(sorted(m for m in sys.modules if 'nixl' in m and not m.startswith('kvhost.nixl.')))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.strip() == "['kvhost.nixl']"


# --- real NIXL, two agents in this process ------------------------------------------------------


NIXL_INSTALLED = any(importlib.util.find_spec(name.split(".")[0]) for name in NIXL_MODULES)
needs_nixl = pytest.mark.skipif(not NIXL_INSTALLED, reason="NIXL is not installed (pip install 'kvhost[nixl]')")


@pytest.fixture(scope="module")
def agents():
    from kvhost.nixl import Agent

    with Agent("test-prefill") as sender, Agent("test-decode") as receiver:
        yield sender, receiver


def expose(sender, receiver, caches):
    """Register ``caches`` with the sender and (re)load its metadata into the receiver."""
    table = sender.register(caches, "KBNHC")
    return receiver.add_peer(sender.metadata()), table


@needs_nixl
@pytest.mark.timeout(60)
@pytest.mark.parametrize("ids", IDS)
@pytest.mark.parametrize(("remote_size", "local_size", "count"), [(4, 16, 6), (32, 8, 2)])
def test_nixl_read_lands_what_the_descriptors_say(agents, remote_size, local_size, count, ids):
    """A read with merged descriptors (the reader's default) lands what the per-piece rows,
    moved one by one, would."""
    sender, receiver = agents
    sizes = dict(K=2, H=2, C=8)
    remote = caches_for("KBNHC", "KBHNC", sizes, remote_size, 16, seed=7, layers=3)
    local = caches_for("KBNHC", "KBNHC", sizes, local_size, 24, seed=70, layers=3)
    simulated = {name: t.clone() for name, t in local.items()}
    peer, remote_table = expose(sender, receiver, remote)
    plan = plan_transfer(receiver.register(local, "KBNHC"), remote_table)
    all_local, all_remote = IDS[ids]
    local_ids, remote_ids = all_local[: plan.local_blocks_for(count)], all_remote[:count]
    transfer = receiver.reader(plan, peer).read(local_ids, remote_ids)
    transfer.wait(timeout=20)
    assert transfer.poll() and transfer.nbytes == plan.bytes_for(count)
    per_piece = plan.descriptor_pairs(local_ids, remote_ids)[0].shape[0]
    assert (transfer.descriptors < per_piece) if ids == "runs" else (transfer.descriptors <= per_piece)
    transfer.release()
    sim_plan = plan_transfer(region_table(simulated, "KBNHC"), remote_table)
    memmove_rows(*sim_plan.descriptor_pairs(local_ids, remote_ids))
    for name in local:
        assert torch.equal(raw(local[name]), raw(simulated[name])), name
    kvhost.receive(local, {"x": local_ids}, axes="KBNHC", remote_order="HNC", remote_block_size=remote_size)
    for (name, r), lo in zip(remote.items(), local.values()):
        got = read_tokens(lo, CacheSet({name: lo}, "KBNHC").layout, local_ids)[: count * remote_size]
        assert torch.equal(got, read_tokens(r, CacheSet({name: r}, "KBNHC").layout, remote_ids))


@needs_nixl
@pytest.mark.timeout(60)
def test_nixl_reads_a_batch_of_requests_as_one_transfer(agents):
    """Several requests read as one transfer land what each read alone lands; a batch that
    names one local block twice is refused before anything moves."""
    sender, receiver = agents
    sizes = dict(K=2, H=2, C=8)
    remote = caches_for("KBNHC", "KBHNC", sizes, 4, 16, seed=17, layers=3)
    peer, remote_table = expose(sender, receiver, remote)
    landed = []
    for together in (False, True):
        local = caches_for("KBNHC", "KBNHC", sizes, 16, 24, seed=71, layers=3)
        plan = plan_transfer(receiver.register(local, "KBNHC"), remote_table)
        requests = split_batch(plan, [5, 1, 8, 3], 24, 16, seed=3)
        reader = receiver.reader(plan, peer)
        if together:
            before = [raw(t).clone() for t in local.values()]
            with pytest.raises(RequestError, match="same local block"):
                reader.read_batch([requests[0], requests[0]])
            assert all(torch.equal(raw(t), b) for t, b in zip(local.values(), before))
            transfer = reader.read_batch(requests)
            transfer.wait(timeout=20)
            assert transfer.nbytes == plan.bytes_for(17)
            assert transfer.descriptors == reader.batch_descriptors(requests)[0].shape[0]
            transfer.release()
        else:
            for request in requests:
                transfer = reader.read(*request)
                transfer.wait(timeout=20)
                transfer.release()
        landed.append([raw(t).clone() for t in local.values()])
    assert all(torch.equal(a, b) for a, b in zip(*landed))


@needs_nixl
@pytest.mark.timeout(60)
@pytest.mark.parametrize("bound", [None, 1 << 20])
def test_nixl_reads_a_batch_layer_by_layer(agents, monkeypatch, bound):
    """``read_layers`` yields each local layer once its bytes have landed, the next layer's
    transfer posted: received then, each holds the sender's tokens, and the whole lands what
    ``read_batch`` then one receive leave. A bad timeout or batch is refused before anything
    is posted; a transfer that cannot be made, or a loop left early, leaves none posted."""
    sender, receiver = agents
    sizes = dict(K=2, H=2, C=8)
    remote = caches_for("KBNHC", "KBHNC", sizes, 4, 16, seed=17, layers=3)
    peer, remote_table = expose(sender, receiver, remote)
    released = []
    real_release = Transfer.release
    monkeypatch.setattr(Transfer, "release", lambda self: (released.append(self), real_release(self)))
    posted = []
    real_post = receiver.nixl.transfer

    def post(handle, *rest):
        posted.append(handle)
        state = real_post(handle, *rest)
        return "PROC" if state == "DONE" else state  # as a transfer larger than these still in flight

    monkeypatch.setattr(receiver.nixl, "transfer", post)
    landed = []
    for layered in (False, True):
        local = caches_for("KBNHC", "KBNHC", sizes, 16, 24, seed=71, layers=3)
        plan = plan_transfer(receiver.register(local, "KBNHC"), remote_table)
        requests = split_batch(plan, [5, 1, 8, 3], 24, 16, seed=3)
        named = {f"r{i}": local_ids for i, (local_ids, _) in enumerate(requests)}
        reader = receiver.reader(plan, peer, max_descriptor_bytes=bound)
        host = kvhost.KVHost(local, axes="KBNHC")
        if layered:
            for timeout in (-1, float("nan"), True):
                with pytest.raises(InvalidTimeoutError):
                    reader.read_layers(requests, timeout=timeout)
            with pytest.raises(RequestError, match="same local block"):
                reader.read_layers([requests[0], requests[0]], timeout=20)
            rows = reader.layer_descriptors(requests)
            assert list(rows) == list(local)
            assert sum(r.shape[0] for r, _ in rows.values()) == reader.batch_descriptors(requests)[0].shape[0]
            assert all(int(r[:, 1].sum()) == plan.bytes_for(17) // 3 for r, _ in rows.values())
            posted.clear()
            released.clear()
            order = []
            for name in reader.read_layers(requests, timeout=20):
                order.append(name)
                assert len(posted) == min(len(order) + 1, 3)  # the next layer already posted
                host.receive(named, remote_order="HNC", remote_block_size=4, layers=[name])
                lo, r = local[name], remote[name]
                for local_ids, remote_ids in requests:
                    got = read_tokens(lo, CacheSet({name: lo}, "KBNHC").layout, local_ids)[: 4 * len(remote_ids)]
                    assert torch.equal(got, read_tokens(r, CacheSet({name: r}, "KBNHC").layout, remote_ids)), name
            assert order == list(local)
            assert len({id(t) for t in released}) == 3 and all(t.finished is not None for t in released)
        else:
            transfer = reader.read_batch(requests)
            transfer.wait(timeout=20)
            transfer.release()
            host.receive(named, remote_order="HNC", remote_block_size=4)
        landed.append([raw(t).clone() for t in local.values()])
    assert all(torch.equal(a, b) for a, b in zip(*landed))
    released.clear()
    layers = reader.read_layers(requests, timeout=20)
    assert next(layers) == "l0"
    layers.close()  # left after one layer: the second layer's transfer is released
    assert len({id(t) for t in released}) == 2 and all(t.released for t in released)
    made = []
    real_make = receiver.nixl.initialize_xfer

    def make_two(*args):
        if len(made) == 2:
            raise RuntimeError("no more requests")
        made.append(real_make(*args))
        return made[-1]

    monkeypatch.setattr(receiver.nixl, "initialize_xfer", make_two)
    released.clear()
    layers = reader.read_layers(requests, timeout=20)
    assert next(layers) == "l0"
    with pytest.raises(TransferError, match="creating the transfer failed: no more requests"):
        next(layers)
    assert len({id(t) for t in released}) == 2 and all(t.released for t in released)


@needs_nixl
@pytest.mark.timeout(60)
def test_nixl_merges_descriptors_within_registered_memory(agents):
    """Layers laid out block by block in one buffer on both sides: the reader finds each side
    registered as one region, and a run of blocks moves as one descriptor for every layer;
    one descriptor per piece when asked. Both land the same bytes."""
    sender, receiver = agents
    remote_buffer = fill_random(torch.empty(12, 3, 2, 8, 2, 4, dtype=torch.bfloat16), 5)
    peer, remote_table = expose(sender, receiver, layer_views(remote_buffer))
    local_ids, remote_ids = [4, 5, 6, 1], [7, 8, 9, 2]
    landed = []
    for bound, descriptors in ((None, 12), (1 << 20, 2)):
        local_buffer = torch.zeros(10, 3, 2, 8, 2, 4, dtype=torch.bfloat16)
        plan = plan_transfer(receiver.register(layer_views(local_buffer), "KBNHC"), remote_table)
        reader = receiver.reader(plan, peer, max_descriptor_bytes=bound)
        if bound is not None:
            assert reader.local_domains.tolist() == reader.remote_domains.tolist() == [0, 0, 0]
        transfer = reader.read(local_ids, remote_ids)
        transfer.wait(timeout=20)
        assert transfer.descriptors == descriptors and transfer.nbytes == 4 * 3 * plan.chunk_bytes
        transfer.release()
        landed.append(local_buffer)
    assert torch.equal(raw(landed[0]), raw(landed[1]))
    assert torch.equal(raw(landed[1][[4, 5, 6, 1]]), raw(remote_buffer[[7, 8, 9, 2]]))


@needs_nixl
@pytest.mark.timeout(60)
def test_nixl_merges_nothing_a_peer_registered_block_by_block(agents):
    """A peer that registered every block region on its own: no descriptor may span two, so
    the reader merges nothing on that side, and the bytes still land."""
    sender, receiver = agents
    sizes = dict(K=2, H=2, C=8)
    remote = caches_for("KBNHC", "KBHNC", sizes, 4, 8, seed=14, layers=2)
    remote_table = region_table(remote, "KBNHC")
    rows = [
        (s.address + b * s.block_stride, remote_table.run_bytes, 0, "")
        for s in remote_table.streams
        for b in range(remote_table.num_blocks)
    ]
    registered = sender.nixl.register_memory(rows, "DRAM")
    try:
        peer = receiver.add_peer(sender.metadata())
        local = caches_for("KBNHC", "KBNHC", sizes, 16, 4, seed=140, layers=2)
        plan = plan_transfer(receiver.register(local, "KBNHC"), remote_table)
        reader = receiver.reader(plan, peer)
        assert (reader.remote_domains == -1).all() and (reader.local_domains >= 0).all()
        transfer = reader.read([1, 2], [0, 1, 2, 3, 4, 5, 6, 7])
        transfer.wait(timeout=20)
        assert transfer.descriptors == 4 * 8  # streams x sender blocks: none merged
        transfer.release()
        for (name, r), lo in zip(remote.items(), local.values()):
            kvhost.receive({name: lo}, {"x": [1, 2]}, axes="KBNHC", remote_order="HNC", remote_block_size=4)
            got = read_tokens(lo, CacheSet({name: lo}, "KBNHC").layout, [1, 2])
            assert torch.equal(got, read_tokens(r, CacheSet({name: r}, "KBNHC").layout, list(range(8))))
    finally:
        sender.nixl.deregister_memory(registered)


@needs_nixl
@pytest.mark.timeout(60)
def test_nixl_reads_a_share_of_the_heads_for_each_rank(agents):
    """A sender with 4 heads, head-major blocks of 16; two receiver ranks of 2 heads, token-major blocks of 32."""
    sender, receiver = agents
    remote = caches_for("KBNHC", "KBHNC", dict(K=2, H=4, C=8), 16, 8, seed=12)
    peer, remote_table = expose(sender, receiver, remote)
    remote_ids = [5, 2, 7]
    for rank in range(2):
        local = caches_for("KBNHC", "KBNHC", dict(K=2, H=2, C=8), 32, 6, seed=120 + rank)
        plan = plan_transfer(receiver.register(local, "KBNHC"), remote_table.heads(2 * rank, 2))
        local_ids = [4, 1]
        transfer = receiver.reader(plan, peer).read(local_ids, remote_ids)
        transfer.wait(timeout=20)
        assert transfer.nbytes == 3 * 16 * 2 * 8 * 2 * 2 * 2  # tokens x heads x C x K x layers x bytes
        transfer.release()
        kvhost.receive(local, {"x": local_ids}, axes="KBNHC", remote_order=plan.remote_order, remote_block_size=16)
        for (name, r), lo in zip(remote.items(), local.values()):
            layout = CacheSet({name: r}, "KBNHC").layout
            want = heads_of(read_tokens(r, layout, remote_ids), layout, 2 * rank, 2)
            got = read_tokens(lo, CacheSet({name: lo}, "KBNHC").layout, local_ids)[:48]
            assert torch.equal(got, want), f"rank {rank}, {name}"


@needs_nixl
@pytest.mark.timeout(60)
def test_nixl_write_pushes_token_runs_into_the_peer_layout(agents):
    """The pushing side: head-major blocks of 16 written into the peer's head-major blocks of 4."""
    sender, receiver = agents
    sizes = dict(K=2, H=2, C=8)
    target = caches_for("KBNHC", "KBHNC", sizes, 4, 12, seed=9)
    source = caches_for("KBNHC", "KBHNC", sizes, 16, 4, seed=90)
    before = {name: raw(t).clone() for name, t in target.items()}
    peer, target_table = expose(sender, receiver, target)
    plan = plan_transfer(receiver.register(source, "KBNHC").token_runs(), target_table.token_runs())
    target_ids = [11, 0, 6, 3, 8, 5]
    source_ids = [2, 0]  # 32 tokens hold the 6 x 4 = 24 target tokens, and 8 more that stay home
    transfer = receiver.reader(plan, peer).write(source_ids, target_ids)
    transfer.wait(timeout=20)
    transfer.release()
    for (name, t), s in zip(target.items(), source.values()):
        layout = CacheSet({name: t}, "KBNHC").layout
        sent = read_tokens(s, CacheSet({name: s}, "KBNHC").layout, source_ids)[:24]
        assert torch.equal(read_tokens(t, layout, target_ids), sent)
        assert untouched_blocks_same(t, before[name], layout, target_ids)


@needs_nixl
@pytest.mark.timeout(60)
def test_nixl_metadata_loaded_again_replaces_the_peers_old_registrations(agents):
    """A peer registered 64-byte pieces, deregistered them and registered the whole buffer.
    NIXL alone merges the two views and then refuses 95 of the buffer's 128 pieces (found
    when a CI run's heap put one test's tensors where another's had been); add_peer loads
    the peer afresh, so every piece is found and a read of the whole buffer lands."""
    sender, receiver = agents
    buffer = torch.arange(8192, dtype=torch.int32).to(torch.uint8)
    start = buffer.data_ptr()
    pieces = sender.nixl.register_memory([(start + 128 * i, 64, 0, "") for i in range(32)], "DRAM")
    peer = receiver.add_peer(sender.metadata())
    sender.nixl.deregister_memory(pieces)
    whole = sender.nixl.register_memory([(start, 8192, 0, "")], "DRAM")
    landing = torch.zeros(8192, dtype=torch.uint8)
    mine = receiver.nixl.register_memory([(landing.data_ptr(), 8192, 0, "")], "DRAM")
    try:
        assert receiver.add_peer(sender.metadata()) == peer
        for offset in range(0, 8192, 64):
            rows = np.array([[start + offset, 64, 0]], dtype=np.uint64)
            receiver.nixl.prep_xfer_dlist(peer, rows, "DRAM").release()
        local = receiver.nixl.get_xfer_descs(np.array([[landing.data_ptr(), 8192, 0]], dtype=np.uint64), "DRAM")
        remote = receiver.nixl.get_xfer_descs(np.array([[start, 8192, 0]], dtype=np.uint64), "DRAM")
        handle = receiver.nixl.initialize_xfer("READ", local, remote, peer, b"")
        state, deadline = receiver.nixl.transfer(handle), time.monotonic() + 20
        while state == "PROC" and time.monotonic() < deadline:
            state = receiver.nixl.check_xfer_state(handle)
        assert state == "DONE"
        receiver.nixl.release_xfer_handle(handle)
        assert torch.equal(landing, buffer)
    finally:
        receiver.nixl.deregister_memory(mine)
        sender.nixl.deregister_memory(whole)
        receiver.add_peer(sender.metadata())


@needs_nixl
@pytest.mark.timeout(60)
def test_nixl_errors_are_kvhost_errors(agents):
    sender, receiver = agents
    sizes = dict(K=2, H=2, C=8)
    registered = caches_for("KBNHC", "KBNHC", sizes, 8, 4, seed=11)
    never_registered = caches_for("KBNHC", "KBNHC", sizes, 8, 4, seed=12)
    peer, _ = expose(sender, receiver, registered)
    local_table = receiver.register(caches_for("KBNHC", "KBNHC", sizes, 8, 4, seed=13), "KBNHC")
    with pytest.raises(TransferError, match="has not registered"):
        receiver.reader(plan_transfer(local_table, region_table(never_registered, "KBNHC")), peer)
    with pytest.raises(TransferError, match="no peer 'nobody'"):
        receiver.reader(plan_transfer(local_table, region_table(registered, "KBNHC")), "nobody")
    with pytest.raises(ProtocolError, match="rejected by NIXL"):
        receiver.add_peer(b"nixlSerDes|" + bytes(range(64)))
    with pytest.raises(ProtocolError, match="must be bytes, got str"):
        receiver.add_peer("nixlSerDes|")
    reader = receiver.reader(plan_transfer(local_table, region_table(registered, "KBNHC")), peer)
    with pytest.raises(RequestError):
        reader.read([0, 1], [2])  # one remote block of 8 fills one local block of 8, not two
    for bad in (0, -1, 2.5, True):
        with pytest.raises(TransferError, match="max_descriptor_bytes"):
            receiver.reader(
                plan_transfer(local_table, region_table(registered, "KBNHC")), peer, max_descriptor_bytes=bad
            )
    reader.close()
    with pytest.raises(TransferError, match="closed"):
        reader.read([0], [1])


@needs_nixl
def test_a_missing_transport_is_a_clear_error():
    from kvhost.nixl import Agent

    with pytest.raises(NixlUnavailableError, match="unknown-transport"):
        Agent("no-such-backend", backends=("unknown-transport",))


def test_missing_nixl_is_a_clear_error(monkeypatch):
    from kvhost.nixl import Agent
    from kvhost.nixl import agent as nixl_agent

    monkeypatch.setattr(nixl_agent, "NIXL_MODULES", ("no_such_nixl._api",))
    nixl_agent.load_nixl.cache_clear()
    try:
        with pytest.raises(
            NixlUnavailableError,
            match=r"NIXL is not installed \(no_such_nixl._api: No module named 'no_such_nixl'\); .*kvhost\[nixl\]",
        ):
            Agent("nowhere")
    finally:
        nixl_agent.load_nixl.cache_clear()


def fake_table(addresses, stride, num_blocks, run=64, order="NC", tokens=1):
    """A table of streams at made-up addresses (plans never touch the memory): 1-byte items,
    ``tokens`` tokens of ``run`` bytes a block, stream ``i`` keyed ``K=i``."""
    streams = tuple(Stream("l", (("K", i),), address, stride) for i, address in enumerate(addresses))
    sizes = {"N": tokens, "C": run} if order == "NC" else {"H": 4, "N": tokens, "C": run // 4}
    return RegionTable("DRAM", 0, order, "", sizes, 1, num_blocks, streams)


def rows_of(pair):
    return [rows.tolist() for rows in pair]


def test_merged_pairs_default_bound_is_one_mebibyte():
    """Runs of 512 KiB blocks, dense on both sides: by default a merged row moves 1 MiB at most."""
    run = 1 << 19
    plan = plan_transfer(fake_table([0], run, 8, run), fake_table([1 << 30], run, 8, run))
    assert MAX_DESCRIPTOR_BYTES == 1 << 20
    local, remote = plan.merged_pairs(range(4), range(4))
    assert local.tolist() == [[0, 1 << 20, 0], [1 << 20, 1 << 20, 0]]
    assert remote.tolist() == [[1 << 30, 1 << 20, 0], [(1 << 30) + (1 << 20), 1 << 20, 0]]


def test_interleaving_on_one_side_merges_across_streams():
    """Local streams interleave (the two layers' 128-byte blocks back to back); remote streams
    lie apart, stream 1 starting where stream 0's last 64-byte block ends. One domain a side: a
    local block holds two remote blocks, and the second half of stream 0's block and the first
    half of stream 1's continue one another on both sides when they hold remote blocks 4 then 0."""
    local = fake_table([0, 128], 256, 4, tokens=2)
    remote = fake_table([10_000, 10_000 + 5 * 64], 64, 5)
    plan = plan_transfer(local, remote)
    assert (plan.chunk_bytes, plan.local_parts, plan.remote_parts) == (64, 2, 1)
    zero = np.zeros(2, dtype=np.int64)
    # Pairs (local, remote): (512, 10000), (576, 10256), (640, 10320), (704, 10576).
    got = plan.merged_pairs([2], [0, 4], local_domains=zero, remote_domains=zero)
    assert rows_of(got) == [
        [[512, 64, 0], [576, 128, 0], [704, 64, 0]],
        [[10_000, 64, 0], [10_256, 128, 0], [10_576, 64, 0]],
    ]
    # Each stream its own domain: nothing merges across streams, rows go stream by stream.
    assert rows_of(plan.merged_pairs([2], [0, 4])) == [
        [[512, 64, 0], [576, 64, 0], [640, 64, 0], [704, 64, 0]],
        [[10_000, 64, 0], [10_256, 64, 0], [10_320, 64, 0], [10_576, 64, 0]],
    ]


@pytest.mark.parametrize(
    ("second", "blocks", "want"),
    [
        # Two blocks, stream 1 inside stream 0's blocks: the extents meet only in the last run.
        (64, 2, [(0, 256)]),
        # Three blocks, stream 1 one and a half strides in: stream 0's block 1, stream 1's
        # block 0, stream 0's block 2 and stream 1's block 1 continue one another.
        (192, 3, [(0, 64), (128, 256), (448, 64)]),
    ],
)
def test_streams_whose_extents_overlap_merge_across_streams(second, blocks, want):
    """Two streams of 64-byte blocks every 128 bytes, one domain a side, the same on both:
    wherever their extents overlap, pieces of the two streams may continue one another, and
    merged rows take them together."""
    local = fake_table([0, second], 128, blocks)
    remote = fake_table([10_000, 10_000 + second], 128, blocks)
    plan = plan_transfer(local, remote)
    zero = np.zeros(2, dtype=np.int64)
    ids = list(range(blocks))
    got = plan.merged_pairs(ids, ids, local_domains=zero, remote_domains=zero)
    assert rows_of(got) == [
        [[start, length, 0] for start, length in want],
        [[10_000 + start, length, 0] for start, length in want],
    ]


def test_streams_that_touch_but_do_not_overlap_merge_each_on_its_own():
    """K and V of one tensor, V's blocks right after K's last, one domain a side: the streams do
    not interleave, so each merges on its own; K's last block and V's first (ids 4 then 0)
    would continue one another, and that merge is left out (one more row, same bytes)."""
    local = fake_table([0, 5 * 64], 64, 5)
    remote = fake_table([10_000, 10_000 + 5 * 64], 64, 5)
    plan = plan_transfer(local, remote)
    zero = np.zeros(2, dtype=np.int64)
    got = plan.merged_pairs([4, 0], [4, 0], local_domains=zero, remote_domains=zero)
    assert rows_of(got) == [
        [[256, 64, 0], [0, 64, 0], [576, 64, 0], [320, 64, 0]],
        [[10_256, 64, 0], [10_000, 64, 0], [10_576, 64, 0], [10_320, 64, 0]],
    ]


def test_streams_of_two_kinds_all_get_rows():
    """Stream 0 merges, stream 1 (a negative domain) does not: two kinds of stream, rows for both."""
    local = fake_table([0, 10_000], 64, 8)
    remote = fake_table([20_000, 30_000], 64, 8)
    plan = plan_transfer(local, remote)
    got = plan.merged_pairs([1, 2, 3], [5, 6, 7], local_domains=np.array([-1, 0]))
    assert rows_of(got) == [
        [[64, 64, 0], [128, 64, 0], [192, 64, 0], [10_064, 192, 0]],
        [[20_320, 64, 0], [20_384, 64, 0], [20_448, 64, 0], [30_320, 192, 0]],
    ]


def test_merge_rows_edge_cases():
    """No rows come back as they are; a bound below 1 is refused; a bound of one piece keeps
    the rows as given, in their order."""
    empty = np.empty((0, 3), dtype=np.uint64)
    got = merge_rows(empty, empty, 1 << 20, np.zeros(0), np.zeros(0))
    assert got[0].shape == (0, 3) and got[1].shape == (0, 3)
    local = np.array([[128, 64, 0], [64, 64, 0], [0, 64, 0]], dtype=np.uint64)
    remote = np.array([[1128, 64, 1], [1064, 64, 1], [1000, 64, 1]], dtype=np.uint64)
    zero = np.zeros(3, dtype=np.int64)
    with pytest.raises(ArgumentError, match="max_bytes must be an integer of at least 1, got 0"):
        merge_rows(local, remote, 0, zero, zero)
    assert rows_of(merge_rows(local, remote, 64, zero, zero)) == [local.tolist(), remote.tolist()]
    assert rows_of(merge_rows(local, remote, 127, zero, zero)) == [local.tolist(), remote.tolist()]
    assert rows_of(merge_rows(local, remote, 192, zero, zero)) == [[[0, 192, 0]], [[1000, 192, 1]]]
    # A bound of 1 byte is allowed, and any bound under one piece keeps every piece whole.
    assert rows_of(merge_rows(local, remote, 1, zero, zero)) == [local.tolist(), remote.tolist()]
    assert rows_of(merge_rows(local, remote, 32, zero, zero)) == [local.tolist(), remote.tolist()]
    # One row comes back as it is; two that continue one another become one.
    assert rows_of(merge_rows(local[2:], remote[2:], 192, zero[2:], zero[2:])) == [[[0, 64, 0]], [[1000, 64, 1]]]
    assert rows_of(merge_rows(local[1:], remote[1:], 192, zero[1:], zero[1:])) == [[[0, 128, 0]], [[1000, 128, 1]]]
    # A negative label merges nothing, on either side, even where the labels are equal.
    apart = np.full(3, -1, dtype=np.int64)
    assert rows_of(merge_rows(local, remote, 192, zero, apart)) == [local[::-1].tolist(), remote[::-1].tolist()]
    assert rows_of(merge_rows(local, remote, 192, apart, zero)) == [local[::-1].tolist(), remote[::-1].tolist()]


def test_plans_refuse_empty_requests():
    plan = plan_transfer(fake_table([0], 64, 4), fake_table([1000], 64, 4))
    with pytest.raises(RequestError, match=r"^remote_ids: empty \(no block ids\)$"):
        plan.descriptor_pairs([], [])
    with pytest.raises(RequestError, match=r"^remote_ids: empty \(no block ids\)$"):
        plan.merged_pairs([1], [])
    with pytest.raises(RequestError, match=r"^local_ids: empty \(no block ids\)$"):
        plan.merged_pairs([], [1])
    assert plan.remote_block_size == 1 and plan.remote_order == "NC"


def test_a_bound_of_one_byte_merges_nothing():
    plan = plan_transfer(fake_table([0], 64, 4), fake_table([1000], 64, 4))
    assert rows_of(plan.merged_pairs([0, 1], [2, 3], max_bytes=1)) == rows_of(plan.descriptor_pairs([0, 1], [2, 3]))
    with pytest.raises(ArgumentError, match="max_bytes must be an integer of at least 1, got 0"):
        plan.merged_pairs([0, 1], [2, 3], max_bytes=0)


def test_merge_rows_refuses_rows_of_two_lengths_on_either_side():
    local = np.array([[0, 64, 0], [64, 64, 0]], dtype=np.uint64)
    other = np.array([[1000, 64, 0], [1064, 32, 0]], dtype=np.uint64)
    zero = np.zeros(2, dtype=np.int64)
    for rows in ((local, other), (other, local)):
        with pytest.raises(ArgumentError, match="rows of one length"):
            merge_rows(*rows, 1 << 20, zero, zero)


def test_one_plan_asked_with_other_domains_answers_for_them():
    """Kinds are remembered per pair of domain lists: asking again with other lists (one
    domain, then nothing merging) gets their own answer, not the first one's."""
    plan = plan_transfer(fake_table([0], 64, 4), fake_table([1000], 64, 4))
    together = np.zeros(1, dtype=np.int64)
    apart = np.full(1, -1, dtype=np.int64)
    assert rows_of(plan.merged_pairs([0, 1], [2, 3], local_domains=together, remote_domains=together)) == [
        [[0, 128, 0]],
        [[1128, 128, 0]],
    ]
    assert rows_of(plan.merged_pairs([0, 1], [2, 3], local_domains=apart, remote_domains=apart)) == [
        [[0, 64, 0], [64, 64, 0]],
        [[1128, 64, 0], [1192, 64, 0]],
    ]


def test_streams_that_merge_nothing_keep_their_order_even_when_they_interleave():
    """Two interleaved streams whose domains are negative (merging nothing): rows go stream
    by stream, each in the request's order, as for streams apart."""
    local = fake_table([0, 64], 128, 4)
    remote = fake_table([10_000, 10_064], 128, 4)
    plan = plan_transfer(local, remote)
    apart = np.full(2, -1, dtype=np.int64)
    got = plan.merged_pairs([3, 1], [3, 1], local_domains=apart, remote_domains=apart)
    assert rows_of(got) == rows_of(plan.descriptor_pairs([3, 1], [3, 1]))
    assert got[0][:, 0].tolist() == [384, 128, 448, 192]


def test_stream_extents_and_region_bytes():
    table = fake_table([0, 5000], 128, 6)
    assert stream_extents(table).tolist() == [[0, 5 * 128 + 64, 0], [5000, 5 * 128 + 64, 0]]
    assert extent_rows(table).tolist() == [[0, 64, 0], [640, 64, 0], [5000, 64, 0], [5640, 64, 0]]
    on_device = replace(table, device_id=3)
    assert stream_extents(on_device)[:, 2].tolist() == extent_rows(on_device)[:, 2].tolist()[::2] == [3, 3]
    assert table.region_bytes == 64
    runs = table.token_runs()
    assert runs is table  # N leads the region: nothing to cut
    head_major = fake_table([0], 256, 6, order="HNC")
    runs = head_major.token_runs()
    assert runs.split == "H" and runs.region_bytes == 64 and runs.run_bytes == 16
    assert [s.address for s in runs.streams] == [0, 16, 32, 48]
    assert runs.token_runs() is runs


def test_tables_refuse_layers_that_differ():
    """One table needs every layer alike: as many tensors a layer, one region order."""
    sizes = dict(H=2, C=4, N=8, B=10)
    pair = tuple(make_cache("BNHC", "BNHC", sizes) for _ in range(2))
    with pytest.raises(LayoutError, match=r"layers hold different numbers of tensors \[1, 2\]"):
        region_table({"a": pair, "b": (make_cache("BNHC", "BNHC", sizes),)}, "KBNHC")
    head_major = make_cache("KBNHC", "KBHNC", dict(sizes, K=2))
    token_major = make_cache("KBNHC", "KBNHC", dict(sizes, K=2))
    with pytest.raises(LayoutError, match="one table needs one region order"):
        region_table({"a": head_major, "b": token_major}, "KBNHC")


def test_table_facts_of_a_two_byte_cache_and_its_shares_of_heads():
    """Region bytes count the item size; a table of one stream knows its outer letters; a
    share of one head is allowed, a share from before the first head is not."""
    table = region_table({"l": make_cache("KBNHC", "KBHNC", dict(K=2, H=4, C=8, N=4, B=3))}, "KBNHC")
    assert table.itemsize == 2 and table.region_bytes == 4 * 4 * 8 * 2 and table.outer == "K"
    assert fake_table([0], 64, 2).outer == "K"
    one = table.heads(3, 1)
    assert one.sizes["H"] == 1 and [s.address for s in one.streams] == [s.address + 3 * 64 for s in table.streams]
    with pytest.raises(LayoutError, match=r"heads -1\.\.-1 are not within the 4 heads"):
        table.heads(-1, 1)
    with pytest.raises(LayoutError, match="are not within"):
        table.heads(0, 0)


def test_heads_of_a_table_with_one_stream():
    """Head-major regions in one stream (one layer, no K): a share of the heads is an offset."""
    share = fake_table([1000], 256, 6, order="HNC").heads(1, 2)
    assert [s.address for s in share.streams] == [1016]
    assert share.sizes["H"] == 2 and share.run_bytes == 32


def test_a_tuple_of_tensors_without_k_numbers_its_members():
    """Two tensors per layer, axes without K: each is a stream of its own, keyed by its place."""
    caches = {
        name: tuple(fill_random(make_cache("BNHC", "BNHC", dict(H=2, C=4, N=8, B=5)), k) for k in range(2))
        for name in ("l0", "l1")
    }
    table = region_table(caches, "BNHC")
    assert [(s.layer, s.coords) for s in table.streams] == [
        ("l0", (("#", 0),)),
        ("l0", (("#", 1),)),
        ("l1", (("#", 0),)),
        ("l1", (("#", 1),)),
    ]
    assert [s.address for s in table.streams] == [t.data_ptr() for name in ("l0", "l1") for t in caches[name]]
    assert len(table.by_key) == 4


def test_domains_split_interleaved_streams():
    """Three layers laid out block by block on both sides; locally the third is a domain of its
    own: pieces merge across the first two layers only, never into the third."""
    local = fake_table([0, 64, 128], 192, 4)
    remote = fake_table([10_000, 10_064, 10_128], 192, 4)
    plan = plan_transfer(local, remote)
    got = plan.merged_pairs(
        [1, 2], [1, 2], local_domains=np.array([0, 0, 1]), remote_domains=np.zeros(3, dtype=np.int64)
    )
    assert rows_of(got) == [
        [[192, 128, 0], [320, 64, 0], [384, 128, 0], [512, 64, 0]],
        [[10_192, 128, 0], [10_320, 64, 0], [10_384, 128, 0], [10_512, 64, 0]],
    ]
    got = plan.merged_pairs(
        [1, 2], [1, 2], local_domains=np.zeros(3, dtype=np.int64), remote_domains=np.zeros(3, dtype=np.int64)
    )
    assert rows_of(got) == [[[192, 384, 0]], [[10_192, 384, 0]]]


def check_block_counts(plan):
    """``plan`` (a TransferPlan or a RankPlan: r = 4) takes counts of blocks as ints >= 0 alone."""
    assert plan.local_blocks_for(np.int64(8)) == plan.local_blocks_for(8) == 2 and plan.local_blocks_for(0) == 0
    assert plan.bytes_for(0) == 0 and plan.bytes_for(8) == 2 * plan.bytes_for(4) > 0
    for bad in ("ab", -1, 2.5, True, None):
        with pytest.raises(ArgumentError, match="a count of blocks must be an int >= 0"):
            plan.bytes_for(bad)
        with pytest.raises(ArgumentError, match="a count of blocks must be an int >= 0"):
            plan.local_blocks_for(bad)


def test_a_plan_s_counts_of_blocks_and_a_table_s_heads_are_ints():
    """A plan's counts of blocks are ints >= 0, 0 included (a string was repeated, -1 gave
    negative bytes, 2.5 a fraction of a block); a table's heads are ints (NaN made NaN addresses)."""
    sizes = dict(K=2, H=4, C=8)
    local = region_table(caches_for("KBNHC", "KBNHC", sizes, 64, 8, seed=1), "KBNHC")
    remote = region_table(caches_for("KBNHC", "KBHNC", sizes, 16, 8, seed=2), "KBNHC")
    check_block_counts(plan_transfer(local, remote))
    heads = sizes["H"]
    for first, count in ((float("nan"), 1), (0, 1.5), (True, 1), (0, torch.tensor(1)), (None, 1)):
        with pytest.raises(LayoutError, match="heads: first and count must be ints"):
            remote.heads(first, count)  # type: ignore[arg-type]
    assert remote.heads(np.int64(heads - 1), 1).sizes["H"] == 1


@pytest.mark.parametrize(
    ("change", "words"),
    [
        (dict(num_blocks=-1), "local table: num_blocks must be an int of at least 1, got -1"),
        (dict(num_blocks="8"), "local table: num_blocks must be an int of at least 1, got '8'"),
        (dict(device_id=None), "local table: device_id must be an int of at least 0, got None"),
        (dict(memory="GPU"), "local table: memory 'GPU' is not one of ['DRAM', 'VRAM']"),
        (dict(itemsize=3), "local table: item size 3 is not 1, 2, 4 or 8"),
        (dict(sizes={"K": 2, "N": 0, "H": 2, "C": 4}), "local table: sizes must map letters to ints of at least 1"),
        (dict(sizes={"K": 2, "N": 4.0, "H": 2, "C": 4}), "local table: sizes must map letters to ints of at least 1"),
        (dict(order="HXC"), "local table: order 'HXC' must be letters that have sizes"),
        (dict(order="HC"), "local table: order 'HC' and sizes must name the tokens (N)"),
        (dict(split=None), "local table: split None must be letters that have sizes"),
        (dict(streams=[]), "local table: streams must be a tuple of Streams, got []"),
        (dict(streams=(Stream("l", (("K", 0),), "x", 4),)), "local table: a stream must be a Stream of int address"),
        (dict(streams=(Stream("l", (("K", 0),), 4096, -1),)), "local table: a stream must be a Stream of int address"),
        (dict(streams=(Stream("l", (("K", 0),), 2**64, 4),)), "local table: a stream must be a Stream of int address"),
        (dict(streams=("l",)), "local table: a stream must be a Stream of int address and stride, got 'l'"),
    ],
)
def test_a_table_made_by_hand_is_refused_naming_the_field_before_it_is_planned(change, words):
    """Planning trusts a table's numbers as addresses and lengths: a table made by hand
    (not by region_table or from_dict, which check them) is held to their kinds and ranges.
    A size of 0 was a ZeroDivisionError, a count of -1 or "8" was planned."""
    table = region_table({"l": make_cache("KBNHC", "KBHNC", dict(K=2, B=8, N=4, H=2, C=4))}, "KBNHC")
    bad = replace(table, **change)
    with pytest.raises(LayoutError) as raised:
        plan_transfer(bad, table)
    assert str(raised.value).startswith(words)
    with pytest.raises(LayoutError, match=r"^remote table: "):
        plan_transfer(table, bad)
    with pytest.raises(LayoutError, match=r"^(the )?remote rank 1"):
        plan_ranks(table, 0, 1, [table, bad])
    with pytest.raises(ArgumentError, match="plan_transfer takes two RegionTables, got"):
        plan_transfer(table, table.to_dict())  # type: ignore[arg-type]
    with pytest.raises(ArgumentError, match="plan_ranks takes RegionTables, got"):
        plan_ranks(table.to_dict(), 0, 1, [table])  # type: ignore[arg-type]
    assert plan_transfer(table, table).remote_order == "HNC"  # the table it was made from plans


@pytest.mark.parametrize("first", ["head inside", "head outside"])
def test_layers_whose_one_head_sits_apart_make_one_table_and_land_the_truth(first):
    """A letter of size 1 moves no byte wherever it sits (``kvhost.receive`` takes such
    layers): one layer's single head inside its block region and another's outside make
    one table, in the first layer's order, whichever comes first (it was refused)."""
    sizes = dict(B=8, N=4, H=1, C=8)
    inside = fill_random(make_cache("BNHC", "BNHC", sizes), 1)  # region NHC
    outside = fill_random(make_cache("BNHC", "HBNC", sizes), 2)  # H before B: region NC
    local = {"a": inside, "b": outside} if first == "head inside" else {"b": outside, "a": inside}
    remote = {name: fill_random(make_cache("BNHC", "BHNC", dict(sizes, N=2)), 3 + i) for i, name in enumerate(local)}
    table = region_table(local, "BNHC")
    assert table.order == ("NHC" if first == "head inside" else "NC")
    assert len({s.coords for s in table.streams}) == 1  # every stream indexed alike
    plan = plan_transfer(table, region_table(remote, "BNHC"))
    local_ids, remote_ids = [5, 2], [0, 3, 7, 1]
    before = {name: raw(t).clone() for name, t in local.items()}
    memmove_rows(*plan.merged_pairs(local_ids, remote_ids))
    kvhost.receive(local, {"r": local_ids}, axes="BNHC", remote_order=plan.remote_order, remote_block_size=2)
    for r, lo in zip(CacheSet(remote, "BNHC").members, CacheSet(local, "BNHC").members):
        assert torch.equal(read_tokens(lo.tensor, lo.layout, local_ids), read_tokens(r.tensor, r.layout, remote_ids))
        assert untouched_blocks_same(lo.tensor, before[lo.layer], lo.layout, local_ids)


@pytest.mark.parametrize(
    ("local_memory", "remote_memory", "local_size", "remote_size", "cut", "in_local_layout"),
    [
        ("KBHNC", "KBHNC", 16, 4, True, True),  # token runs cut at H, one order
        ("KBNHC", "KBNHC", 16, 4, True, True),  # a region that begins with N is its own token runs
        ("KBNHC", "KBNCH", 16, 4, True, False),  # N first on both sides, two orders: regions
        ("KBNHC", "KBNCH", 8, 8, True, False),
        ("KBHNC", "KBHNC", 16, 4, False, False),  # regions cut at r: wire bytes
        ("KBHNC", "KBHNC", 8, 8, False, True),  # one order, one block size: nothing to rearrange
        ("KBHNC", "KBNHC", 8, 8, False, False),
    ],
)
def test_a_plan_says_whether_its_bytes_land_in_the_local_layout(
    local_memory, remote_memory, local_size, remote_size, cut, in_local_layout
):
    """``in_local_layout`` is what a connector asks before it skips ``kvhost.receive``:
    where True, the bytes that land are the local layout's; where False, the plan's
    remote order and block size make them so (two N-first orders paired by
    ``token_runs()`` tables landed in the sender's order, unsaid)."""
    sizes = dict(K=2, H=2, C=4)
    remote = caches_for("KBNHC", remote_memory, sizes, remote_size, 16, seed=3)
    local = caches_for("KBNHC", local_memory, sizes, local_size, 24, seed=30)
    tables = [region_table(side, "KBNHC") for side in (local, remote)]
    plan = plan_transfer(*[t.token_runs() if cut else t for t in tables])
    assert plan.in_local_layout is in_local_layout
    count = 3
    local_ids, remote_ids = [7, 2, 11, 4, 9][: plan.local_blocks_for(count)], [5, 0, 12]
    memmove_rows(*plan.merged_pairs(local_ids, remote_ids))
    if not plan.in_local_layout:
        kvhost.receive(
            local, {"r": local_ids}, axes="KBNHC", remote_order=plan.remote_order, remote_block_size=remote_size
        )
    tokens = count * remote_size
    for r, lo in zip(CacheSet(remote, "KBNHC").members, CacheSet(local, "KBNHC").members):
        got = read_tokens(lo.tensor, lo.layout, local_ids)[:tokens]
        assert torch.equal(got, read_tokens(r.tensor, r.layout, remote_ids))


def test_a_table_made_by_hand_at_the_edges_of_its_ranges_is_taken():
    """Every item size a cache may have, and the last address a descriptor can name."""
    table = region_table({"l": make_cache("KBNHC", "KBHNC", dict(K=2, B=8, N=4, H=2, C=4))}, "KBNHC")
    for itemsize in (1, 2, 4, 8):
        replace(table, itemsize=itemsize).check_fields("local")
    last = replace(table, streams=(Stream("l", (("K", 0),), 2**64 - 1, 2**64 - 1),))
    last.check_fields("local")
    with pytest.raises(LayoutError, match="a stream must be a Stream of int address"):
        replace(table, streams=(Stream("l", (("K", 0),), 2**64, 0),)).check_fields("local")
