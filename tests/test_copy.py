"""Copy conformance: block dst_ids[i] of every layer holds block src_ids[i], read logically."""

from __future__ import annotations

import math

import pytest
import torch

import kvhost
from kvhost.testing import CopyCase, fill_random, make_cache, raw

SIZES = dict(K=2, B=12, N=8, H=2, C=16)

# (axes, physical) pairs for the two sides of a copy.
PAIRS = {
    "same-NHD": (("KBNHC", "KBNHC"), ("KBNHC", "KBNHC")),
    "HND->NHD": (("KBNHC", "KBHNC"), ("KBNHC", "KBNHC")),
    "NHD->HND": (("KBNHC", "KBNHC"), ("KBNHC", "KBHNC")),
    "KBNHC->BKHNC": (("KBNHC", "KBNHC"), ("BKNHC", "BKHNC")),
    "BHNC/HBNC->BNHC": (("BHNC", "HBNC"), ("BNHC", "BNHC")),
    "MLA": (("BNC", "BNC"), ("BNC", "BNC")),
    "cross-layer": (("LBHNC", "BLHNC"), ("LBNHC", "LBNHC")),
}
IDS = {
    "runs": ([0, 1, 2, 3, 8, 9, 10], [4, 5, 6, 7, 0, 1, 2]),  # allocator-like runs
    "scattered": ([11, 3, 7, 0], [2, 9, 4, 6]),
    "one": ([5], [5]),
}


def sizes_for(axes: str, blocks: int) -> dict[str, int]:
    sizes = dict(SIZES, B=blocks, L=3)
    return {a: sizes[a] for a in axes}


def build(axes, physical, blocks, device, seed, dtype=torch.bfloat16, units=None):
    """Two layers of random bytes; ``units`` sets letters to other sizes (of 1, say)."""
    sizes = {a: n for a, n in (sizes_for(axes, blocks) | (units or {})).items() if a in axes}
    caches = {f"layer{i}": make_cache(axes, physical, sizes, dtype, device) for i in range(2)}
    for i, t in enumerate(caches.values()):
        fill_random(t, seed + i)
    return caches


@pytest.mark.parametrize("ids", list(IDS), ids=list(IDS))
@pytest.mark.parametrize("pair", list(PAIRS), ids=list(PAIRS))
@pytest.mark.parametrize("direction", ["host->device", "device->host", "device->device"])
def test_copy_between_layouts_and_devices(target, pair, ids, direction):
    (src_axes, src_phys), (dst_axes, dst_phys) = PAIRS[pair]
    src_dev, dst_dev = {
        "host->device": ("cpu", target.device),
        "device->host": (target.device, "cpu"),
        "device->device": (target.device, target.device),
    }[direction]
    src = build(src_axes, src_phys, 12, src_dev, 1)
    dst = build(dst_axes, dst_phys, 10, dst_dev, 100)
    case = CopyCase(src, dst, src_axes, dst_axes)
    src_ids, dst_ids = IDS[ids]
    result = kvhost.copy_blocks(src, dst, src_ids, dst_ids, axes=src_axes, dst_axes=dst_axes, backend=target.backend)
    result.wait()
    assert result.done()
    case.check(src_ids, dst_ids)
    block_bytes = 2  # bf16
    for a in src_axes.replace("B", ""):
        block_bytes *= sizes_for(src_axes, 12)[a]
    assert result.blocks == len(src_ids)
    assert result.bytes_moved == len(src_ids) * block_bytes * 2  # two layers
    assert result.backend == target.name


# Layouts that differ by letters of size 1 (an MLA latent with or without a head dim of
# one, K of one member, a group of one layer): (axes, physical, sizes) per side.
UNIT_PAIRS = {
    "BNHC(H=1)->BNC": (("BNHC", "BNHC", dict(H=1)), ("BNC", "BNC", {})),
    "HBNC(H=1 outer)->BNC": (("HBNC", "HBNC", dict(H=1)), ("BNC", "BNC", {})),
    "BNC->BHNC(H=1)": (("BNC", "BNC", {}), ("BNHC", "BHNC", dict(H=1))),
    "KBNC(K=1)->BNHC(H=1)": (("KBNC", "KBNC", dict(K=1)), ("BNHC", "BNHC", dict(H=1))),
    "LKBNHC(L=1)->KBNHC(HND)": (("LKBNHC", "LKBNHC", dict(L=1)), ("KBNHC", "KBHNC", {})),
}


@pytest.mark.parametrize("ids", ["runs", "scattered"])
@pytest.mark.parametrize("pair", list(UNIT_PAIRS), ids=list(UNIT_PAIRS))
@pytest.mark.parametrize("direction", ["host->device", "device->host"])
def test_copy_between_layouts_that_differ_by_letters_of_size_1(target, pair, ids, direction):
    (src_axes, src_phys, src_units), (dst_axes, dst_phys, dst_units) = UNIT_PAIRS[pair]
    src_dev, dst_dev = ("cpu", target.device) if direction == "host->device" else (target.device, "cpu")

    src = build(src_axes, src_phys, 12, src_dev, 1, units=src_units)
    dst = build(dst_axes, dst_phys, 10, dst_dev, 100, units=dst_units)
    case = CopyCase(src, dst, src_axes, dst_axes)
    src_ids, dst_ids = IDS[ids]
    result = kvhost.copy_blocks(src, dst, src_ids, dst_ids, axes=src_axes, dst_axes=dst_axes, backend=target.backend)
    result.wait()
    case.check(src_ids, dst_ids)
    block_bytes = 2 * math.prod(n for a, n in (sizes_for(dst_axes, 10) | dst_units).items() if a != "B")  # bf16
    assert result.blocks == len(src_ids) and result.bytes_moved == len(src_ids) * block_bytes * 2


def test_layouts_that_differ_by_a_letter_of_more_than_one_are_refused_unchanged():
    src = {"layer0": make_cache("BNHC", "BNHC", dict(B=4, N=8, H=2, C=16))}
    dst = {"layer0": make_cache("BNC", "BNC", dict(B=4, N=8, C=16))}  # all but H alike: H of 2 is no letter to drop
    fill_random(dst["layer0"], 5)
    before = dst["layer0"].clone()
    with pytest.raises(kvhost.LayoutError, match=r"'H': 2.*letters of size 1 may be left out"):
        kvhost.copy_blocks(src, dst, [0], [1], axes="BNHC", dst_axes="BNC")
    assert torch.equal(raw(dst["layer0"]), raw(before))


@pytest.mark.parametrize(
    "dtype", [torch.float8_e4m3fn, torch.float8_e5m2, torch.float32, torch.float64, torch.int8], ids=str
)
def test_copy_dtypes(target, dtype):
    src = build("KBNHC", "KBHNC", 12, "cpu", 3, dtype)
    dst = build("KBNHC", "KBNHC", 10, target.device, 4, dtype)
    case = CopyCase(src, dst, "KBNHC", "KBNHC")
    kvhost.copy_blocks(src, dst, [3, 4, 9], [0, 1, 7], axes="KBNHC", backend=target.backend).wait()
    case.check([3, 4, 9], [0, 1, 7])


def test_copy_kv_tuple_to_k_axis_and_back(target):
    """Separate K and V tensors on one side, one tensor with a K axis on the other."""
    sizes = dict(B=10, N=8, H=2, C=16)
    pairs = {
        f"layer{i}": (
            make_cache("BNHC", "BNHC", sizes, device=target.device),
            make_cache("BNHC", "BNHC", sizes, device=target.device),
        )
        for i in range(2)
    }
    for i, (k, v) in enumerate(pairs.values()):
        fill_random(k, 10 + i)
        fill_random(v, 20 + i)
    host = build("KBNHC", "KBHNC", 6, "cpu", 30)
    kvhost.copy_blocks(pairs, host, [7, 2, 3], [0, 4, 5], axes="KBNHC", backend=target.backend).wait()
    for name, (k, v) in pairs.items():
        for s, d in zip([7, 2, 3], [0, 4, 5]):
            assert torch.equal(raw(host[name][0, d]).cpu(), raw(k[s]).cpu())
            assert torch.equal(raw(host[name][1, d]).cpu(), raw(v[s]).cpu())
    fresh = build("KBNHC", "KBNHC", 6, "cpu", 40)
    kvhost.copy_blocks(fresh, pairs, [1, 2], [9, 0], axes="KBNHC", backend=target.backend).wait()
    for name, (k, v) in pairs.items():
        assert torch.equal(raw(k[9]).cpu(), raw(fresh[name][0, 1]))
        assert torch.equal(raw(v[0]).cpu(), raw(fresh[name][1, 2]))


def test_kvhost_copy_to_and_from(target):
    device_caches = build("KBNHC", "KBNHC", 12, target.device, 50)
    host = kvhost.KVHost(device_caches, axes="KBNHC", backend=target.backend)
    host_buffer = build("KBNHC", "KBHNC", 8, "cpu", 60)
    case = CopyCase(device_caches, host_buffer, "KBNHC", "KBNHC")
    host.copy_to(host_buffer, [10, 11, 4], [0, 1, 2]).wait()
    case.check([10, 11, 4], [0, 1, 2])
    case = CopyCase(host_buffer, device_caches, "KBNHC", "KBNHC")
    host.copy_from(host_buffer, [5, 6], [1, 2]).wait()
    case.check([5, 6], [1, 2])


def test_non_blocking_copy_completes(target):
    src = build("KBNHC", "KBNHC", 12, "cpu", 70)
    dst = build("KBNHC", "KBNHC", 12, target.device, 80)
    case = CopyCase(src, dst, "KBNHC", "KBNHC")
    result = kvhost.copy_blocks(
        src, dst, [0, 1, 2, 3], [8, 9, 10, 11], axes="KBNHC", non_blocking=True, backend=target.backend
    )
    assert result.wait() is result and result.done()
    case.check([0, 1, 2, 3], [8, 9, 10, 11])


def test_empty_copy_is_a_no_op(target):
    src = build("KBNHC", "KBNHC", 4, "cpu", 90)
    dst = build("KBNHC", "KBNHC", 4, target.device, 91)
    case = CopyCase(src, dst, "KBNHC", "KBNHC")
    result = kvhost.copy_blocks(src, dst, [], [], axes="KBNHC", backend=target.backend)
    assert result.blocks == 0 and result.bytes_moved == 0 and result.done() and result.runs == 0
    case.check([], [])


def test_copy_results_compare_and_print_by_their_numbers():
    """Two copies of the same blocks report equal results; neither the completion nor the
    job (a backend's objects) takes part in equality or in the repr."""
    src = build("KBNHC", "KBNHC", 6, "cpu", 92)
    dst = build("KBNHC", "KBNHC", 6, "cpu", 93)
    first = kvhost.copy_blocks(src, dst, [0, 1, 4], [2, 3, 5], axes="KBNHC").wait()
    second = kvhost.copy_blocks(src, dst, [0, 1, 4], [2, 3, 5], axes="KBNHC").wait()
    assert first == second and first.completion is not second.completion and first.job is not second.job
    assert first.runs == 2 and repr(first) == f"CopyResult(blocks=3, bytes_moved={first.bytes_moved}, backend='cpu')"


def test_receive_stats_count_nothing_unless_told():
    stats = kvhost.ReceiveStats(blocks=4, bytes_moved=64, groups=1, backend="cpu")
    assert (stats.requests, stats.skipped_blocks, stats.zeroed_blocks, stats.seconds) == (0, 0, 0, 0.0)


@pytest.mark.parametrize("ids", ["runs", "scattered"])
def test_copy_large_enough_for_every_core(target, ids):
    """Over a megabyte per job: the CPU backend's parallel kernels, not the serial ones."""
    sizes = dict(K=2, B=24, N=64, H=8, C=128)
    src = {"l": fill_random(make_cache("KBNHC", "KBHNC", sizes, device="cpu"), 1)}
    dst = {"l": fill_random(make_cache("KBNHC", "KBNHC", sizes, device=target.device), 2)}
    case = CopyCase(src, dst, "KBNHC", "KBNHC")
    src_ids, dst_ids = {
        "runs": (list(range(2, 14)), list(range(8, 20))),
        "scattered": ([5, 1, 22, 9, 14], [0, 23, 7, 12, 3]),
    }[ids]
    result = kvhost.copy_blocks(src, dst, src_ids, dst_ids, axes="KBNHC", backend=target.backend).wait()
    assert result.bytes_moved > 1 << 20
    case.check(src_ids, dst_ids)


# (source ids, destination ids): destination ids in one run (a staging buffer filling in
# order), source ids in one run (loading it back), both scattered.
MANY_RUNS = {
    "dst-in-order": ([11, 3, 7, 0, 5], [2, 3, 4, 5, 6]),
    "src-in-order": ([3, 4, 5, 6, 7], [9, 0, 4, 2, 6]),
    "both-scattered": ([11, 3, 7, 0, 5], [2, 9, 4, 6, 0]),
}


# On the host, calls under ``host_thread_bytes`` take numpy's way on the calling thread;
# 0 sends these small caches through torch's ops.
HOST_WAYS = {"numpy": {}, "torch-ops": {"host_thread_bytes": 0}}


@pytest.mark.parametrize("way", list(HOST_WAYS))
@pytest.mark.parametrize("ids", list(MANY_RUNS))
@pytest.mark.parametrize("pair", list(PAIRS), ids=list(PAIRS))
def test_torch_copy_gathers_or_scatters_straight_when_one_side_runs(pair, ids, way):
    """More runs than ``max_run_copies``: the torch path gathers straight into destination
    runs, scatters straight from source runs, or gathers then scatters; the same bytes, by
    numpy's calls or torch's."""
    from kvhost_torch.backend import TorchBackend

    (src_axes, src_phys), (dst_axes, dst_phys) = PAIRS[pair]
    src = build(src_axes, src_phys, 12, "cpu", 1)
    dst = build(dst_axes, dst_phys, 10, "cpu", 100)
    case = CopyCase(src, dst, src_axes, dst_axes)
    src_ids, dst_ids = MANY_RUNS[ids]
    backend = TorchBackend(max_run_copies=1, **HOST_WAYS[way])
    kvhost.copy_blocks(src, dst, src_ids, dst_ids, axes=src_axes, dst_axes=dst_axes, backend=backend).wait()
    case.check(src_ids, dst_ids)


@pytest.mark.parametrize("way", list(HOST_WAYS))
@pytest.mark.parametrize("ids", list(MANY_RUNS))
def test_torch_copy_within_one_cache(ids, way):
    """Source and destination in one cache (blocks apart): the torch path keeps such copies
    off its one-pass index ops, and lands the same bytes."""
    from kvhost_torch.backend import TorchBackend

    src_ids, dst_ids = MANY_RUNS[ids]
    dst_ids = [12 + d for d in dst_ids]
    for max_run_copies in (1, 64):  # a gather then a scatter; a copy_ per run
        cache = build("KBNHC", "KBHNC", 24, "cpu", 1)  # anew: each copy must land its own bytes
        case = CopyCase(cache, cache, "KBNHC", "KBNHC")
        backend = TorchBackend(max_run_copies=max_run_copies, **HOST_WAYS[way])
        kvhost.copy_blocks(cache, cache, src_ids, dst_ids, axes="KBNHC", backend=backend).wait()
        case.check(src_ids, dst_ids)


FAULTS = {  # what a faulty copy leaves (the cache it wrote, the block), and what the oracle says
    "wrong block": ("dst", 2, "block 2 does not hold source block 1"),
    "untouched block": ("dst", 3, "block 3, not written by the copy, changed"),
    "source written": ("src", 4, "block 4, not written by the copy, changed"),
    # Source and destination written alike (staging garbage through both): they agree, but
    # not with the source as it was.
    "both written alike": ("both", 4, "block 0 does not hold source block 4"),
}


@pytest.mark.parametrize("fault", list(FAULTS))
def test_the_copy_oracle_fails_a_copy_that_is_wrong_anywhere(fault):
    """CopyCase must be able to fail, whatever a copy got wrong."""
    src = build("KBNHC", "KBHNC", 6, "cpu", 11)
    dst = build("KBNHC", "KBNHC", 6, "cpu", 12)
    case = CopyCase(src, dst, "KBNHC", "KBNHC")
    kvhost.copy_blocks(src, dst, [4, 1], [0, 2], axes="KBNHC").wait()
    case.check([4, 1], [0, 2])
    written, block, message = FAULTS[fault]
    raw((dst if written == "dst" else src)["layer1"])[1, block, 5, 0, 3] += 1  # one element of a V half
    if written == "both":
        kvhost.copy_blocks(src, dst, [4], [0], axes="KBNHC").wait()
    with pytest.raises(AssertionError, match=message):
        case.check([4, 1], [0, 2])
