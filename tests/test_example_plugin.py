"""The Gaudi-style example plugin (examples/gaudi_style_plugin), on CPU tensors in its layout.

The engine's caches are what such an engine allocates: per layer a (K, V) pair of
``[num_blocks * block_size, heads, head_dim]`` uint8 tensors (fp8 kept as bytes). The
example's backend serves ``hpu``; here it runs the same code on CPU tensors, passed as an
instance, and, in a subprocess, loaded through the installed distribution's entry point.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import kvhost
from kvhost.integrations.vllm import RemoteEngine
from kvhost.testing import CopyCase, ReceiveCase, assert_same_tokens, fill_random, make_cache, nixl_read, raw

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "gaudi_style_plugin"
LAYERS, BLOCKS, BLOCK_SIZE, HEADS, HEAD_DIM = 2, 24, 8, 2, 16


@pytest.fixture(scope="module")
def example():
    sys.path.insert(0, str(EXAMPLE))
    try:
        yield importlib.import_module("kvhost_gaudi_style")
    finally:
        sys.path.remove(str(EXAMPLE))


def engine_caches(seed: int, blocks: int = BLOCKS) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Per layer (K, V), each [num_blocks * block_size, heads, head_dim] uint8, random bytes."""
    return {
        f"layers.{i}": tuple(
            fill_random(torch.empty(blocks * BLOCK_SIZE, HEADS, HEAD_DIM, dtype=torch.uint8), seed * 10 + 2 * i + j)
            for j in range(2)
        )
        for i in range(LAYERS)
    }


def blocks_of(engine: dict[str, tuple[torch.Tensor, torch.Tensor]]) -> dict[str, tuple[torch.Tensor, ...]]:
    """The engine's own tensors seen as ``[B, N, H, C]`` blocks (axes ``KBNHC``, K the tuple):
    written here, not by the example, so that the checks read the engine's memory itself."""
    return {name: tuple(t.view(-1, BLOCK_SIZE, HEADS, HEAD_DIM) for t in pair) for name, pair in engine.items()}


def flash_attn_fp8(order: str, block_size: int, seed: int) -> dict[str, torch.Tensor]:
    """A CUDA-style sender: FlashAttention [2, B, N, H, C] in float8_e4m3fn, NHD or HND memory."""
    physical = "KBHNC" if order == "HND" else "KBNHC"
    sizes = dict(K=2, B=12, N=block_size, H=HEADS, C=HEAD_DIM)
    caches = {f"layers.{i}": make_cache("KBNHC", physical, sizes, torch.float8_e4m3fn) for i in range(LAYERS)}
    for i, tensor in enumerate(caches.values()):
        fill_random(tensor, seed * 10 + i)
    return caches


def test_block_views_are_views_of_the_engine_memory(example):
    engine = engine_caches(seed=1)
    views = example.block_views(engine, BLOCK_SIZE)
    assert list(views) == list(engine)
    for name, (key, value) in views.items():
        assert key.shape == value.shape == (BLOCKS, BLOCK_SIZE, HEADS, HEAD_DIM)
        assert key.data_ptr() == engine[name][0].data_ptr() and value.data_ptr() == engine[name][1].data_ptr()
        assert torch.equal(key[3, 5], engine[name][0][3 * BLOCK_SIZE + 5])  # slot = block * block_size + token
    with pytest.raises(
        kvhost.LayoutError, match=r"layer 'layers.0': expected .* block size 7, got shape \(192, 2, 16\)"
    ):
        example.block_views(engine, 7)
    with pytest.raises(kvhost.LayoutError, match="layer 'x' must be a \\(key, value\\) tuple, got Tensor"):
        example.block_views({"x": torch.zeros(8, 2, 16)}, BLOCK_SIZE)


def test_post_process_senders_of_other_layouts_sizes_and_dtypes(example):
    """Three senders, one call: fp8 FlashAttention HND/2 and NHD/16, and a Gaudi-style peer."""
    backend = example.GaudiStyleBackend()
    engine = engine_caches(seed=2)
    decode = example.GaudiStyleCaches(engine, BLOCK_SIZE, backend=backend)
    assert decode.axes == "KBNHC" and decode.caches.layout.axes == "BNHC"
    case = ReceiveCase(blocks_of(engine), decode.axes, seed=3)  # random sentinels in every block

    peer = example.GaudiStyleCaches(engine_caches(seed=4, blocks=6), BLOCK_SIZE)
    senders = {
        "cuda-hnd": (flash_attn_fp8("HND", 2, seed=5), "KBNHC", {"a": ([7, 2], [0, 5, 9, 1, 3, 8, 11, 4])}),
        "cuda-nhd": (flash_attn_fp8("NHD", 16, seed=6), "KBNHC", {"b": ([20, 21], [6]), "c": ([11, 4], [10])}),
        "gaudi": (peer.views, peer.axes, {"d": ([0], [5])}),
    }
    engines = {"cuda-hnd": RemoteEngine("HND", 2), "cuda-nhd": RemoteEngine("NHD", 16), "gaudi": RemoteEngine("NHD", 8)}
    for caches, axes, requests in senders.values():
        for local_ids, remote_ids in requests.values():
            nixl_read(caches, axes, remote_ids, decode.views, decode.axes, local_ids)
    received = {engine: {name: ids for name, (ids, _) in senders[engine][2].items()} for engine in senders}
    stats = decode.post_process(received, engines)

    assert stats.backend == "gaudi-style" and stats.requests == 4 and stats.blocks == 7
    # HND/2 needs a transform; NHD senders are token-major like us: identity, nothing copied.
    assert stats.groups == 1 and stats.skipped_blocks == 5
    for caches, axes, requests in senders.values():  # read in the engine's memory, not the example's views
        for local_ids, remote_ids in requests.values():
            assert_same_tokens(blocks_of(engine), decode.axes, local_ids, caches, axes, remote_ids)
    claimed = {b for _, _, requests in senders.values() for ids, _ in requests.values() for b in ids}
    for i in range(len(case.set.members)):
        case.check_untouched(i, claimed)
    # fp8 NaN bit patterns (0x7F, 0xFF) travelled as plain bytes.
    sender = raw(senders["cuda-hnd"][0]["layers.0"])
    assert ((sender == 0x7F) | (sender == 0xFF)).any()


def test_staging_copy_to_a_heads_first_float8_host_buffer_and_back(example):
    backend = example.GaudiStyleBackend()
    prefill_engine, decode_engine = engine_caches(seed=7), engine_caches(seed=8)
    prefill = example.GaudiStyleCaches(prefill_engine, BLOCK_SIZE, backend=backend)
    host = {
        name: tuple(t.view(torch.float8_e4m3fn) for t in pair)  # the host keeps the same bytes as float8
        for name, pair in prefill.host_buffers(physical="KBHNC").items()
    }
    assert kvhost.Layout.of(host["layers.0"][0], "BNHC").physical == "BHNC"
    requests = {"r1": [3, 4, 5, 9], "r2": [3, 4, 17]}  # a shared prefix is copied once
    saving = CopyCase(blocks_of(prefill_engine), host, prefill.axes, prefill.axes)  # both sides as they were
    saved = prefill.save_to_host(host, requests).wait()
    assert saved.backend == "gaudi-style" and saved.blocks == 5 and saved.runs == 3
    blocks = [3, 4, 5, 9, 17]
    saving.check(blocks, blocks)

    decode = example.GaudiStyleCaches(decode_engine, BLOCK_SIZE, backend=backend)
    loading = CopyCase(host, blocks_of(decode_engine), decode.axes, decode.axes)
    loaded = decode.load_from_host(host, requests).wait()
    assert loaded.blocks == 5
    loading.check(blocks, blocks)
    assert_same_tokens(blocks_of(decode_engine), decode.axes, blocks, blocks_of(prefill_engine), prefill.axes, blocks)


def test_the_backend_says_where_it_can_run(example):
    backend = example.GaudiStyleBackend
    assert (backend.name, backend.device_types, backend.priority) == ("gaudi-style", ("hpu",), 10)
    if importlib.util.find_spec("habana_frameworks") is None:
        assert backend.unavailable_reason() == "habana_frameworks is not installed"


INSTALLED_CHECK = """
import json, runpy, sys
import kvhost, kvhost_gaudi_style
from kvhost.registry import registry
summary = runpy.run_path(sys.argv[1])["main"]()
row = {r.name: r for r in registry.info()}["gaudi-style"]
try:
    kvhost.get_backend("hpu", "gaudi-style")
    named = None
except kvhost.BackendError as err:
    named = str(err)
print(json.dumps({
    "summary": summary,
    "package": kvhost_gaudi_style.__file__,
    "row": [row.name, list(row.device_types), row.priority, row.source, row.unavailable],
    "hpu": kvhost.get_backend("hpu").name,
    "named": named,
}))
"""


@pytest.mark.timeout(120)
def test_installed_example_is_found_through_its_entry_point(tmp_path):
    source = tmp_path / "gaudi_style_plugin"
    shutil.copytree(EXAMPLE, source, ignore=shutil.ignore_patterns("__pycache__", "build", "*.egg-info"))
    site = tmp_path / "site"
    command = [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--target", str(site), str(source)]
    if importlib.util.find_spec("setuptools") is not None:
        command[4:4] = ["--no-build-isolation", "--no-index"]
    subprocess.run(command, check=True, timeout=120, capture_output=True)

    environment = {k: v for k, v in os.environ.items() if k != "KVHOST_BACKEND"}
    environment["PYTHONPATH"] = str(site)
    done = subprocess.run(
        [sys.executable, "-c", INSTALLED_CHECK, str(EXAMPLE / "demo.py")],
        cwd=tmp_path,
        env=environment,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert Path(report["package"]).is_relative_to(site)  # the installed copy, not the source tree
    assert report["summary"] == {
        "backend": "gaudi-style",
        "loaded_by": "entry point kvhost_gaudi_style.backend:GaudiStyleBackend",
        "post_process": {"requests": 2, "blocks": 3, "groups": 1},
        "save": {"backend": "gaudi-style", "blocks": 3, "runs": 3},
        "checked": True,
    }
    name, device_types, priority, entry, why = report["row"]
    assert (name, device_types, priority, entry) == (
        "gaudi-style",
        ["hpu"],
        10,
        "kvhost_gaudi_style.backend:GaudiStyleBackend",
    )
    if importlib.util.find_spec("habana_frameworks") is None:
        # Registered but unable to run: HPU tensors fall back to the generic torch backend,
        # and asking for it by name says why.
        assert why == "habana_frameworks is not installed"
        assert report["hpu"] == "torch"
        assert report["named"] == "backend 'gaudi-style' cannot run here: habana_frameworks is not installed"
