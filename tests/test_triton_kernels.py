"""The Triton kernels in Triton's interpreter, in the modes the default target rarely reaches.

The conformance suite runs the kernels through the ``triton-interpret`` target with
settings where most pieces fit in registers. Here the same conformance test bodies run
with every piece forced through the scratch slot and tiles so small that every loop and
mask is used, plus cases the suite's shapes do not produce: misaligned tensors (narrow
words), sizes that are not powers of two, and a staged host copy with kernels on both
device-side steps. Needs TRITON_INTERPRET=1 (ci/cpu.sh sets it); skipped otherwise.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import torch
from conftest import Target
from kvhost_accelerator import backend as accelerator_backend
from kvhost_accelerator.backend import load_kernels
from kvhost_accelerator.interpret import TritonInterpretBackend
from kvhost_accelerator.launch import Limits, plan_receive_launch
from test_copy import test_copy_between_layouts_and_devices as copy_conformance
from test_receive import CASES
from test_receive import test_blocks_padded_past_their_region as padded_conformance
from test_receive import test_receive_matches_sender as receive_conformance

import kvhost
from kvhost.batch import plan_copy_batch, plan_receive_batch
from kvhost.caches import CacheSet
from kvhost.testing import CopyCase, ReceiveCase, fill_random, raw, read_tokens

pytestmark = pytest.mark.skipif(
    TritonInterpretBackend.unavailable_reason() is not None, reason=str(TritonInterpretBackend.unavailable_reason())
)

TINY = Limits(register_bytes=0, tile_bytes=64, programs=3)  # scratch slots, tiles of a few words: every loop runs
# Scratch for a slot or two: split receives, many rounds, one half or two, chunks of 8 words.
SPLIT = Limits(register_bytes=0, tile_bytes=64, programs=3, scratch_bytes=512)
# The same budget, allowed to grow to a slot per program: slots launches with scratch beyond the budget.
GROWN = replace(SPLIT, scratch_most_bytes=1 << 20)


def tiny_target(limits: Limits = TINY) -> Target:
    return Target(TritonInterpretBackend(limits), "cpu")  # type: ignore[arg-type]


GUARD_WORDS = 256
SENTINEL = -7


@pytest.fixture
def guarded_scratch(monkeypatch):
    """Each receive's scratch placed between guard words; after the test, every guard word
    must still hold its sentinel: the kernels write their slots and nothing around them
    (a receive that is the identity launches nothing)."""
    kernels = load_kernels()
    original = kernels.receive_calls
    scratches: list[tuple[torch.Tensor, int]] = []

    def guarded(launch, *, scratch, **tables):
        memory = torch.full((scratch.numel() + 2 * GUARD_WORDS,), SENTINEL, dtype=scratch.dtype)
        scratches.append((memory, scratch.numel()))
        return original(launch, scratch=memory[GUARD_WORDS : GUARD_WORDS + scratch.numel()], **tables)

    monkeypatch.setattr(kernels, "receive_calls", guarded)
    yield
    for memory, words in scratches:
        assert (memory[:GUARD_WORDS] == SENTINEL).all() and (memory[GUARD_WORDS + words :] == SENTINEL).all()


@pytest.fixture
def receive_launches(monkeypatch):
    """Every receive launch the kernels are asked for, with its tables, in order."""
    kernels = load_kernels()
    original, launches = kernels.receive_calls, []

    def recorded(launch, **tables):
        launches.append((launch, tables))
        return original(launch, **tables)

    monkeypatch.setattr(kernels, "receive_calls", recorded)
    return launches


@pytest.mark.timeout(300)
@pytest.mark.parametrize(("layout", "kind", "k", "order"), CASES[::11])
def test_receive_through_scratch_in_tiny_tiles(guarded_scratch, layout, kind, k, order):
    receive_conformance(tiny_target(), layout, kind, k, order)


@pytest.mark.timeout(300)
@pytest.mark.parametrize(("layout", "kind", "k", "order"), CASES[5::11])
def test_receive_split_over_launches(guarded_scratch, layout, kind, k, order):
    receive_conformance(tiny_target(SPLIT), layout, kind, k, order)


@pytest.mark.timeout(300)
@pytest.mark.parametrize(("layout", "kind", "k", "order"), CASES[7::22])
def test_receive_through_slots_grown_beyond_the_budget(guarded_scratch, receive_launches, layout, kind, k, order):
    """Where the budget holds too few slots, grown ones: one launch, and the bytes as split mode leaves them."""
    receive_conformance(tiny_target(GROWN), layout, kind, k, order)
    assert {launch.mode for launch, _ in receive_launches} <= {"slots"}


@pytest.mark.timeout(300)
@pytest.mark.parametrize(("layout", "kind", "k", "order"), CASES[7::23])
def test_receive_without_an_in_kernel_barrier(layout, kind, k, order):
    """As on XPU with an Intel Triton whose barrier fences only local memory: every receive split, default sizes."""
    receive_conformance(tiny_target(Limits(register_bytes=4 << 10, tile_bytes=2 << 10, programs=4, barrier=False)),
                        layout, kind, k, order)  # fmt: skip


@pytest.mark.timeout(300)
@pytest.mark.parametrize("ids", ["runs", "scattered"])
@pytest.mark.parametrize("pair", ["HND->NHD", "BHNC/HBNC->BNHC"])
def test_copy_in_tiny_tiles(pair, ids):
    copy_conformance(tiny_target(), pair, ids, "device->device")


@pytest.mark.parametrize("limits", [None, TINY], ids=["default", "tiny"])
def test_copy_of_blocks_whose_rows_are_not_a_power_of_two(limits):
    """6 tokens x 3 heads of 12 channels, head-major -> token-major: 18 rows a block, so the
    last tile of rows is part mask; the blocks around each destination keep their bytes."""
    src = {"l": torch.empty([10, 3, 6, 12], dtype=torch.float16).permute(0, 2, 1, 3)}  # BNHC axes, HND memory
    dst = {"l": torch.empty([10, 6, 3, 12], dtype=torch.float16)}
    fill_random(src["l"], 31)
    fill_random(dst["l"], 32)
    before = raw(dst["l"]).clone()
    src_ids, dst_ids = [7, 2, 5], [1, 4, 8]
    kvhost.copy_blocks(src, dst, src_ids, dst_ids, axes="BNHC", backend=TritonInterpretBackend(limits))
    source, dest = CacheSet(src, "BNHC").members[0], CacheSet(dst, "BNHC").members[0]
    for s, d in zip(src_ids, dst_ids):
        assert torch.equal(read_tokens(dest.tensor, dest.layout, [d]), read_tokens(source.tensor, source.layout, [s]))
    others = sorted(set(range(10)) - set(dst_ids))
    assert torch.equal(raw(dst["l"])[others], before[others])


def offset_cache(shape_in_memory: list[int], order: list[int], dtype: torch.dtype, skip: int) -> torch.Tensor:
    """A cache that starts ``skip`` items into its allocation: addresses only that aligned."""
    count = int(np.prod(shape_in_memory))
    memory = torch.empty(count + skip, dtype=dtype)[skip:].view(shape_in_memory)
    return memory.permute(order)


@pytest.mark.parametrize(("dtype", "skip", "word"), [(torch.bfloat16, 1, 2), (torch.float8_e4m3fn, 3, 1)])
def test_misaligned_caches_move_narrow_words(dtype, skip, word):
    # KBHNC memory seen as KBNHC: head-major local blocks of 8 tokens, senders token-major with 4.
    caches = {f"l{i}": offset_cache([2, 10, 2, 8, 16], [0, 1, 3, 2, 4], dtype, skip + i) for i in range(2)}
    case = ReceiveCase(caches, "KBNHC", seed=21)
    case.send("r", [7, 2, 5], "NHC", 4)
    backend = TritonInterpretBackend()
    kvhost.receive(caches, {"r": [7, 2, 5]}, axes="KBNHC", remote_order="NHC", remote_block_size=4, backend=backend)
    case.check()
    job = plan_receive_batch(CacheSet(caches, "KBNHC"), {"r": [7, 2, 5]}, "NHC", 4).jobs[0]
    bases = np.array([m.tensor.data_ptr() for m in job.members])
    alignment = int(np.bitwise_or.reduce(np.concatenate([bases, job.layout.outer_offsets_bytes])))
    launch = plan_receive_launch(job.rearrangement, members=2, outer=2, units=3, alignment=alignment, limits=Limits())
    assert launch.word_bytes == word


@pytest.mark.parametrize("limits", [None, TINY, SPLIT], ids=["default", "tiny", "split"])
@pytest.mark.parametrize(("order", "remote"), [("NCH", 4), ("CNH", 8), ("HNC", 2)])
@pytest.mark.parametrize("offset", [1, 2])
def test_items_at_addresses_their_size_does_not_divide_move_as_narrower_words(offset, order, remote, limits):
    """fp32 from imported memory at 1 or 2 bytes past a 4-byte boundary, in a transform
    whose last dim is not kept (NCH, CNH): each item is its own run of 1- or 2-byte words.
    The launch plan had counted the piece in items, not words, and refused the receive."""
    count = 6 * 4 * 2 * 3
    memory = bytearray(count * 4 + 8)
    cache = torch.frombuffer(memory, dtype=torch.float32, count=count, offset=offset).view(6, 4, 2, 3)
    caches = {"l": cache}  # BNHC, token-major blocks of 4 tokens
    case = ReceiveCase(caches, "BNHC", seed=offset)
    ids = [4, 1] if remote <= 4 else [4, 5]
    case.send("r", ids, order, remote)
    backend = TritonInterpretBackend(limits)
    kvhost.receive(caches, {"r": ids}, axes="BNHC", remote_order=order, remote_block_size=remote, backend=backend)
    case.check()
    job = plan_receive_batch(CacheSet(caches, "BNHC"), {"r": ids}, order, remote).jobs[0]
    launch = plan_receive_launch(job.rearrangement, members=1, outer=1, units=1, alignment=cache.data_ptr(),
                                 limits=Limits())  # fmt: skip
    assert launch.word_bytes == offset
    # A kept last dim stays one run (C items); only an item the order moves alone is split.
    assert launch.rows.run * launch.word_bytes == (3 * 4 if order == "HNC" else 4)


@pytest.mark.parametrize("limits", [None, TINY], ids=["default", "tiny"])
def test_blocks_padded_to_a_stride_the_words_do_not_divide(monkeypatch, limits):
    """The conformance case of blocks 66 bytes apart with 64-byte regions: the block stride,
    not the bases or the region, narrows the word to 2 bytes. The interpreter reads a wider
    word at any address where a GPU would fault, so the plan's word is checked too."""
    planned = []

    def plan_and_record(*args, **kwargs):
        planned.append(plan_receive_launch(*args, **kwargs))
        return planned[-1]

    monkeypatch.setattr(accelerator_backend, "plan_receive_launch", plan_and_record)
    padded_conformance(Target(TritonInterpretBackend(limits), "cpu"), "r", 2)  # type: ignore[arg-type]
    assert planned and {launch.word_bytes for launch in planned} == {2}


@pytest.mark.parametrize("limits", [None, TINY, SPLIT, GROWN], ids=["default", "tiny", "split", "grown"])
@pytest.mark.parametrize(("remote", "order"), [(2, "HNC"), (18, "HNC"), (6, "NHC")])
def test_sizes_that_are_not_powers_of_two(remote, order, limits):
    """Local blocks of 6 tokens, 3 heads of 12 channels: r = 3, g = 3 and masks everywhere."""
    sizes = [10, 6, 3, 12]  # B N H C, physical BHNC for head-major local blocks
    caches = {"l": torch.empty([sizes[0], sizes[2], sizes[1], sizes[3]], dtype=torch.float16).permute(0, 2, 1, 3)}
    case = ReceiveCase(caches, "BNHC", seed=remote)
    ids = [4, 8, 1] if remote == 18 else [4, 8]
    case.send("r", ids, order, remote)
    backend = TritonInterpretBackend(limits)
    stats = kvhost.receive(caches, {"r": ids}, axes="BNHC", remote_order=order, remote_block_size=remote,
                           backend=backend)  # fmt: skip
    case.check()
    assert stats.bytes_moved == len(ids) * 6 * 3 * 12 * 2


@pytest.mark.parametrize(
    ("non_blocking", "buffers"),
    [(True, [(4, 3), (4, 3)]), (False, [(3, 4)])],  # bounce: [blocks, layers] twice; host spans: [layers, blocks]
    ids=["bounce", "host-spans"],
)
@pytest.mark.parametrize("to_device", [True, False], ids=["load", "save"])
def test_staged_host_copy_with_kernels_on_the_device_side(to_device, non_blocking, buffers):
    """Host copies that stage: the kernel gathers or scatters the device side into a staging buffer."""
    backend = TritonInterpretBackend()
    device_caches = {f"l{i}": torch.empty([2, 12, 2, 8, 16], dtype=torch.bfloat16).permute(0, 1, 3, 2, 4)
                     for i in range(3)}  # fmt: skip
    host = {f"l{i}": torch.empty([7, 2, 8, 2, 16], dtype=torch.bfloat16) for i in range(3)}  # BKNHC
    for i, t in enumerate([*device_caches.values(), *host.values()]):
        fill_random(t, 60 + i)
    device_ids, host_ids = [9, 2, 11, 5], [6, 0, 3, 1]
    if to_device:
        src, dst, src_axes, dst_axes, src_ids, dst_ids = host, device_caches, "BKNHC", "KBNHC", host_ids, device_ids
    else:
        src, dst, src_axes, dst_axes, src_ids, dst_ids = device_caches, host, "KBNHC", "BKNHC", device_ids, host_ids
    case = CopyCase(src, dst, src_axes, dst_axes)
    job = plan_copy_batch(CacheSet(src, src_axes), CacheSet(dst, dst_axes), src_ids, dst_ids, non_blocking).jobs[0]
    keep: list[object] = []
    finish = backend.copy_host(job, to_device=to_device, keep=keep)
    staging = [k for k in keep if isinstance(k, torch.Tensor) and k.dim() == 6]
    assert [tuple(t.shape[:2]) for t in staging] == buffers
    if finish is not None:
        finish()
    case.check(src_ids, dst_ids)


def test_gpu_check_rows_count_launches_and_compare_bytes():
    """The GPU check in the interpreter: launches, programs, and bytes equal to the torch path's."""
    from kvhost_tools.device_checks.gpucheck import Sizes, measure

    sizes = Sizes(layers=1, heads=2, channels=16, receive_units=4, staging_blocks=4, repeats=1)
    backends = {"triton": TritonInterpretBackend(), "torch": TritonInterpretBackend().torch_path}
    rows = measure(torch.device("cpu"), backends, sizes)  # type: ignore[arg-type]
    triton_rows = [row for row in rows if row.method == "triton"]
    assert len(triton_rows) == 8 and all(row.agrees == "yes" for row in rows if row.method != "memcpy")
    assert all(row.launches >= 1 and 1 <= row.programs <= TritonInterpretBackend.limits.programs for row in triton_rows)
    # Replayed launches timed alone where the device does all the work; host copies are not replayed.
    on_device = [row for row in triton_rows if not row.workload.startswith("staging")]
    assert len(on_device) == 4 and all(row.kernel_fraction > 0 for row in on_device)
    # One call's launches only: the timed calls' would be replayed on tensors freed since.
    assert [row.launches for row in on_device if "HND16" in row.workload or "copy" in row.workload] == [1, 1, 1]
    assert all(row.kernel_fraction == 0 for row in triton_rows if row not in on_device)
    assert all(row.host_seconds > 0 for row in rows if row.method != "memcpy")


@pytest.mark.timeout(300)
@pytest.mark.parametrize(("layout", "k", "order"), [("KBNHC/NHD", 2, "HNC"), ("KBNHC/HND", 4, "HNC")])
def test_split_receive_of_two_layers_with_k_outside_the_block(guarded_scratch, receive_launches, layout, k, order):
    """Split items count (member, outer index, unit, piece): two layers and two outer offsets use every part."""
    receive_conformance(tiny_target(SPLIT), layout, "g", k, order)
    seen = [(launch.mode, t["bases"].numel(), t["outer_offsets"].numel()) for launch, t in receive_launches]
    assert seen == [("split", 2, 2)]


@pytest.mark.timeout(300)
@pytest.mark.parametrize(("layout", "order"), [("BKNHC", "NKHC"), ("LBHNC/BLHNC", "NLHC")])
def test_split_receive_of_units_cut_into_pieces(guarded_scratch, receive_launches, layout, order):
    """A unit cut along the dim both sides lead with (g = 2: the local block): every piece
    read from and written back at its own offset in the unit."""
    receive_conformance(tiny_target(SPLIT), layout, "g", 2, order)
    assert [(launch.mode, launch.pieces) for launch, _ in receive_launches] == [("split", 2)]


def test_a_batch_whose_later_group_the_kernels_cannot_index_changes_nothing(monkeypatch):
    """Each group's launch is planned before any runs: a unit too large for the kernels'
    32-bit offsets in the second group leaves the first group's blocks as they were.
    (The bound is lowered so that a unit of one local block passes it and one of three
    does not.)"""
    from kvhost_accelerator import launch

    monkeypatch.setattr(launch, "MAX_UNIT_WORDS", 100)
    launch._pieces.cache_clear()  # planned under the real bound
    try:
        sizes = [10, 6, 3, 12]  # B N H C, local blocks of 6 tokens, physical BHNC
        caches = {"l": torch.empty([sizes[0], sizes[2], sizes[1], sizes[3]], dtype=torch.float16).permute(0, 2, 1, 3)}
        backend = TritonInterpretBackend()

        def send(seed, requests):
            case = ReceiveCase(caches, "BNHC", seed=seed)
            for name, (ids, size) in requests.items():
                case.send(name, ids, "HNC", size)
            return case, {name: kvhost.Incoming(ids, remote_block_size=size) for name, (ids, size) in requests.items()}

        def receive(incoming):
            return kvhost.receive(caches, incoming, axes="BNHC", remote_order="HNC", backend=backend)

        case, incoming = send(1, {"fits": ([4], 2)})
        receive(incoming)  # alone it fits
        case.check()
        _, incoming = send(2, {"too large": ([0, 1, 2], 18)})
        with pytest.raises(kvhost.BackendError, match=r"a receive unit of 1296 bytes is \d+ words"):
            receive(incoming)
        case, incoming = send(3, {"fits": ([4], 2), "too large": ([0, 1, 2], 18)})
        wire = case.snapshot()  # the bytes as they landed
        with pytest.raises(kvhost.BackendError, match="a receive unit of 1296 bytes"):
            receive(incoming)
        assert case.same_as(wire)
    finally:
        launch._pieces.cache_clear()


def test_a_receive_plans_each_launch_once(monkeypatch):
    """The plan its check made is the one that launches: a receive of two groups plans two
    launches, and a job received without its check plans its own."""
    planned = []

    def plan_and_record(*args, **kwargs):
        planned.append(plan_receive_launch(*args, **kwargs))
        return planned[-1]

    monkeypatch.setattr(accelerator_backend, "plan_receive_launch", plan_and_record)
    sizes = [10, 6, 3, 12]  # B N H C, local blocks of 6 tokens, physical BHNC
    caches = {"l": torch.empty([sizes[0], sizes[2], sizes[1], sizes[3]], dtype=torch.float16).permute(0, 2, 1, 3)}
    case = ReceiveCase(caches, "BNHC", seed=7)
    case.send("a", [4], "HNC", 2)
    case.send("b", [0, 1, 2], "HNC", 18)
    requests = {"a": kvhost.Incoming([4], remote_block_size=2), "b": kvhost.Incoming([0, 1, 2], remote_block_size=18)}
    backend = TritonInterpretBackend()
    stats = kvhost.receive(caches, requests, axes="BNHC", remote_order="HNC", backend=backend)
    case.check()
    assert stats.groups == 2 and len(planned) == 2
    case = ReceiveCase(caches, "BNHC", seed=8)
    case.send("a", [4], "HNC", 2)
    batch = plan_receive_batch(CacheSet(caches, "BNHC"), {"a": [4]}, "HNC", 2)
    backend.receive(batch.jobs[0])
    case.check()
    assert len(planned) == 3
