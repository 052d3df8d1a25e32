"""The TPU backend on a real XLA device (torch_xla; ``PJRT_DEVICE=CPU`` runs it on the host).

Compile counts stay within the buckets, padding never writes a block outside the
request, updates rewrite the cache where it lies (same device buffer, O(n) time), one
graph per call, bytes exact for every KV dtype, host <-> XLA copies both ways across
layouts, copies between two XLA devices (made on the CPU, in a fresh process). Run by
``ci/tpu.sh``; skipped where torch_xla is not installed.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch

torch_xla = pytest.importorskip("torch_xla")  # importing it also registers the XLA device with torch
import torch_xla.debug.metrics as metrics  # noqa: E402
from kvhost_tpu import TpuBackend, write_dtype, xla  # noqa: E402
from kvhost_tpu.buckets import bucket_size, buckets_up_to  # noqa: E402

import kvhost  # noqa: E402
from kvhost.testing import ReceiveCase, make_cache  # noqa: E402
from kvhost_tools.device_checks.xla_scaling import growth, measure_scaling  # noqa: E402

pytestmark = [pytest.mark.xla, pytest.mark.timeout(300)]

ON_CPU = xla.hardware(torch_xla.device()) == "CPU"
KV_DTYPES = [
    torch.bfloat16,
    torch.float16,
    torch.float32,
    torch.float8_e4m3fn,
    torch.float8_e5m2,
    torch.uint8,
    torch.int8,
]


@pytest.fixture
def device() -> torch.device:
    return torch_xla.device()


def random_bytes(shape: list[int], dtype: torch.dtype, seed: int) -> torch.Tensor:
    """A host tensor whose every byte is random (NaN payloads included)."""
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, size=(*shape, dtype.itemsize), dtype=np.uint8)
    return torch.from_numpy(raw).view(dtype).squeeze(-1)


def device_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """An XLA tensor's bytes on the host, as integers, read with a bitcast on the device.

    ``tensor.cpu()`` would move fp16 through f32 and rewrite NaN payloads.
    """
    return xla.bitcast(tensor, xla.raw_dtype(tensor.dtype)).cpu()


def host_bytes(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.view(xla.raw_dtype(tensor.dtype))


def kv_cache(blocks: int, dtype: torch.dtype, seed: int, device: torch.device, shape=(8, 2, 16)) -> torch.Tensor:
    """A KBNHC cache ``[2, blocks, N, H, C]`` of random bytes on ``device``."""
    return random_bytes([2, blocks, *shape], dtype, seed).to(device)


def executions() -> int:
    """Graphs run so far: counted when torch_xla schedules one (the ExecuteTime metric is
    recorded when one finishes, at times after the sync that waited for it returned)."""
    return int(metrics.counter_value("ExecuteComputation") or 0)


# --- graphs ------------------------------------------------------------------------------


def test_a_call_runs_its_own_graph_and_leaves_an_engines_pending_work_pending(device):
    """An engine's lazy tensors are not pulled into kvhost's graph: with a different one
    pending before each call, no call compiles a graph (each did, the engine's work taken
    in), the engine's work is still pending after, and the cache is written in place."""
    cache = kv_cache(64, torch.bfloat16, 31, device)
    host = kvhost.KVHost({"l": cache}, axes="KBNHC", backend="tpu")
    staging = {"l": random_bytes([2, 16, 8, 2, 16], torch.bfloat16, 32)}
    calls = [
        lambda: host.receive({"r": [3, 9]}, remote_order="HNC", remote_block_size=4),
        lambda: host.copy_from(staging, [0, 1], [5, 7]),
        lambda: host.copy_to(staging, [5, 7], [2, 3]),
        lambda: host.receive({"p": kvhost.Incoming([11, 12], "HNC", 4, tokens=9)}),
    ]
    for call in calls:  # each call's graph once
        call()
    address, before = xla.buffer_address(cache), xla.compile_count()
    engine = []
    for step, call in enumerate(calls * 2):
        engine.append(torch.arange(8 + step, device=device, dtype=torch.float32) * 3.0)  # the engine's, pending
        call()
    assert xla.compile_count() == before, "a call compiled the engine's pending work into its graph"
    assert xla.buffer_address(cache) == address
    assert [t.cpu().tolist() for t in engine[:2]] == [[3.0 * i for i in range(8)], [3.0 * i for i in range(9)]]


def test_compile_count_over_200_random_batches_stays_within_the_buckets(device):
    """Receive (whole prompts, and prompts ending mid-block), both copies, 200 random batches
    each: compiles grow with log(batch), not per batch or per prompt length."""
    caches = {f"l{i}": kv_cache(256, torch.bfloat16, i, device) for i in range(2)}
    host = kvhost.KVHost(caches, axes="KBNHC", backend="tpu")
    staging = {name: random_bytes([2, 128, 8, 2, 16], torch.bfloat16, 9) for name in caches}
    rng = np.random.default_rng(0)
    most = 100
    sizes_seen: dict[str, set[int]] = {"receive": set(), "partial": set(), "load": set(), "save": set()}
    for operation in sizes_seen:
        before = xla.compile_count()
        for _ in range(200):
            count = int(rng.integers(1, most + 1))
            sizes_seen[operation].add(count)
            ids = rng.choice(256, count, replace=False)
            if operation == "receive":
                # Several requests of one key; HND senders of 4 tokens -> NHD blocks of 8.
                cut = np.sort(rng.choice(np.arange(1, count), min(3, count - 1), replace=False)) if count > 1 else []
                requests = {f"r{i}": part for i, part in enumerate(np.split(ids, cut))}
                host.receive(requests, remote_order="HNC", remote_block_size=4)
            elif operation == "partial":  # one prompt whose last block it fills to any token
                tokens = int(rng.integers(1, count * 8 + 1))
                host.receive({"p": kvhost.Incoming(ids, "HNC", 4, tokens=tokens)})
            elif operation == "load":
                host.copy_from(staging, rng.choice(128, min(count, 128), replace=False), ids[:128])
            else:
                host.copy_to(staging, ids[:128], rng.choice(128, min(count, 128), replace=False))
        compiled = xla.compile_count() - before
        allowed = len(buckets_up_to(most))  # 16, 32, 64, 128: 4 graphs
        if operation == "partial":
            allowed *= 2  # the rearrangement's graphs and the zeroing's
        assert len(sizes_seen[operation]) > 3 * allowed  # many distinct batch sizes...
        assert 1 <= compiled <= allowed, f"{operation}: {compiled} graphs compiled for 200 batches"


def test_one_call_is_one_graph(device):
    caches = {f"l{i}": kv_cache(64, torch.float16, i, device) for i in range(3)}
    host = kvhost.KVHost(caches, axes="KBNHC", backend="tpu")
    staging = {name: random_bytes([2, 8, 8, 2, 16], torch.float16, 5) for name in caches}
    calls = [
        lambda: host.receive({"a": [3, 9], "b": [40]}, remote_order="HNC", remote_block_size=2),
        lambda: host.copy_from(staging, [0, 1, 2], [5, 6, 60]),
        lambda: host.copy_to(staging, [7, 8, 33], [4, 5, 6]),
        # Nothing to rearrange, only tokens to zero: block 20 from token 5 on, all of 21.
        lambda: host.receive({"z": kvhost.Incoming([20, 21], tokens=5)}),
    ]
    for call in calls:
        call()  # compiles
        before = executions()
        call()
        assert executions() - before == 1  # every layer's work in one execution


def test_a_host_to_xla_copy_uploads_the_destination_ids_once(device):
    """One upload per layer's bytes and one for the destination ids, whatever the layer count."""
    for layers in (1, 3):
        caches = {f"l{i}": kv_cache(64, torch.float16, i, device) for i in range(layers)}
        host = kvhost.KVHost(caches, axes="KBNHC", backend="tpu")
        staging = {name: random_bytes([2, 8, 8, 2, 16], torch.float16, 5) for name in caches}
        host.copy_from(staging, [0, 1, 2], [5, 6, 60])  # compiles
        before = int(metrics.counter_value("xla::_to_copy") or 0)
        host.copy_from(staging, [0, 1, 2], [5, 6, 60])
        assert int(metrics.counter_value("xla::_to_copy") or 0) - before == layers + 1


# --- padding -----------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.int16, torch.float32], ids=str)
@pytest.mark.parametrize(("ids", "g"), [([0], 1), ([63], 1), ([31, 2, 63], 1), ([62, 63], 2), ([10, 11, 0, 1], 2)])
def test_padding_never_writes_a_block_outside_the_request(device, dtype, ids, g):
    """1 to 4 blocks pad to 16: the padded entries repeat the last real one, at either end of the cache."""
    sizes = dict(K=2, B=64, N=8, H=2, C=16)
    caches = {f"l{i}": make_cache("KBNHC", "KBNHC", sizes, dtype, device) for i in range(2)}
    case = ReceiveCase(caches, "KBNHC", seed=len(ids))  # sentinels in every block
    remote = 4 if g == 1 else 16
    case.send("r", ids, "HNC", remote)
    kvhost.receive(caches, {"r": ids}, axes="KBNHC", remote_order="HNC", remote_block_size=remote, backend="tpu")
    case.check()  # the request reads back as sent; every other block kept its sentinel


@pytest.mark.parametrize(("g", "units", "uploaded"), [(8, 1, 16), (32, 1, 32), (32, 2, 64), (2, 3, 16), (2, 9, 32)])
def test_units_of_a_larger_sender_pad_to_a_floor_counted_in_blocks(device, monkeypatch, g, units, uploaded):
    """A sender's block of g of ours is a unit of g blocks: one unit pads to 16 blocks or to
    its own g, not to 16 units of g (a peer's block size would set what a small request
    gathers); the bytes are the wire model's."""
    from kvhost_tpu import backend as tpu_backend

    sizes = dict(K=2, B=64, N=4, H=2, C=16)
    caches = {"l": make_cache("KBNHC", "KBNHC", sizes, torch.bfloat16, device)}
    case = ReceiveCase(caches, "KBNHC", seed=g)
    ids = list(range(64 - units * g, 64))
    case.send("r", ids, "HNC", 4 * g)
    lengths = []
    upload = tpu_backend._upload
    monkeypatch.setattr(tpu_backend, "_upload", lambda ids, dev: lengths.append(ids.size) or upload(ids, dev))
    kvhost.receive(caches, {"r": ids}, axes="KBNHC", remote_order="HNC", remote_block_size=4 * g, backend="tpu")
    case.check()
    assert lengths == [uploaded]


@pytest.mark.parametrize("dtype", [torch.uint16, torch.uint32, torch.uint64], ids=str)
def test_unsigned_caches_are_received_and_copied_byte_for_byte(device, dtype):
    sizes = dict(K=2, B=16, N=8, H=2, C=16)
    caches = {"l": make_cache("KBNHC", "KBNHC", sizes, dtype, device)}
    case = ReceiveCase(caches, "KBNHC", seed=5)
    case.send("r", [3, 7], "HNC", 4)
    kvhost.receive(caches, {"r": [3, 7]}, axes="KBNHC", remote_order="HNC", remote_block_size=4, backend="tpu")
    case.check()
    host = {"l": random_bytes([2, 16, 8, 2, 16], dtype, 6)}
    kvhost.copy_blocks(host, caches, [1, 2], [9, 10], axes="KBNHC", backend="tpu")
    assert torch.equal(device_bytes(caches["l"])[:, 9:11], host_bytes(host["l"])[:, 1:3])


@pytest.mark.parametrize("dtype", [torch.complex64, torch.bool], ids=str)
def test_a_cache_of_no_xla_bitcast_is_refused_before_any_byte_moves(device, dtype):
    """complex (a pair of floats to XLA) and bool (a bit, XLA's pred, to its bitcast: a bool
    block copied as bytes changed shape, and crashed the process) are refused as such."""
    caches = {"l": make_cache("KBNHC", "KBNHC", dict(K=2, B=8, N=8, H=2, C=8), dtype, device)}
    before = caches["l"].cpu().clone()  # XLA has no bitcast of these: their values, compared as such
    refused = rf"layer 'l'\[0\]: {dtype} has no XLA bitcast to integers"
    host = torch.zeros(2, 2, 8, 2, 8, dtype=dtype)
    with pytest.raises(kvhost.LayoutError, match=refused):
        kvhost.receive(caches, {"r": [1]}, axes="KBNHC", remote_order="HNC", remote_block_size=4, backend="tpu")
    with pytest.raises(kvhost.LayoutError, match=refused):
        kvhost.copy_blocks({"l": host}, caches, [0], [3], axes="KBNHC", backend="tpu")
    with pytest.raises(kvhost.LayoutError, match=refused):  # read from the device: its bits are asked for too
        kvhost.copy_blocks(caches, {"l": host}, [3], [0], axes="KBNHC", backend="tpu")
    with pytest.raises(kvhost.LayoutError, match=refused):  # the identity with a prompt cut short: zeroing alone
        kvhost.receive(
            caches,
            {"r": kvhost.Incoming([1, 2], tokens=9)},
            axes="KBNHC",
            remote_order="NHC",
            remote_block_size=8,
            backend="tpu",
        )
    with pytest.raises(kvhost.LayoutError, match=rf"an XLA tensor: {dtype} has no XLA bitcast"):
        kvhost.get_backend(caches["l"].device).raw(caches["l"])  # its bytes, as the oracle asks for them
    assert torch.equal(caches["l"].cpu(), before)


def test_a_size_1_block_region_letter_named_before_b_is_refused_on_xla(device):
    """An XLA tensor's memory is its shape order: tokens of size 1 named before B (which a
    strided tensor may have) are refused there, naming them, before any byte moves."""
    caches = {"l": make_cache("NBHC", "NBHC", dict(N=1, B=6, H=2, C=8), torch.bfloat16, device)}
    before = caches["l"].cpu().view(torch.int16).clone()
    refused = r"XLA tensor with axes 'NBHC': N \(of size 1\) is named before B"
    with pytest.raises(kvhost.LayoutError, match=refused):
        kvhost.receive(caches, {"r": [1, 2]}, axes="NBHC", remote_order="CHN", remote_block_size=1, backend="tpu")
    with pytest.raises(kvhost.LayoutError, match=refused):
        kvhost.copy_blocks(
            {"l": torch.zeros(1, 6, 2, 8, dtype=torch.bfloat16)}, caches, [0], [3], axes="NBHC", backend="tpu"
        )
    assert torch.equal(caches["l"].cpu().view(torch.int16), before)


@pytest.mark.parametrize("dst_ids", [[0], [63], [17, 63, 0]])
def test_padded_copies_write_only_their_destinations(device, dst_ids):
    cache = kv_cache(64, torch.float16, 1, device)
    before = device_bytes(cache)
    host = random_bytes([2, 4, 8, 2, 16], torch.float16, 2)
    src_ids = [3, 1, 2][: len(dst_ids)]
    kvhost.copy_blocks({"l": host}, {"l": cache}, src_ids, dst_ids, axes="KBNHC", backend="tpu")
    after = device_bytes(cache)
    want = before.clone()
    want[:, dst_ids] = host_bytes(host)[:, src_ids]
    assert torch.equal(after, want)


# --- in place ----------------------------------------------------------------------------


IN_PLACE_SCRIPT = textwrap.dedent(
    """
    import torch, torch_xla, kvhost
    from kvhost_tpu import xla
    d = torch_xla.device()
    cache = torch.zeros(2, 4096, 8, 2, 16, dtype=torch.{dtype}).to(d)
    xla.sync()
    address = xla.buffer_address(cache)
    kvhost.receive({{"l": cache}}, {{"r": [5, 9, 4000]}}, axes="KBNHC", remote_order="HNC", remote_block_size=4)
    kvhost.copy_blocks({{"l": torch.ones(2, 3, 8, 2, 16, dtype=torch.{dtype})}}, {{"l": cache}}, [0, 1, 2], [7, 8, 9],
                       axes="KBNHC")
    print("in place" if xla.buffer_address(cache) == address else "moved")
    """
)


def run_in_place_script(dtype: str, **env: str) -> str:
    script = IN_PLACE_SCRIPT.format(dtype=dtype)
    result = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=240, env={**os.environ, **env}
    )
    assert result.returncode == 0, result.stderr[-2000:]
    return result.stdout.strip().splitlines()[-1]


@pytest.mark.parametrize("dtype", KV_DTYPES, ids=str)
def test_updates_keep_the_cache_buffer(device, dtype):
    """After receive and copy-in, the cache lives in the same device buffer: donated, updated in place."""
    cache = kv_cache(512, dtype, 3, device)
    xla.sync()
    address = xla.buffer_address(cache)
    host = kvhost.KVHost({"l": cache}, axes="KBNHC", backend="tpu")
    host.receive({"r": [5, 9, 500]}, remote_order="HNC", remote_block_size=4)
    assert xla.buffer_address(cache) == address
    host.copy_from({"l": random_bytes([2, 3, 8, 2, 16], dtype, 4)}, [0, 1, 2], [7, 8, 9])
    assert xla.buffer_address(cache) == address


def test_the_buffer_check_sees_a_whole_cache_copy():
    """With torch_xla's buffer donation switched off, the same calls move the cache: the check can fail."""
    assert run_in_place_script("float16") == "in place"
    assert run_in_place_script("float16", XLA_ENABLE_PARAM_ALIASING="0") == "moved"


@pytest.mark.skipif(not ON_CPU, reason="figures for XLA:CPU")
def test_cost_is_o_n_not_o_cache(device):
    """16x the cache, same n: time stays flat, while one whole-cache pass grows ~16x."""
    rows = measure_scaling((256, 4096), (64,), dtype=torch.float16, block_tokens=16, heads=4, repeats=9)
    for operation in ("receive", "load", "save"):
        assert growth(rows, operation, 64) < 4.0, [r for r in rows if r.operation == operation]
        largest = max((r for r in rows if r.operation == operation), key=lambda r: r.cache_blocks)
        assert largest.seconds < largest.cache_clone_seconds / 3, largest


@pytest.mark.skipif(not ON_CPU, reason="XLA:CPU upcasts bf16 scatters; a TPU does not")
def test_scaling_check_sees_a_whole_cache_pass():
    """bf16 on XLA:CPU is written through a bitcast of the whole cache (exact, O(cache)): the check sees it."""
    rows = measure_scaling((256, 4096), (64,), dtype=torch.bfloat16, operations=("receive",), repeats=5)
    assert growth(rows, "receive", 64) > 4.0, rows


def test_write_types():
    device = torch_xla.device()
    assert write_dtype(torch.zeros(2, dtype=torch.float32).to(device)) == torch.float32
    assert write_dtype(torch.zeros(2, dtype=torch.int8).to(device)) == torch.int8
    if ON_CPU:
        assert write_dtype(torch.zeros(2, dtype=torch.float16).to(device)) == torch.float16
        assert write_dtype(torch.zeros(2, dtype=torch.bfloat16).to(device)) == torch.int16
        assert write_dtype(torch.zeros(2, dtype=torch.float8_e5m2).to(device)) == torch.uint8


# --- bytes -------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", KV_DTYPES, ids=str)
@pytest.mark.parametrize(("remote_size", "ids"), [(2, [6, 1]), (16, [4, 5, 0, 1])])
def test_receive_is_byte_exact_for_every_kv_dtype(device, dtype, remote_size, ids):
    """Random bytes (NaN payloads included) read back exactly, through a bitcast on the device."""
    sizes = [2, 10, 8, 2, 16]  # KBNHC, local block 8
    host = random_bytes(sizes, dtype, 7)
    cache = host.to(device)
    # What the sender's HND blocks of remote_size tokens leave in the request's regions:
    truth = host_bytes(host)[:, ids].reshape(2, -1, 2, 16)  # [K, tokens, H, C]
    senders = truth.reshape(2, -1, remote_size, 2, 16).permute(0, 1, 3, 2, 4)  # [K, sender block, H, n, C]
    wire = senders.reshape(2, len(ids), 8, 2, 16)
    staged = host_bytes(host).clone()
    staged[:, ids] = wire
    cache = staged.view(dtype).to(device)
    kvhost.receive({"l": cache}, {"r": ids}, axes="KBNHC", remote_order="HNC", remote_block_size=remote_size)
    assert torch.equal(device_bytes(cache), host_bytes(host))  # the request is the truth; the rest untouched


@pytest.mark.parametrize("dtype", KV_DTYPES, ids=str)
def test_host_xla_copies_both_ways_across_layouts(device, dtype):
    """Host HND (KBHNC memory) -> XLA KBNHC, XLA -> host BKNHC with heads first (BKHNC memory)."""
    xla_cache = kv_cache(12, dtype, 11, device)
    hnd = make_cache("KBNHC", "KBHNC", dict(K=2, B=6, N=8, H=2, C=16), dtype, "cpu")
    host_bytes(hnd).copy_(host_bytes(random_bytes([2, 6, 8, 2, 16], dtype, 12)))
    before = device_bytes(xla_cache)
    kvhost.copy_blocks({"l": hnd}, {"l": xla_cache}, [5, 0, 3], [11, 2, 3], axes="KBNHC", backend="tpu").wait()
    want = before.clone()
    want[:, [11, 2, 3]] = host_bytes(hnd)[:, [5, 0, 3]]  # read through the host view's logical order
    assert torch.equal(device_bytes(xla_cache), want)

    out = make_cache("BKNHC", "BKHNC", dict(K=2, B=5, N=8, H=2, C=16), dtype, "cpu")
    host_bytes(out).zero_()
    result = kvhost.copy_blocks(
        {"l": xla_cache}, {"l": out}, [11, 7, 2], [4, 0, 1], axes="KBNHC", dst_axes="BKNHC", backend="tpu"
    )
    assert result.done() and result.backend == "tpu"
    got = host_bytes(out)
    for s, d in zip([11, 7, 2], [4, 0, 1]):
        assert torch.equal(got[d], want[:, s])
    assert torch.equal(got[[2, 3]], torch.zeros_like(got[[2, 3]]))  # blocks not written stay as they were


def test_xla_to_xla_copy_and_tuples(device):
    """Within the device, K and V as separate tensors on one side and a K axis on the other."""
    source = kv_cache(8, torch.bfloat16, 21, device)
    pair = (random_bytes([8, 8, 2, 16], torch.bfloat16, 22).to(device), torch.zeros(8, 8, 2, 16).bfloat16().to(device))
    kvhost.copy_blocks({"l": source}, {"l": pair}, [1, 6], [7, 0], axes="KBNHC", backend="tpu")
    for k in range(2):
        assert torch.equal(device_bytes(pair[k])[[7, 0]], device_bytes(source)[k, [1, 6]])


def test_views_of_one_xla_buffer_are_refused_before_a_byte_moves(device):
    """XLA gives no addresses and reports every view at storage offset 0: two layers over one
    buffer would be rearranged twice, so they are refused, and the cache keeps its bytes."""
    cache = kv_cache(8, torch.bfloat16, 23, device)
    before = device_bytes(cache)
    for layers in ({"a": cache, "b": cache.view(cache.shape)}, {"a": tuple(cache.unbind(0))}):
        with pytest.raises(kvhost.LayoutError, match="are views of one buffer"):
            kvhost.receive(layers, {"r": [1]}, axes="KBNHC", remote_order="HNC", remote_block_size=2)
    assert torch.equal(device_bytes(cache), before)


@pytest.mark.parametrize("inference", [False, True], ids=["", "inference mode"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float8_e5m2, torch.float16])
def test_an_xla_view_of_a_larger_buffer_is_not_written_and_keeps_every_byte(device, dtype, inference):
    """torch_xla writes a view back through its base in the base's element type: the whole
    buffer rewritten (NaN payloads of bf16 and fp8 changed, blocks not named too), and not
    in place. A receive into a slice, or a copy into K taken off a K dim, is refused before a
    byte moves, naming the layer; reading such a view (a copy from it) is taken. Alike under
    inference mode, as vLLM runs, where a view has no ``_base`` (it was taken there)."""
    with torch.inference_mode(inference):
        _check_a_view_of_a_larger_buffer(device, dtype)


def _check_a_view_of_a_larger_buffer(device, dtype):
    big = kv_cache(32, dtype, 24, device)
    before = device_bytes(big)
    refused = r"layer 'l'(\[0\])?: an XLA view of a larger buffer .* cannot be written in place"
    with pytest.raises(kvhost.LayoutError, match=refused):
        kvhost.receive({"l": big[:, 8:24]}, {"r": [5, 6]}, axes="KBNHC", remote_order="HNC", remote_block_size=4)
    pair = tuple(random_bytes([16, 8, 2, 16], dtype, 25 + k) for k in range(2))
    with pytest.raises(kvhost.LayoutError, match=refused):  # K and V apart on the host, a K dim on the device
        kvhost.copy_blocks({"l": pair}, {"l": big}, [1, 2], [5, 31], axes="KBNHC", backend="tpu")
    assert torch.equal(device_bytes(big), before)
    out = tuple(torch.zeros(16, 8, 2, 16, dtype=dtype) for _ in range(2))
    kvhost.copy_blocks({"l": big}, {"l": out}, [5, 31], [0, 15], axes="KBNHC", backend="tpu")
    for k in range(2):
        assert torch.equal(host_bytes(out[k])[[0, 15]], before[k, [5, 31]])


def test_a_cache_that_requires_grad_is_received_and_copied_into_as_one_that_does_not(device):
    """The other backends write such a cache's bytes (detached); on XLA an in-place op on it
    raised mid-job, after the layers before it were queued. Its bytes now end as a plain
    cache's do, and it keeps requiring grad."""
    plain = kv_cache(8, torch.float32, 26, device)
    grad = kv_cache(8, torch.float32, 26, device).requires_grad_(True)
    for caches in ({"a": plain}, {"a": grad}):
        kvhost.receive(caches, {"r": [3, 4]}, axes="KBNHC", remote_order="HNC", remote_block_size=4)
        source = {"a": random_bytes([2, 2, 8, 2, 16], torch.float32, 27)}
        kvhost.copy_blocks(source, caches, [0, 1], [6, 0], axes="KBNHC", backend="tpu")
    assert torch.equal(device_bytes(grad.detach()), device_bytes(plain)) and grad.requires_grad


def test_a_copy_refused_by_a_later_job_has_written_nothing(device):
    """Host layers of two layouts are two jobs; the second's refusal (complex64, which XLA
    has no bits for, beside float64 of its size) comes before the first writes: every job
    of a copy is checked first."""
    sizes = dict(K=2, B=8, N=8, H=2, C=4)
    dest = {
        "a": torch.zeros(2, 8, 8, 2, 4, dtype=torch.float64).to(device),
        "b": torch.zeros(2, 8, 8, 2, 4, dtype=torch.complex64).to(device),
    }
    source = {
        "a": torch.ones(2, 8, 8, 2, 4, dtype=torch.float64),  # token-major memory
        "b": make_cache("KBNHC", "KBHNC", sizes, torch.complex64).fill_(1),  # head-major: another job
    }
    with pytest.raises(kvhost.LayoutError, match=r"layer 'b'\[0\]: torch.complex64 has no XLA bitcast"):
        kvhost.copy_blocks(source, dest, [1], [3], axes="KBNHC", backend="tpu")
    assert not dest["a"].cpu().any()


TWO_DEVICES = """
import sys
import torch, torch_xla
import kvhost
from kvhost_tpu import xla
sys.path.insert(0, "tests")
from test_tpu import device_bytes, kv_cache

assert xla.compile_count() == 0, xla.compile_count()  # a fresh process: nothing compiled yet
for dtype in (torch.bfloat16, torch.float16, torch.float8_e5m2, torch.int8):
    source = kv_cache(8, dtype, 21, torch.device("xla:0"))
    dest = kv_cache(8, dtype, 22, torch.device("xla:1"))
    before, sent = device_bytes(dest), device_bytes(source)
    kvhost.copy_blocks({"l": source}, {"l": dest}, [1, 6], [7, 0], axes="KBNHC", backend="tpu")
    got = device_bytes(dest)
    assert torch.equal(device_bytes(source), sent), dtype  # the copy read the source, never wrote it
    assert torch.equal(got[:, [7, 0]], device_bytes(source)[:, [1, 6]]), dtype
    assert torch.equal(got[:, 1:7], before[:, 1:7]), dtype
assert xla.compile_count() > 0
# A receive into a cache on the second device runs before it returns (a sync of the default
# device's pending work ran none of it: its graph was left pending).
from test_tpu import executions
cache = kv_cache(8, torch.float32, 23, torch.device("xla:1"))
expected = cache.cpu()
kvhost.receive({"l": expected}, {"r": [3, 4]}, axes="KBNHC", remote_order="HNC", remote_block_size=4, backend="torch")
before = executions()
kvhost.receive({"l": cache}, {"r": [3, 4]}, axes="KBNHC", remote_order="HNC", remote_block_size=4, backend="tpu")
assert executions() - before == 1, executions() - before
assert torch.equal(device_bytes(cache), expected.view(torch.int32))  # bytes: NaN payloads too
print("ok")
"""


@pytest.mark.skipif(not ON_CPU, reason="two XLA devices made on the CPU (CPU_NUM_DEVICES)")
def test_copies_between_two_xla_devices():
    """A host with several chips: blocks move from one device's cache to another's, byte for
    byte, and a receive on the second device is done on return (a fresh process: the
    runtime's device count is fixed when it starts)."""
    env = {**os.environ, "PJRT_DEVICE": "CPU", "CPU_NUM_DEVICES": "2"}
    root = Path(__file__).parent.parent
    done = subprocess.run(
        [sys.executable, "-c", TWO_DEVICES], cwd=root, env=env, capture_output=True, text=True, timeout=240
    )
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-3000:]


def test_receive_on_an_xla_cache_through_the_public_api(device):
    sizes = dict(K=2, B=16, N=8, H=2, C=16)
    caches = {f"layer{i}": make_cache("KBNHC", "KBNHC", sizes, torch.bfloat16, device) for i in range(2)}
    case = ReceiveCase(caches, "KBNHC", seed=4)
    case.send("short", [3, 12], "HNC", 2)  # r = 4
    case.send("long", [8, 9], "HNC", 16)  # g = 2
    stats = kvhost.receive(
        caches,
        {"short": kvhost.Incoming([3, 12], "HNC", 2), "long": kvhost.Incoming([8, 9], "HNC", 16)},
        axes="KBNHC",
    )
    case.check()
    assert stats.backend == "tpu" and stats.groups == 2 and stats.blocks == 4
    assert isinstance(kvhost.get_backend(caches["layer0"]), TpuBackend)


def test_bucket_choice_matches_the_padded_graph(device):
    """A batch of 17 blocks runs the 32-bucket graph: no new compile after one batch of 30."""
    cache = kv_cache(64, torch.float32, 31, device)
    host = kvhost.KVHost({"l": cache}, axes="KBNHC", backend="tpu")
    host.receive({"r": list(range(30))}, remote_order="HNC", remote_block_size=4)
    before = xla.compile_count()
    host.receive({"r": list(range(40, 57))}, remote_order="HNC", remote_block_size=4)
    assert bucket_size(17) == bucket_size(30) == 32
    assert xla.compile_count() == before
