"""Receive conformance: truth in logical axes, wire bytes from the oracle, every backend."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch

import kvhost
from kvhost.testing import ReceiveCase, fill_random, make_cache, raw

# (axes in shape order, physical order in memory, sizes). Local block size N = 8.
LAYOUTS = {
    "KBNHC/NHD": ("KBNHC", "KBNHC", dict(K=2, B=12, N=8, H=2, C=4)),
    "KBNHC/HND": ("KBNHC", "KBHNC", dict(K=2, B=12, N=8, H=2, C=4)),
    "BKNHC": ("BKNHC", "BKNHC", dict(K=2, B=12, N=8, H=2, C=4)),
    "BKNHC/BKHNC": ("BKNHC", "BKHNC", dict(K=2, B=12, N=8, H=2, C=4)),
    "BHNC/BNHC": ("BHNC", "BNHC", dict(B=12, N=8, H=3, C=4)),
    "BHNC/BHNC": ("BHNC", "BHNC", dict(B=12, N=8, H=3, C=4)),
    "BHNC/HBNC": ("BHNC", "HBNC", dict(B=12, N=8, H=3, C=4)),
    "BNC/MLA": ("BNC", "BNC", dict(B=12, N=8, C=12)),
    "LBHNC/BLHNC": ("LBHNC", "BLHNC", dict(L=3, B=12, N=8, H=2, C=4)),
    "LBHNC/LBHNC": ("LBHNC", "LBHNC", dict(L=3, B=12, N=8, H=2, C=4)),
    "BNHKC": ("BNHKC", "BNHKC", dict(B=12, N=8, H=2, K=2, C=4)),
}
RATIOS = [("r", 1), ("r", 2), ("r", 4), ("r", 8), ("g", 2), ("g", 4)]


def region_of(physical: str) -> str:
    return physical[physical.index("B") + 1 :]


def remote_orders(region: str) -> list[str]:
    """Every permutation of the region's letters with C last."""
    others = [a for a in region if a != "C"]
    return ["".join(p) + "C" for p in itertools.permutations(others)]


def request_ids(g: int) -> dict[str, list[int]]:
    """Three requests over scattered blocks, in whole groups of g."""
    pool = [9, 2, 7, 0, 11, 4, 5, 10]
    sizes = {"a": 1, "b": 2, "c": 1} if g == 1 else {"a": 1, "b": 1}
    out, at = {}, 0
    for name, groups in sizes.items():
        out[name] = pool[at : at + groups * g]
        at += groups * g
    return out


CASES = [
    pytest.param(name, kind, k, order, id=f"{name}-{kind}{k}-{order}")
    for name, (axes, physical, sizes) in LAYOUTS.items()
    for kind, k in RATIOS
    for order in remote_orders(region_of(physical))
]


@pytest.mark.parametrize(("layout", "kind", "k", "order"), CASES)
def test_receive_matches_sender(target, layout, kind, k, order):
    axes, physical, sizes = LAYOUTS[layout]
    if target.device == "xla" and physical != axes:
        pytest.skip("XLA tensors have no strides: their memory order is their shape order")
    caches = {f"layer{i}": make_cache(axes, physical, sizes, torch.bfloat16, target.device) for i in range(2)}
    remote_size = sizes["N"] // k if kind == "r" else sizes["N"] * k
    g = k if kind == "g" else 1
    case = ReceiveCase(caches, axes, seed=k)
    for name, ids in request_ids(g).items():
        case.send(name, ids, order, remote_size)
    requests = {name: wired.block_ids for name, wired in case.requests.items()}
    stats = kvhost.receive(
        caches, requests, axes=axes, remote_order=order, remote_block_size=remote_size, backend=target.backend
    )
    case.check()
    assert stats.blocks == sum(len(ids) for ids in requests.values())
    assert stats.backend == target.name
    if stats.bytes_moved == 0:
        assert stats.skipped_blocks == stats.blocks and stats.groups == 0


# One head per rank whose stride lies outside the blocks: H is an outer letter of size 1.
ONE_HEAD_OUTSIDE = ("KBNHC", "HBNKC", dict(K=2, B=12, N=8, H=1, C=4))


@pytest.mark.parametrize(("kind", "k"), RATIOS)
@pytest.mark.parametrize("order", ["NKC", "KNC", "HKNC", "KHNC", "NKHC", "KNHC"])
def test_a_letter_of_size_one_may_lie_anywhere_in_the_senders_order(target, order, kind, k):
    """The sender may name H inside its region (its blocks hold one head too) or leave it
    out: a letter of size 1 moves no byte wherever it lies, so every such order is taken,
    and the bytes are the wire model's."""
    axes, physical, sizes = ONE_HEAD_OUTSIDE
    if target.device == "xla":
        pytest.skip("XLA tensors have no strides: their memory order is their shape order")
    caches = {f"layer{i}": make_cache(axes, physical, sizes, torch.bfloat16, target.device) for i in range(2)}
    remote_size = sizes["N"] // k if kind == "r" else sizes["N"] * k
    case = ReceiveCase(caches, axes, seed=k)
    for name, ids in request_ids(k if kind == "g" else 1).items():
        case.send(name, ids, order, remote_size)
    requests = {name: wired.block_ids for name, wired in case.requests.items()}
    kvhost.receive(
        caches, requests, axes=axes, remote_order=order, remote_block_size=remote_size, backend=target.backend
    )
    case.check()


def test_without_letters_of_size_one_a_refused_order_excuses_none():
    caches = {"l": make_cache("KBNHC", "KBHNC", dict(K=2, B=8, N=8, H=2, C=4))}
    with pytest.raises(kvhost.ArgumentError, match=r"\(local physical order 'KBHNC'\): it must use the same letters$"):
        kvhost.receive(caches, {"r": [1]}, axes="KBNHC", remote_order="NC", remote_block_size=8)


def test_a_letter_of_size_one_does_not_excuse_a_missing_one():
    caches = {"l": make_cache(*ONE_HEAD_OUTSIDE)}
    for order in ("NC", "HNC", "LKNC"):  # K (2) left out; L named, which these caches have not
        with pytest.raises(
            kvhost.ArgumentError, match=r"must use the same letters \(those of size 1, H, may be left out\)"
        ):
            kvhost.receive(caches, {"r": [1]}, axes="KBNHC", remote_order=order, remote_block_size=8)


DTYPES = [
    torch.float16,
    torch.bfloat16,
    torch.float32,
    torch.float64,  # 8-byte items: moved as int64
    torch.uint8,
    torch.int8,
    torch.float8_e4m3fn,
    torch.float8_e5m2,
]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(("kind", "k"), [("r", 4), ("g", 2)])
def test_every_kv_dtype(target, dtype, kind, k):
    # C = 16 makes fp16/bf16 rows 32 bytes: the kernels' vector path; 1-byte types take the other.
    sizes = dict(K=2, B=10, N=8, H=2, C=16)
    caches = {"l0": make_cache("KBNHC", "KBNHC", sizes, dtype, target.device)}
    remote = 8 // k if kind == "r" else 8 * k
    case = ReceiveCase(caches, "KBNHC", seed=3)
    case.send("x", [6, 1, 3, 8][: 2 * (k if kind == "g" else 1)], "HNC", remote)
    kvhost.receive(
        caches,
        {"x": case.requests["x"].block_ids},
        axes="KBNHC",
        remote_order="HNC",
        remote_block_size=remote,
        backend=target.backend,
    )
    case.check()


def receive_and_check(target, caches, axes: str, kind: str, k: int, tokens: int) -> None:
    """Token-major senders with blocks ``k`` times smaller (r) or larger (g) than the local
    ``tokens``: send request_ids' requests, receive them in one call, check every block."""
    remote_size = tokens // k if kind == "r" else tokens * k
    case = ReceiveCase(caches, axes, seed=k)
    for name, ids in request_ids(k if kind == "g" else 1).items():
        case.send(name, ids, "NHC", remote_size)
    requests = {name: wired.block_ids for name, wired in case.requests.items()}
    kvhost.receive(
        caches, requests, axes=axes, remote_order="NHC", remote_block_size=remote_size, backend=target.backend
    )
    case.check()


@pytest.mark.parametrize(("kind", "k"), RATIOS)
def test_layers_as_views_of_one_cross_layer_buffer(target, kind, k):
    # Every block holds all layers back to back (a cross-layer allocation) and each layer's
    # tensor is a view of it: a layer's blocks lie three regions apart, so the block stride
    # is not the region's size.
    if target.device == "xla":
        pytest.skip("XLA tensors have no strides: their memory order is their shape order")
    sizes = dict(B=12, N=8, H=2, C=4)
    buffer = torch.empty(12, 3, 2, 8, 4, dtype=torch.bfloat16, device=target.device)  # B, layer, H, N, C
    caches = {f"layer{i}": buffer[:, i] for i in range(3)}
    assert caches["layer1"].stride(0) == 3 * caches["layer1"][0].numel()
    receive_and_check(target, caches, "BHNC", kind, k, sizes["N"])


@pytest.mark.parametrize(("kind", "k"), [("r", 2), ("r", 4), ("g", 2)])
def test_blocks_padded_past_their_region(target, kind, k):
    # A cache whose blocks carry 2 bytes of padding: 66 bytes apart, 64-byte regions, so
    # only 2-byte words divide every block's address. The padding is never written.
    if target.device == "xla":
        pytest.skip("XLA tensors have no strides: their memory order is their shape order")
    blocks, heads, tokens, channels = 12, 2, 4, 4
    stride = heads * tokens * channels + 1
    memory = torch.empty(2 * blocks * stride, dtype=torch.bfloat16, device=target.device)
    hnd = memory.as_strided(
        (2, blocks, heads, tokens, channels), (blocks * stride, stride, tokens * channels, channels, 1)
    )
    caches = {"layer": hnd.permute(0, 1, 3, 2, 4)}  # KBNHC over head-major blocks
    fill_random(caches["layer"], k)
    padding = memory.view(torch.int16).view(2 * blocks, stride)[:, -1].clone()
    receive_and_check(target, caches, "KBNHC", kind, k, tokens)
    assert torch.equal(memory.view(torch.int16).view(2 * blocks, stride)[:, -1], padding)


def test_kv_tuples(target):
    """K and V as separate tensors (as Gaudi keeps them): axes name each member, K the tuple index."""
    caches = kv_tuples(dict(B=10, N=8, H=2, C=4), target.device)
    case = ReceiveCase(caches, "KBNHC", seed=5)
    case.send("p", [4, 2], "HNC", 2)
    case.send("q", [9], "HNC", 2)
    stats = kvhost.receive(
        caches, {"p": [4, 2], "q": [9]}, axes="KBNHC", remote_order="HNC", remote_block_size=2, backend=target.backend
    )
    case.check()
    assert stats.bytes_moved == 3 * 2 * 3 * (8 * 2 * 4 * 2)  # blocks x members x layers x region bytes


def kv_tuples(sizes: dict[str, int], device: str, v_memory: str = "BNHC") -> dict[str, tuple[torch.Tensor, ...]]:
    """Three layers of separate K and V tensors ``[B, N, H, C]``, V laid out as ``v_memory``."""
    return {
        f"l{i}": (make_cache("BNHC", "BNHC", sizes, device=device), make_cache("BNHC", v_memory, sizes, device=device))
        for i in range(3)
    }


def test_mixed_remote_specs_in_one_batch(target):
    """Each request names its own sender layout; one call serves them all, one group per key."""
    sizes = dict(K=2, B=16, N=8, H=2, C=4)
    caches = {f"l{i}": make_cache("KBNHC", "KBNHC", sizes, device=target.device) for i in range(2)}
    case = ReceiveCase(caches, "KBNHC", seed=7)
    specs = {
        "hnd16": ([3, 1, 7, 2][:2], "HNC", 16),
        "hnd2": ([5], "HNC", 2),
        "hnd2b": ([0, 12], "HNC", 2),
        "nhd4": ([9], "NHC", 4),
        "nhd8": ([10, 11], "NHC", 8),
        "hnd8": ([14], "HNC", 8),
    }
    for name, (ids, order, size) in specs.items():
        case.send(name, ids, order, size)
    requests = {name: kvhost.Incoming(ids, order, size) for name, (ids, order, size) in specs.items()}
    stats = kvhost.receive(caches, requests, axes="KBNHC", backend=target.backend)
    case.check()
    # HNC/16, HNC/2, HNC/8 have work; both NHC specs are token-major on both sides: identity.
    assert stats.groups == 3
    assert stats.skipped_blocks == 3
    assert stats.requests == 6


def test_call_defaults_and_request_overrides(target):
    sizes = dict(K=2, B=8, N=8, H=2, C=4)
    caches = {"l": make_cache("KBNHC", "KBHNC", sizes, device=target.device)}
    case = ReceiveCase(caches, "KBNHC", seed=9)
    case.send("plain", [1, 2], "NHC", 4)
    case.send("own", [5], "HNC", 2)
    kvhost.receive(
        caches,
        {"plain": [1, 2], "own": kvhost.Incoming([5], remote_block_size=2, remote_order="HNC")},
        axes="KBNHC",
        remote_order="NHC",
        remote_block_size=4,
        backend=target.backend,
    )
    case.check()


class Recorder(kvhost.Backend):
    """A backend that records calls: identity transforms must not reach any backend."""

    name = "recorder"
    device_types = ("*",)

    def __init__(self) -> None:
        self.jobs: list[object] = []

    def receive(self, job):
        self.jobs.append(job)

    def copy(self, job):
        self.jobs.append(job)
        return kvhost.Completion()


@pytest.mark.parametrize(
    ("axes", "physical", "sizes", "order", "remote"),
    [
        ("KBNHC", "KBNHC", dict(K=2, B=8, N=8, H=2, C=4), "NHC", 8),  # same order, same size
        ("KBNHC", "KBNHC", dict(K=2, B=8, N=8, H=2, C=4), "NHC", 2),  # token-major both sides, r = 4
        ("KBNHC", "KBNHC", dict(K=2, B=8, N=8, H=2, C=4), "NHC", 32),  # token-major both sides, g = 4
        ("KBNHC", "KBHNC", dict(K=2, B=8, N=8, H=2, C=4), "HNC", 8),  # head-major, same size
        ("BNC", "BNC", dict(B=8, N=8, C=12), "NC", 2),  # MLA
        ("BNC", "BNC", dict(B=8, N=8, C=12), "NC", 16),
        ("BHNC", "HBNC", dict(B=8, N=8, H=2, C=4), "NC", 4),  # per-head regions
        ("KBNHC", "KBHNC", dict(K=2, B=8, N=8, H=1, C=4), "NHC", 2),  # one head: orders look alike
    ],
)
def test_identity_transforms_copy_nothing(axes, physical, sizes, order, remote):
    caches = {"l": make_cache(axes, physical, sizes)}
    case = ReceiveCase(caches, axes, seed=11)
    ids = [3, 4, 5, 6][: max(remote // sizes["N"], 1) * 2]
    case.send("r", ids, order, remote)
    recorder = Recorder()
    stats = kvhost.receive(
        caches, {"r": ids}, axes=axes, remote_order=order, remote_block_size=remote, backend=recorder
    )
    assert recorder.jobs == []
    assert stats.bytes_moved == 0 and stats.groups == 0 and stats.skipped_blocks == len(ids)
    case.check()  # the bytes as they landed are already the local layout


def test_identity_batches_are_counted_not_read():
    """No byte moves, so the ids are not checked (the call costs about what an empty one
    does); one request with work anywhere in the batch makes every id checked again."""
    caches = {"l": make_cache("KBNHC", "KBNHC", dict(K=2, B=8, N=8, H=2, C=4))}
    case = ReceiveCase(caches, "KBNHC", seed=5)
    before = case.snapshot()
    recorder = Recorder()
    odd = {"a": [99, 99], "b": (-1,), "c": range(3), "d": np.array([7, 8])}
    stats = kvhost.receive(caches, odd, axes="KBNHC", remote_order="NHC", remote_block_size=8, backend=recorder)
    assert recorder.jobs == [] and case.same_as(before)
    assert (stats.requests, stats.blocks, stats.skipped_blocks, stats.bytes_moved) == (4, 8, 8, 0)
    with_work = {**odd, "e": kvhost.Incoming([1], "HNC", 8)}
    with pytest.raises(kvhost.RequestError, match="request 'a': block id 99 at position 0 is out of range"):
        kvhost.receive(caches, with_work, axes="KBNHC", remote_order="NHC", remote_block_size=8, backend=recorder)
    with pytest.raises(kvhost.RequestError, match="request 'a': block id 99"):  # the call's transform has work
        kvhost.receive(caches, odd, axes="KBNHC", remote_order="HNC", remote_block_size=8, backend=recorder)
    assert recorder.jobs == [] and case.same_as(before)
    # A larger sender's blocks span 2 of ours: whole groups are counted, not read, alike...
    pairs = {"a": [99, 99], "b": (-1, -1), "d": np.array([7, 8])}
    stats = kvhost.receive(caches, pairs, axes="KBNHC", remote_order="NHC", remote_block_size=16, backend=recorder)
    assert (stats.requests, stats.blocks, stats.skipped_blocks) == (3, 6, 6) and recorder.jobs == []
    # ... and a count that is not whole groups takes the checked path, which says so.
    with pytest.raises(kvhost.RequestError, match="request 'b': 1 block ids are not whole groups of 2"):
        kvhost.receive(caches, {"a": [1, 2], "b": [3]}, axes="KBNHC", remote_order="NHC", remote_block_size=16)
    lists = {"a": [99, 99], "b": (-1,)}  # counted by len() alone
    stats = kvhost.receive(caches, lists, axes="KBNHC", remote_order="NHC", remote_block_size=8, backend=recorder)
    assert (stats.requests, stats.blocks, stats.skipped_blocks) == (2, 3, 3) and recorder.jobs == []
    with pytest.raises(TypeError):  # the identity count relies on this
        len(kvhost.Incoming([1]))


def test_empty_batch_is_a_no_op(target):
    caches = {"l": make_cache("KBNHC", "KBHNC", dict(K=2, B=4, N=8, H=2, C=4), device=target.device)}
    case = ReceiveCase(caches, "KBNHC")
    before = case.snapshot()
    stats = kvhost.receive(caches, {}, axes="KBNHC", remote_order="NHC", remote_block_size=2, backend=target.backend)
    assert stats.blocks == 0 and stats.bytes_moved == 0 and stats.groups == 0
    stats = kvhost.receive(
        caches, {"empty": []}, axes="KBNHC", remote_order="NHC", remote_block_size=2, backend=target.backend
    )
    assert stats.blocks == 0 and stats.bytes_moved == 0
    assert case.same_as(before)


def test_kvhost_object_reuses_and_matches(target):
    sizes = dict(K=2, B=12, N=8, H=2, C=4)
    caches = {f"l{i}": make_cache("KBNHC", "KBNHC", sizes, device=target.device) for i in range(2)}
    host = kvhost.KVHost(caches, axes="KBNHC", backend=target.backend)
    for round_, ids in enumerate(([1, 5], [7], [0, 2, 3])):
        case = ReceiveCase(caches, "KBNHC", seed=20 + round_)
        case.send("r", ids, "HNC", 4)
        stats = host.receive({"r": ids}, remote_order="HNC", remote_block_size=4)
        case.check()
        assert stats.backend == target.name


def test_registered_layers_received_one_at_a_time(target):
    """``KVHost.receive(layers=...)`` post-processes the named layers only (a layer as soon as
    its transfer is done): the others keep the wire bytes until their turn, and layer by
    layer the blocks end as one call would leave them, partly arrived requests included."""
    caches = kv_tuples(dict(B=12, N=8, H=2, C=4), target.device, v_memory="BHNC")
    host = kvhost.KVHost(caches, axes="KBNHC", backend=target.backend)
    case = ReceiveCase(caches, "KBNHC", seed=9)
    case.send("p", [4, 2], "HNC", 2)
    case.send("q", [9, 0], "HNC", 2, tokens=11)
    requests = {"p": [4, 2], "q": kvhost.Incoming([9, 0], tokens=11)}
    wire = {name: [raw(t).cpu().clone() for t in layer] for name, layer in caches.items()}
    stats = host.receive(requests, remote_order="HNC", remote_block_size=2, layers=["l1"])
    assert stats.bytes_moved == 4 * 2 * (8 * 2 * 4 * 2)  # blocks x members x region bytes, one layer
    for name in ("l0", "l2"):
        assert all(torch.equal(raw(t).cpu(), w) for t, w in zip(caches[name], wire[name])), name
    assert not all(torch.equal(raw(t).cpu(), w) for t, w in zip(caches["l1"], wire["l1"]))
    host.receive(requests, remote_order="HNC", remote_block_size=2, layers=("l2", "l0"))
    case.check()


def test_registered_layers_named_wrongly_change_nothing(monkeypatch):
    sizes = dict(K=2, B=8, N=4, H=2, C=4)
    caches = {f"l{i}": make_cache("KBNHC", "KBHNC", sizes) for i in range(2)}
    host = kvhost.KVHost(caches, axes="KBNHC")
    before = [raw(t).clone() for t in caches.values()]
    for layers, words in (
        ("l0", "a list or tuple of layer names"),
        ({"l0"}, "a list or tuple"),
        ([], "at least one layer"),
        (["l2"], r"layers\[0\]: 'l2' is not a registered layer \(2 are\)"),
        (["l1", True], r"layers\[1\]: True is not a registered layer"),
        (["l0", "l1", "l0"], r"layers\[2\]: 'l0' is named twice"),
    ):
        with pytest.raises(kvhost.ArgumentError, match=words):
            host.receive({"r": [1]}, remote_order="NHC", remote_block_size=2, layers=layers)
    assert all(torch.equal(raw(t), b) for t, b in zip(caches.values(), before))
    # A set of some layers is made once; it sees a registered tensor moved as the whole does.
    made = []
    real_cache_set = kvhost.api.CacheSet
    monkeypatch.setattr(kvhost.api, "CacheSet", lambda *args, **kw: made.append(args) or real_cache_set(*args, **kw))
    for _ in range(2):
        host.receive({"r": [1]}, remote_order="NHC", remote_block_size=2, layers=["l1"])
    assert len(made) == 1
    caches["l1"].set_(torch.empty_like(caches["l1"]))
    for layers in (["l1"], ["l0", "l1"], None):
        with pytest.raises(kvhost.LayoutError, match="changed since it was registered"):
            host.receive({"r": [1]}, remote_order="NHC", remote_block_size=2, layers=layers)


def test_a_model_of_512_layers_received_layer_by_layer_makes_each_set_once(monkeypatch):
    """A KVHost keeps a set of layers for each of 512 ``layers=`` lists (one per layer of the
    largest models); the 513th pushes out the least recently used."""
    sizes = dict(K=2, B=2, N=1, H=1, C=1)
    caches = {f"l{i}": make_cache("KBNHC", "KBNHC", sizes, torch.float32) for i in range(513)}
    host = kvhost.KVHost(caches, axes="KBNHC")
    made = []
    real_cache_set = kvhost.api.CacheSet
    monkeypatch.setattr(kvhost.api, "CacheSet", lambda *args, **kw: made.append(args) or real_cache_set(*args, **kw))

    def layer_by_layer(names):
        for name in names:
            host.receive({"r": [1]}, remote_order="NHC", remote_block_size=1, layers=[name])

    layer_by_layer([f"l{i}" for i in range(512)] * 2)
    assert len(made) == 512 == kvhost.api.MAX_LAYER_SETS
    layer_by_layer(["l512", "l0"])  # l0 was the least recently used
    assert len(made) == 514


@pytest.mark.parametrize(("order", "remote"), [("HNC", 16), ("HNC", 128)])
def test_jobs_large_enough_for_every_core(target, order, remote):
    """Over a megabyte per job: the CPU backend's parallel kernels, not the serial ones."""
    sizes = dict(K=2, B=24, N=64, H=8, C=128)
    caches = {"l0": make_cache("KBNHC", "KBNHC", sizes, torch.bfloat16, target.device)}
    case = ReceiveCase(caches, "KBNHC", seed=13)
    case.send("big", [3, 17, 5, 8, 20, 1, 11, 14], order, remote)
    case.send("small", [0, 2], order, remote)
    stats = kvhost.receive(
        caches,
        {"big": [3, 17, 5, 8, 20, 1, 11, 14], "small": [0, 2]},
        axes="KBNHC",
        remote_order=order,
        remote_block_size=remote,
        backend=target.backend,
    )
    assert stats.bytes_moved > 1 << 20
    case.check()


def test_regions_of_one_element_whose_letters_of_size_1_carry_any_stride(target):
    # A block region of one element (N = C = 1) is one run of bytes whatever strides its
    # letters of size 1 carry (7, 999, 0 here): kvhost takes it, and so must the oracle
    # that writes the sender's bytes into it.
    if target.device == "xla":
        pytest.skip("XLA tensors have no strides: their memory order is their shape order")
    base = torch.zeros(12, dtype=torch.bfloat16, device=target.device)
    for strides in ((1, 7, 999), (1, 0, 0)):
        caches = {"l": base.as_strided((12, 1, 1), strides)}
        case = ReceiveCase(caches, "BNC", seed=5)
        case.send("r", [3, 4, 9, 1], "NC", 2)  # g = 2: a sender block of 2 tokens over two of ours
        stats = kvhost.receive(
            caches, {"r": [3, 4, 9, 1]}, axes="BNC", remote_order="NC", remote_block_size=2, backend=target.backend
        )
        assert stats.blocks == 4
        case.check()
