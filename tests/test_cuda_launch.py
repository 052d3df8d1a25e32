"""Launch planning for the CUDA/XPU Triton kernels, checked without a device or Triton.

``run_receive_launch`` and ``run_copy_launch`` carry out a launch plan with NumPy using
the same index arithmetic as the kernels (words, pieces, rows placed by dims and
strides, regions back to back); the conformance oracle then checks the bytes. So a plan
that would make the kernels move the wrong words fails here, on any machine.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import torch
from kvhost_accelerator.backend import AcceleratorBackend, _byte_view
from kvhost_accelerator.launch import (
    Limits,
    Rows,
    Tile,
    _rows,
    _tile,
    plan_copy_launch,
    plan_receive_launch,
    register_cost,
    widest_word,
)
from test_receive import LAYOUTS, RATIOS, remote_orders, request_ids

import kvhost
from kvhost.batch import plan_copy_batch, plan_receive_batch
from kvhost.caches import CacheSet
from kvhost.errors import BackendError
from kvhost.layout import Layout
from kvhost.testing import CopyCase, ReceiveCase, fill_random, make_cache
from kvhost.transform import MAX_LOOP_DIMS, plan_copy, plan_receive

WORDS = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}
SCRATCH_ONLY = Limits(register_bytes=0, tile_bytes=64, programs=3)
# Too little scratch for a slot per program: split, several rounds, both halves in use.
SPLIT = Limits(register_bytes=0, tile_bytes=64, programs=3, scratch_bytes=512)


def row_offsets(rows: Rows) -> tuple[np.ndarray, np.ndarray]:
    """(source, destination) word offset of every row, as the kernels compute them."""
    pairs = np.array([rows.offsets(r) for r in range(rows.rows)], dtype=np.int64).reshape(-1, 2)
    return pairs[:, 0], pairs[:, 1]


def run_receive_launch(job, limits: Limits) -> None:
    """Carry out the receive launch for ``job`` on CPU tensors, item by item like the kernels.

    Registers and slots: piece by piece. Split: launch by launch as ``launch.schedule``
    says, chunk by chunk through one scratch array and slots as the split kernel addresses
    them; within a launch the copies in run before the write-backs (the kernel promises
    nothing about their order, so the order that would expose a shared slot is taken).
    """
    layout = job.layout
    bases = [m.tensor.data_ptr() for m in job.members]
    outer = layout.outer_offsets_bytes
    alignment = int(np.bitwise_or.reduce(np.array(bases + outer.tolist()))) | layout.block_stride_bytes
    units = job.unit_ids.shape[0]
    launch = plan_receive_launch(
        job.rearrangement, members=len(bases), outer=outer.size, units=units, alignment=alignment, limits=limits
    )
    word = WORDS[launch.word_bytes]
    src_rows, dst_rows = row_offsets(launch.rows)
    run = launch.rows.run
    region = job.rearrangement.region_bytes
    columns = np.arange(run)
    assert launch.items == len(bases) * outer.size * units * launch.pieces
    if launch.in_registers:  # a piece held whole by one program: within both register budgets
        assert launch.piece_words * launch.word_bytes <= limits.register_bytes
        assert register_cost(launch.tile, launch.word_bytes, launch.align_bytes) <= limits.thread_registers
    # Every unit's words, in the kernels' item order: (member, outer index, unit).
    memories = [_byte_view(member.tensor).numpy() for member in job.members]
    starts, unit_words = [], []
    for memory in memories:
        for outer_offset in outer:
            for blocks in job.unit_ids:
                at = [int(outer_offset) + int(b) * layout.block_stride_bytes for b in blocks]
                starts.append((memory, at))
                unit_words.append(np.concatenate([memory[s : s + region] for s in at]).view(word))
    if launch.mode == "split":
        run_split(launch, unit_words, word)
    else:
        for words in unit_words:
            for piece in range(launch.pieces):
                piece_words = words[piece * launch.piece_words : (piece + 1) * launch.piece_words]
                piece_words[dst_rows[:, None] + columns[None, :]] = piece_words[src_rows[:, None] + columns[None, :]]
    for (memory, at), words in zip(starts, unit_words):
        unit_bytes = words.view(np.uint8)
        for k, s in enumerate(at):
            memory[s : s + region] = unit_bytes[k * region : (k + 1) * region]


def run_split(launch, unit_words: list[np.ndarray], word) -> None:
    """The split kernel's arithmetic: pieces by job number, slots of a scratch, chunks of tile rows."""
    rows, run, chunk_rows = launch.rows, launch.rows.run, launch.tile.rows
    scratch = np.zeros(launch.scratch_words, dtype=word)
    wire_rows, _ = row_offsets(rows)
    columns = np.arange(run)

    def piece(job: int) -> np.ndarray:
        words = unit_words[job // launch.pieces]
        return words[(job % launch.pieces) * launch.piece_words :][: launch.piece_words]

    for r in launch.schedule:
        assert r.items(launch.chunks) > 0 and launch.programs >= 1
        for k in range(r.in_count):  # copy in, as the wire has it
            slot = scratch[(r.in_slot + k) * launch.piece_words :][: launch.piece_words]
            for chunk in range(launch.chunks):
                lines = np.arange(chunk * chunk_rows, min((chunk + 1) * chunk_rows, rows.rows))
                index = (lines * run)[:, None] + columns[None, :]
                slot[index] = piece(r.in_first + k)[index]
        for k in range(r.out_count):  # write back, rearranged
            slot = scratch[(r.out_slot + k) * launch.piece_words :][: launch.piece_words]
            for chunk in range(launch.chunks):
                lines = np.arange(chunk * chunk_rows, min((chunk + 1) * chunk_rows, rows.rows))
                target = piece(r.out_first + k)
                target[(lines * run)[:, None] + columns[None, :]] = slot[wire_rows[lines][:, None] + columns[None, :]]


def receive_cases() -> list[object]:
    cases = []
    for name, (_, physical, _) in LAYOUTS.items():
        region = physical[physical.index("B") + 1 :]
        for kind, k in RATIOS:
            for order in remote_orders(region):
                cases.append(pytest.param(name, kind, k, order, id=f"{name}-{kind}{k}-{order}"))
    return cases


@pytest.mark.parametrize(
    "limits",
    [Limits(), SCRATCH_ONLY, SPLIT, Limits(barrier=False)],
    ids=["registers", "scratch", "split", "no-barrier"],
)
@pytest.mark.parametrize(("layout", "kind", "k", "order"), receive_cases())
def test_receive_launch_moves_what_the_sender_sent(layout, kind, k, order, limits):
    axes, physical, sizes = LAYOUTS[layout]
    caches = {f"layer{i}": make_cache(axes, physical, sizes) for i in range(2)}
    remote = sizes["N"] // k if kind == "r" else sizes["N"] * k
    case = ReceiveCase(caches, axes, seed=k)
    for name, ids in request_ids(k if kind == "g" else 1).items():
        case.send(name, ids, order, remote)
    requests = {name: wired.block_ids for name, wired in case.requests.items()}
    batch = plan_receive_batch(CacheSet(caches, axes), requests, order, remote)
    for job in batch.jobs:
        run_receive_launch(job, limits)
    case.check()


def vllm_cache(physical: str, blocks: int = 16, tokens: int = 64) -> Layout:
    return Layout.of(make_cache("KBNHC", physical, dict(K=2, B=blocks, N=tokens, H=8, C=128)), "KBNHC")


def test_head_major_16_to_token_major_64_stays_in_registers():
    """The common case (HND sender, block 16 -> NHD, block 64): 32 KB pieces, one read and one write."""
    layout = vllm_cache("KBNHC")
    plan = plan_receive(layout, "HNC", 16)
    launch = plan_receive_launch(plan, members=32, outer=2, units=100, alignment=256, limits=Limits(programs=528))
    assert launch.in_registers and launch.scratch_words == 0
    assert launch.word_bytes == 8 and launch.align_bytes == 16  # bf16 rows of 128 channels move as 16-byte pairs
    assert launch.pieces == 4  # the four remote sub-blocks rearrange independently
    assert launch.piece_words * launch.word_bytes == 32 << 10
    assert (launch.rows.rows, launch.rows.run) == (16 * 8, 32)  # rows: (token, head) in local order
    assert launch.items == 32 * 2 * 100 * 4 and launch.programs == 528


def test_a_unit_too_large_to_index_in_32_bits_is_refused():
    """The kernels place a word within its unit in 32 bits: a 64 GiB block (a million tokens
    of 256 heads) would wrap to offsets before the block; so would one of 2^31 words, the
    least that is too many. One of 15 GiB (2^31 - 2^27 words of 8 bytes) still fits."""

    def block(tokens, heads):
        cache = make_cache("KBNHC", "KBNHC", dict(K=2, B=2, N=tokens, H=heads, C=128), device="meta")
        return plan_receive(Layout.of(cache, "KBNHC"), "HNC", tokens)

    with pytest.raises(BackendError, match=r"is 8589934592 words of 8 bytes: .*\(at most 2147483647 words\)"):
        plan_receive_launch(block(1 << 20, 256), members=1, outer=2, units=1, alignment=256, limits=H200)
    with pytest.raises(BackendError, match=r"is 2147483648 words of 8 bytes"):
        plan_receive_launch(block(1 << 20, 64), members=1, outer=2, units=1, alignment=256, limits=H200)
    fits = plan_receive_launch(
        block((1 << 20) - (1 << 16), 64), members=1, outer=2, units=1, alignment=256, limits=H200
    )
    assert fits.piece_words * fits.pieces == (1 << 31) - (1 << 27)


def test_a_unit_of_exactly_the_most_words_the_kernels_index_is_taken(monkeypatch):
    """The bound is inclusive: a unit of ``MAX_UNIT_WORDS`` words is indexed, one more is not
    (the bound lowered to a small unit's words, which stand for 2^31 - 1)."""
    from kvhost_accelerator import launch

    cache = make_cache("KBNHC", "KBNHC", dict(K=2, B=2, N=16, H=2, C=128), device="meta")
    plan = plan_receive(Layout.of(cache, "KBNHC"), "HNC", 16)
    fits = plan_receive_launch(plan, members=1, outer=2, units=1, alignment=256, limits=H200)
    words = plan.unit_bytes // fits.word_bytes
    try:
        monkeypatch.setattr(launch, "MAX_UNIT_WORDS", words)
        launch._pieces.cache_clear()
        assert plan_receive_launch(plan, members=1, outer=2, units=1, alignment=256, limits=H200) == fits
        monkeypatch.setattr(launch, "MAX_UNIT_WORDS", words - 1)
        launch._pieces.cache_clear()
        with pytest.raises(BackendError, match=f"is {words} words of {fits.word_bytes} bytes"):
            plan_receive_launch(plan, members=1, outer=2, units=1, alignment=256, limits=H200)
    finally:
        launch._pieces.cache_clear()


def test_rows_of_more_dims_than_the_kernels_loop_over_are_refused():
    dims = list(range(2, MAX_LOOP_DIMS + 3))
    strides = [1] * len(dims)
    with pytest.raises(BackendError, match=f"at most {MAX_LOOP_DIMS} row dims"):
        _rows(dims, strides, strides, 1)
    assert _rows(dims[:MAX_LOOP_DIMS], strides[:MAX_LOOP_DIMS], strides[:MAX_LOOP_DIMS], 1).dims == tuple(
        dims[:MAX_LOOP_DIMS]
    )


def test_grouped_receive_uses_a_bounded_scratch():
    """Remote block 64 -> local 16 (g = 4): one 128 KB piece spans four blocks; scratch stays in cache.

    With a slot for every program the budget allows (128 here), pieces take the slots
    mode; with more programs than that, the split mode (``test_large_pieces_fill_the_device``).
    """
    layout = vllm_cache("KBNHC", tokens=16)
    plan = plan_receive(layout, "HNC", 64)
    limits = Limits(programs=128, scratch_bytes=16 << 20)
    launch = plan_receive_launch(plan, members=32, outer=2, units=100, alignment=256, limits=limits)
    assert not launch.in_registers and launch.pieces == 1 and launch.parts == 4
    assert launch.piece_words * launch.word_bytes == 4 * (32 << 10)
    assert launch.scratch_words * launch.word_bytes <= limits.scratch_bytes
    assert launch.programs == (16 << 20) // (128 << 10)
    assert launch.tile.words * launch.word_bytes <= limits.tile_bytes


H200 = Limits(programs=132 * 4, processors=132)  # 132 SMs, four programs each; the default 32 MiB scratch


def grids(launch) -> list[int]:
    """Programs of each launch, as ``kernels.receive_calls`` sizes them."""
    if launch.mode != "split":
        return [launch.programs]
    return [max(1, min(r.items(launch.chunks), launch.programs)) for r in launch.schedule]


@pytest.mark.parametrize(
    ("heads", "remote", "units"),
    [(32, 64, 100), (64, 256, 40), (96, 1024, 3), (64, 4096, 2)],
    ids=["32-heads-64", "64-heads-256", "piece-over-half-the-budget", "piece-beyond-budget"],
)
def test_large_pieces_fill_the_device(heads, remote, units):
    """Grouped receives (remote 64..4096 -> local 16) on a 132-SM GPU: every launch has every program busy.

    With no room to grow (``scratch_most_bytes`` 0), as slots these were 64, 8 and 1
    program (budget / piece), fewer than the 132 multiprocessors; split, each launch's
    chunks outnumber the device's programs, and scratch stays within the budget unless
    one piece alone is larger (then it is that piece, once).
    """
    layout = Layout.of(make_cache("KBNHC", "KBNHC", dict(K=2, B=8, N=16, H=heads, C=128)), "KBNHC")
    plan = plan_receive(layout, "HNC", remote)
    launch = plan_receive_launch(plan, members=32, outer=2, units=units, alignment=256, limits=H200)
    piece_bytes = launch.piece_words * launch.word_bytes
    assert launch.mode == "split" and piece_bytes == remote * heads * 128 * 2
    assert H200.scratch_bytes // piece_bytes < H200.processors  # too few slots for the device
    assert all(grid == H200.programs for grid in grids(launch))
    scratch = launch.scratch_words * launch.word_bytes
    assert scratch <= max(H200.scratch_bytes, piece_bytes)
    assert launch.tile.words * launch.word_bytes <= H200.tile_bytes
    rounds = -(-launch.items // launch.round_pieces)
    assert launch.launches == (rounds + 1 if launch.halves == 2 else 2 * rounds)
    # Two halves (a round copied in while the last is written back) wherever two pieces fit.
    assert (launch.halves == 2) == (2 * piece_bytes <= H200.scratch_bytes)


@pytest.mark.parametrize(("items", "round_pieces", "halves"), [(1, 4, 2), (9, 4, 2), (8, 4, 2), (5, 1, 1), (7, 3, 1)])
def test_split_schedule_moves_every_piece_once_through_a_slot_nobody_reuses_early(items, round_pieces, halves):
    from kvhost_accelerator.launch import _schedule

    slots: dict[int, int] = {}  # slot -> piece copied in and not yet written back
    copied, written = [], []
    for number, r in enumerate(_schedule(items, round_pieces, halves)):
        outs = {r.out_slot + k: r.out_first + k for k in range(r.out_count)}
        ins = {r.in_slot + k: r.in_first + k for k in range(r.in_count)}
        assert not outs.keys() & ins.keys(), f"launch {number} reads and writes one slot"
        assert max([*outs, *ins]) < round_pieces * halves
        for slot, piece in outs.items():
            assert slots.pop(slot) == piece  # copied in by an earlier launch, into this slot
            written.append(piece)
        for slot, piece in ins.items():
            assert slot not in slots  # nothing waits there
            slots[slot] = piece
            copied.append(piece)
    assert copied == written == list(range(items)) and not slots


@pytest.mark.parametrize(("remote", "slots"), [(32, 512), (64, 256)])
def test_pieces_with_a_slot_per_multiprocessor_keep_one_launch(remote, slots):
    """Remote 32 or 64 -> local 16 with 8 heads on an H200: 64 or 128 KiB pieces, one launch of a program per slot.

    Measured there (ci/gpu-check.sh, 2 GB receives): 128 KiB pieces ran at 0.52 of memcpy in
    one launch of 264 programs and at 0.33 split into 129 launches.
    """
    plan = plan_receive(vllm_cache("KBNHC", tokens=16), "HNC", remote)
    launch = plan_receive_launch(plan, members=32, outer=2, units=100, alignment=256, limits=H200)
    assert launch.mode == "slots" and launch.launches == 1 and launch.programs == slots
    assert launch.scratch_words * launch.word_bytes == H200.scratch_bytes
    few = plan_receive_launch(plan, members=1, outer=1, units=3, alignment=256, limits=H200)
    assert few.mode == "slots" and few.programs == 3  # never more programs than items
    # One slot short of a program per multiprocessor: split.
    short = replace(H200, scratch_bytes=132 * remote * 8 * 128 * 2 - 1)
    enough = replace(short, scratch_bytes=short.scratch_bytes + 1)
    for limits, mode in ((short, "split"), (enough, "slots")):
        assert plan_receive_launch(plan, members=32, outer=2, units=100, alignment=256, limits=limits).mode == mode


@pytest.mark.parametrize(
    ("heads", "remote", "programs"),
    [(32, 64, 512), (32, 128, 256), (24, 256, 170), (64, 256, 0)],
    ids=["512KiB", "1MiB", "1.5MiB", "4MiB-too-large"],
)
def test_scratch_grows_to_a_slot_per_multiprocessor_before_a_receive_is_split(heads, remote, programs):
    """Pieces too large for a slot per multiprocessor in 32 MiB get slots of up to 256 MiB
    (AcceleratorBackend's limits): on an H200, 512 KiB pieces ran at 0.41 of memcpy in one
    launch of 512 programs, against 0.16 split into 513 launches. Split only beyond that
    (``programs`` 0 here: 4 MiB x 132 is more than 256 MiB)."""
    grown = replace(H200, scratch_most_bytes=256 << 20)
    assert AcceleratorBackend.limits.scratch_most_bytes == grown.scratch_most_bytes
    layout = Layout.of(make_cache("KBNHC", "KBNHC", dict(K=2, B=8, N=16, H=heads, C=128)), "KBNHC")
    plan = plan_receive(layout, "HNC", remote)
    launch = plan_receive_launch(plan, members=32, outer=2, units=100, alignment=256, limits=grown)
    piece_bytes = launch.piece_words * launch.word_bytes
    assert piece_bytes == remote * heads * 128 * 2 and H200.scratch_bytes // piece_bytes < H200.processors
    if programs:
        assert launch.mode == "slots" and launch.launches == 1 and launch.programs == programs
        assert launch.scratch_words * launch.word_bytes == programs * piece_bytes <= grown.scratch_most_bytes
    else:
        assert launch.mode == "split" and launch.scratch_words * launch.word_bytes <= H200.scratch_bytes
    # At the edge: 132 slots exactly, or one byte short of them.
    edge = replace(grown, scratch_most_bytes=132 * piece_bytes)
    short = replace(edge, scratch_most_bytes=edge.scratch_most_bytes - 1)
    for limits, mode in ((edge, "slots"), (short, "split")):
        assert plan_receive_launch(plan, members=32, outer=2, units=100, alignment=256, limits=limits).mode == mode
    # A budget that holds a slot per multiprocessor is not grown: its slots stay in the cache.
    enough = replace(grown, scratch_bytes=132 * piece_bytes)
    kept = plan_receive_launch(plan, members=32, outer=2, units=100, alignment=256, limits=enough)
    assert kept.mode == "slots" and kept.programs == 132


def test_a_piece_stays_in_registers_at_exactly_the_thread_budget():
    """The registers mode's register cost edge: at the budget, registers; one register less, through scratch."""
    plan = plan_receive(vllm_cache("KBNHC", tokens=64), "HNC", 16)
    launch = plan_receive_launch(plan, members=4, outer=2, units=10, alignment=256, limits=H200)
    assert launch.mode == "registers"
    cost = register_cost(launch.tile, launch.word_bytes, launch.align_bytes)
    at_budget = replace(H200, thread_registers=cost)
    under = replace(H200, thread_registers=cost - 1)
    kept = plan_receive_launch(plan, members=4, outer=2, units=10, alignment=256, limits=at_budget)
    assert kept.in_registers and (kept.pieces, kept.tile) == (launch.pieces, launch.tile)  # not a finer cut
    assert not plan_receive_launch(plan, members=4, outer=2, units=10, alignment=256, limits=under).in_registers


def test_pieces_in_registers_need_no_slots():
    """A registers launch has a program per item up to the device's, whatever the scratch budget."""
    plan = plan_receive(vllm_cache("KBNHC", tokens=64), "HNC", 16)
    launch = plan_receive_launch(
        plan, members=32, outer=2, units=100, alignment=256, limits=replace(H200, scratch_bytes=1)
    )
    assert launch.mode == "registers" and launch.programs == H200.programs and launch.scratch_words == 0


def test_pieces_with_a_slot_per_program_keep_one_launch():
    """Without a processor count (``processors=0``), slots need one for every program: 512 slots, 528 programs."""
    layout = vllm_cache("KBNHC", tokens=16)
    plan = plan_receive(layout, "HNC", 32)
    unknown = replace(H200, processors=0)
    assert plan_receive_launch(plan, members=32, outer=2, units=100, alignment=256, limits=unknown).mode == "split"
    fewer = Limits(programs=384)
    launch = plan_receive_launch(plan, members=32, outer=2, units=100, alignment=256, limits=fewer)
    assert launch.mode == "slots" and launch.launches == 1 and launch.programs == 384
    at_edge = Limits(programs=384, scratch_bytes=384 * (64 << 10))  # a slot for every program, not a byte more
    assert plan_receive_launch(plan, members=32, outer=2, units=100, alignment=256, limits=at_edge).mode == "slots"
    short = Limits(programs=384, scratch_bytes=384 * (64 << 10) - 1)
    assert plan_receive_launch(plan, members=32, outer=2, units=100, alignment=256, limits=short).mode == "split"


def test_without_a_global_barrier_every_piece_is_split():
    """Where the in-kernel barrier does not order global memory (XPU, older Intel Triton): no mode relies on it."""
    plan = plan_receive(vllm_cache("KBNHC"), "HNC", 16)
    assert plan_receive_launch(plan, members=4, outer=2, units=10, alignment=256, limits=Limits()).in_registers
    launch = plan_receive_launch(plan, members=4, outer=2, units=10, alignment=256, limits=Limits(barrier=False))
    assert launch.mode == "split" and launch.launches >= 2


@pytest.mark.parametrize(
    ("alignment", "word", "align"),
    [(256, 8, 16), (4096 + 8, 8, 8), (4096 + 4, 4, 4), (2, 2, 2)],
)
def test_word_narrows_to_the_least_aligned_address(alignment, word, align):
    plan = plan_receive(vllm_cache("KBHNC"), "NHC", 16)
    launch = plan_receive_launch(plan, members=1, outer=2, units=1, alignment=alignment, limits=Limits())
    assert (launch.word_bytes, launch.align_bytes) == (word, align)


def test_a_transposed_last_axis_moves_single_items():
    """When channels do not stay innermost (an NCH cache), rows are single items."""
    cache = make_cache("BNHC", "BNCH", dict(B=4, N=8, H=2, C=4), torch.float16)
    plan = plan_receive(Layout.of(cache, "BNHC"), "HNC", 8)
    assert plan is not None
    launch = plan_receive_launch(plan, members=1, outer=1, units=1, alignment=256, limits=Limits())
    assert launch.word_bytes == 2 and launch.rows.run == 1


def test_rows_are_padded_to_max_dims():
    plan = plan_receive(vllm_cache("KBHNC"), "NHC", 16)
    launch = plan_receive_launch(plan, members=1, outer=2, units=1, alignment=256, limits=Limits())
    assert len(launch.rows.dims) == len(launch.rows.src_strides) == len(launch.rows.dst_strides) == MAX_LOOP_DIMS
    src, dst = row_offsets(launch.rows)
    assert sorted(src.tolist()) == dst.tolist() == list(range(0, launch.piece_words, launch.rows.run))


@pytest.mark.parametrize(
    ("field", "value"), [("tile_bytes", 15 << 10), ("tile_bytes", 0), ("programs", 0), ("processors", -1)]
)
def test_limits_a_kernel_cannot_run_with_are_refused(field, value):
    with pytest.raises(BackendError, match=f"Limits.{field} {value} must be"):
        Limits(**{field: value})


def test_limits_at_their_edges_are_taken():
    limits = Limits(tile_bytes=1, programs=1)  # 2^0 bytes is a power of two
    assert (limits.tile_bytes, limits.programs) == (1, 1)


def staging_copy_plan():
    """A staging copy's plan: HND blocks of 16 tokens into NHD ones, rows of one head's 128 bf16 channels."""
    return plan_copy(vllm_cache("KBHNC", tokens=16), vllm_cache("KBNHC", tokens=16))


def staging_copy_launch(limits: Limits, blocks: int = 4):
    """Its launch for 2 layers and ``blocks`` blocks, addresses 256-byte aligned."""
    return plan_copy_launch(staging_copy_plan(), pairs=2, blocks=blocks, alignment=256, limits=limits)


@pytest.mark.parametrize(
    ("tile_bytes", "tile", "warps"),
    [(16 << 10, Tile(64, 32), 8), (8 << 10, Tile(32, 32), 4), (4 << 10, Tile(16, 32), 4)],
)
def test_tiles_fill_their_budget_and_take_8_warps_past_8_kib(tile_bytes, tile, warps):
    launch = staging_copy_launch(Limits(tile_bytes=tile_bytes))
    assert (launch.word_bytes, launch.align_bytes) == (8, 16)
    assert launch.tile == tile and launch.num_warps == warps


@pytest.mark.parametrize("tile_bytes", [1 << n for n in range(16)])
def test_a_tile_stays_within_its_bytes(tile_bytes):
    """Rows of 256 bytes (32 words of 8): from 256 bytes down a tile is one row, then part of one."""
    launch = staging_copy_launch(Limits(tile_bytes=tile_bytes))
    assert launch.tile.words * launch.word_bytes <= max(tile_bytes, launch.word_bytes)
    if tile_bytes <= 256:
        assert launch.tile == Tile(1, max(1, tile_bytes // 8))


def test_a_tile_costing_exactly_the_thread_budget_is_kept():
    full = staging_copy_launch(Limits())
    cost = register_cost(full.tile, full.word_bytes, full.align_bytes)
    assert cost == 24  # 64 rows x 32 words over 256 threads, as 16-byte pairs: 4 accesses of 4 + 2 registers
    at_budget = staging_copy_launch(Limits(thread_registers=cost))
    assert at_budget.tile == full.tile
    under = staging_copy_launch(Limits(thread_registers=cost - 1))
    assert under.tile.words < full.tile.words
    assert register_cost(under.tile, under.word_bytes, under.align_bytes) <= cost - 1


def test_a_tile_shrinks_to_one_word_and_no_further():
    """A budget no tile meets still leaves a tile that moves something."""
    launch = staging_copy_launch(Limits(thread_registers=1))
    assert launch.tile == Tile(1, 1)


@pytest.mark.parametrize("budget", range(1, 40))
@pytest.mark.parametrize(("rows", "run", "word", "align"), [(16, 512, 1, 1), (64, 32, 8, 16), (4, 2048, 2, 2)])
def test_a_tile_halves_its_rows_to_one_before_its_run(budget, rows, run, word, align):
    """The tile kept is the first of (R, C), (R/2, C) .. (1, C), (1, C/2) .. (1, 1) within the budget:
    whole rows are kept while any fit (a row's loads stay wide), and no larger step fits."""
    full = Tile(rows, run)  # 16 KiB: the default tile_bytes
    tile = _tile(_rows([rows], [run], [run], run), word, align, Limits(thread_registers=budget))
    if tile.rows > 1:
        assert tile.run == full.run
    if tile.words > 1:
        assert register_cost(tile, word, align) <= budget
    larger = Tile(tile.rows * 2, tile.run) if tile.run == full.run else Tile(1, tile.run * 2)
    if tile != full:
        assert register_cost(larger, word, align) > budget


def test_an_empty_launch_still_has_a_grid():
    """Zero items: one program that finds no work (a grid of none is not a launch)."""
    receive = plan_receive_launch(
        plan_receive(vllm_cache("KBNHC"), "HNC", 16), members=2, outer=2, units=0, alignment=256, limits=Limits()
    )
    copy = staging_copy_launch(Limits(), blocks=0)
    assert (receive.items, receive.programs) == (0, 1)
    assert (copy.items, copy.programs) == (0, 1)


def test_helpers():
    assert widest_word(256, 64) == 8 and widest_word(6) == 2 and widest_word(256, most=16) == 16
    assert widest_word() == 8


def test_register_cost_of_narrow_rows():
    """2-byte words in rows of one word: each access moves one word (a register) from its
    own 64-bit address (two): three registers per two bytes. 4 warps for tiles up to 8 KiB."""
    for rows in (128, 256, 1024):
        assert register_cost(Tile(rows, 1), word=2, align=2) == 3 * rows // 128
    # Rows of 8 words 16-byte aligned: one 16-byte vector per access, 4 registers + 2.
    assert register_cost(Tile(128, 8), word=2, align=16) == 6


def run_copy_launch(job, limits: Limits) -> None:
    """Carry out a copy launch with NumPy, block by block like the kernel."""
    src_bases = [s.tensor.data_ptr() for s, _ in job.pairs]
    dst_bases = [d.tensor.data_ptr() for _, d in job.pairs]
    alignment = int(np.bitwise_or.reduce(np.array(src_bases + dst_bases)))
    launch = plan_copy_launch(
        job.plan, pairs=len(job.pairs), blocks=job.src_ids.size, alignment=alignment, limits=limits
    )
    word, run = WORDS[launch.word_bytes], launch.rows.run
    src_rows, dst_rows = row_offsets(launch.rows)
    columns = np.arange(run)
    for src, dst in job.pairs:
        source = _byte_view(src.tensor).numpy()
        target = _byte_view(dst.tensor).numpy()
        for s, d in zip(job.src_ids, job.dst_ids):
            s0 = int(s) * job.plan.src_block_stride // launch.word_bytes
            d0 = int(d) * job.plan.dst_block_stride // launch.word_bytes
            usable = source.size // launch.word_bytes * launch.word_bytes
            words = source[:usable].view(word)[s0 + src_rows[:, None] + columns[None, :]]
            target[: target.size // launch.word_bytes * launch.word_bytes].view(word)[
                d0 + dst_rows[:, None] + columns[None, :]
            ] = words


@pytest.mark.parametrize(
    ("src_axes", "src_phys", "dst_axes", "dst_phys"),
    [
        ("KBNHC", "KBHNC", "KBNHC", "KBNHC"),
        ("KBNHC", "KBNHC", "BKNHC", "BKHNC"),
        ("BHNC", "HBNC", "BNHC", "BNHC"),
        ("LBHNC", "BLHNC", "LBNHC", "LBNHC"),
        ("BNC", "BNC", "BNC", "BNC"),
    ],
)
def test_copy_launch_copies_blocks_between_layouts(src_axes, src_phys, dst_axes, dst_phys):
    sizes = dict(L=3, K=2, N=8, H=2, C=16)
    src = {f"l{i}": make_cache(src_axes, src_phys, {**sizes, "B": 12}) for i in range(2)}
    dst = {f"l{i}": make_cache(dst_axes, dst_phys, {**sizes, "B": 10}) for i in range(2)}
    for i, t in enumerate([*src.values(), *dst.values()]):
        fill_random(t, 40 + i)
    case = CopyCase(src, dst, src_axes, dst_axes)
    src_ids, dst_ids = [11, 3, 7, 0], [2, 9, 4, 6]
    batch = plan_copy_batch(CacheSet(src, src_axes), CacheSet(dst, dst_axes), src_ids, dst_ids, False)
    for job in batch.jobs:
        run_copy_launch(job, Limits())
    case.check(src_ids, dst_ids)


def test_copy_launch_of_a_large_cache_keeps_outer_strides():
    """K-outer caches: the K stride is a row stride; a tile never exceeds its budget."""
    src = Layout.of(make_cache("KBNHC", "KBHNC", dict(K=2, B=4096, N=16, H=8, C=128)), "KBNHC")
    dst = Layout.of(make_cache("KBNHC", "KBNHC", dict(K=2, B=64, N=16, H=8, C=128)), "KBNHC")
    plan = plan_copy(src, dst)
    launch = plan_copy_launch(plan, pairs=64, blocks=300, alignment=512, limits=Limits(programs=528))
    assert launch.word_bytes == 8 and launch.align_bytes == 16
    assert launch.rows.run == 32  # one head's 128 bf16 channels
    assert src.stride("K") * 2 // 8 in launch.rows.src_strides
    assert launch.items == 64 * 300 and launch.programs == 528
    assert launch.tile.words * launch.word_bytes <= Limits().tile_bytes


def test_launches_too_large_for_int32_items_are_refused():
    plan = plan_receive(vllm_cache("KBHNC"), "NHC", 16)
    with pytest.raises(kvhost.BackendError, match="work items in one launch"):
        plan_receive_launch(plan, members=1 << 12, outer=2, units=1 << 20, alignment=256, limits=Limits())


def test_launches_of_up_to_2_31_minus_1_less_the_programs_items_are_planned():
    """The kernels count items in int32, each program stepping by the grid: a count within
    the grid's size of 2^31 - 1 would wrap on the last step (a negative item, wild addresses)."""
    plan = staging_copy_plan()
    most = (1 << 31) - 1 - Limits().programs
    assert plan_copy_launch(plan, pairs=1, blocks=most, alignment=256, limits=Limits()).items == most
    with pytest.raises(kvhost.BackendError, match=f"{most + 1} work items in one launch; .* up to {most} with 1024"):
        plan_copy_launch(plan, pairs=1, blocks=most + 1, alignment=256, limits=Limits())
    fewer = Limits(programs=8)  # fewer programs, fewer steps past the count
    assert plan_copy_launch(plan, pairs=1, blocks=(1 << 31) - 9, alignment=256, limits=fewer).items == (1 << 31) - 9
    with pytest.raises(kvhost.BackendError, match="2147483648 work items in one launch"):
        plan_copy_launch(plan, pairs=2, blocks=1 << 30, alignment=256, limits=Limits())


def test_a_unit_that_fits_in_registers_is_one_piece():
    """Shared leading dims (the remote sub-blocks) could make pieces, but a unit held whole needs only one."""
    layout = Layout.of(make_cache("KBNHC", "KBNHC", dict(K=2, B=4, N=16, H=2, C=8)), "KBNHC")
    plan = plan_receive(layout, "HNC", 4)
    assert plan.perm[0] == 0  # the remote sub-block leads on both sides
    launch = plan_receive_launch(plan, members=2, outer=2, units=4, alignment=256, limits=Limits())
    assert launch.in_registers and launch.pieces == 1
    assert launch.piece_words * launch.word_bytes == plan.unit_bytes == 512


def test_a_split_launch_prints_without_its_schedule():
    """Failed asserts and debuggers show a launch by its repr; its schedule (one round per launch) is left out."""
    plan = plan_receive(vllm_cache("KBNHC", tokens=16), "HNC", 4096)
    launch = plan_receive_launch(plan, members=32, outer=2, units=2, alignment=256, limits=H200)
    assert launch.mode == "split" and len(launch.schedule) > 1
    assert "schedule" not in repr(launch) and "Round(" not in repr(launch)
