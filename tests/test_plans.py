"""Plans from letters: the shapes docs/design.md promises, checked on the plans themselves.

"One permutation between the two, with size-1 letters dropped and neighbours merged":
the tests here pin the merging (three letters in a row, the part axis with the tokens
when it selects no region), the loops' form (one stride per dim on both sides), the
planner's own checks when it is called without the front end, and copy plans that must
not merge blocks that are not back to back. Found by mutation testing (ci/mutation.py):
each fails on a change to kvhost/transform.py (or a kernel) that the rest of the suite
let pass, because the results stay right while the plan gets worse, or because only a
direct caller reaches the check.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch

import kvhost
from kvhost.layout import Layout
from kvhost.testing import fill_random, make_cache, raw, read_tokens
from kvhost.transform import Loops, block_ratio, plan_copy, plan_receive


def layout(axes: str, physical: str, **sizes: int) -> Layout:
    return Layout.of(make_cache(axes, physical, sizes, device="meta"), axes)


def test_letters_next_to_each_other_in_both_orders_merge_into_one_dim():
    # Local region N K H C, sender K H C N at half the block size: K H C stay together.
    plan = plan_receive(layout("BNKHC", "BNKHC", B=4, N=8, K=2, H=2, C=4), "KHCN", 4)
    assert plan is not None
    assert plan.src_shape == (2, 2 * 2 * 4, 4)  # sub-block, K H C, token
    assert plan.perm == (0, 2, 1)


def test_the_part_axis_merges_with_the_tokens_when_it_selects_no_region():
    # r = 2: the sub-block and token axes are neighbours on both sides and become one.
    plan = plan_receive(layout("BNHC", "BNHC", B=4, N=8, H=2, C=4), "NCH", 4)
    assert plan is not None
    assert (plan.parts, plan.src_shape, plan.perm) == (1, (8, 4, 2), (0, 2, 1))
    assert plan.write_back.pieces == 8  # each token is rearranged on its own


def _loops_are_well_formed(loops: Loops) -> None:
    assert len(loops.src_strides) == len(loops.dst_strides) == len(loops.shape)
    assert all(n > 1 for n in loops.shape), loops  # a dim of one step is no dim


@pytest.mark.parametrize("physical", ["KBNHC", "KBHNC", "BKNHC", "BKHNC", "HBKNC"])
def test_every_plan_names_one_stride_per_dim_on_both_sides(physical):
    local = layout("KBNHC", physical, K=2, B=4, N=8, H=2, C=4)
    region = local.region
    for order in ("".join(p) for p in itertools.permutations(region)):
        for remote in (2, 4, 8, 16, 32):
            plan = plan_receive(local, order, remote)
            if plan is not None:
                _loops_are_well_formed(plan.write_back.loops)
    for other in ("KBNHC", "KBHNC", "BKNHC", "BKHNC", "HBKNC"):
        _loops_are_well_formed(plan_copy(local, layout("KBNHC", other, K=2, B=4, N=8, H=2, C=4)).loops)


def test_the_planner_checks_what_it_is_given():
    local = layout("KBNHC", "KBHNC", K=2, B=4, N=8, H=2, C=4)
    with pytest.raises(kvhost.LayoutError, match="remote order must be a non-empty string"):
        plan_receive(local, ("H", "N", "C"), 4)  # type: ignore[arg-type]
    with pytest.raises(kvhost.RequestError, match="remote block size 0 must be positive"):
        plan_receive(local, "HNC", 0)
    with pytest.raises(kvhost.RequestError, match="remote block size -8 must be positive"):
        plan_receive(local, "HNC", -8)
    wide = Layout.of(make_cache("KBNHC", "KBHNC", dict(K=2, B=4, N=8, H=2, C=4), torch.float32, "meta"), "KBNHC")
    with pytest.raises(kvhost.LayoutError, match="source item size 2 != destination item size 4"):
        plan_copy(local, wide)


def test_size_1_letters_never_split_a_copy():
    # One head, with a stride of its own: whole blocks still copy as one run.
    one_head = Layout.of(torch.zeros(2 * 8 * 64).as_strided((2, 8, 8, 1, 8), (8 * 64, 64, 8, 3, 1)), "KBNHC")
    plan = plan_copy(one_head, one_head)
    assert plan.merge_blocks
    assert plan.loops.shape == (2,) and plan.loops.run_bytes == 64 * 4


def test_blocks_that_are_not_back_to_back_are_copied_one_by_one(target):
    if target.device == "xla":
        pytest.skip("XLA tensors have no strides: a view of every other block is a copy there")
    # Every other block of two buffers: runs of ids are consecutive, their bytes are not.
    sizes = dict(K=2, B=16, N=8, H=2, C=4)
    src_memory = fill_random(make_cache("KBNHC", "KBNHC", sizes, device=target.device), 1)
    dst_memory = fill_random(make_cache("KBNHC", "KBNHC", sizes, device=target.device), 2)
    src, dst = {"l": src_memory[:, 0::2]}, {"l": dst_memory[:, 0::2]}
    assert not plan_copy(Layout.of(src["l"], "KBNHC"), Layout.of(dst["l"], "KBNHC")).merge_blocks
    before, source_before = raw(dst_memory).cpu().clone(), raw(src_memory).cpu().clone()
    kvhost.copy_blocks(src, dst, [0, 1, 2], [4, 5, 6], axes="KBNHC", backend=target.backend).completion.wait()
    layout_of = Layout.of(src["l"], "KBNHC")
    for s, d in zip([0, 1, 2], [4, 5, 6]):
        assert torch.equal(read_tokens(dst["l"], layout_of, [d]), read_tokens(src["l"], layout_of, [s]))
    now = raw(dst_memory).cpu()
    for block in set(range(16)) - {8, 10, 12}:
        assert torch.equal(now[:, block], before[:, block]), f"buffer block {block} changed"
    assert torch.equal(raw(src_memory).cpu(), source_before), "the source changed"


def _written_back(write_back, piece: np.ndarray) -> np.ndarray:
    """A piece's bytes after its loops, run from a copy of it (how the scratch way writes)."""
    loops, out = write_back.loops, piece.copy()
    regions = write_back.piece_bytes // (int(np.prod(loops.shape, dtype=np.int64)) * loops.run_bytes)
    region_bytes = write_back.piece_bytes // regions
    for k in range(regions):
        for index in itertools.product(*(range(n) for n in loops.shape)):
            src = k * write_back.part_stride + sum(i * s for i, s in zip(index, loops.src_strides))
            dst = k * region_bytes + sum(i * s for i, s in zip(index, loops.dst_strides))
            out[dst : dst + loops.run_bytes] = piece[src : src + loops.run_bytes]
    return out


def _rotated(cycles, piece: np.ndarray) -> np.ndarray:
    """A piece's bytes after its cycles, done in place as the kernels do them."""
    out, chunk = piece.copy(), cycles.chunk_bytes
    for first, end in itertools.pairwise(cycles.starts):
        order = cycles.order[first:end]
        kept = out[order[0] * chunk : (order[0] + 1) * chunk].copy()
        for to, source in itertools.pairwise(order):
            out[to * chunk : (to + 1) * chunk] = out[source * chunk : (source + 1) * chunk]
        out[order[-1] * chunk : (order[-1] + 1) * chunk] = kept
    return out


@pytest.mark.parametrize(
    ("axes", "physical", "sizes", "order", "remote"),
    [
        ("KBNHC", "KBNHC", dict(K=2, B=4, N=8, H=2, C=4), "HNC", 2),  # r = 4, pieces within a region
        ("KBNHC", "KBHNC", dict(K=2, B=4, N=8, H=3, C=4), "HNC", 4),  # head-major, r = 2: runs of whole sub-blocks
        ("KBNHC", "KBNHC", dict(K=2, B=4, N=4, H=2, C=4), "HNC", 16),  # g = 4: one piece over four regions
        ("LBHNC", "BLNHC", dict(L=3, B=4, N=8, H=2, C=4), "HLNC", 8),  # rows of every layer, heads first
        ("LBHNC", "BLNHC", dict(L=3, B=4, N=8, H=2, C=4), "LNHC", 2),  # rows, r = 4
        ("BKNHC", "BKHNC", dict(K=2, B=4, N=4, H=2, C=2), "NKHC", 8),  # K inside the block, g = 2
    ],
)
def test_a_piece_s_cycles_write_what_its_loops_write(axes, physical, sizes, order, remote):
    """The cycles of a piece, done in place one chunk at a time, leave every byte where the
    scratch way's loops put it; every chunk that moves is in exactly one cycle, and a chunk
    that stays is in none."""
    plan = plan_receive(layout(axes, physical, **sizes), order, remote)
    assert plan is not None
    write_back = plan.write_back
    cycles = write_back.cycles
    piece = np.arange(write_back.piece_bytes, dtype=np.int64)  # every byte tells where it was
    wanted = _written_back(write_back, piece)
    assert np.array_equal(_rotated(cycles, piece), wanted)
    chunk = cycles.chunk_bytes
    assert chunk == write_back.loops.run_bytes and write_back.piece_bytes % chunk == 0
    moved = {c for c in range(write_back.piece_bytes // chunk) if wanted[c * chunk] != c * chunk}
    assert sorted(cycles.order.tolist()) == sorted(moved)
    assert cycles.starts[0] == 0 and cycles.starts[-1] == cycles.order.size
    assert all(end - first >= 2 for first, end in itertools.pairwise(cycles.starts))


def test_chunk_cycles_of_a_permutation():
    from kvhost.transform import ChunkCycles

    none = ChunkCycles.of(8, [0, 1, 2])
    assert none.chunk_bytes == 8 and none.order.tolist() == [] and none.starts.tolist() == [0]
    two = ChunkCycles.of(4, [1, 0, 2, 4, 5, 3])  # a swap, a fixed chunk, a rotation of three
    assert two.order.tolist() == [0, 1, 3, 4, 5] and two.starts.tolist() == [0, 2, 5]
    assert two.order.dtype == two.starts.dtype == np.int64


@pytest.mark.parametrize(
    ("local", "remote", "ratio"),
    [(64, 16, (4, 1)), (16, 64, (1, 4)), (16, 16, (1, 1)), (1, 8, (1, 8)), (8, 1, (8, 1))],
)
def test_block_ratio_is_r_remote_blocks_a_local_one_holds_and_g_local_blocks_a_remote_one_spans(local, remote, ratio):
    assert block_ratio(local, remote) == ratio


def test_block_sizes_that_do_not_divide_are_the_error_asked_for():
    words = r"^block sizes 8 \(local\) and 12 \(remote\) do not divide one another$"
    with pytest.raises(kvhost.LayoutError, match=words):
        block_ratio(8, 12)
    with pytest.raises(kvhost.RequestError, match=r"^block sizes 12 \(local\) and 8 \(remote\)"):
        block_ratio(12, 8, kvhost.RequestError)
