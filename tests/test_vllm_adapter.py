"""kvhost.integrations.vllm against caches built the way vLLM builds them.

Every local cache below is allocated as vLLM allocates it: KVCacheLayout caches as one
byte buffer viewed ``[L, B, H, N, C]`` with the layout's strides and cut into per-layer
``[B, H, N, C]`` views; attention-backend caches in their stride order and permuted back
to their logical shape. Senders are real caches in their own layout and block size; NIXL's
region-by-region read is played by ``nixl_read`` from the sender's strides, and the result
is checked token by token and, for every block outside the batch, byte by byte.
"""

from __future__ import annotations

import itertools
import re

import numpy as np
import pytest
import torch
from kvhost_torch.backend import TorchBackend

import kvhost
from kvhost.integrations.vllm import (
    CACHE_FORMATS,
    GROUP_NAME,
    KV_CACHE_LAYOUTS,
    RemoteEngine,
    VllmCaches,
    cross_layer_view,
    kv_cache_axes,
    remote_order,
)
from kvhost.testing import (
    CopyCase,
    ReceiveCase,
    assert_same_tokens,
    fill_random,
    make_cache,
    nixl_read,
    raw,
    read_tokens,
)

LAYERS, HEADS, CONTENT, BLOCK = 3, 2, 4, 4  # C holds K and V of head_dim 2; local blocks of 4 tokens
REMOTE_BLOCK_SIZES = (2, 4, 8)  # 2 sender blocks per local block, the same size, one over 2 local blocks


def kv_layout_group(
    name: str, *, blocks: int, block_size: int, dtype=torch.bfloat16, heads: int = HEADS, layers: int = LAYERS
):
    """Per-layer views and the group tensor, cut from one int8 buffer as vLLM cuts it."""
    sizes = dict(L=layers, B=blocks, H=heads, N=block_size, C=CONTENT * dtype.itemsize)
    strides, step = {}, 1
    for letter in reversed(name):  # the name spells the memory order, outermost first
        strides[letter] = step
        step *= sizes[letter]
    buffer = torch.empty(step, dtype=torch.int8)
    group = buffer.as_strided([sizes[a] for a in "LBHNC"], [strides[a] for a in "LBHNC"]).view(dtype)
    views = {f"model.layers.{i}.self_attn.attn": group[i] for i in range(layers)}
    return views, group


def attention_caches(fmt: str, order: str, *, blocks: int, block_size: int, dtype=torch.bfloat16):
    """FlashAttention/FlashInfer/MLA caches, NHD or HND strides, allocated in stride order."""
    axes = CACHE_FORMATS[fmt]
    physical = axes.replace("NH", "HN") if order == "HND" else axes
    sizes = dict(K=2, B=blocks, N=block_size, H=HEADS, C=CONTENT)
    return {f"model.layers.{i}.self_attn.attn": make_cache(axes, physical, sizes, dtype) for i in range(LAYERS)}


def fill(caches, seed):
    for i, layer in enumerate(caches.values()):
        for j, tensor in enumerate(layer if isinstance(layer, tuple) else (layer,)):
            fill_random(tensor, seed * 100 + i * 10 + j)


class Sender:
    """One remote engine: its caches, the blocks it sends and the local blocks they land in."""

    def __init__(self, caches, axes, remote_ids, local_ids):
        self.caches, self.axes, self.remote_ids, self.local_ids = caches, axes, remote_ids, local_ids


def local_id_plan(count: int, blocks: int) -> list[int]:
    """``count`` scattered local block ids out of ``blocks``."""
    generator = torch.Generator().manual_seed(count * 7919 + blocks)
    return torch.randperm(blocks, generator=generator)[:count].tolist()


def run_batch(kv: VllmCaches, caches, senders: dict[str, Sender], engines: dict[str, RemoteEngine]):
    """NIXL-read every sender, post-process the batch in one call, check every block."""
    case = ReceiveCase(caches, kv.axes, seed=1)  # random sentinels everywhere
    for sender in senders.values():
        nixl_read(sender.caches, sender.axes, sender.remote_ids, caches, kv.axes, sender.local_ids)
    received = {engine: {f"req-{engine}": sender.local_ids} for engine, sender in senders.items()}
    stats = kv.post_process(received, engines)
    for sender in senders.values():
        assert_same_tokens(caches, kv.axes, sender.local_ids, sender.caches, sender.axes, sender.remote_ids)
    claimed = {b for sender in senders.values() for b in sender.local_ids}
    for i in range(len(case.set.members)):
        case.check_untouched(i, claimed)
    assert stats.requests == len(senders)
    assert stats.blocks == len(claimed)
    return stats


def engine_blocks(remote_size: int) -> tuple[int, int]:
    """(sender blocks, local blocks) of one request: two local blocks, or one when r = 2."""
    if remote_size < BLOCK:
        return BLOCK // remote_size, 1
    if remote_size == BLOCK:
        return 2, 2
    return 1, remote_size // BLOCK


# --- axes -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("layout", "shape", "axes"),
    [
        ("flash_attn", (2, 100, 16, 8, 128), "KBNHC"),
        ("flashinfer", (100, 2, 16, 8, 128), "BKNHC"),
        ("mla", (100, 16, 576), "BNC"),
        *[(name, (100, 8, 16, 256), "BHNC") for name in KV_CACHE_LAYOUTS if name != "BHLNC"],
        *[(name, (32, 100, 8, 16, 256), "LBHNC") for name in KV_CACHE_LAYOUTS],
        ("BHLNC", (100, 1, 16, 576), "BHNC"),  # one head slot (MLA): the layer view is one run
        # vLLM 0.33: every backend's layer view is [B, H, N, 2 * head_dim], whatever its name
        ("flash_attn", (100, 8, 16, 256), "BHNC"),
        ("flashinfer", (100, 8, 16, 256), "BHNC"),
        ("mla", (100, 1, 16, 576), "BHNC"),
    ],
)
def test_kv_cache_axes(layout, shape, axes):
    assert kv_cache_axes(layout, shape) == axes


@pytest.mark.parametrize(
    ("layout", "shape", "message"),
    [
        ("flash_attn", (100, 2, 16, 8, 128), "holds K and V in dim 0, which must be 2; shape .* has 100"),
        ("flashinfer", (2, 100, 16, 8, 128), "holds K and V in dim 1, which must be 2; shape .* has 100"),
        ("flash_attn", (100, 16, 1024), r"\[K, B, N, H, C\] \(5 dims\) or, from vLLM 0.33 on, a layer view"),
        ("mla", (100, 1, 1, 16, 576), "a mla cache is .* but shape .* has 5"),
        ("LBNHC", (100, 16, 256), "shape \\(100, 16, 256\\) has 3 dims"),
        ("BHLNC", (100, 8, 16, 256), "a BHLNC layer view .* no contiguous block region.*cross_layer_view"),
        ("NHD", (2, 100, 16, 8, 128), "unknown vLLM cache layout 'NHD'"),
        # Never cast: 2.9 is not the 2 of K and V, nor is "2".
        ("flash_attn", (2.9, 8, 8, 2, 4), r"a cache's shape must be a sequence of integers, got 2.9 in \(2.9, 8"),
        ("flash_attn", ("2", 8, 8, 2, 4), "a cache's shape must be a sequence of integers, got '2'"),
        ("flash_attn", (True, 8, 8, 2, 4), "a cache's shape must be a sequence of integers, got True"),
        ("flash_attn", (np.timedelta64(2), 8, 8, 2, 4), r"integers, got np\.timedelta64\(2\)"),
        ("flash_attn", "KBNHC", "a cache's shape must be a sequence of integers, got 'KBNHC'"),
        (["flash_attn"], (2, 8, 8, 2, 4), r"layout must be a name \(a str\), got \['flash_attn'\]"),
        ({}, (2, 8, 8, 2, 4), r"layout must be a name \(a str\), got \{\}"),
    ],
)
def test_kv_cache_axes_rejects(layout, shape, message):
    with pytest.raises(kvhost.LayoutError, match=message):
        kv_cache_axes(layout, shape)


@pytest.mark.parametrize(
    ("axes", "physical", "remote", "order"),
    [
        ("KBNHC", "KBNHC", "HND", "HNC"),
        ("KBNHC", "KBHNC", "NHD", "NHC"),
        ("KBNHC", "KBNHC", "NHD", "NHC"),
        ("BKNHC", "BKNHC", "HND", "KHNC"),
        ("BNHKC", "BNHKC", "HND", "HNKC"),  # TPU-style K/V interleaved per head
        ("BNC", "BNC", "HND", "NC"),
        ("BHNC", "HBNC", "HND", "NC"),  # LHBNC layer view: heads are outer, regions hold tokens
        ("BHNC", "BNHC", "LBHNC", "HNC"),
        ("BHNC", "BHNC", "BLNHC", "NHC"),
        ("BHNC", "HBNC", "LBNHC", "NC"),
        ("LBHNC", "BLHNC", "BHLNC", "HLNC"),
        ("LBHNC", "BHLNC", "LBNHC", "LNHC"),
        ("LBHNC", "BHLNC", "NHD", "LNHC"),  # an NHD engine keeps layers apart: L leads
        ("LBHNC", "BLNHC", "HND", "LHNC"),
    ],
)
def test_remote_order(axes, physical, remote, order):
    assert remote_order(axes, physical, remote) == order


def test_remote_order_rejects_mixed_vocabularies_and_unknown_names():
    with pytest.raises(kvhost.RequestError, match=r"keeps K and V together in C.*'KBNHC'"):
        remote_order("KBNHC", "KBNHC", "LBHNC")
    with pytest.raises(kvhost.RequestError, match="unknown remote layout 'NDH'"):
        remote_order("BHNC", "BHNC", "NDH")
    with pytest.raises(kvhost.RequestError, match=r"remote layout must be a name \(a str\), got \['HND'\]"):
        remote_order("BHNC", "BHNC", ["HND"])
    with pytest.raises(kvhost.LayoutError, match=r"physical order 'KNHC' must be the letters of axes 'KBNHC' \(K"):
        remote_order("KBNHC", "KNHC", "HND")
    assert remote_order("KBNHC", "BNHC", "HND") == "HNC"  # a tuple layer's tensors: K is the tuple's index
    with pytest.raises(kvhost.LayoutError, match="physical order 'KBNHQ' has unknown letter"):
        remote_order("KBNHC", "KBNHQ", "HND")


# --- post-process: every KVCacheLayout, per-layer views and whole groups -----------------

LAYOUT_CASES = [
    pytest.param(name, view, id=f"{name}-{view}") for name in KV_CACHE_LAYOUTS for view in ("layer", "group")
]


@pytest.mark.parametrize(("name", "view"), LAYOUT_CASES)
def test_post_process_every_kv_cache_layout(name, view):
    """24 senders (6 layouts + NHD/HND, 3 block sizes each) in one batch, into one local layout."""
    local_views, local_group = kv_layout_group(name, blocks=56, block_size=BLOCK)
    caches = local_views if view == "layer" else {"group": local_group}
    kv = VllmCaches(caches, name)
    # BHLNC layer views have no block of their own: VllmCaches sees them as their group.
    seen_as_group = view == "group" or name == "BHLNC"
    assert kv.axes == ("LBHNC" if seen_as_group else "BHNC")
    if view == "layer" and seen_as_group:
        assert kv.layer_names == tuple(local_views)
        caches = {GROUP_NAME: local_group}  # what the oracle reads and writes: the same memory

    senders, engines = {}, {}
    needed = [engine_blocks(size) for _ in range(8) for size in REMOTE_BLOCK_SIZES]
    local_ids = iter(local_id_plan(sum(n for _, n in needed), 56))
    for remote_name, size in itertools.product((*KV_CACHE_LAYOUTS, "NHD", "HND"), REMOTE_BLOCK_SIZES):
        engine = f"{remote_name}/{size}"
        # A NHD/HND sender is an older engine with tokens/heads first: LBNHC/LBHNC memory.
        memory = {"NHD": "LBNHC", "HND": "LBHNC"}.get(remote_name, remote_name)
        remote_views, remote_group = kv_layout_group(memory, blocks=6, block_size=size)
        remote = remote_views if not seen_as_group else {next(iter(caches)): remote_group}
        fill(remote, seed=len(senders) + 2)
        their, ours = engine_blocks(size)
        remote_ids = [5, 0, 3, 2][:their]
        senders[engine] = Sender(remote, kv.axes, remote_ids, [next(local_ids) for _ in range(ours)])
        engines[engine] = RemoteEngine(remote_name, size)
    stats = run_batch(kv, caches, senders, engines)
    if kv.caches.layout.region == "NC":
        # LHBNC keeps one region per (layer, head, block): token-major whatever the sender, so
        # every block already reads right and none may be copied.
        assert stats.groups == 0 and stats.skipped_blocks == stats.blocks
    else:
        assert stats.groups >= 1


@pytest.mark.parametrize("layout", ["BHLNC", "flash_attn"])
def test_bhlnc_layer_views_are_seen_as_their_group(layout):
    """vLLM 0.33 hands a connector per-layer views, named by the layout or by the backend."""
    views, group = kv_layout_group("BHLNC", blocks=4, block_size=BLOCK)
    kv = VllmCaches(views, layout)
    assert kv.axes == "LBHNC" and kv.caches.layout.region == "HLNC"
    assert kv.layer_names == tuple(views)
    (member,) = kv.caches.members
    assert member.tensor.data_ptr() == group.data_ptr() and member.tensor.stride() == group.stride()
    host = kv.host_buffers()  # layer views of one host buffer, as vLLM registers them
    assert list(host) == list(views)
    assert all(h.shape == v.shape and h.stride() == v.stride() for h, v in zip(host.values(), views.values()))
    fill(views, seed=3)
    kv.save_to_host(host, {"a": [2, 0]}).wait()
    assert_same_tokens({"g": cross_layer_view(host)}, "LBHNC", [2, 0], {"g": group}, "LBHNC", [2, 0])
    apart = {name: torch.empty_like(view) for name, view in views.items()}  # not one buffer
    with pytest.raises(kvhost.LayoutError, match="so must the host buffers be"):
        kv.save_to_host(apart, {"a": [1]})
    whole = cross_layer_view(views)
    assert whole.shape == group.shape and whole.stride() == group.stride()
    assert whole.data_ptr() == group.data_ptr()
    assert VllmCaches({"group": whole}, "BHLNC").caches.layout.region == "HLNC"


def test_cross_layer_view_rejects_layers_of_different_buffers():
    views, _ = kv_layout_group("LBHNC", blocks=4, block_size=BLOCK)
    other, _ = kv_layout_group("LBHNC", blocks=4, block_size=BLOCK)
    mixed = dict(views)
    mixed["model.layers.1.self_attn.attn"] = other["model.layers.1.self_attn.attn"]
    with pytest.raises(kvhost.LayoutError, match=r"'model.layers.1.self_attn.attn' is not a view of the buffer"):
        cross_layer_view(mixed)
    reordered = dict(reversed(list(views.items())))
    with pytest.raises(kvhost.LayoutError, match="not evenly spaced upwards"):
        cross_layer_view(reordered)


def test_layout_name_must_match_the_strides():
    views, _ = kv_layout_group("LBNHC", blocks=4, block_size=BLOCK)
    with pytest.raises(kvhost.LayoutError, match=r"stored BNHC .* but layout 'LBHNC' stores a BHNC cache as BHNC"):
        VllmCaches(views, "LBHNC")


# --- post-process: attention-backend cache formats, NHD and HND -------------------------


@pytest.mark.parametrize("local_order", ["NHD", "HND"])
@pytest.mark.parametrize("fmt", ["flash_attn", "flashinfer", "mla"])
def test_post_process_attention_formats(fmt, local_order):
    caches = attention_caches(fmt, local_order, blocks=24, block_size=BLOCK)
    kv = VllmCaches(caches, fmt)
    assert kv.axes == CACHE_FORMATS[fmt]
    senders, engines = {}, {}
    local_ids = iter(local_id_plan(12, 24))
    for remote_order_name, size in itertools.product(("NHD", "HND"), REMOTE_BLOCK_SIZES):
        engine = f"{remote_order_name}/{size}"
        remote = attention_caches(fmt, remote_order_name, blocks=6, block_size=size)
        fill(remote, seed=len(senders) + 2)
        their, ours = engine_blocks(size)
        senders[engine] = Sender(remote, kv.axes, [4, 1, 2][:their], [next(local_ids) for _ in range(ours)])
        engines[engine] = RemoteEngine(remote_order_name, size)
    stats = run_batch(kv, caches, senders, engines)
    # Identity, nothing copied: the same order and size; token-major on both sides at any
    # size when K is outside the region (FlashAttention); always for MLA (no heads).
    identity = {"mla": 10, "flash_attn": 5 if local_order == "NHD" else 2, "flashinfer": 2}
    assert stats.skipped_blocks == identity[fmt]


@pytest.mark.parametrize("remote_size", REMOTE_BLOCK_SIZES)
@pytest.mark.parametrize("fmt", ["flash_attn", "flashinfer"])
def test_post_process_of_a_share_of_the_senders_heads(fmt, remote_size):
    """Heterogeneous TP: a head-major sender with twice our heads; each of two ranks reads
    its half (what kvhost.nixl's RegionTable.heads plans) and post-processes it as usual."""
    axes = CACHE_FORMATS[fmt]
    sizes = dict(K=2, B=6, N=remote_size, H=2 * HEADS, C=CONTENT)
    head_major = axes.replace("NH", "HN")
    sender = {f"model.layers.{i}.self_attn.attn": make_cache(axes, head_major, sizes) for i in range(LAYERS)}
    fill(sender, seed=8)
    their, ours = engine_blocks(remote_size)
    for rank in range(2):
        caches = attention_caches(fmt, "NHD", blocks=12, block_size=BLOCK)
        share = {name: t.narrow(axes.index("H"), rank * HEADS, HEADS) for name, t in sender.items()}
        senders = {"p": Sender(share, axes, [4, 1, 2][:their], local_id_plan(ours, 12))}
        stats = run_batch(VllmCaches(caches, fmt), caches, senders, {"p": RemoteEngine("HND", remote_size)})
        assert stats.groups == 1


class CountingBackend(TorchBackend):
    name = "counting"

    def __init__(self) -> None:
        self.calls = 0

    def receive(self, job):
        self.calls += 1
        super().receive(job)


def test_one_backend_call_per_transform_group_not_per_request():
    """Forty requests from four engines, two of which share a layout and block size."""
    caches = attention_caches("flash_attn", "NHD", blocks=64, block_size=BLOCK)
    backend = CountingBackend()
    kv = VllmCaches(caches, "flash_attn", backend=backend)
    engines = {
        "p0": RemoteEngine("HND", 2),
        "p1": RemoteEngine("HND", 2),  # same key as p0: same group
        "p2": RemoteEngine("HND", 8),
        "p3": RemoteEngine("NHD", 2),  # token-major both sides: identity, never reaches the backend
    }
    ids = iter(range(64))
    received = {
        engine: {f"{engine}-r{i}": [next(ids), next(ids)] for i in range(10)} if engine != "p2" else {}
        for engine in engines
    }
    received["p2"] = {f"p2-r{i}": [next(ids), next(ids)] for i in range(2)}
    stats = kv.post_process(received, engines)
    assert stats.requests == 32 and stats.blocks == 64
    assert stats.groups == 2 and backend.calls == 2
    assert stats.skipped_blocks == 20


def test_a_step_whose_senders_all_match_us_is_only_counted():
    """Peers laid out like us (NHD, same block size): nothing moves, so ids are counted, not
    checked; a second peer whose bytes need work makes every id of the step checked."""
    caches = attention_caches("flash_attn", "NHD", blocks=8, block_size=BLOCK)
    backend = CountingBackend()
    kv = VllmCaches(caches, "flash_attn", backend=backend)
    case = ReceiveCase(caches, kv.axes, seed=6)
    before = case.snapshot()
    alike = {"p0": RemoteEngine("NHD", BLOCK), "p1": RemoteEngine("NHD", BLOCK)}
    received = {"p0": {"a": [1, 2]}, "p1": {"b": [3], "c": [99]}}
    stats = kv.post_process(received, alike)
    assert (stats.requests, stats.blocks, stats.skipped_blocks, stats.bytes_moved) == (3, 4, 4, 0)
    assert backend.calls == 0 and case.same_as(before)
    with pytest.raises(kvhost.RequestError, match="request 'c': block id 99 at position 0 is out of range"):
        kv.post_process({**received, "p2": {"d": [5]}}, {**alike, "p2": RemoteEngine("HND", BLOCK)})
    assert backend.calls == 0 and case.same_as(before)


# --- bad input: a clear error naming the value, nothing changed --------------------------


def flash_attn_decoder(seed: int):
    """FlashAttention's NHD caches of 8 blocks behind a VllmCaches, their bytes as they
    were, and a sender it takes."""
    caches = attention_caches("flash_attn", "NHD", blocks=8, block_size=BLOCK)
    kv = VllmCaches(caches, "flash_attn")
    case = ReceiveCase(caches, kv.axes, seed=seed)
    return kv, case, case.snapshot(), RemoteEngine("HND", 2)


def test_post_process_rejects_bad_batches_before_moving_a_byte():
    kv, case, before, good = flash_attn_decoder(seed=3)
    bad_batches = [
        ({"p": {"a": [1]}, "q": {"b": [2]}}, {"p": good}, "engine 'q' sent blocks but has no RemoteEngine"),
        ({"p": {"a": [1]}}, {"p": RemoteEngine("HND", 0)}, "engine 'p': block size 0 must be a positive"),
        ({"p": {"a": [1]}}, {"p": RemoteEngine("XYZ", 2)}, "engine 'p': unknown remote layout 'XYZ'"),
        ({"p": {"a": [1]}}, {"p": RemoteEngine("LBHNC", 2)}, "engine 'p': remote layout 'LBHNC' keeps K and V"),
        ({"p": {"a": [1]}, "q": {"a": [2]}}, {"p": good, "q": good}, "'a' is listed under engine 'p' and engine 'q'"),
        ({"p": {"a": [1, 9]}}, {"p": good}, "request 'a': block id 9 at position 1 is out of range"),
        ({"p": {"a": [1]}, "q": {"b": [1]}}, {"p": good, "q": good}, "block id 1 is claimed by request 'a'"),
        ({"p": {"a": [1]}}, {"p": RemoteEngine("HND", 8)}, "request 'a': 1 block ids are not whole groups of 2"),
        (
            {"p": {"a": [1]}},
            {"p": RemoteEngine("HND", 3)},
            "request 'a': block sizes 4 \\(local\\) and 3 \\(remote\\) do not divide",
        ),
    ]
    for received, engines, message in bad_batches:
        with pytest.raises(kvhost.RequestError, match=message):
            kv.post_process({"ok": {"fine": [0, 3]}, **received}, {"ok": good, **engines})
        assert case.same_as(before), message


def test_post_process_names_the_engine_of_malformed_arguments():
    """Arguments of the wrong shape are a RequestError naming the engine where there is one,
    raised before any byte moves; never an AttributeError or TypeError from inside."""
    kv, case, before, good = flash_attn_decoder(seed=4)
    bad_calls = [
        ({"p": [3, 7]}, {"p": good}, "engine 'p': received must map request id to block ids, got list"),
        ({"p": {"r": [3]}}, {"p": ("HND", 2)}, "engine 'p': remote_engines gives a tuple, not a RemoteEngine"),
        ({"p": {"r": [3]}}, {"p": RemoteEngine(["HND"], 2)}, r"engine 'p': layout \['HND'\] must be a layout name"),
        ({"p": {"r": [3]}}, [good], "remote_engines must map engine id to RemoteEngine, got list"),
        ([("p", {"r": [3]})], {"p": good}, "received must map engine id to {request id: block ids}, got list"),
    ]
    for received, engines, message in bad_calls:
        with pytest.raises(kvhost.RequestError, match=message):
            kv.post_process(received, engines)
        assert case.same_as(before), message


def test_numpy_integers_are_block_sizes_and_counts_and_bools_are_not():
    """A numpy integer is an integer wherever the adapter takes one, as in the core; a bool
    is not, and a huge or unprintable name is cut or said by its type, never raised from."""
    kv, case, _, _ = flash_attn_decoder(seed=5)
    as_numpy = kv.post_process({"p": {"a": [1]}}, {"p": RemoteEngine("HND", np.int64(2))})
    kv2, case2, _, _ = flash_attn_decoder(seed=5)
    as_int = kv2.post_process({"p": {"a": [1]}}, {"p": RemoteEngine("HND", 2)})
    assert as_numpy.blocks == as_int.blocks == 1 and case.same_as(case2.snapshot())
    for bad in (True, np.True_, 2.0, -2, np.int64(0)):
        with pytest.raises(kvhost.RequestError, match=r"engine 'p': block size .* must be a positive integer"):
            kv.post_process({"p": {"a": [2]}}, {"p": RemoteEngine("HND", bad)})
    assert [t.shape[1] for t in kv.host_buffers(num_blocks=np.int32(3)).values()] == [3] * LAYERS
    for bad in (True, 3.0, np.int64(0)):
        with pytest.raises(kvhost.LayoutError, match=r"num_blocks .* must be a positive integer"):
            kv.host_buffers(num_blocks=bad)

    class Unprintable(str):
        def __repr__(self):
            raise RuntimeError("no repr")

    snapshot = case.snapshot()
    long_id = "r" * 100_000
    with pytest.raises(kvhost.RequestError) as refused:
        kv.post_process({"p": {long_id: [1, 99]}}, {"p": RemoteEngine("HND", 2)})
    assert len(str(refused.value)) < 400 and "rrr..." in str(refused.value)
    with pytest.raises(kvhost.RequestError, match="engine a Unprintable sent blocks but has no RemoteEngine"):
        kv.post_process({Unprintable("q"): {"b": [1]}}, {})
    host = kv.host_buffers()
    with pytest.raises(kvhost.RequestError, match="request a Unprintable: block id 99"):
        kv.save_to_host(host, {Unprintable("b"): [99]})
    assert case.same_as(snapshot)


def test_engine_and_request_ids_are_strings_and_odd_sizes_are_refused():
    """Request and engine ids are strings, as kvhost.receive holds them to; a RemoteEngine
    given as None is said to be one, not missing; a shape with a negative size and host
    buffers past int64 are LayoutErrors."""
    kv, case, before, good = flash_attn_decoder(seed=6)
    with pytest.raises(kvhost.RequestError, match=r"engine ids must be strings, got None \(NoneType\)"):
        kv.post_process({None: {"r": [1, 2]}}, {None: good})
    with pytest.raises(kvhost.RequestError, match=r"engine 'p': request ids must be strings, got 7 \(int\)"):
        kv.post_process({"p": {7: [1, 2]}}, {"p": good})
    with pytest.raises(kvhost.RequestError, match="engine 'p': remote_engines gives a NoneType, not a RemoteEngine"):
        kv.post_process({"p": {"r": [1, 2]}}, {"p": None})
    host = kv.host_buffers()
    with pytest.raises(kvhost.RequestError, match=r"request ids must be strings, got None \(NoneType\)"):
        kv.save_to_host(host, {None: [1, 2]})
    assert case.same_as(before)
    with pytest.raises(kvhost.LayoutError, match=r"a cache's shape has a negative size: \(2, -1, 8, 2, 4\)"):
        kv_cache_axes("flash_attn", (2, -1, 8, 2, 4))
    assert kv_cache_axes("flash_attn", (2, 0, 8, 2, 4)) == "KBNHC"  # a size of 0 is a size (kvhost refuses it later)
    with pytest.raises(kvhost.LayoutError, match="host buffers of 9223372036854775808 blocks cannot be made"):
        kv.host_buffers(num_blocks=2**63)


@pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors")
def test_layers_without_strides_are_refused_as_layout_errors():
    """Nested and sparse layers are refused naming the layer, before their strides or
    storage are read (torch raises from either); as the core refuses them."""
    dense = next(iter(attention_caches("flash_attn", "NHD", blocks=4, block_size=BLOCK).values()))
    nested = torch.nested.nested_tensor([dense[0], dense[1]])
    sparse = dense.reshape(2, -1).to_sparse()
    for odd, why in ((nested, "nested tensor"), (sparse, "torch.sparse_coo tensor")):
        with pytest.raises(kvhost.LayoutError, match=f"layer 'a': a {why}"):
            VllmCaches({"a": odd, "b": odd}, "flash_attn")
        with pytest.raises(kvhost.LayoutError, match=f"layer 'a': a {why}"):
            VllmCaches({"a": odd, "b": odd}, "LBHNC")
        with pytest.raises(kvhost.LayoutError, match=f"layer 'b': a {why}"):
            cross_layer_view({"a": dense, "b": odd})


@pytest.mark.parametrize("remote", [("BLNHC", 2), ("BHLNC", 1), ("BLNHC", BLOCK)])
def test_blnhc_layer_views_asked_for_as_their_group_receive_rows(remote):
    """``group=True``: BLNHC layer views (each layer's block one run) described as their
    group, whose block region is a block's row of every layer, as vLLM registers it with
    NIXL. A sender's rows landed there read as its tokens in every layer view; the views
    read alone (``group=False``) keep a region per layer."""
    remote_layout, remote_size = remote
    local_views, local_group = kv_layout_group("BLNHC", blocks=12, block_size=BLOCK)
    assert VllmCaches(local_views, "BLNHC").axes == "BHNC"
    kv = VllmCaches(local_views, "BLNHC", group=True)
    assert kv.axes == "LBHNC" and kv.caches.layout.region == "LNHC" and kv.layer_names == tuple(local_views)
    host = kv.host_buffers()  # layer views of one host buffer, like the device's
    assert all(h.stride() == v.stride() for h, v in zip(host.values(), local_views.values()))
    remote_views, remote_group = kv_layout_group(remote_layout, blocks=12, block_size=remote_size)
    fill({"g": remote_group}, seed=23)
    sent = list(range(11, 11 - 2 * BLOCK // remote_size, -1))
    senders = {"p": Sender({GROUP_NAME: remote_group}, "LBHNC", sent, [9, 2])}
    stats = run_batch(kv, {GROUP_NAME: local_group}, senders, {"p": RemoteEngine(remote_layout, remote_size)})
    assert stats.groups == (0 if remote == ("BLNHC", BLOCK) else 1)
    for name, view in local_views.items():  # the layer views vLLM's attention reads, [B, H, N, C]
        got = raw(view)[[9, 2]].permute(0, 2, 1, 3).reshape(2 * BLOCK, HEADS, -1)
        want = raw(remote_views[name])[sent].permute(0, 2, 1, 3).reshape(2 * BLOCK, HEADS, -1)
        assert torch.equal(got, want), name


def test_group_is_asked_for_with_a_layout_name_and_a_bool():
    views, _ = kv_layout_group("BLNHC", blocks=4, block_size=BLOCK)
    with pytest.raises(kvhost.ArgumentError, match="group must be True or False, got 1"):
        VllmCaches(views, "BLNHC", group=1)
    with pytest.raises(kvhost.ArgumentError, match="group=True describes vLLM's layer views: give their layout"):
        VllmCaches(views, axes="BHNC", group=True)
    one = dict([next(iter(views.items()))])
    assert VllmCaches(one, "BLNHC", group=True).axes == "BHNC"  # one layer is its own group
    apart = {name: view.clone() for name, view in views.items()}  # a buffer each
    with pytest.raises(kvhost.LayoutError, match="is not a view of the buffer that holds layer"):
        VllmCaches(apart, "BLNHC", group=True)


def test_constructor_errors():
    caches = attention_caches("flash_attn", "NHD", blocks=8, block_size=BLOCK)
    with pytest.raises(kvhost.LayoutError, match="give exactly one of layout"):
        VllmCaches(caches)
    with pytest.raises(kvhost.LayoutError, match="give exactly one of layout"):
        VllmCaches(caches, "flash_attn", axes="KBNHC")
    with pytest.raises(kvhost.LayoutError, match="kv_caches: no layers given"):
        VllmCaches({}, "flash_attn")
    pairs = {name: tuple(t.unbind(0)) for name, t in caches.items()}
    with pytest.raises(kvhost.LayoutError, match="is a tuple; layout 'flash_attn' describes single tensors"):
        VllmCaches(pairs, "flash_attn")
    assert VllmCaches(pairs, axes="KBNHC").caches.layout.axes == "BNHC"
    with pytest.raises(kvhost.LayoutError, match="kv_caches must map layer name to tensor, got list"):
        VllmCaches(list(caches.values()), "flash_attn")
    with pytest.raises(kvhost.LayoutError, match=r"layout must be a name \(a str\), got \['flash_attn'\]"):
        VllmCaches(caches, ["flash_attn"])
    with pytest.raises(kvhost.LayoutError, match="kv_caches must map layer name to tensor, got list"):
        cross_layer_view(list(caches.values()))


# --- host staging ------------------------------------------------------------------------


def test_save_and_load_through_a_host_buffer_in_another_layout():
    """FlashAttention NHD on the device, HND ([K, B, H, N, C] memory) on the host, both ways."""
    device = attention_caches("flash_attn", "NHD", blocks=16, block_size=BLOCK)
    fill(device, seed=4)
    kv = VllmCaches(device, "flash_attn")
    host = kv.host_buffers(physical="KBHNC")
    first = next(iter(host.values()))
    assert first.shape == (2, 16, BLOCK, HEADS, CONTENT)
    assert kvhost.Layout.of(first, "KBNHC").physical == "KBHNC"
    fill(host, seed=5)

    # Two requests share a prefix block (3): it is copied once.
    requests = {"a": [3, 4, 5], "b": [3, 9], "c": []}
    saving = CopyCase(device, host, "KBNHC", "KBNHC")  # both sides as they were
    result = kv.save_to_host(host, requests).wait()
    assert result.blocks == 4 and result.runs == 2  # ids 3, 4, 5, 9: two runs
    saved = [3, 4, 5, 9]
    saving.check(saved, saved)

    # Load into other device blocks' worth of data: clear the device blocks, load them back.
    truth = {name: read_tokens(t, kvhost.Layout.of(t, "KBNHC"), saved) for name, t in device.items()}
    for tensor in device.values():
        tensor[:, saved] = 0
    loading = CopyCase(host, device, "KBNHC", "KBNHC")
    kv.load_from_host(host, {"a": [3, 4, 5], "b": [9]}).wait()
    loading.check(saved, saved)
    for name, tensor in device.items():
        assert torch.equal(read_tokens(tensor, kvhost.Layout.of(tensor, "KBNHC"), saved), truth[name])


def test_save_rejects_bad_ids_by_request_and_changes_nothing():
    device = attention_caches("flash_attn", "NHD", blocks=8, block_size=BLOCK)
    kv = VllmCaches(device, "flash_attn")
    host = kv.host_buffers()
    fill(host, seed=6)
    before = [raw(t).clone() for t in host.values()]
    with pytest.raises(kvhost.RequestError, match=r"request 'b': block id 8 at position 1 is out of range \[0, 8\)"):
        kv.save_to_host(host, {"a": [1, 2], "b": [3, 8]})
    with pytest.raises(kvhost.RequestError, match=r"request 'a': block ids must be integers, got 1\.5 at position 0"):
        kv.save_to_host(host, {"a": [1.5]})
    small = kv.host_buffers(num_blocks=4)  # fewer blocks than ours: ids are checked against both
    fill(small, seed=7)
    small_before = [raw(t).clone() for t in small.values()]
    host_range = r"request 'b': host buffer block id 5 at position 0 is out of range \[0, 4\)"
    with pytest.raises(kvhost.RequestError, match=host_range):
        kv.save_to_host(small, {"a": [1], "b": [5]})
    with pytest.raises(kvhost.RequestError, match=host_range):
        kv.load_from_host(small, {"a": [1], "b": [5]})
    assert all(torch.equal(raw(t), b) for t, b in zip(small.values(), small_before))
    with pytest.raises(kvhost.LayoutError, match="host layout 'KBNC' must use the letters"):
        kv.host_buffers(physical="KBNC")
    assert all(torch.equal(raw(t), b) for t, b in zip(host.values(), before))


def test_host_ids_are_checked_against_the_smallest_host_buffer_of_any_shape():
    """The host buffers' block count is read off K/V tuples as off single tensors, and is the
    fewest any buffer holds; buffers that are not even a layer dict, or whose tensors are not
    shaped as named, are refused by the copy itself, as layout errors."""
    device = attention_caches("flash_attn", "NHD", blocks=8, block_size=BLOCK)
    pairs = VllmCaches({name: tuple(t.unbind(0)) for name, t in device.items()}, axes="KBNHC")
    small_pairs = pairs.host_buffers(num_blocks=4)
    assert all(isinstance(layer, tuple) for layer in small_pairs.values())
    fill(small_pairs, seed=8)
    before = [raw(t).clone() for layer in small_pairs.values() for t in layer]
    with pytest.raises(kvhost.RequestError, match=r"request 'b': host buffer block id 5 at position 0 .* \[0, 4\)"):
        pairs.save_to_host(small_pairs, {"a": [1], "b": [5]})
    assert all(torch.equal(raw(t), b) for t, b in zip((t for layer in small_pairs.values() for t in layer), before))

    kv = VllmCaches(device, "flash_attn")
    uneven = kv.host_buffers(num_blocks=6)
    first = next(iter(uneven))
    uneven[first] = uneven[first][:, :5]  # one layer holds 5 blocks: ids are checked against 5
    with pytest.raises(kvhost.RequestError, match=r"request 'b': host buffer block id 5 at position 0 .* \[0, 5\)"):
        kv.load_from_host(uneven, {"a": [1], "b": [5]})
    with pytest.raises(kvhost.LayoutError, match="expected a mapping of layer name to tensor, got list"):
        kv.save_to_host(list(kv.host_buffers().values()), {"a": [1]})
    flat = {name: torch.zeros(64) for name in device}  # one dim where five are named
    with pytest.raises(kvhost.LayoutError):
        kv.save_to_host(flat, {"a": [1]})


def test_host_buffer_mode_end_to_end_with_a_tpu_style_sender():
    """Prefill on a TPU-style cache, decode on a FlashAttention one, both through host buffers.

    The prefill engine keeps [num_blocks, block_size, 2 * heads, head_dim] with K and V
    interleaved per head (viewed as B N H K C) and stages to a head-major host buffer; NIXL
    moves host regions; the decode engine post-processes its own host buffer (blocks twice
    as large, token-major) and loads it to the device.
    """
    prefill_device = {
        f"model.layers.{i}.self_attn.attn": torch.empty(10, 2, HEADS * 2, CONTENT, dtype=torch.bfloat16).unflatten(
            2, (HEADS, 2)
        )
        for i in range(LAYERS)
    }
    fill(prefill_device, seed=7)
    prefill = VllmCaches(prefill_device, axes="BNHKC")
    prefill_host = prefill.host_buffers(physical="KBHNC")
    saving = CopyCase(prefill_device, prefill_host, "BNHKC", "BNHKC")  # both sides as they were
    prefill.save_to_host(prefill_host, {"r1": [6, 2, 7, 3], "r2": [0, 1]}).wait()
    saving.check([6, 2, 7, 3, 0, 1], [6, 2, 7, 3, 0, 1])  # a host buffer's blocks are the device's

    decode_device = attention_caches("flash_attn", "NHD", blocks=12, block_size=BLOCK)
    fill(decode_device, seed=8)
    decode = VllmCaches(decode_device, "flash_attn")
    decode_host = decode.host_buffers()  # the device's token-major layout, on the host
    decode_host_kv = VllmCaches(decode_host, "flash_attn")
    received = {"r1": [9, 4], "r2": [11]}
    nixl_read(prefill_host, "BNHKC", [6, 2, 7, 3], decode_host, "KBNHC", received["r1"])
    nixl_read(prefill_host, "BNHKC", [0, 1], decode_host, "KBNHC", received["r2"])

    stats = decode_host_kv.post_process({"prefill": received}, {"prefill": RemoteEngine("HND", 2)})
    assert stats.groups == 1 and stats.blocks == 3 and stats.backend == "cpu"
    decode.load_from_host(decode_host, received).wait()
    assert_same_tokens(decode_device, "KBNHC", [9, 4], prefill_device, "BNHKC", [6, 2, 7, 3])
    assert_same_tokens(decode_device, "KBNHC", [11], prefill_device, "BNHKC", [0, 1])


# --- each sender its own transform: where vLLM 0.33's own post-process goes wrong ---------


@pytest.mark.parametrize("first", ["LBHNC", "LBNHC"])
def test_a_head_major_and_a_token_major_sender_each_read_right_in_either_order(first):
    """vLLM 0.33 turns its HND->NHD permute on for the whole worker once one head-major
    (LBHNC) sender shakes hands, and then permutes a token-major (LBNHC) sender's blocks
    too. kvhost takes each sender's transform from its own handshake: in one step, and in
    two steps in either order, both read as their senders' tokens."""
    local_views, _ = kv_layout_group("LBNHC", blocks=24, block_size=BLOCK)
    kv = VllmCaches(local_views, "LBNHC")
    engines = {"head-major": RemoteEngine("LBHNC", 2), "token-major": RemoteEngine("LBNHC", 2)}
    senders = {}
    for engine, ids in zip(engines, ([3, 11], [7, 19])):
        remote_views, _ = kv_layout_group(engines[engine].kv_cache_layout, blocks=6, block_size=2)
        fill(remote_views, seed=len(senders) + 11)
        senders[engine] = Sender(remote_views, "BHNC", [4, 1, 5, 0], ids)
    run_batch(kv, local_views, senders, engines)  # one step, both senders
    second = "LBNHC" if first == "LBHNC" else "LBHNC"
    for name in (first, second):  # one sender per step, in this order
        engine = "head-major" if name == "LBHNC" else "token-major"
        run_batch(kv, local_views, {engine: senders[engine]}, {engine: engines[engine]})


@pytest.mark.parametrize("remote_size", [1, 2])
def test_bhlnc_caches_take_smaller_remote_blocks(remote_size):
    """vLLM 0.33 converts block sizes only for block-contiguous layouts; with BHLNC caches
    and smaller sender blocks it leaves the wire bytes as they landed. kvhost rearranges
    them: the per-layer views vLLM hands a connector read as the sender's tokens."""
    local_views, local_group = kv_layout_group("BHLNC", blocks=12, block_size=BLOCK)
    kv = VllmCaches(local_views, "BHLNC")
    remote_views, remote_group = kv_layout_group("BHLNC", blocks=12, block_size=remote_size)
    fill({"g": remote_group}, seed=21)
    sent = list(range(11, 11 - 2 * BLOCK // remote_size, -1))
    senders = {"p": Sender({GROUP_NAME: remote_group}, "LBHNC", sent, [9, 2])}
    stats = run_batch(kv, {GROUP_NAME: local_group}, senders, {"p": RemoteEngine("BHLNC", remote_size)})
    assert stats.groups == 1 and stats.bytes_moved > 0
    for name, view in local_views.items():  # the layer views vLLM's attention reads, [B, H, N, C]
        got = raw(view)[[9, 2]].permute(0, 2, 1, 3).reshape(2 * BLOCK, HEADS, -1)
        want = raw(remote_views[name])[sent].permute(0, 2, 1, 3).reshape(2 * BLOCK, HEADS, -1)
        assert torch.equal(got, want), name


@pytest.mark.parametrize(
    ("local", "remote", "remote_size"),
    [("LBNHC", "LBHNC", 2), ("BLHNC", "BLHNC", 1), ("BHLNC", "BHLNC", 2), ("LBHNC", "LBNHC", 8)],
)
def test_post_process_of_partial_blocks_through_vllm_words(local, remote, remote_size):
    """``tokens`` per request: what arrived reads as the sender's tokens, the rest of the
    request's blocks is zero, and blocks outside the step keep their bytes."""
    local_views, local_group = kv_layout_group(local, blocks=20, block_size=BLOCK)
    kv = VllmCaches(local_views, local)
    caches = {GROUP_NAME: local_group} if kv.layer_names else local_views
    described = next(iter(caches))
    case = ReceiveCase(caches, kv.axes, seed=13)
    remote_views, remote_group = kv_layout_group(remote, blocks=48, block_size=remote_size)
    remote_caches = {described: remote_group} if kv.layer_names else remote_views
    fill(remote_caches, seed=14)
    g = max(remote_size // BLOCK, 1)
    plan = {"a": (3 * g, 2 * BLOCK + 1), "b": (2 * g, 1), "c": (g, BLOCK)}  # blocks, tokens
    ids = iter(local_id_plan(sum(n for n, _ in plan.values()), 20))
    received, sent_from = {}, iter(range(47, -1, -1))
    for request, (blocks, tokens) in plan.items():
        local_ids = [next(ids) for _ in range(blocks)]
        whole = blocks * BLOCK // remote_size
        remote_ids = [next(sent_from) for _ in range(whole)]
        nixl_read(remote_caches, kv.axes, remote_ids, caches, kv.axes, local_ids)
        received[request] = (local_ids, remote_ids, tokens)
    stats = kv.post_process(
        {"p": {r: v[0] for r, v in received.items()}},
        {"p": RemoteEngine(remote, remote_size)},
        tokens={r: v[2] for r, v in received.items()},
    )
    assert stats.requests == 3
    for local_ids, remote_ids, tokens in received.values():
        for member in kvhost.caches.CacheSet(caches, kv.axes).members:
            got = read_tokens(member.tensor, member.layout, local_ids)
            sender = remote_caches[member.layer]
            want = read_tokens(sender, kvhost.Layout.of(sender, kv.axes), remote_ids)
            assert torch.equal(got[:tokens], want[:tokens])
            assert not got[tokens:].any()
    claimed = {b for local_ids, _, _ in received.values() for b in local_ids}
    for i in range(len(case.set.members)):
        case.check_untouched(i, claimed)
    with pytest.raises(kvhost.RequestError, match="tokens name request 'z', which no engine sent"):
        kv.post_process({"p": {"a": received["a"][0]}}, {"p": RemoteEngine(remote, remote_size)}, tokens={"z": 1})


# --- edges the first mutation run found untested (2 December 2026) ---------------------------


def test_cross_layer_view_names_what_is_wrong_and_takes_any_even_spacing():
    views, group = kv_layout_group("LBHNC", blocks=4, block_size=BLOCK)
    first, second, third = (re.escape(repr(name)) for name in views)
    names = list(views)
    with pytest.raises(kvhost.LayoutError, match="kv_caches: no layers given"):
        cross_layer_view({})
    with pytest.raises(kvhost.LayoutError, match=f"layer {second} is a list, not a tensor view"):
        cross_layer_view({names[0]: views[names[0]], names[1]: [1, 2]})
    shorter = {**views, names[1]: views[names[1]][:2]}
    with pytest.raises(kvhost.LayoutError, match=rf"layer {second} is \(2, .* but layer {first} is \(4, "):
        cross_layer_view(shorter)
    other, _ = kv_layout_group("LBHNC", blocks=4, block_size=BLOCK)
    with pytest.raises(kvhost.LayoutError, match=f"layer {third} is not a view of the buffer that holds layer {first}"):
        cross_layer_view({**views, names[2]: other[names[2]]})
    alone = cross_layer_view({names[0]: views[names[0]]})
    assert alone.shape == (1, *views[names[0]].shape) and alone.data_ptr() == group.data_ptr()
    later = cross_layer_view({names[1]: views[names[1]], names[2]: views[names[2]]})  # not at the buffer's start
    assert later.stride() == group.stride() and later.data_ptr() == group[1].data_ptr() and later.shape[0] == 2
    with pytest.raises(kvhost.LayoutError, match=r"layer offsets \[.*\] .* not evenly spaced upwards"):
        cross_layer_view({names[0]: views[names[0]], "again": views[names[0]]})  # a step of 0
    buffer = torch.zeros(64, dtype=torch.int8)
    one_apart = {f"l{i}": buffer.as_strided((2, 3), (3, 1), i) for i in range(2)}  # a step of one element
    assert cross_layer_view(one_apart).stride() == (1, 3, 1)
    uneven = {f"l{i}": buffer.as_strided((2, 3), (3, 1), offset) for i, offset in enumerate((0, 8, 24))}
    with pytest.raises(kvhost.LayoutError, match=r"layer offsets \[0, 8, 24\]"):
        cross_layer_view(uneven)


def test_bhlnc_layer_views_need_their_group():
    """A BHLNC layer view of more than one head has no block region of its own: one alone is
    refused, two are seen as their group, and a name kvhost does not know is refused either way.
    The view of a buffer of one layer (a hybrid model's memory shared by groups of one layer
    each) has nothing between its heads: it is described alone."""
    assert kv_cache_axes("BHLNC", (4, 1, BLOCK, 16)) == "BHNC"
    with pytest.raises(kvhost.LayoutError, match="no contiguous block region"):
        kv_cache_axes("BHLNC", (4, 2, BLOCK, 16))
    views, _ = kv_layout_group("BHLNC", blocks=4, block_size=BLOCK, heads=2)
    names = list(views)
    with pytest.raises(kvhost.LayoutError, match="no contiguous block region"):
        VllmCaches({names[0]: views[names[0]]}, "BHLNC")
    pair, _ = kv_layout_group("BHLNC", blocks=4, block_size=BLOCK, heads=2, layers=2)
    two = VllmCaches(pair, "BHLNC")
    assert two.layer_names == tuple(pair) and two.axes == "LBHNC" and two.layout_name == "BHLNC"
    with pytest.raises(kvhost.LayoutError, match="unknown vLLM cache layout 'bogus'"):
        VllmCaches(views, "bogus")
    alone, _ = kv_layout_group("BHLNC", blocks=4, block_size=BLOCK, heads=2, layers=1)
    one = VllmCaches(alone, "BHLNC")
    assert one.axes == "BHNC" and one.layer_names is None and one.caches.layout.region == "HNC"


def test_caches_of_one_head_read_either_kv_cache_layout_name():
    """With one head, H's place in memory cannot be told from the strides: both names fit."""
    views, _ = kv_layout_group("LBNHC", blocks=4, block_size=BLOCK, heads=1)
    assert VllmCaches(views, "LBHNC").axes == VllmCaches(views, "LBNHC").axes == "BHNC"


def test_block_is_one_run_looks_only_inside_the_block():
    from kvhost.integrations.vllm import _block_is_one_run

    buffer = torch.zeros(4096, dtype=torch.int8)
    assert _block_is_one_run(buffer.as_strided((4, 2, 8, 16), (256, 128, 16, 1)))
    # a head of one: its stride says nothing
    assert _block_is_one_run(buffer.as_strided((4, 1, 8, 16), (128, 5, 16, 1)))
    # heads at the block's stride are not inside it; the block is 64 bytes of 128
    assert _block_is_one_run(buffer.as_strided((4, 2, 4, 16), (128, 128, 16, 1)))
    assert not _block_is_one_run(buffer.as_strided((4, 2, 8, 16), (512, 256, 16, 1)))  # a gap between heads
    assert _block_is_one_run(buffer.as_strided((1, 2, 8, 16), (1, 128, 16, 1)))  # one block: every dim is inside
    assert not _block_is_one_run(buffer.as_strided((1, 2, 8, 16), (1, 256, 16, 1)))


def test_the_worker_steps_name_bad_arguments():
    caches = attention_caches("flash_attn", "NHD", blocks=8, block_size=BLOCK)
    kv = VllmCaches(caches, "flash_attn", backend="torch")
    assert kv.backend.name == "torch" and kv.layout_name == "flash_attn"
    assert VllmCaches(caches, axes="KBNHC").layout_name is None
    host = kv.host_buffers()
    assert kv.save_to_host(host, {"a": [1, 2]}).job.non_blocking is False  # blocking unless asked
    assert kv.load_from_host(host, {"a": [1, 2]}).job.non_blocking is False
    with pytest.raises(kvhost.RequestError, match="block ids must map request id to block ids, got list"):
        kv.save_to_host(host, [1, 2])
    with pytest.raises(kvhost.RequestError, match=r"engine 'e' sent blocks but has no RemoteEngine \(known: none\)"):
        kv.post_process({"e": {"r": [1]}}, {})
    with pytest.raises(kvhost.RequestError, match="tokens must map request id to a token count, got list"):
        kv.post_process({"e": {"r": [1]}}, {"e": RemoteEngine("NHD", BLOCK)}, tokens=[("r", 3)])
    for bad in (0, -1, True, 2.5):
        with pytest.raises(kvhost.LayoutError, match=f"num_blocks {bad!r} must be a positive integer"):
            kv.host_buffers(num_blocks=bad)
    assert all(t.shape[1] == 1 for t in kv.host_buffers(num_blocks=1).values())
    with pytest.raises(kvhost.LayoutError, match="host buffers of 4611686018427387904 blocks cannot be made"):
        kv.host_buffers(num_blocks=2**62)
    with pytest.raises(kvhost.LayoutError, match="physical must be a string of the caches' axis letters or None, got"):
        kv.host_buffers(physical=5)
    saved = {name: raw(t).clone() for name, t in host.items()}
    with pytest.raises(kvhost.LayoutError, match="dst: axes must be a string of axis letters, got 5"):
        kv.save_to_host(host, {"a": [3]}, host_axes=5)
    with pytest.raises(kvhost.LayoutError, match=r"src: axes must be a string of axis letters, got \['K'"):
        kv.load_from_host(host, {"a": [3]}, host_axes=list("KBNHC"))
    assert all(torch.equal(raw(t), saved[name]) for name, t in host.items())
    with pytest.raises(kvhost.RequestError, match=r"remote layout must be a name \(a str\), got \['HND'\]"):
        kv.remote_order(["HND"])
    # No tokens is None: 0 or an empty list is not a mapping of token counts, and never
    # taken for "every block whole".
    for bad in (0, []):
        wording = f"tokens must map request id to a token count, got {type(bad).__name__} {re.escape(repr(bad))}"
        with pytest.raises(kvhost.RequestError, match=wording):
            kv.post_process({"e": {"r": [1]}}, {"e": RemoteEngine("NHD", BLOCK)}, tokens=bad)
    # A step whose senders all share one spec gives it for the call: a fault in it still names them.
    named = "engine 'e', 'f': remote_order 'NHC', remote_block_size 3: block sizes 4"
    with pytest.raises(kvhost.RequestError, match=named):
        kv.post_process({"e": {"r": [1]}, "f": {"s": [2]}}, dict.fromkeys("ef", RemoteEngine("NHD", 3)))


def test_host_buffers_of_tuple_layers_are_tuples():
    caches = attention_caches("flash_attn", "NHD", blocks=8, block_size=BLOCK)
    pairs = {name: tuple(t.unbind(0)) for name, t in caches.items()}
    host = VllmCaches(pairs, axes="KBNHC").host_buffers(physical="KBHNC")  # K stands for the tuple's index
    for name, (k, v) in pairs.items():
        k_host, v_host = host[name]
        assert k_host.shape == k.shape and v_host.shape == v.shape
        assert k_host.permute(0, 2, 1, 3).is_contiguous()  # heads before tokens in memory
    singles = {name: (k,) for name, (k, _) in pairs.items()}  # one tensor a layer, still a tuple
    host = VllmCaches(singles, axes="KBNHC").host_buffers()
    assert all(isinstance(h, tuple) and len(h) == 1 and h[0].shape == singles[n][0].shape for n, h in host.items())
    apart = {name: (k, v) for name, (k, v) in pairs.items()}  # axes without K: the tuple numbers its tensors
    host = VllmCaches(apart, axes="BNHC").host_buffers()
    assert all(isinstance(h, tuple) and len(h) == 2 for h in host.values())
