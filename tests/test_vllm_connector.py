"""kvhost's connector inside vLLM 0.33: vLLM's own connector and worker classes, on the CPU.

Runs in ci/vllm.sh's environment (``pytest -m vllm``); elsewhere it skips with the reason.
Only what vLLM's own connector tests mock is mocked: the NIXL wrapper (a fake agent whose
transfers finish at once). Either the bytes a transfer would move are written by
``kvhost.testing.nixl_read`` from the sender's real caches, as NIXL reads
them, or (``CopyingNixlWrapper``) the fake agent itself moves the bytes that vLLM's
descriptor lists, and the connector's, name: every engine lives in this process, so a
READ is a memmove of each remote descriptor into its local partner. vLLM's config comes
from a model config file the test writes (no weights, no hub); caches are cut from one
buffer by vLLM's own ``create_kv_cache_views``. Every check is against the sender's
tokens.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import importlib.util
import itertools
import json
import os
import re
import threading
import time
import uuid
from collections.abc import Iterator, Mapping
from typing import Any, ClassVar
from unittest.mock import patch

import numpy as np
import pytest
import torch

from kvhost.errors import LayoutError, RequestError
from kvhost.integrations.vllm import cross_layer_view
from kvhost.nixl import region_table
from kvhost.testing import fill_random, nixl_read, raw

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM not installed (ci/vllm.sh installs it)"),
]

LAYERS, HEADS, HEAD_DIM, BLOCK, BLOCKS = 2, 2, 8, 32, 24  # CPU_ATTN takes blocks of 32n
LAYOUTS = ("LBHNC", "LBNHC", "LHBNC", "BLHNC", "BLNHC", "BHLNC")
LAYER_NAMES = [f"model.layers.{i}.self_attn.attn" for i in range(LAYERS)]


class FakeNixlWrapper:
    """NIXL's agent as vLLM's own connector tests fake it: every transfer is done at once."""

    AGENT_METADATA = b"fake-agent"

    def __init__(self, name, *args, **kwargs):
        self.name = name

    def get_reg_descs(self, data, *args, **kwargs):
        return [str(uuid.uuid4()) for _ in data]

    def get_xfer_descs(self, data, *args, **kwargs):
        return [str(uuid.uuid4()) for _ in data]

    def get_agent_metadata(self):
        return self.AGENT_METADATA

    def add_remote_agent(self, metadata):
        return "remote-agent"

    def get_new_notifs(self):
        return {}

    def check_xfer_state(self, handle):
        return "DONE"

    def transfer(self, handle, *args, **kwargs):
        return "PROC"

    def prep_xfer_dlist(self, *args, **kwargs):
        return uuid.uuid4().int

    def make_prepped_xfer(self, *args, **kwargs):
        return uuid.uuid4().int

    def get_xfer_telemetry(self, *args, **kwargs):
        return None

    def __getattr__(self, name):  # register_memory, send_notif, release_*, ...: nothing to do
        return lambda *args, **kwargs: None


@pytest.fixture(scope="module")
def vllm_env(tmp_path_factory):
    """vLLM's distributed state for one CPU worker, and a model config file (no weights)."""
    os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
    from vllm.distributed.parallel_state import (
        destroy_distributed_environment,
        destroy_model_parallel,
        init_distributed_environment,
        initialize_model_parallel,
    )

    model = write_model(tmp_path_factory.mktemp("model"), HEADS)
    from vllm.config import set_current_vllm_config

    port = 29500 + os.getpid() % 1000
    with set_current_vllm_config(make_config(str(model), "LBHNC")):
        init_distributed_environment(1, 0, f"tcp://127.0.0.1:{port}", 0, "gloo")
        initialize_model_parallel(1, 1)
    yield str(model)
    destroy_model_parallel()
    destroy_distributed_environment()


def write_model(directory, heads: int) -> str:
    """A Llama config file with ``heads`` KV heads (no weights)."""
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": heads * 2 * HEAD_DIM,
        "num_attention_heads": heads * 2,
        "num_key_value_heads": heads,
        "head_dim": HEAD_DIM,
        "num_hidden_layers": LAYERS,
        "intermediate_size": 64,
        "vocab_size": 128,
        "max_position_embeddings": 512,
        "torch_dtype": "bfloat16",
    }
    (directory / "config.json").write_text(json.dumps(config))
    return str(directory)


def make_config(model: str, layout: str, block_size: int = BLOCK):
    from vllm.config import CacheConfig, KVTransferConfig, ModelConfig, VllmConfig

    transfer = KVTransferConfig(
        kv_connector="KvhostNixlConnector",
        kv_connector_module_path="kvhost.integrations.vllm_connector",
        kv_role="kv_both",
    )
    config = VllmConfig(
        model_config=ModelConfig(model=model, skip_tokenizer_init=True, dtype="bfloat16", max_model_len=512),
        cache_config=CacheConfig(block_size=block_size),
        kv_transfer_config=transfer,
    )
    config.cache_config.kv_cache_layout = layout  # what the engine core resolves before profiling
    return config


def allocate(layout: str, block_size: int = BLOCK, blocks: int = BLOCKS, dtype=torch.bfloat16, heads: int = HEADS):
    """(kv_cache_config, per-layer views) as vLLM's worker allocates them for ``layout``."""
    from vllm.v1.kv_cache_interface import (
        FullAttentionSpec,
        KVCacheConfig,
        KVCacheGroupSpec,
        KVCacheTensor,
        compute_layout_strides,
        create_kv_cache_views,
    )
    from vllm.v1.kv_cache_layout import KVCacheLayout

    spec = FullAttentionSpec(block_size=block_size, num_kv_heads=heads, head_size=HEAD_DIM, dtype=dtype)
    strides = compute_layout_strides(spec, blocks, LAYERS, KVCacheLayout[layout])  # bytes, [L, B, H, N, C]
    tensor = KVCacheTensor(
        size=spec.page_size_bytes * blocks * LAYERS,
        layers=list(LAYER_NAMES),
        layer_stride=strides[0],
        block_stride=strides[1],
    )
    config = KVCacheConfig(
        num_blocks=blocks,
        kv_cache_tensors=[tensor],
        kv_cache_groups=[KVCacheGroupSpec(list(LAYER_NAMES), spec)],
    )
    memory = torch.empty(tensor.size, dtype=torch.int8)
    views = create_kv_cache_views(memory, spec, blocks, KVCacheLayout[layout], tensor)
    return config, dict(zip(LAYER_NAMES, views))


WINDOW = 64  # a hybrid model's sliding window, in tokens


HYBRID_LAYERS = [f"model.layers.{i}.self_attn.attn" for i in range(4)]


def hybrid_specs(block_size: int = BLOCK, window: int = WINDOW, kinds: str = "fsfs"):
    """A layer of full attention for each ``f`` of ``kinds``, of a sliding window for each
    ``s``: by default layers 0 and 2 full, 1 and 3 sliding, a hybrid model of two groups."""
    from vllm.v1.kv_cache_interface import FullAttentionSpec, SlidingWindowSpec

    shape = {"block_size": block_size, "num_kv_heads": HEADS, "head_size": HEAD_DIM, "dtype": torch.bfloat16}
    full, sliding = FullAttentionSpec(**shape), SlidingWindowSpec(**shape, sliding_window=window)
    return {f"model.layers.{i}.self_attn.attn": sliding if kind == "s" else full for i, kind in enumerate(kinds)}


def allocate_hybrid(config, layout: str, block_size: int = BLOCK, blocks: int = BLOCKS, specs=None, kinds="fsfs"):
    """(kv_cache_config, per-layer views) of a hybrid model as vLLM plans and allocates them:
    one group per kind of layer, the groups laid over shared memory (the i-th layer of each
    group one tensor) and their blocks drawn from one pool of ``blocks``."""
    from vllm.config import set_current_vllm_config
    from vllm.v1.core.kv_cache_planning import get_kv_cache_config_from_groups, get_kv_cache_groups
    from vllm.v1.kv_cache_layout import KVCacheLayout
    from vllm.v1.worker.utils import allocate_kv_cache

    specs = hybrid_specs(block_size, kinds=kinds) if specs is None else specs
    with set_current_vllm_config(config):
        groups = get_kv_cache_groups(config, dict(specs))
        page = max(spec.page_size_bytes for spec in specs.values())
        tensors = max(len(group.layer_names) for group in groups)  # each a memory every group shares
        kv_cache_config = get_kv_cache_config_from_groups(config, groups, page * blocks * tensors)
        caches = allocate_kv_cache(kv_cache_config, torch.device("cpu"), KVCacheLayout[layout])
    assert kv_cache_config.num_blocks == blocks, kv_cache_config.num_blocks
    return kv_cache_config, caches


@contextlib.contextmanager
def vllm_worker_made(config: Any, wrapper: type = FakeNixlWrapper) -> Iterator[None]:
    """What a worker is built and registered under: vLLM's config current, NIXL's agent
    ``wrapper``, and this process's cores left alone."""
    from vllm.config import set_current_vllm_config
    from vllm.platforms import current_platform

    base = "vllm.distributed.kv_transfer.kv_connector.v1.nixl.base_worker"
    with (
        set_current_vllm_config(config),
        patch(f"{base}.NixlWrapper", wrapper),
        patch(f"{base}.check_nixl_version", lambda version: None),
        patch.object(current_platform, "discover_numa_topology", lambda: []),  # keep this process's cores
    ):
        yield


def make_connector(config: Any, kv_cache_config: Any, wrapper: type = FakeNixlWrapper) -> Any:
    """kvhost's connector as vLLM's connector factory builds it for a worker (not registered)."""
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    with vllm_worker_made(config, wrapper):
        return KVConnectorFactory.create_connector(config, KVConnectorRole.WORKER, kv_cache_config)


def make_worker(
    model: str,
    layout: str,
    *,
    host_buffer: bool = False,
    block_size: int = BLOCK,
    blocks: int = BLOCKS,
    wrapper: type = FakeNixlWrapper,
    heads: int = HEADS,
    hybrid: str | Mapping[str, Any] | None = None,
):
    """kvhost's connector, built by vLLM's connector factory, its worker registered (a model
    of ``heads`` KV heads: ``model`` must be written with as many); ``hybrid``: caches of
    full and sliding-window layers, their kinds or vLLM's specs by layer (``allocate_hybrid``)."""
    config = make_config(model, layout, block_size)
    if hybrid:
        specs = None if isinstance(hybrid, str) else hybrid
        kinds = hybrid if isinstance(hybrid, str) else "fsfs"
        kv_cache_config, caches = allocate_hybrid(config, layout, block_size, blocks, specs=specs, kinds=kinds)
    else:
        kv_cache_config, caches = allocate(layout, block_size, blocks, heads=heads)
    connector = make_connector(config, kv_cache_config, wrapper)
    worker = connector.connector_worker
    if host_buffer:  # what TPU, XPU and plugin platforms set up: NIXL sees host buffers only
        worker.use_host_buffer = True
        worker.kv_buffer_device = "cpu"
    with vllm_worker_made(config, wrapper):
        connector.register_kv_caches(caches)
    return connector, worker, caches


def test_the_factory_loads_kvhosts_connector_by_module_path(vllm_env):
    from kvhost.integrations.vllm_connector import KvhostNixlConnector, KvhostNixlWorker

    connector, worker, _ = make_worker(vllm_env, "LBHNC")
    assert type(connector) is KvhostNixlConnector and type(worker) is KvhostNixlWorker
    assert connector.connector_scheduler is None
    assert worker.kvhost is not None and worker.kvhost.axes == "BHNC"


def test_vllms_nixl_agent_starts_with_cuda_ipc_reads(vllm_env, monkeypatch):
    """vLLM's agent reads another process's VRAM; without cuda_ipc's get (UCX leaves it off on
    GPUs without NVLink) it would read over TCP loopback. An operator's setting stays."""
    key = "UCX_CUDA_IPC_ENABLE_GET_ZCOPY"
    seen = []

    class Recording(FakeNixlWrapper):
        def __init__(self, name, *args, **kwargs):
            seen.append(os.environ.get(key))
            super().__init__(name, *args, **kwargs)

    monkeypatch.setattr("kvhost.nixl.ucx._cuda_driver_loads", lambda: True)
    monkeypatch.delenv(key, raising=False)
    make_worker(vllm_env, "LBHNC", wrapper=Recording)
    monkeypatch.setenv(key, "off")
    make_worker(vllm_env, "LBHNC", wrapper=Recording)
    assert seen == ["on", "off"]


def test_the_scheduler_side_is_vllms_own(vllm_env):
    """In the scheduler process the connector is vLLM's pull scheduler, with no worker."""
    from vllm.config import set_current_vllm_config
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl import NixlPullConnectorScheduler

    from kvhost.integrations.vllm_connector import KvhostNixlConnector

    config = make_config(vllm_env, "LBHNC")
    kv_cache_config, _ = allocate("LBHNC")
    with set_current_vllm_config(config):
        connector = KVConnectorFactory.create_connector(config, KVConnectorRole.SCHEDULER, kv_cache_config)
    assert type(connector) is KvhostNixlConnector
    assert type(connector.connector_scheduler) is NixlPullConnectorScheduler and connector.connector_worker is None


@pytest.mark.parametrize("hybrid", [None, "fsfs"], ids=["one-group", "hybrid"])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_cache_registration_for_every_layout(vllm_env, layout, hybrid):
    """vLLM registers its regions with NIXL; kvhost describes the same views, as their group
    where vLLM registers rows of every layer (BLNHC, BHLNC): kvhost's block regions are
    vLLM's NIXL regions, one for one, at the same addresses and of the same length. A
    hybrid model's groups share memory: each memory is one region to both."""
    _, worker, caches = make_worker(vllm_env, layout, hybrid=hybrid)
    kv = worker.kvhost
    assert kv.axes == ("LBHNC" if layout in ("BLNHC", "BHLNC") else "BHNC")
    assert worker.num_regions >= 1 and worker.xfer_handshake_metadata is not None
    table = region_table(kv.caches)
    assert worker.block_len_per_layer == [table.region_bytes] * len(table.streams)
    assert [s.address for s in table.streams] == worker.kv_caches_base_addr[worker.engine_id][worker.tp_rank]
    assert kv.num_blocks == BLOCKS
    described = {m.tensor.data_ptr() for m in kv.caches.members}
    assert described <= {t.data_ptr() for t in caches.values()}  # the very views vLLM registered


def test_whether_vllm_registers_rows_is_read_from_the_views(vllm_env):
    """Rows of every layer where the buffer is block-major and a layer's block is not its
    [H, N, C] in order; a region per layer everywhere else, and for what is no layer view."""
    from kvhost.integrations.vllm_connector import _registered_as_rows

    assert {layout: _registered_as_rows(allocate(layout)[1]) for layout in LAYOUTS} == {
        layout: layout in ("BLNHC", "BHLNC") for layout in LAYOUTS
    }
    assert _registered_as_rows(allocate("BLNHC", blocks=1)[1]) is True  # a cache of one block: one row
    views = allocate("BLNHC")[1]
    one = next(iter(views.values()))
    assert _registered_as_rows({"only": one}) is False  # one layer of rows of three: not a row alone
    assert _registered_as_rows({}) is False
    assert _registered_as_rows({"a": (one, one)}) is False  # separate K and V: no row
    assert _registered_as_rows({"a": one[0]}) is False  # not a layer view
    assert _registered_as_rows({"a": one[:0]}) is False  # no blocks
    assert _registered_as_rows({"a": torch.empty(0, *one.shape[1:], dtype=one.dtype)}) is False  # nor memory
    assert _registered_as_rows({"a": one.contiguous()}) is False  # a block's [H, N, C] in order
    # Every layer's view again, in a buffer one block row longer (vLLM then cuts segments),
    # or an element short of that (a rounded tail: still rows).
    for extra, rows in ((one.stride(0) * one.element_size(), False), (one.stride(0) * one.element_size() - 2, True)):
        longer = torch.empty(one.untyped_storage().nbytes() + extra, dtype=torch.int8)
        moved = {
            n: longer.view(one.dtype).as_strided(v.shape, v.stride(), v.storage_offset()) for n, v in views.items()
        }
        assert _registered_as_rows(moved) is rows
    # Layers padded apart within a row (vLLM's page_size_padded): vLLM registers the padded
    # rows, which are no block region kvhost can describe; a layer each it is, as before.
    blocks, heads, tokens, channels = one.shape
    page, layers = heads * tokens * channels, len(views)
    memory = torch.zeros(blocks * layers * (page + 64), dtype=one.dtype)
    strides = (layers * (page + 64), channels, heads * channels, 1)
    apart = {f"l{i}": memory.as_strided(one.shape, strides, i * (page + 64)) for i in range(layers)}
    assert _registered_as_rows(apart) is False
    dense = torch.zeros(blocks * layers * page, dtype=one.dtype)  # the same views unpadded: rows kvhost describes
    assert _registered_as_rows(
        {f"l{i}": dense.as_strided(one.shape, (layers * page, *strides[1:]), i * page) for i in range(layers)}
    )

    class NoStorage(torch.Tensor):  # as a functional or fake tensor: no storage to ask
        def untyped_storage(self):
            raise RuntimeError("no storage")

    assert _registered_as_rows({"a": one.as_subclass(NoStorage)}) is False


def test_a_sender_to_rearrange_is_refused_where_kvhost_did_not_describe_vllms_regions(vllm_env, copying, monkeypatch):
    """Had kvhost guessed wrong how vLLM registers a BLNHC cache (a region per layer where
    vLLM registers rows), a sender whose bytes need rearranging is refused at its
    handshake, naming both; one of our layout and block size lands right and is taken."""
    monkeypatch.setattr("kvhost.integrations.vllm_connector._registered_as_rows", lambda caches: False)
    _, worker, _ = make_worker(vllm_env, "BLNHC", block_size=64, blocks=64, wrapper=copying)
    assert worker.kvhost.axes == "BHNC"
    _, payloads = sender_workers(vllm_env, {"half": ("BLNHC", 32), "same": ("BLNHC", 64)})
    with pytest.raises(LayoutError, match=r"engine 'half': its BLNHC blocks of 32 tokens need rearranging, but our "):
        worker.add_remote_agent(payloads["half"], 0, 1)
    assert not worker.remote_engines
    worker.add_remote_agent(payloads["same"], 0, 1)
    assert set(worker.remote_engines) == {"same"}


@pytest.mark.parametrize("host_buffer", [False, True])
def test_registration_asks_for_huge_pages_under_the_caches_and_the_host_buffers(vllm_env, monkeypatch, host_buffer):
    """Registering asks for huge pages under every tensor kvhost describes, then (host-buffer
    mode) under every host buffer, and keeps what each ask did, added up."""
    from kvhost.integrations import vllm_connector
    from kvhost.nixl.hugepages import HugePages

    asked: list[list[torch.Tensor]] = []

    def record(tensors):
        asked.append(list(tensors))
        return HugePages(len(asked[-1]) << 21, len(asked) << 21, f"ask {len(asked)}")

    monkeypatch.setattr(vllm_connector, "back_host_tensors_with_huge_pages", record)
    _, worker, _ = make_worker(vllm_env, "LBNHC", host_buffer=host_buffer)

    def views(tensors):
        return [(t.data_ptr(), tuple(t.shape), t.stride()) for t in tensors]

    assert views(asked[0]) == views(m.tensor for m in worker.kvhost.caches.members)
    if not host_buffer:
        assert len(asked) == 1 and worker.kvhost_huge_pages == HugePages(len(asked[0]) << 21, 1 << 21, "ask 1")
        return
    buffers = [
        t for layer in worker.host_xfer_buffers.values() for t in (layer if isinstance(layer, tuple) else (layer,))
    ]
    assert len(asked) == 2 and views(asked[1]) == views(buffers)
    expected = HugePages((len(asked[0]) + len(asked[1])) << 21, 3 << 21, "ask 1; ask 2")
    assert worker.kvhost_huge_pages == expected


# --- a step: several senders, partial blocks, a failed request ---------------------------


def sender_caches(layout: str, block_size: int, seed: int):
    """A prefill engine's caches in its own layout and block size, filled with its tokens."""
    _, caches = allocate(layout, block_size, blocks=BLOCKS * BLOCK // block_size)
    for i, view in enumerate(caches.values()):
        fill_random(view, seed * 10 + i)
    return caches


def handshake_payload(sender_worker, engine: str):
    """The sender's own handshake metadata, as the decode side receives it."""
    import msgspec
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl import NixlAgentMetadata

    payload = sender_worker.xfer_handshake_metadata
    meta = msgspec.msgpack.Decoder(NixlAgentMetadata).decode(payload.agent_metadata_bytes)
    meta.engine_id = engine
    return meta


def tokens_of(caches, ids, block_size):
    """Raw [layer, tokens, H, C] of ``ids`` read through vLLM's [B, H, N, C] layer views."""
    out = []
    for view in caches.values():
        blocks = raw(view)[list(ids)]  # [blocks, H, N, C]
        out.append(blocks.permute(0, 2, 1, 3).reshape(len(ids) * block_size, HEADS, -1))
    return torch.stack(out)


def run_step(connector, worker, requests):
    """One step as the model runner drives it: bind metadata, start loads, poll until every
    request finished or failed; returns (finished, failed, each step's post-process stats)."""
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl import NixlConnectorMetadata

    metadata = NixlConnectorMetadata()
    for req_id, (local_ids, remote_ids, engine) in requests.items():
        metadata.add_new_req_to_recv(
            req_id,
            (list(local_ids),),
            {
                "remote_block_ids": (list(remote_ids),),
                "remote_engine_id": engine,
                "remote_request_id": req_id,
                "remote_host": "localhost",
                "remote_port": 1,
                "remote_tp_size": 1,
            },
        )
    finished, failed, processed = set(), set(), []
    for step in range(200):
        connector.bind_connector_metadata(metadata if step == 0 else NixlConnectorMetadata())
        connector.start_load_kv(None)
        results = worker.get_transfer_results()
        finished |= set(results.finished_recving)
        failed |= set(results.failed_recving)
        if worker.last_post_process is not None:
            processed.append(worker.last_post_process)
        connector.clear_connector_metadata()
        if finished >= set(requests):
            return finished, failed, processed
        time.sleep(0.02)
    raise AssertionError(f"requests {set(requests) - finished} never finished")


DECODE_BLOCK = 64  # decode blocks of 64; senders of 32 (r = 2) and 64, as CPU_ATTN allows


def filled_senders(model, senders):
    """Sender workers of ``senders`` (engine -> layout, block size), their caches filled with
    values of their own: each engine's caches and handshake payload."""
    caches, payloads = {}, {}
    for seed, (engine, (layout, size)) in enumerate(senders.items()):
        _, sender_worker, sender = make_worker(model, layout, block_size=size)
        for i, view in enumerate(sender.values()):
            fill_random(view, seed * 10 + i + 1)
        caches[engine] = sender
        payloads[engine] = handshake_payload(sender_worker, engine)
    return caches, payloads


@pytest.mark.parametrize("local", ["LBNHC"])  # a packed (BHLNC) decoder: vLLM's handshake refuses other senders
def test_a_step_of_several_senders_partial_blocks_and_a_failed_request(vllm_env, local):
    """Three engines of different layouts and block sizes in one step, two partial prompts,
    and one engine whose handshake fails: its request skips the post-process."""
    connector, worker, caches = make_worker(vllm_env, local, block_size=DECODE_BLOCK)
    senders = {"hnd-32": ("LBHNC", 32), "nhd-32": ("LBNHC", 32), "same-64": (local, DECODE_BLOCK)}
    sender_caches_by_engine, payloads = filled_senders(vllm_env, senders)

    def fake_handshake(host, port, remote_tp_size, expected_engine_id, *args, **kwargs):
        if expected_engine_id == "down":
            raise RuntimeError("handshake refused")  # NIXL could not reach it
        name = worker.add_remote_agent(payloads[expected_engine_id], 0, remote_tp_size)
        return {(0, 0): name}, 0.0

    worker._nixl_handshake = fake_handshake
    for i, view in enumerate(caches.values()):
        fill_random(view, 100 + i)  # stale bytes everywhere
    before = {name: raw(view).clone() for name, view in caches.items()}
    # req: (local ids, sender ids, engine, tokens the prompt has)
    plan = {
        "a": ([3, 9], [0, 5, 2, 7], "hnd-32", 4 * 32),
        "b": ([4, 11], [6, 1, 3], "hnd-32", 2 * 32 + 5),  # 3 sender blocks: the last local block half full
        "c": ([20, 2], [8, 4, 9], "nhd-32", 3 * 32),
        "d": ([15], [2], "same-64", 40),
        "e": ([17, 18], [1, 2], "down", 128),
    }
    requests = {}
    for req, (local_ids, remote_ids, engine, _) in plan.items():
        requests[req] = (local_ids, remote_ids, engine)
        if engine != "down":
            size = senders[engine][1]
            read_ids = list(remote_ids)
            while len(read_ids) * size < len(local_ids) * DECODE_BLOCK:  # bytes past the prompt: zeroed
                read_ids.append(read_ids[-1])
            group = {"g": cross_layer_view(caches)}
            nixl_read(
                {"g": cross_layer_view(sender_caches_by_engine[engine])}, "LBHNC", read_ids, group, "LBHNC", local_ids
            )
    finished, failed, processed = run_step(connector, worker, requests)
    assert failed == {"e"} and finished == set(plan)
    assert sum(stats.requests for stats in processed) == 4  # one kvhost call per step, never "e"
    for req, (local_ids, remote_ids, engine, _) in plan.items():
        got = tokens_of(caches, local_ids, DECODE_BLOCK)
        if engine == "down":
            assert torch.equal(got, tokens_of(before, local_ids, DECODE_BLOCK)), "a failed request was touched"
            continue
        size = senders[engine][1]
        want = tokens_of(sender_caches_by_engine[engine], remote_ids, size)
        arrived = len(remote_ids) * size
        assert torch.equal(got[:, :arrived], want), req
        assert not got[:, arrived:].any(), req  # the rest of the request's blocks: zero, as vLLM leaves them


@pytest.mark.parametrize("good", [("a", "b"), ("a",)])
def test_a_request_kvhost_refuses_fails_alone_and_the_step_s_others_are_post_processed(vllm_env, good):
    """A refusal comes before any byte moves, so the step's requests are tried one by one:
    an engine whose block size kvhost cannot take fails its own request, two requests that
    name one block both fail untried (alone, each would rearrange it), the others land."""
    connector, worker, caches = make_worker(vllm_env, "LBNHC", block_size=DECODE_BLOCK)
    senders = {"hnd-32": ("LBHNC", 32), "broken": ("LBHNC", 32)}
    sender_caches_by_engine, payloads = filled_senders(vllm_env, senders)

    def fake_handshake(host, port, remote_tp_size, expected_engine_id, *args, **kwargs):
        name = worker.add_remote_agent(payloads[expected_engine_id], 0, remote_tp_size)
        if expected_engine_id == "broken":  # as if it had said 48 tokens a block: 48 does not divide 64
            worker.remote_engines["broken"] = dataclasses.replace(worker.remote_engines["broken"], block_size=48)
        return {(0, 0): name}, 0.0

    worker._nixl_handshake = fake_handshake
    plan = {
        "a": ([3, 9], [0, 5, 2, 7], "hnd-32"),
        "b": ([4], [6, 1], "hnd-32"),
        "c": ([20], [8, 4], "broken"),
        "d1": ([14], [3, 9], "hnd-32"),
        "d2": ([15, 14], [10, 11, 12, 13], "hnd-32"),
    }
    plan = {req: request for req, request in plan.items() if req in good or req not in ("a", "b")}
    for local_ids, remote_ids, engine in plan.values():
        group = {"g": cross_layer_view(caches)}
        nixl_read(
            {"g": cross_layer_view(sender_caches_by_engine[engine])}, "LBHNC", remote_ids, group, "LBHNC", local_ids
        )
    with patch.object(worker, "_log_failure", wraps=worker._log_failure) as logged:
        finished, failed, processed = run_step(connector, worker, plan)
    assert finished == set(plan) and failed == {"c", "d1", "d2"}
    assert sorted(c.kwargs["req_id"] for c in logged.call_args_list) == ["c", "d1", "d2"]
    [stats] = processed  # the step's calls, added up
    assert (stats.requests, stats.blocks, stats.backend) == (len(good), 3 if "b" in good else 2, "cpu")
    for req in good:
        local_ids, remote_ids, engine = plan[req]
        got = tokens_of(caches, local_ids, DECODE_BLOCK)
        assert torch.equal(got, tokens_of(sender_caches_by_engine[engine], remote_ids, 32)), req
    assert worker.get_block_ids_with_load_errors() == {20, 14, 15}


def test_a_post_process_that_fails_once_bytes_may_have_moved_fails_every_request_untried(vllm_env, copying):
    """Only a refusal (a KVHostError) promises nothing moved: after any other error no request
    is tried again (a block rearranged twice is garbage), and every one of the call fails."""
    senders = {"s": ("LBHNC", 32)}
    _, payloads = sender_workers(vllm_env, senders)
    connector, worker, _ = make_worker(vllm_env, "LBNHC", block_size=64, blocks=64, wrapper=copying)
    fake_handshakes(worker, payloads)
    calls = []

    def broken(*args, **kwargs):
        calls.append(args)
        raise RuntimeError("the device failed half-way")

    worker.kvhost.post_process = broken
    requests = {"a": ([30, 9], [0, 5, 2, 7], "s"), "b": ([40], [6, 1], "s")}
    steps = drive(connector, worker, requests)
    failed = set().union(*(f for _, f, _ in steps))
    assert failed == {"a", "b"} and len(calls) == 1 and worker.last_post_process is None


# --- the bytes moved by the descriptor plans themselves ------------------------------------


class CopyingNixlWrapper(FakeNixlWrapper):
    """The fake agent, but a READ moves the bytes its descriptors name.

    vLLM prepares descriptor lists in NIXL's strided form (address, length, device, stride,
    count per row) and pairs them by index, request by request; this fake expands them,
    checks that paired descriptors have one length and lie in memory an agent registered,
    and copies each remote descriptor into its local partner when the transfer is posted.
    What lands in the decode caches is then what the descriptor plans say, vLLM's and the
    connector's, not what the test writes. Transfers from an agent in ``failing`` move
    nothing and end in ERR, as over a broken link.
    """

    # Shared by every agent of the process (the decode side's and the senders').
    registered: ClassVar[list[tuple[int, int]]] = []  # (start, length) of every span registered
    lists: ClassVar[dict[int, tuple[str, np.ndarray, np.ndarray]]] = {}  # handle -> (agent, starts, lengths)
    posted: ClassVar[dict[int, tuple[str, np.ndarray, np.ndarray, np.ndarray]]] = {}  # handle -> (agent, to, from, n)
    failing: ClassVar[set[str]] = set()

    def get_agent_metadata(self):
        return self.name.encode()

    def add_remote_agent(self, metadata):
        return bytes(metadata).decode()

    def get_reg_descs(self, data, *args, **kwargs):
        return [(int(start), int(length)) for start, length, *_ in data]

    def register_memory(self, descs, *args, **kwargs):
        self.registered.extend(descs)

    def prep_xfer_dlist(self, agent, descs, *args, **kwargs):
        rows = np.asarray(descs, dtype=np.uint64).reshape(-1, 5)
        starts = [np.uint64(a) + np.arange(int(n), dtype=np.uint64) * np.uint64(s) for a, _, _, s, n in rows]
        lengths = [np.full(int(n), length, dtype=np.uint64) for _, length, _, _, n in rows]
        handle = uuid.uuid4().int
        self.lists[handle] = (agent, np.concatenate(starts), np.concatenate(lengths))
        return handle

    def make_prepped_xfer(self, op, local, local_ids, remote, remote_ids, *args, **kwargs):
        assert op == "READ", op
        local_ids, remote_ids = np.asarray(local_ids, dtype=np.int64), np.asarray(remote_ids, dtype=np.int64)
        assert local_ids.shape == remote_ids.shape, (local_ids.shape, remote_ids.shape)
        _, to, lengths = self.lists[local]
        agent, source, remote_lengths = self.lists[remote]
        assert np.array_equal(lengths[local_ids], remote_lengths[remote_ids]), "paired descriptors differ in length"
        handle = uuid.uuid4().int
        self.posted[handle] = (agent, to[local_ids], source[remote_ids], lengths[local_ids])
        return handle

    def transfer(self, handle, *args, **kwargs):
        agent, to, source, lengths = self.posted[handle]
        if agent not in self.failing:
            for dst, src, n in zip(to.tolist(), source.tolist(), lengths.tolist()):
                assert self.inside(dst, n) and self.inside(src, n), f"descriptor {src:#x}+{n} -> {dst:#x} unregistered"
                ctypes.memmove(dst, src, n)
        return "PROC"

    def check_xfer_state(self, handle):
        return "ERR" if self.posted[handle][0] in self.failing else "DONE"

    @classmethod
    def inside(cls, start: int, length: int) -> bool:
        return any(s <= start and start + length <= s + n for s, n in cls.registered)


@pytest.fixture
def copying():
    CopyingNixlWrapper.failing.clear()
    yield CopyingNixlWrapper
    CopyingNixlWrapper.failing.clear()
    CopyingNixlWrapper.lists.clear()
    CopyingNixlWrapper.posted.clear()


@pytest.fixture
def copying_worker(vllm_env, copying):
    """(connector, worker, caches): an LBNHC worker with blocks of 64 tokens, 64 blocks,
    whose NIXL wrapper copies what it is asked to read."""
    return make_worker(vllm_env, "LBNHC", block_size=64, blocks=64, wrapper=copying)


def spy(worker, names=("post_process", "load_from_host", "save_to_host")):
    """Every kvhost call the worker makes, in order: (name, args)."""
    calls = []
    for name in names:
        original = getattr(worker.kvhost, name)

        def record(*args, _name=name, _original=original, **kwargs):
            calls.append((_name, args))
            return _original(*args, **kwargs)

        setattr(worker.kvhost, name, record)
    return calls


def forbid_vllm_copies(*args, **kwargs):
    raise AssertionError("vLLM's per-request host copy ran; kvhost's one call per step should have")


def host_buffer_decoder(vllm_env, copying, payloads, layout="LBNHC"):
    """A decode worker in host-buffer mode that has met ``payloads``' senders: vLLM's own
    per-request copies forbidden, its caches random; with their bytes as they were."""
    connector, worker, caches = make_worker(
        vllm_env, layout, block_size=64, blocks=64, host_buffer=True, wrapper=copying
    )
    worker.copy_blocks = forbid_vllm_copies
    fake_handshakes(worker, payloads)
    for i, view in enumerate(caches.values()):
        fill_random(view, 100 + i)
    return connector, worker, caches, {name: raw(view).clone() for name, view in caches.items()}


def engine_port(engine: str) -> int:
    """A port of the engine's own: vLLM takes a new engine at a known address for a restart
    of the one before, and drops that one once its requests are done."""
    import zlib

    return 1 + zlib.crc32(engine.encode()) % 60000


def drive(connector, worker, requests, computed=None):
    """Steps as the model runner drives them: bind metadata, start loads, poll, until every
    request finished or failed. ``requests``: req -> (local ids, remote ids, engine);
    ``computed``: req -> blocks its prefix-cache hit holds. Returns per step (finished,
    failed, the kvhost calls made in it)."""
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl import NixlConnectorMetadata

    metadata = NixlConnectorMetadata()
    for req_id, (local_ids, remote_ids, engine) in requests.items():
        # A tuple of lists is a hybrid model's ids, a list per group; else one group's ids.
        local_groups = local_ids if isinstance(local_ids, tuple) else (list(local_ids),)
        params = {
            "remote_block_ids": remote_ids if isinstance(remote_ids, tuple) else (list(remote_ids),),
            "remote_engine_id": engine,
            "remote_request_id": req_id,
            "remote_host": "localhost",
            "remote_port": engine_port(engine),
            "remote_tp_size": 1,
        }
        hit = (computed or {}).get(req_id, 0)
        metadata.add_new_req_to_recv(
            req_id, local_groups, params, local_num_computed_blocks=tuple(hit for _ in local_groups)
        )
    calls = spy(worker)
    steps, done = [], set()
    for step in range(200):
        made = len(calls)
        connector.bind_connector_metadata(metadata if step == 0 else NixlConnectorMetadata())
        connector.start_load_kv(None)
        results = worker.get_transfer_results()
        connector.clear_connector_metadata()
        steps.append((set(results.finished_recving), set(results.failed_recving), calls[made:]))
        done |= set(results.finished_recving)
        if done >= set(requests):
            return steps
        time.sleep(0.02)
    raise AssertionError(f"requests {set(requests) - done} never finished")


def assert_one_call_per_step(steps, name):
    """Each step that finished requests made one ``name`` call naming exactly those that did
    not fail (a sender block read in part is named ``request/offset``); other steps none."""
    for finished, failed, calls in steps:
        made = [args for called, args in calls if called == name]
        if not finished - failed:
            assert not made, (name, made)
            continue
        assert len(made) == 1, (name, len(made))
        named = made[0][0] if name == "post_process" else {"": made[0][1]}
        served = finished - failed
        assert {request_of(req, served) for by_request in named.values() for req in by_request} == served


def request_of(name, requests):
    """The request of ``requests`` that a name in a kvhost call stands for: the request
    itself, or a part of it, ``request/offset`` primed until unique. Matched against the
    ids, never parsed from the name: an id may hold a ``/`` of its own."""
    if name in requests:
        return name
    parts = [req for req in requests if re.fullmatch(re.escape(req) + r"/\d+'*", name)]
    assert len(parts) == 1, (name, parts)
    return parts[0]


def sender_workers(model, senders, *, host_buffer=False, wrapper=CopyingNixlWrapper, heads=HEADS):
    """Prefill workers (engine -> (layout, block size)): engine -> (worker, its caches filled
    with its tokens, its connector), and each one's handshake as the decode side receives it."""
    caches, payloads = {}, {}
    for seed, (engine, (layout, size)) in enumerate(senders.items()):
        blocks = max(BLOCKS * BLOCK // size, 8)
        connector, worker, sender = make_worker(
            model, layout, block_size=size, blocks=blocks, host_buffer=host_buffer, wrapper=wrapper, heads=heads
        )
        for i, view in enumerate(sender.values()):
            fill_random(view, seed * 10 + i + 1)
        caches[engine] = (worker, sender, connector)
        payloads[engine] = handshake_payload(worker, engine)
    return caches, payloads


def fake_handshakes(worker, payloads, down=()):
    """vLLM's handshake transport, played here: the decode worker adds the sender's own
    metadata; engines in ``down`` refuse the connection."""

    def handshake(host, port, remote_tp_size, expected_engine_id, *args, **kwargs):
        if expected_engine_id in down:
            raise RuntimeError("handshake refused")  # NIXL could not reach it
        name = worker.add_remote_agent(payloads[expected_engine_id], 0, remote_tp_size)
        return {(0, 0): name}, 0.0

    worker._nixl_handshake = handshake


def plan_requests(plan, senders, seed):
    """``plan``: req -> (engine, our blocks, prefix-hit blocks, sender blocks). Distinct random
    block ids on both sides (64 of ours, ``sender_workers``' count of each sender's);
    returns (requests for ``drive``, computed)."""
    import random

    rng = random.Random(seed)
    ours = rng.sample(range(64), sum(count for _, count, _, _ in plan.values()))
    pools = {}
    for engine, (_, size) in senders.items():
        blocks = max(BLOCKS * BLOCK // size, 8)
        pools[engine] = rng.sample(range(blocks), blocks)
    requests, computed = {}, {}
    for req, (engine, count, hit, theirs) in plan.items():
        local_ids, ours = ours[:count], ours[count:]
        remote_ids, pools[engine] = pools[engine][:theirs], pools[engine][theirs:]
        requests[req] = (local_ids, remote_ids, engine)
        computed[req] = hit
    return requests, computed


def check_tokens(caches, local_size, requests, computed, senders, prefill, before, failed):
    """Every request's blocks against its sender's tokens from its first position on; a
    sender with smaller blocks leaves the tokens after its last block zero (as vLLM does);
    a failed request's blocks kept their bytes."""
    for req, (local_ids, remote_ids, engine) in requests.items():
        got = tokens_of(caches, local_ids, local_size)
        if req in failed:
            assert torch.equal(got, tokens_of(before, local_ids, local_size)), f"failed request {req} was touched"
            continue
        size = senders[engine][1]
        want = tokens_of(prefill[engine][1], remote_ids, size)
        start = computed.get(req, 0) * local_size
        arrived = min(got.shape[1], want.shape[1] - start)
        assert torch.equal(got[:, :arrived], want[:, start : start + arrived]), req
        assert not got[:, arrived:].any(), req  # the tail a smaller sender's blocks did not reach


# decode layout and block size; senders: engine -> (layout, block size); requests: req ->
# (engine, our blocks, prefix-hit blocks, sender blocks)
LARGER_SENDERS = {
    "LBNHC-32": (
        "LBNHC",
        32,
        {
            "hnd-64": ("LBHNC", 64),  # g = 2, head-major: 2 runs of tokens per block
            "hnd-128": ("LBHNC", 128),  # g = 4
            "nhd-128": ("LBNHC", 128),  # g = 4, token-major: the wire bytes read right
            "blhnc-64": ("BLHNC", 64),  # g = 2, padded blocks (the other layers between them)
            "hnd-32": ("LBHNC", 32),  # same size, head-major
        },
        {
            "a": ("hnd-64", 4, 0, 2),  # two whole groups
            "b": ("hnd-64", 3, 0, 2),  # a whole group and a last group of one
            "c": ("hnd-128", 6, 0, 2),  # a whole group of 4 and a last group of 2
            "d": ("hnd-128", 2, 1, 1),  # after a prefix hit of one block: parts 1..2 of a sender block
            "e": ("nhd-128", 5, 0, 2),
            "f": ("nhd-128", 3, 2, 2),  # parts 2..3 of one sender block, part 0 of the next
            "g": ("blhnc-64", 3, 0, 2),
            "h": ("hnd-32", 2, 0, 2),
            "x": ("hnd-64", 3, 0, 1),  # the sender's blocks do not reach ours: the request fails
        },
    ),
    "LBHNC-64": (
        "LBHNC",
        64,
        {
            "nhd-128": ("LBNHC", 128),  # g = 2, token-major into head-major
            "hnd-256": ("LBHNC", 256),  # g = 4
            "blhnc-128": ("BLHNC", 128),  # g = 2, padded, head-major
            "hnd-32": ("LBHNC", 32),  # r = 2: vLLM's own split of our blocks
        },
        {
            "a": ("nhd-128", 3, 0, 2),
            "user/b": ("hnd-256", 6, 0, 2),  # a client's id may hold a "/" (X-Request-Id)
            "user/c": ("hnd-256", 3, 2, 2),  # read in part: named "user/c/<offset>"
            "d": ("blhnc-128", 3, 0, 2),
            "e": ("hnd-32", 2, 0, 3),  # three sender blocks: our last block half full, its tail zeroed
            "f": ("hnd-32", 2, 0, 4),
            # After a prefix hit: the sender's blocks from the hit on, not its last ones
            # (vLLM's own pairing took the last 2 for our one block: tokens 32..95 at 64)
            "g": ("hnd-32", 1, 1, 3),
            "h": ("hnd-32", 2, 1, 6),
        },
    ),
    # Rows of every layer (vLLM registers a BLNHC or BHLNC cache so): each sender's row
    # lands in ours and is rearranged whole, layers and all.
    "BLNHC-64": (
        "BLNHC",
        64,
        {
            "rows-128": ("BLNHC", 128),  # g = 2, our layout
            "rows-32": ("BLNHC", 32),  # r = 2: vLLM's own split of our rows
            "rows-64": ("BLNHC", 64),  # our layout and size: nothing to rearrange
            "heads-64": ("BHLNC", 64),  # heads first, then layers
            "heads-256": ("BHLNC", 256),  # g = 4
            "heads-32": ("BHLNC", 32),
        },
        {
            "a": ("rows-128", 3, 0, 2),  # a whole group and a last group of one
            "b": ("rows-32", 2, 0, 3),  # our last block half full, its tail zeroed
            "c": ("rows-64", 2, 0, 2),
            "d": ("heads-64", 3, 0, 3),
            "e": ("heads-256", 6, 1, 2),  # after a prefix hit of one block
            "f": ("heads-32", 3, 0, 5),
            "g": ("rows-32", 2, 1, 5),  # after a prefix hit: our last block half full
        },
    ),
    "BHLNC-64": (
        "BHLNC",
        64,
        {
            "rows-128": ("BLNHC", 128),  # g = 2
            "heads-256": ("BHLNC", 256),  # g = 4, our layout
            "rows-32": ("BLNHC", 32),  # r = 2
        },
        {
            "a": ("rows-128", 4, 0, 2),
            "b": ("heads-256", 5, 2, 2),  # parts 2..3 of one sender block, then a whole one
            "c": ("rows-32", 3, 0, 5),
        },
    ),
}


@pytest.mark.parametrize("case", list(LARGER_SENDERS))
def test_a_step_with_remote_blocks_larger_than_ours(vllm_env, copying, case):
    """Senders whose blocks hold 2 and 4 of ours (head-major and token-major, dense and
    padded), next to senders of our size and smaller, in one step: vLLM's reads with the
    connector's descriptor plans move the bytes, one kvhost post-process finishes them,
    and every request reads its sender's tokens, from its first position on (after a
    prefix-cache hit), whole groups and last groups of fewer blocks alike."""
    local, local_size, senders, plan = LARGER_SENDERS[case]
    connector, worker, caches = make_worker(vllm_env, local, block_size=local_size, blocks=64, wrapper=copying)
    prefill, payloads = sender_workers(vllm_env, senders)
    fake_handshakes(worker, payloads)
    for i, view in enumerate(caches.values()):
        fill_random(view, 100 + i)  # stale bytes everywhere
    before = {name: raw(view).clone() for name, view in caches.items()}
    requests, computed = plan_requests(plan, senders, seed=list(LARGER_SENDERS).index(case))
    with patch.object(worker, "_log_failure", wraps=worker._log_failure) as logged:
        steps = drive(connector, worker, requests, computed)

    failed = set().union(*(f for _, f, _ in steps))
    assert failed == ({"x"} & set(plan))
    # A read never posted (the sender's blocks end first) is logged as such, not counted as
    # a failed transfer of its engine.
    setup_failures = [c.kwargs for c in logged.call_args_list if c.kwargs["failure_type"] == "transfer_setup_failed"]
    assert [(f["req_id"], f["msg"], f["dst_engine_id"]) for f in setup_failures] == [
        (r, "1 remote blocks do not reach our 3 blocks from position 0", "hnd-64") for r in failed
    ]
    assert not worker.xfer_stats.data.get("num_failed_transfers")
    assert {e: larger.g for e, larger in worker.larger_remote_blocks.items()} == {
        e: size // local_size for e, (_, size) in senders.items() if size > local_size
    }
    assert_one_call_per_step(steps, "post_process")
    check_tokens(caches, local_size, requests, computed, senders, prefill, before, failed)


def test_failed_requests_skip_the_post_process(vllm_env, copying):
    """Requests that fail never reach the post-process and keep their blocks' bytes: a
    sender whose handshake fails, one whose transfer ends in error, and one whose blocks
    do not reach ours; the step's other request is post-processed as usual."""
    senders = {"ok": ("LBHNC", 32), "broken": ("LBHNC", 32), "short": ("LBHNC", 64)}
    connector, worker, caches = make_worker(vllm_env, "LBNHC", blocks=32, wrapper=copying)
    prefill, payloads = sender_workers(vllm_env, senders)
    copying.failing.add(prefill["broken"][0].nixl_wrapper.name)
    fake_handshakes(worker, payloads, down={"down"})
    for i, view in enumerate(caches.values()):
        fill_random(view, 100 + i)
    before = {name: raw(view).clone() for name, view in caches.items()}
    senders["down"] = ("LBHNC", 32)
    requests = {
        "a": ([3, 9], [0, 5], "ok"),
        "b": ([4, 11], [6, 1], "broken"),
        "c": ([17, 18], [1, 2], "down"),
        "d": ([20, 2, 7], [3], "short"),  # one sender block of 64 for three of our 32
    }
    steps = drive(connector, worker, requests)
    failed = set().union(*(f for _, f, _ in steps))
    assert failed == {"b", "c", "d"}
    processed = [args[0] for _, _, calls in steps for name, args in calls if name == "post_process"]
    assert processed == [{"ok": {"a": [3, 9]}}]  # one call, naming none of the failed requests
    check_tokens(caches, BLOCK, requests, {}, senders, prefill, before, failed)


@pytest.mark.parametrize(
    ("decoder", "layouts"),
    [("LBNHC", ("LBHNC", "LBNHC", "LBHNC")), ("BLNHC", ("BHLNC", "BLNHC", "BHLNC"))],  # rows: every layer's
)
def test_host_buffer_staging_through_the_worker(vllm_env, copying, decoder, layouts):
    """Host-buffer mode (TPU, XPU, plugin devices) on both sides: each sender saves every
    request of its step to its host buffer in one kvhost copy (a block two requests share
    once), NIXL reads host to host, and the decode worker loads every finished request of
    its step in one kvhost copy and post-processes them in one call, with senders whose
    blocks are half and twice ours; vLLM's per-request copies never run."""
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl import NixlConnectorMetadata

    senders = {"p-hnd-32": (layouts[0], 32), "p-nhd-128": (layouts[1], 128), "p-hnd-128": (layouts[2], 128)}
    prefill, payloads = sender_workers(vllm_env, senders, host_buffer=True)
    plan = {
        "a": ("p-hnd-32", 2, 0, 3),  # our last block half full: its tail zeroed
        "b": ("p-hnd-32", 1, 0, 2),
        "c": ("p-nhd-128", 3, 0, 2),  # a whole group of 2 and a last group of 1
        "d": ("p-hnd-128", 3, 0, 2),
    }
    requests, computed = plan_requests(plan, senders, seed=7)
    for engine, (worker, device, connector) in prefill.items():  # the prefill side's step: save to host
        worker.copy_blocks = forbid_vllm_copies
        saved = {req: remote for req, (_, remote, e) in requests.items() if e == engine}
        if engine == "p-hnd-32":
            saved["shared"] = [requests["a"][1][0]]  # a prefix block another request names too
        metadata = NixlConnectorMetadata()
        for req, ids in saved.items():
            metadata.add_new_req_to_save(req, (list(ids),), {})
        calls = spy(worker)
        connector.bind_connector_metadata(metadata)
        connector.wait_for_save()
        connector.clear_connector_metadata()
        assert [name for name, _ in calls] == ["save_to_host"] and set(calls[0][1][1]) == set(saved)
        ids = sorted({b for blocks in saved.values() for b in blocks})
        size = senders[engine][1]
        assert torch.equal(tokens_of(worker.host_xfer_buffers, ids, size), tokens_of(device, ids, size)), engine

    connector, worker, caches, before = host_buffer_decoder(vllm_env, copying, payloads, decoder)
    for i, view in enumerate(worker.host_xfer_buffers.values()):
        fill_random(view, 200 + i)
    steps = drive(connector, worker, requests, computed)
    assert not set().union(*(f for _, f, _ in steps))
    assert_one_call_per_step(steps, "load_from_host")
    assert_one_call_per_step(steps, "post_process")
    for _, _, calls in steps:  # the load comes first: the post-process works on the device
        names = [name for name, _ in calls]
        assert names in ([], ["load_from_host", "post_process"]), names
    check_tokens(caches, 64, requests, computed, senders, prefill, before, set())
    calls = spy(worker)
    worker.get_transfer_results()  # a step with nothing new: no load again, no post-process
    assert calls == []


def test_senders_the_connector_cannot_serve_are_refused_and_change_nothing(vllm_env, copying_worker):
    """A sender whose blocks are not a whole number of ours, or larger ones with a case the
    connector does not cover, is refused at its handshake with a LayoutError naming the
    engine; so is one vLLM itself refuses. Either way what the worker had noted of its
    senders stays as it was."""
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl import NixlConnectorWorker

    _, worker, _ = copying_worker
    senders = {
        "good": ("LBHNC", 128),
        "odd": ("LBHNC", 96),
        "tp": ("LBHNC", 128),
        "late": ("LBHNC", 256),
        "unknown": ("LBHNC", 32),
        "uneven": ("LBHNC", 32),
    }
    _, payloads = sender_workers(vllm_env, senders)
    payloads["unknown"].kv_cache_layout = "LBHNC_v2"  # vLLM is shown ours: only kvhost can refuse it
    payloads["uneven"].block_size = 48  # smaller than ours, but no whole number of them fills one
    worker.add_remote_agent(payloads["good"], 0, 1)
    noted = (dict(worker.remote_engines), dict(worker.larger_remote_blocks))
    assert set(noted[0]) == set(noted[1]) == {"good"}
    with pytest.raises(LayoutError, match=r"engine 'odd': remote blocks of 96 tokens are not a whole number of ours"):
        worker.add_remote_agent(payloads["odd"], 0, 1)
    with pytest.raises(LayoutError, match=r"engine 'tp': .* \(128 > 64 tokens\) with a different tensor-parallel size"):
        worker.add_remote_agent(payloads["tp"], 0, 2)
    with pytest.raises(
        LayoutError, match=r"engine 'unknown': its 'LBHNC_v2' blocks of 32 tokens cannot be post-processed here: "
    ):
        worker.add_remote_agent(payloads["unknown"], 0, 1)
    with pytest.raises(
        LayoutError, match=r"engine 'uneven': its 'LBHNC' blocks of 48 tokens .* do not divide one another"
    ):
        worker.add_remote_agent(payloads["uneven"], 0, 1)
    with (
        patch.object(NixlConnectorWorker, "add_remote_agent", side_effect=RuntimeError("vLLM says no")),
        pytest.raises(RuntimeError, match="vLLM says no"),
    ):
        worker.add_remote_agent(payloads["late"], 0, 1)
    assert (worker.remote_engines, worker.larger_remote_blocks) == noted


# --- the connector's own arithmetic, and its handshake's edges ---------------------------


def larger_blocks(g: int, runs: int = 1, heads: int = 2, tokens: int = 16, channels: int = 8):
    """A real plan between our token-major blocks of ``tokens`` and a sender's blocks of
    ``g`` times as many (head-major when ``runs`` > 1: one run per head)."""
    from kvhost.integrations.vllm_connector import LargerRemoteBlocks, _region_table
    from kvhost.nixl import plan_transfer

    sizes = {"H": heads, "N": tokens, "C": channels}
    local = _region_table("DRAM", "NHC", sizes, 2, 8, [1 << 20], [heads * tokens * channels * 2], 0)
    order = "HNC" if runs > 1 else "NHC"
    remote = _region_table("DRAM", order, sizes | {"N": g * tokens}, 2, 4, [1 << 24], [g * heads * tokens * 2 * 8], 0)
    plan = plan_transfer(local, remote)
    assert plan.remote_parts == g and plan.local_parts == 1
    return LargerRemoteBlocks(plan, runs)


def test_sender_blocks_touched_and_pieces():
    """Our blocks from position ``start`` in sender blocks of g of ours: which parts of which
    sender block each run covers, and the pieces post-processed alike (whole sender blocks
    together, a block read in part alone, as a sender of that part)."""
    from kvhost.integrations.vllm_connector import sender_blocks_touched

    assert sender_blocks_touched(0, 6, 2) == [(0, 0, 2), (1, 0, 2), (2, 0, 2)]
    assert sender_blocks_touched(1, 5, 2) == [(0, 1, 2), (1, 0, 2), (2, 0, 2)]
    assert sender_blocks_touched(3, 3, 4) == [(0, 3, 4), (1, 0, 2)]
    assert sender_blocks_touched(5, 0, 4) == []
    two = larger_blocks(2)
    assert two.pieces(0, 6) == [(0, 6, 2)]  # three whole sender blocks: one piece
    assert two.pieces(1, 5) == [(0, 1, 1), (1, 4, 2)]  # part of one, then two whole
    assert two.pieces(0, 5) == [(0, 4, 2), (4, 1, 1)]  # two whole, then part of one
    assert two.pieces(1, 1) == [(0, 1, 1)]
    four = larger_blocks(4)
    assert four.pieces(3, 7) == [(0, 1, 1), (1, 4, 4), (5, 2, 2)]
    assert four.pieces(2, 1) == [(0, 1, 1)]


def test_unit_ids_follow_the_wire_model():
    """A head-major sender's unit ``h * g + t`` of block b is its ``b * units + h * g + t``-th
    unit; our blocks from ``start`` take, per sender block touched, every run's units of
    the parts they cover; None where the sender's blocks end first."""
    blocks = larger_blocks(2, runs=2)
    assert (blocks.g, blocks.units, blocks.runs) == (2, 4, 2)
    assert blocks.unit_bytes == blocks.plan.chunk_bytes // 2
    assert blocks.unit_ids([5, 1], 0, 4) == [20, 21, 22, 23, 4, 5, 6, 7]
    assert blocks.unit_ids([5, 1], 1, 2) == [21, 23, 4, 6]  # part 1 of block 5, part 0 of block 1
    assert blocks.unit_ids([5, 1], 1, 3) == [21, 23, 4, 5, 6, 7]
    assert blocks.unit_ids([5], 1, 2) is None  # the second sender block is missing
    assert blocks.unit_ids([5, 1], 4, 1) is None


def test_a_sender_added_again_is_vllms_known_agent(vllm_env, copying_worker):
    """vLLM skips the handshake of an engine and rank it knows; so does the connector, before
    it plans or notes anything (a payload it would refuse changes nothing). The defaults are
    vLLM's: rank 0, TP 1, DCP 1."""
    _, worker, _ = copying_worker
    _, payloads = sender_workers(vllm_env, {"good": ("LBHNC", 128)})
    name = worker.add_remote_agent(payloads["good"])
    assert isinstance(name, str) and worker.transfer_topo.get_engine_info("good").remote_tp_size == 1
    assert set(worker.dst_xfer_side_handles["good"]) == {0}  # remote rank 0
    worker._remote_agents["good"] = {(0, 0): name}  # what vLLM's handshake keeps of it
    noted = (dict(worker.remote_engines), dict(worker.larger_remote_blocks))
    assert worker.larger_remote_blocks["good"].g == 2
    odd = dataclasses.replace(payloads["good"], block_size=96)  # refused, were it planned
    assert worker.add_remote_agent(odd, 0, 1) == name
    assert (worker.remote_engines, worker.larger_remote_blocks) == noted


def test_a_refused_handshake_restores_what_was_noted_of_a_known_engine(vllm_env, copying_worker):
    """An engine already noted (rank 0) whose next rank vLLM refuses: its notes are the ones
    from before, each in its own table."""
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl import NixlConnectorWorker

    _, worker, _ = copying_worker
    _, payloads = sender_workers(vllm_env, {"good": ("LBHNC", 128), "late": ("LBNHC", 256)})
    worker.add_remote_agent(payloads["good"], 0, 1)
    noted = (dict(worker.remote_engines), dict(worker.larger_remote_blocks))
    again = dataclasses.replace(payloads["late"], engine_id="good")  # another layout and g
    with (
        patch.object(NixlConnectorWorker, "add_remote_agent", side_effect=RuntimeError("vLLM says no")),
        pytest.raises(RuntimeError, match="vLLM says no"),
    ):
        worker.add_remote_agent(again, 1, 1)
    assert (worker.remote_engines, worker.larger_remote_blocks) == noted
    assert worker.remote_engines["good"].block_size == 128 and worker.larger_remote_blocks["good"].g == 2


@pytest.mark.parametrize("host_buffer", [False, True])
def test_vllms_own_handshake_checks_still_run(vllm_env, copying, host_buffer):
    """The connector lifts two of vLLM's refusals, not the others: a sender with another
    number of layers is still refused by vLLM, in either mode, and the mode is restored."""
    _, worker, _ = make_worker(vllm_env, "LBNHC", block_size=64, blocks=64, host_buffer=host_buffer, wrapper=copying)
    _, payloads = sender_workers(vllm_env, {"short": ("LBHNC", 64)}, host_buffer=host_buffer)
    meta = payloads["short"]
    fewer = dataclasses.replace(meta, block_lens=meta.block_lens[:-1])
    with pytest.raises(AssertionError, match="Number of KV layers must match"):
        worker.add_remote_agent(fewer, 0, 1)
    assert worker.use_host_buffer is host_buffer
    assert fewer.kv_cache_layout == "LBHNC"  # the sender's own name, given back
    assert "short" not in worker.remote_engines


def test_larger_senders_the_connector_does_not_cover_are_refused(vllm_env, copying_worker):
    """Decode context parallelism on either side, or a cache vLLM clips to a sliding window,
    is refused for a sender of larger blocks, naming it; the same sender without them is
    accepted."""
    _, worker, _ = copying_worker
    _, payloads = sender_workers(vllm_env, {"big": ("LBHNC", 128)})
    dcp = r"engine 'big': remote blocks larger than ours \(128 > 64 tokens\) with decode context parallelism"
    with pytest.raises(LayoutError, match=dcp):
        worker.add_remote_agent(payloads["big"], 0, 1, 2)
    worker.dcp_size = 2
    with pytest.raises(LayoutError, match=dcp):
        worker.add_remote_agent(payloads["big"], 0, 1, 1)
    assert not worker.remote_engines and not worker.larger_remote_blocks
    worker.dcp_size = 1
    # A sliding-window model: vLLM sends each side's last blocks of the window, lists that
    # start at other tokens on the two sides.
    worker._is_hma_required = True
    clipped = r"engine 'big': blocks of 128 tokens, 1 a logical block; ours 64, 1: a cache vLLM clips to a window"
    with pytest.raises(LayoutError, match=clipped):
        worker.add_remote_agent(payloads["big"], 0, 1, 1)
    worker._is_hma_required = False
    worker.add_remote_agent(payloads["big"], 0, 1, 1)
    assert worker.larger_remote_blocks["big"].g == 2


def test_a_handshake_without_per_region_facts_is_planned_and_read_from_its_totals(vllm_env, copying_worker):
    """A sender's handshake may leave out its per-region block counts and memory types
    (vLLM's fields are optional): its regions are then ``num_blocks`` each, in our memory
    type; the plan is the one its full handshake gives, and its requests read right (vLLM
    then finds its descriptors by ``num_blocks``, in units)."""
    connector, worker, caches = copying_worker
    senders = {"full": ("LBHNC", 128), "bare": ("LBHNC", 128)}
    prefill, payloads = sender_workers(vllm_env, senders)
    full, bare = payloads["full"], payloads["bare"]
    assert full.region_num_blocks and full.region_mem_types
    payloads["bare"] = dataclasses.replace(bare, region_num_blocks=None, region_mem_types=None)
    fake_handshakes(worker, payloads)
    worker.add_remote_agent(full, 0, 1)
    worker.add_remote_agent(payloads["bare"], 0, 1)
    planned = worker.larger_remote_blocks
    theirs, ours = planned["bare"].plan.remote, planned["full"].plan.remote
    assert (theirs.num_blocks, theirs.memory) == (bare.num_blocks, ours.memory) == (full.num_blocks, "DRAM")
    assert dataclasses.replace(planned["bare"].plan, remote=planned["full"].plan.remote) == planned["full"].plan
    for i, view in enumerate(caches.values()):
        fill_random(view, 100 + i)
    before = {name: raw(view).clone() for name, view in caches.items()}
    plan = {"a": ("bare", 4, 0, 2), "b": ("bare", 3, 1, 2), "c": ("full", 3, 0, 2)}
    requests, computed = plan_requests(plan, senders, seed=3)
    steps = drive(connector, worker, requests, computed)
    assert not set().union(*(f for _, f, _ in steps))
    check_tokens(caches, 64, requests, computed, senders, prefill, before, set())


def test_larger_senders_need_nixl_regions_that_are_block_regions(vllm_env, copying_worker):
    """A larger sender is read by kvhost's plan only where every NIXL region, on each side,
    is a block region of the right length, all with as many blocks, in one memory type;
    otherwise it is refused naming the side and what it registered, and nothing is noted."""
    _, worker, _ = copying_worker
    _, payloads = sender_workers(vllm_env, {"big": ("LBHNC", 128)})
    meta = payloads["big"]
    assert len(meta.block_lens) >= 2 and len(set(meta.region_num_blocks)) == 1
    region, regions = meta.block_lens[0], len(meta.block_lens)
    blocks = meta.region_num_blocks[0]
    bad = {
        rf"remote side registered \[{region}, {2 * region}\] bytes": {
            "block_lens": [region, *[2 * region] * 3][: len(meta.block_lens)]
        },
        rf"remote side registered \[{region}\] bytes, \[{blocks - 1}, {blocks}\] blocks": {
            "region_num_blocks": [blocks - 1, *meta.region_num_blocks[1:]]
        },
        r"remote side .* in \['DRAM', 'VRAM'\]": {"region_mem_types": ["VRAM", *meta.region_mem_types[1:]]},
        rf"for {regions} regions \({regions + 1} addresses, {regions} strides\)": {
            "kv_caches_base_addr": [*meta.kv_caches_base_addr, meta.kv_caches_base_addr[-1]]
        },
    }
    for message, change in bad.items():
        with pytest.raises(
            LayoutError, match=r"engine 'big': remote blocks larger than ours need NIXL regions .*" + message
        ):
            worker.add_remote_agent(dataclasses.replace(meta, **change), 0, 1)
    worker.region_mem_types = ["VRAM", *worker.region_mem_types[1:]]
    with pytest.raises(LayoutError, match=r"the local side registered .* in \['DRAM', 'VRAM'\]"):
        worker.add_remote_agent(meta, 0, 1)
    assert not worker.remote_engines and not worker.larger_remote_blocks


def test_a_head_major_sender_needs_our_block_size_to_hold_whole_runs(vllm_env, copying, tmp_path):
    """A head-major sender's block holds one run of tokens per head; a part of it is read per
    run, so our block size must be a multiple of the heads: 3 heads and blocks of 64 are
    refused, naming the engine, the order and the runs; a token-major sender is one run."""
    model = write_model(tmp_path, 3)
    _, worker, _ = make_worker(model, "LBNHC", block_size=64, blocks=64, wrapper=copying, heads=3)
    senders = {"hnd": ("LBHNC", 128), "nhd": ("LBNHC", 128)}
    _, payloads = sender_workers(model, senders, heads=3)
    with pytest.raises(LayoutError, match=r"engine 'hnd': its 'HNC' blocks hold 3 runs of tokens; .* \(64\)"):
        worker.add_remote_agent(payloads["hnd"], 0, 1)
    worker.add_remote_agent(payloads["nhd"], 0, 1)
    assert set(worker.larger_remote_blocks) == {"nhd"} and worker.larger_remote_blocks["nhd"].runs == 1


def received_request(local, remote=None, engine="hnd", **extra):
    """vLLM's metadata of a request received (one attention group) from ``engine``'s blocks
    ``remote`` into ours ``local``; no sender where ``remote`` is None."""
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl.metadata import RemoteMeta, ReqMeta

    sender = None if remote is None else RemoteMeta(([*remote],), "localhost", 1, engine, "req")
    return ReqMeta(([*local],), ([*local],), 1, remote=sender, **extra)


def read_posted(worker, finished):
    """Note each of ``finished``'s reads as ``_read_blocks`` does when vLLM posts it."""
    for req_id, meta in finished.items():
        if meta.remote is not None:
            worker._note_read(req_id, meta.remote.engine_id)
    return finished


def post_process(worker, finished):
    """What ``get_transfer_results`` post-processes for ``finished`` (read from the senders
    noted now): None when kvhost has nothing to do."""
    received, engines, tokens, named = worker._post_process_batch(read_posted(worker, finished))
    assert named <= set(finished)
    return worker.kvhost.post_process(received, engines, tokens=tokens) if received else None


def test_the_post_process_names_only_requests_whose_bytes_kvhost_finishes(vllm_env, copying_worker):
    """Of the finished requests handed to the post-process, those vLLM zeroes itself (a
    region read plan) or that had no sender are left out; nothing to do is no kvhost call."""
    _, worker, _ = copying_worker
    _, payloads = sender_workers(vllm_env, {"hnd": ("LBHNC", 64), "big": ("LBHNC", 128)})
    worker.add_remote_agent(payloads["hnd"], 0, 1)
    worker.add_remote_agent(payloads["big"], 0, 1)
    calls = spy(worker, ("post_process",))
    request = received_request
    assert post_process(worker, {}) is None
    assert post_process(worker, {"local": request([1])}) is None
    assert post_process(worker, {"zeroed": request([2], [7], region_blocks_to_zero=[[2]])}) is None
    assert post_process(worker, {"cached": request([], [7])}) is None  # nothing of ours to receive
    assert calls == []
    stats = post_process(
        worker, {"a": request([3], [5]), "local": request([1]), "zeroed": request([2], [7], region_blocks_to_zero=[])}
    )
    assert [args[0] for _, args in calls] == [{"hnd": {"a": [3]}}]
    assert stats is not None and stats.requests == 1 and stats.blocks == 1
    # A larger sender (g = 2): whole sender blocks under its own name, the part of one as a
    # sender of that part (engine/parts, request/offset).
    post_process(worker, {"b": request([9, 4, 6], [5, 1], "big")})
    received, engines = calls[-1][1][:2]
    assert received == {"big": {"b": [9, 4]}, "big/1": {"b/2": [6]}}
    assert {name: (e.kv_cache_layout, e.block_size) for name, e in engines.items()} == {
        "big": ("LBHNC", 128),
        "big/1": ("LBHNC", 64),
    }
    # Ids are anyone's strings: a peer that calls itself "big/1" (token-major) and a request
    # "b/2" in the same step keep their names and their sender's layout; the part's take
    # names no id of the step has.
    _, nhd = sender_workers(vllm_env, {"big/1": ("LBNHC", 64)})
    worker.add_remote_agent(nhd["big/1"], 0, 1)
    step = {
        "b": request([9, 4, 6], [5, 1], "big"),
        "b/2": request([7], [3], "big/1"),
        "c": request([11], [8], "big"),  # the part of another request: the same part sender
    }
    received, engines, _, named = worker._post_process_batch(read_posted(worker, step))
    assert received == {"big": {"b": [9, 4]}, "big/1'": {"b/2'": [6], "c/0": [11]}, "big/1": {"b/2": [7]}}
    assert {name: (e.kv_cache_layout, e.block_size) for name, e in engines.items()} == {
        "big": ("LBHNC", 128),
        "big/1'": ("LBHNC", 64),
        "big/1": ("LBNHC", 64),
    }
    assert named == {"b", "b/2", "c"}
    stats = post_process(worker, step)
    assert stats is not None and stats.requests == 4 and stats.skipped_blocks == 1  # token-major: nothing to do


@pytest.mark.parametrize("hit", [0, 2])
def test_a_sender_of_our_kernel_blocks_in_larger_logical_blocks_lands_from_its_first_token(vllm_env, copying, hit):
    """A sender whose logical blocks hold two of its kernel blocks of our size: a prompt of
    280 tokens is 5 logical blocks to it, 10 kernel blocks, the last past the prompt; 9 to
    us. vLLM pairs our blocks with its last kernel blocks, each of ours a block late; the
    connector pairs them from the request's first position (after a prefix-cache hit of
    ``hit`` blocks, too), and nothing is zeroed: every block of ours arrived whole."""
    _, prefill, prefill_caches = make_worker(vllm_env, "LBHNC", blocks=48, wrapper=copying)
    for i, view in enumerate(prefill_caches.values()):
        fill_random(view, 40 + i)
    connector, worker, caches = make_worker(vllm_env, "LBNHC", blocks=48, wrapper=copying)
    payload = dataclasses.replace(handshake_payload(prefill, "p"), physical_blocks_per_logical_kv_block=2)
    fake_handshakes(worker, {"p": payload})
    logical = [3, 7, 11, 15, 19]
    kernel = [2 * block + k for block in logical for k in (0, 1)]
    ours = list(range(20, 29))[hit:]
    steps = drive(connector, worker, {"r": (ours, logical, "p")}, computed={"r": hit})
    assert not set().union(*(f for _, f, _ in steps))
    for name in caches:
        want = tokens_of({name: prefill_caches[name]}, kernel[hit:9], BLOCK)
        assert torch.equal(tokens_of({name: caches[name]}, ours, BLOCK), want), name


def test_first_position_counts_kernel_blocks_of_the_prefix_hit(vllm_env):
    """A request's first position is its prefix-cache hit of the first group, in kernel
    blocks (logical blocks times kernel blocks per logical one); none is 0."""
    from types import SimpleNamespace

    _, worker, _ = make_worker(vllm_env, "LBNHC")
    worker._physical_blocks_per_logical_kv_block = 2
    assert worker._first_position(SimpleNamespace(local_num_computed_blocks=(3, 5))) == 6
    assert worker._first_position(SimpleNamespace(local_num_computed_blocks=())) == 0
    assert worker._first_position(None) == 0  # vLLM no longer holds the request's metadata


def test_the_tail_is_zeroed_only_where_vllm_converts(vllm_env, copying_worker):
    """Requests whose sender's blocks hold fewer tokens than ours: the tokens that arrived
    are given for those whose bytes are converted (another block size or layout: kvhost
    zeroes the rest, as vLLM does there), not for those that land as they are (vLLM leaves
    their blocks alone) nor for those that arrived whole."""
    _, worker, caches = copying_worker
    senders = {"same": ("LBNHC", 64), "hnd": ("LBHNC", 64), "small": ("LBNHC", 32)}
    _, payloads = sender_workers(vllm_env, senders)
    for engine in senders:
        worker.add_remote_agent(payloads[engine], 0, 1)
    given = []
    original = worker.kvhost.post_process

    def recording(received, engines, *, tokens=None):
        given.append(tokens)
        return original(received, engines, tokens=tokens)

    worker.kvhost.post_process = recording
    for i, view in enumerate(caches.values()):
        fill_random(view, 300 + i)
    before = {name: raw(view).clone() for name, view in caches.items()}
    stats = post_process(
        worker,
        {
            "same": received_request([10, 11], [5], "same"),
            "hnd": received_request([12, 13], [6], "hnd"),
            "small": received_request([14, 15], [1, 2, 3], "small"),
            "whole": received_request([16], [7], "hnd"),
        },
    )
    assert given == [{"hnd": 64, "small": 96}]
    assert stats.zeroed_blocks == 2  # block 13 whole, block 15 from its token 32 on
    assert torch.equal(tokens_of(caches, [10, 11], 64), tokens_of(before, [10, 11], 64))  # as they landed
    assert not tokens_of(caches, [13], 64).any() and not tokens_of(caches, [15], 64)[:, 32:].any()


def test_a_sender_that_sent_nothing_past_our_first_position_leaves_every_token_zeroed(vllm_env, copying_worker):
    """Where a smaller sender's blocks end before our first position (its tokens before our
    prefix-cache hit were skipped), no token of ours arrived: all are zeroed, from token 0."""
    _, worker, _ = copying_worker
    _, payloads = sender_workers(vllm_env, {"small": ("LBNHC", 32)})
    worker.add_remote_agent(payloads["small"], 0, 1)
    finished = {"r": received_request([14, 15], [1, 2], "small")}
    read_posted(worker, finished)
    worker._read_from["r"] = worker._read_from["r"]._replace(skipped=3 * 32)  # past the 2 blocks it sent
    received, _, tokens, named = worker._post_process_batch(finished)
    assert received == {"small": {"r": [14, 15]}} and tokens == {"r": 0} and named == {"r"}


def test_memories_are_told_apart_by_address_and_view():
    """Layers that view one memory alike are one memory, named by the first; views of other
    memories are their own whatever their shapes; two views of one address that differ in
    shape or strides are refused, naming both; a layer that is no tensor is refused."""
    from kvhost.integrations.vllm_connector import _memories

    buffer = torch.zeros(4096, dtype=torch.bfloat16)
    a = buffer[:1024].view(4, 2, 8, 16)
    elsewhere = buffer[2048:3072].view(8, 2, 4, 16)  # another memory, another shape: fine
    assert _memories({"a": a, "a again": buffer[:1024].view(4, 2, 8, 16), "b": elsewhere}) == {
        "a": "a",
        "a again": "a",
        "b": "b",
    }
    for other in (buffer[:1024].view(8, 2, 4, 16), a.transpose(1, 2)):  # one address: another shape, strides
        with pytest.raises(LayoutError, match=r"layers 'a' and 'x' view one memory in two ways"):
            _memories({"a": a, "x": other})
    with pytest.raises(LayoutError, match=r"layer 'pair' is a tuple, not a tensor view"):
        _memories({"a": a, "pair": (a, a)})


def test_a_save_step_copies_kernel_blocks_and_an_empty_step_copies_nothing(vllm_env):
    """Host-buffer mode, kernel blocks half a logical block: a step's saves are one kvhost
    copy of the kernel blocks of every request to save (vLLM's metadata is given them
    too); other blocks of the host buffer keep their bytes; a step with nothing to save
    makes no call."""
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl import NixlConnectorMetadata

    connector, worker, device = make_worker(vllm_env, "LBHNC", host_buffer=True)
    worker.copy_blocks = forbid_vllm_copies
    worker._physical_blocks_per_logical_kv_block = 2
    for i, view in enumerate(device.values()):
        fill_random(view, 10 + i)
    for i, view in enumerate(worker.host_xfer_buffers.values()):
        fill_random(view, 20 + i)
    before = {name: raw(view).clone() for name, view in worker.host_xfer_buffers.items()}
    calls = spy(worker)
    steps = []
    for saved in ({"r": [3, 5], "s": [5]}, {}):
        metadata = NixlConnectorMetadata()
        for req, ids in saved.items():
            metadata.add_new_req_to_save(req, (ids,), {})
        connector.bind_connector_metadata(metadata)
        connector.wait_for_save()
        connector.clear_connector_metadata()
        steps.append(metadata)
    assert [(name, args[1]) for name, args in calls] == [("save_to_host", {"r": [6, 7, 10, 11], "s": [10, 11]})]
    assert [list(steps[0].reqs_to_save[r].local_physical_block_ids[0]) for r in "rs"] == [[6, 7, 10, 11], [10, 11]]
    copied = [6, 7, 10, 11]
    others = [b for b in range(BLOCKS) if b not in copied]
    assert torch.equal(tokens_of(worker.host_xfer_buffers, copied, BLOCK), tokens_of(device, copied, BLOCK))
    assert torch.equal(tokens_of(worker.host_xfer_buffers, others, BLOCK), tokens_of(before, others, BLOCK))


# --- handshakes on vLLM's thread, heterogeneous TP, groups, failures, dropped engines ----


def test_a_handshake_on_another_thread_leaves_the_steps_host_buffer_mode(vllm_env, copying):
    """vLLM shakes hands on its own thread. While its checks run there (shown no host
    buffer), a step on the main thread still loads its finished request from the host
    buffer and saves to it: the request reads its sender's tokens, not stale device bytes."""
    import threading

    from vllm.distributed.kv_transfer.kv_connector.v1.nixl import NixlConnectorMetadata
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl.base_worker import NixlBaseConnectorWorker

    senders = {"a": ("LBNHC", 64), "b": ("LBNHC", 64)}
    prefill, payloads = sender_workers(vllm_env, senders, host_buffer=True)
    for sender_worker, _, _ in prefill.values():  # the prefill side's save of every block
        sender_worker.kvhost.save_to_host(
            sender_worker.host_xfer_buffers, {"all": range(sender_worker.kvhost.num_blocks)}
        ).wait()
    connector, worker, caches, before = host_buffer_decoder(vllm_env, copying, payloads)

    entered, release, seen_while_checking = threading.Event(), threading.Event(), []
    checks = NixlBaseConnectorWorker._validate_remote_agent_handshake

    def held_checks(self, meta, *args, **kwargs):  # vLLM's checks of b, held open until the step ran
        if meta.engine_id == "b":
            seen_while_checking.append(self.use_host_buffer)
            entered.set()
            release.wait(30)
        return checks(self, meta, *args, **kwargs)

    with patch.object(NixlBaseConnectorWorker, "_validate_remote_agent_handshake", held_checks):
        handshake = threading.Thread(target=worker.add_remote_agent, args=(payloads["b"], 0, 1))
        handshake.start()
        assert entered.wait(30)
        try:
            assert worker.use_host_buffer is True  # this thread's view, during b's checks
            steps = drive(connector, worker, {"r": ([20, 2], [7, 1], "a")})
            metadata = NixlConnectorMetadata()
            metadata.add_new_req_to_save("s", ([5, 6],), {})
            calls = spy(worker, ("save_to_host",))
            connector.bind_connector_metadata(metadata)
            connector.wait_for_save()
            connector.clear_connector_metadata()
        finally:
            release.set()
            handshake.join()
    assert seen_while_checking == [False] and worker.use_host_buffer is True
    assert "b" in worker.remote_engines  # b's handshake went through
    assert [args[1] for _, args in calls] == [{"s": [5, 6]}]
    assert_one_call_per_step(steps, "load_from_host")
    check_tokens(caches, 64, {"r": ([20, 2], [7, 1], "a")}, {}, senders, prefill, before, set())


def test_a_sender_of_another_tp_size_needs_our_region_order(vllm_env, copying, tmp_path):
    """With another tensor-parallel size vLLM reads a share of heads per rank and places it
    as if both sides had one layout: a sender whose block regions hold their letters in
    another order than ours is refused, naming the engine and both layouts, and nothing is
    noted; one in our region order (our layout, or BLHNC's padded blocks) is taken."""
    one_head = write_model(tmp_path, 1)  # a prefill rank of TP 2 holds one of the two KV heads
    _, payloads = sender_workers(
        one_head, {"nhd": ("LBNHC", 64), "hnd": ("LBHNC", 64), "blhnc": ("BLHNC", 64)}, heads=1
    )
    _, worker, _ = make_worker(vllm_env, "LBHNC", block_size=64, blocks=16, wrapper=copying)
    with pytest.raises(
        LayoutError,
        match=r"engine 'nhd': tensor-parallel size 2 \(ours 1\) splits heads, .* its LBNHC blocks read 'NHC' there, "
        r"our LBHNC blocks 'HNC'",
    ):
        worker.add_remote_agent(payloads["nhd"], 0, 2)
    assert not worker.remote_engines and "nhd" not in worker.dst_xfer_side_handles
    for engine in ("hnd", "blhnc"):
        for rank in (0, 1):
            worker.add_remote_agent(dataclasses.replace(payloads[engine]), rank, 2)
        assert set(worker.dst_xfer_side_handles[engine]) == {0, 1}
    assert set(worker.remote_engines) == {"hnd", "blhnc"}


@pytest.mark.parametrize("sender", ["LBHNC", "BLHNC"])
def test_a_sender_of_another_tp_size_in_our_region_order_lands_each_ranks_heads(vllm_env, copying, tmp_path, sender):
    """The pairs the TP rule takes read right: two prefill ranks of one KV head each into a
    decoder of two, each rank's head landing in its head of our blocks, token for token,
    and the post-process leaves them (our region order: nothing to rearrange)."""
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl import NixlConnectorMetadata

    one_head = write_model(tmp_path, 1)
    ranks = []
    for rank in range(2):
        _, prefill, caches = make_worker(one_head, sender, block_size=64, blocks=8, wrapper=copying, heads=1)
        for i, view in enumerate(caches.values()):
            fill_random(view, 10 * rank + i + 1)
        ranks.append((caches, handshake_payload(prefill, "p")))
    connector, worker, caches = make_worker(vllm_env, "LBHNC", block_size=64, blocks=16, wrapper=copying)

    def handshake(host, port, remote_tp_size, expected_engine_id, *args, **kwargs):
        names = {(0, r): worker.add_remote_agent(ranks[r][1], r, remote_tp_size) for r in range(remote_tp_size)}
        return names, 0.0

    worker._nixl_handshake = handshake
    for i, view in enumerate(caches.values()):
        fill_random(view, 100 + i)
    before = {name: raw(view).clone() for name, view in caches.items()}
    local_ids, remote_ids = [3, 9], [2, 5]
    metadata = NixlConnectorMetadata()
    params = {"remote_block_ids": (remote_ids,), "remote_engine_id": "p", "remote_request_id": "r"}
    params |= {"remote_host": "h", "remote_port": 1, "remote_tp_size": 2, "tp_size": 2}
    metadata.add_new_req_to_recv("r", (local_ids,), params)
    finished: set[str] = set()
    for step in range(200):
        connector.bind_connector_metadata(metadata if step == 0 else NixlConnectorMetadata())
        connector.start_load_kv(None)
        results = worker.get_transfer_results()
        connector.clear_connector_metadata()
        assert not results.failed_recving
        finished |= results.finished_recving
        if finished:
            break
        time.sleep(0.01)
    assert finished == {"r"} and worker.last_post_process.bytes_moved == 0
    for name, view in caches.items():
        got = raw(view)  # [B, H, N, C]
        for head, (sent, _) in enumerate(ranks):
            assert torch.equal(got[local_ids, head], raw(sent[name])[remote_ids, 0]), (name, head)
        untouched = [b for b in range(16) if b not in local_ids]
        assert torch.equal(got[untouched], before[name][untouched]), name


def read_one_request(connector, worker, counts, sender_blocks=48, blocks=24):
    """Request ``r`` from engine ``p``, ``counts[g]`` blocks of group ``g`` (a hybrid model's
    lists), its sender's and our blocks drawn at random (seeded) from ``sender_blocks`` and
    ``blocks``: (local ids, remote ids, the steps ``drive`` took), every request landed."""
    import random

    rng = random.Random(5)
    sent, ours = rng.sample(range(sender_blocks), sum(counts)), rng.sample(range(blocks), sum(counts))
    spans = list(itertools.pairwise(np.cumsum([0, *counts])))
    remote = tuple(sent[a:b] for a, b in spans)
    local = tuple(ours[a:b] for a, b in spans)
    steps = drive(connector, worker, {"r": (local, remote, "p")})
    assert not set().union(*(f for _, f, _ in steps))
    return local, remote, steps


HYBRID_CASES = {  # sender layout, decode layout, decode in host-buffer mode, layer kinds (f full, s sliding)
    "LBHNC->LBNHC": ("LBHNC", "LBNHC", False, "fsfs"),  # rearranged (vLLM refuses another layout with HMA)
    "LBNHC->LBHNC": ("LBNHC", "LBHNC", False, "fsfs"),
    "BHLNC->BHLNC": ("BHLNC", "BHLNC", False, "fsfs"),  # rows of every layer, one layout: nothing to rearrange
    "LBHNC->LBNHC-host-buffer": ("LBHNC", "LBNHC", True, "fsfs"),
    "LBHNC->LBNHC-uneven": ("LBHNC", "LBNHC", False, "ffffsss"),  # groups of 4 and 3 (one padded)
    "BHLNC->BHLNC-one-layer-each": ("BHLNC", "BHLNC", False, "fss"),  # three groups of one layer: one memory
}


@pytest.mark.parametrize("case", list(HYBRID_CASES))
def test_a_hybrid_models_groups_are_read_and_post_processed_as_one_pool(vllm_env, copying, case):
    """A hybrid model (full attention and a sliding window of 64 tokens), as vLLM plans and
    allocates it: the groups share memory and draw blocks from one pool. A request reads
    every block of a full group and the window's last blocks of a sliding one, each group a
    list; kvhost describes each memory once, and one post-process (and in host-buffer mode
    one load) a step rearranges every group's blocks from the sender's layout. Every token
    sent lands as the sender held it; no other block changes."""

    from vllm.v1.kv_cache_interface import SlidingWindowSpec

    sender_layout, decode_layout, host_buffer, kinds = HYBRID_CASES[case]
    _, prefill, prefill_caches = make_worker(vllm_env, sender_layout, blocks=48, wrapper=copying, hybrid=kinds)
    connector, worker, caches = make_worker(
        vllm_env, decode_layout, blocks=24, wrapper=copying, hybrid=kinds, host_buffer=host_buffer
    )
    groups = worker.kv_cache_config.transfer_groups
    assert len(groups) > 1 and worker._is_hma_required
    memories = {view.data_ptr() for view in caches.values()}  # each shared by a layer of every group
    assert len(memories) == len(set(worker._memories.values())) == max(len(g.layer_names) for g in groups)
    for i, view in enumerate(prefill_caches.values()):
        fill_random(view, 10 + i)
    for i, view in enumerate(caches.values()):
        fill_random(view, 20 + i)
    if host_buffer:
        worker.copy_blocks = forbid_vllm_copies
        for i, view in enumerate(worker.host_xfer_buffers.values()):
            fill_random(view, 30 + i)
    before = {name: raw(view).clone() for name, view in caches.items()}
    fake_handshakes(worker, {"p": handshake_payload(prefill, "p")})
    # A prompt of 10 blocks: a full group reads them all, a sliding one the window's last 3.
    counts = [3 if isinstance(g.kv_cache_spec, SlidingWindowSpec) else 10 for g in groups]
    local, remote, steps = read_one_request(connector, worker, counts)
    ours = [block for ids in local for block in ids]
    assert_one_call_per_step(steps, "post_process")
    if host_buffer:
        assert_one_call_per_step(steps, "load_from_host")
    for g, group in enumerate(groups):
        for name in group.layer_names:
            if name in caches:  # vLLM pads a group of fewer layers with names of no layer
                got = tokens_of({name: caches[name]}, local[g], BLOCK)
                assert torch.equal(got, tokens_of({name: prefill_caches[name]}, remote[g], BLOCK)), name
    untouched = [b for b in range(24) if b not in ours]
    for name, view in caches.items():
        assert torch.equal(raw(view)[untouched], before[name][untouched]), name
    posted = [args for _, _, calls in steps for called, args in calls if called == "post_process"]
    assert sorted(posted[0][0]["p"]["r"]) == sorted(ours)  # every group's blocks, in one request


def test_one_group_of_any_kind_is_vllms_to_judge(vllm_env, copying):
    """The kinds a hybrid model's groups may be are asked of several groups only: one group
    of another kind (chunked local attention alone) registers as vLLM's own connector would."""
    from vllm.v1.kv_cache_interface import ChunkedLocalAttentionSpec

    shape = {"block_size": BLOCK, "num_kv_heads": HEADS, "head_size": HEAD_DIM, "dtype": torch.bfloat16}
    specs = {name: ChunkedLocalAttentionSpec(attention_chunk_size=64, **shape) for name in HYBRID_LAYERS}
    _, worker, _ = make_worker(vllm_env, "LBNHC", wrapper=copying, hybrid=specs)
    assert len(worker.kv_cache_config.transfer_groups) == 1
    assert worker.kvhost is not None and len(worker._memories) == len(HYBRID_LAYERS)


def test_hybrid_models_kvhost_cannot_serve_are_refused(vllm_env, copying):
    """Refused at registration, before anything is described or registered, naming the
    groups: a group of other state (chunked local attention), and groups whose pages differ.
    Refused at the handshake, before anything of it is noted: a sender of another block
    size (vLLM's lists of a window's last blocks, counted in each side's blocks, would start
    at other tokens)."""
    from vllm.v1.kv_cache_interface import ChunkedLocalAttentionSpec, FullAttentionSpec

    shape = {"num_kv_heads": HEADS, "head_size": HEAD_DIM, "dtype": torch.bfloat16}
    full, local = (
        FullAttentionSpec(block_size=BLOCK, **shape),
        ChunkedLocalAttentionSpec(block_size=BLOCK, attention_chunk_size=64, **shape),
    )
    chunked = {name: local if i % 2 else full for i, name in enumerate(HYBRID_LAYERS)}
    fewer_heads = hybrid_specs()
    for name in HYBRID_LAYERS[1::2]:
        fewer_heads[name] = dataclasses.replace(fewer_heads[name], num_kv_heads=1)
    for specs, refusal in (
        (
            chunked,
            r"only of full and sliding-window attention .*got 2: group 0: FullAttentionSpec of 2 layers "
            r"\('model.layers.0.self_attn.attn', 'model.layers.2.self_attn.attn'\); group 1: ChunkedLocalAttentionSpec",
        ),
        (fewer_heads, r"only where their pages are alike .*\(32, 2, 8.*\(64, 1, 8"),
    ):
        config = make_config(vllm_env, "LBNHC")
        kv_cache_config, caches = allocate_hybrid(config, "LBNHC", specs=specs)
        connector = make_connector(config, kv_cache_config)
        worker = connector.connector_worker
        with vllm_worker_made(config), pytest.raises(LayoutError, match=refusal):
            connector.register_kv_caches(caches)
        assert worker.kvhost is None and not worker.device_kv_caches and worker.num_regions == 0

    _, worker, _ = make_worker(vllm_env, "LBNHC", block_size=64, blocks=12, wrapper=copying, hybrid="fsfs")
    _, larger, _ = make_worker(vllm_env, "LBNHC", block_size=128, blocks=6, wrapper=copying, hybrid="fsfs")
    _, smaller, _ = make_worker(vllm_env, "LBNHC", wrapper=copying, hybrid="fsfs")
    _, alike, _ = make_worker(vllm_env, "LBNHC", block_size=64, blocks=12, wrapper=copying, hybrid="fsfs")
    two_kernel_blocks = dataclasses.replace(handshake_payload(alike, "p-64x2"), physical_blocks_per_logical_kv_block=2)
    for engine, payload, sizes in (
        ("p-128", handshake_payload(larger, "p-128"), "128 tokens, 1"),
        ("p-32", handshake_payload(smaller, "p-32"), "32 tokens, 1"),
        ("p-64x2", two_kernel_blocks, "64 tokens, 2"),  # our kernel blocks, logical blocks of two
    ):
        with pytest.raises(LayoutError, match=rf"engine '{engine}': blocks of {sizes} a logical block; ours 64, 1: "):
            worker.add_remote_agent(payload, 0, 1)
        assert engine not in worker.remote_engines and engine not in worker._remote_agents
    worker.add_remote_agent(handshake_payload(alike, "p-64"), 0, 1)  # our sizes: taken
    assert "p-64" in worker.remote_engines

    # BHLNC groups of 4 and 3 layers: vLLM cuts the shared buffer for each group by its own
    # layer count, so one memory is viewed in two layouts.
    with pytest.raises(
        LayoutError,
        match=r"layers 'model.layers.0.self_attn.attn' and 'model.layers.4.self_attn.attn' "
        r"view one memory in two ways .*unequal layer counts .*\(BHLNC\)",
    ):
        make_worker(vllm_env, "BHLNC", wrapper=copying, hybrid="ffffsss")


def mamba_specs(kinds: str, block_size: int = BLOCK):
    """vLLM's specs of a hybrid model: a layer of full attention for each ``f`` of ``kinds``,
    of Mamba2 state for each ``m``, its page padded to the attention's (as vLLM's platform
    pads it) and its state smaller than a page."""
    from vllm.model_executor.layers.mamba.mamba_utils import MambaStateShapeCalculator
    from vllm.v1.attention.backends.registry import MambaAttentionBackendEnum
    from vllm.v1.kv_cache_interface import FullAttentionSpec, MambaSpec

    full = FullAttentionSpec(block_size=block_size, num_kv_heads=HEADS, head_size=HEAD_DIM, dtype=torch.bfloat16)
    shapes = MambaStateShapeCalculator.mamba2_state_shape(
        tp_world_size=1, intermediate_size=16, n_groups=1, num_heads=2, head_dim=8, state_size=4, conv_kernel=4
    )
    mamba = MambaSpec(
        shapes=shapes,
        dtypes=(torch.bfloat16, torch.float32),
        block_size=block_size,
        page_size_padded=full.page_size_bytes,
        mamba_type=MambaAttentionBackendEnum.MAMBA2,
    )
    assert mamba.real_page_size_bytes < full.page_size_bytes
    return {
        f"model.layers.{i}.mixer" if kind == "m" else f"model.layers.{i}.self_attn.attn": mamba if kind == "m" else full
        for i, kind in enumerate(kinds)
    }


@pytest.fixture
def mamba_conv_state(monkeypatch):
    """vLLM's NIXL worker reads Mamba state in the conv layout it names DS (dim first): asked
    of an environment variable it reads once."""
    from vllm.model_executor.layers.mamba.mamba_utils import get_conv_state_layout

    monkeypatch.setenv("VLLM_SSM_CONV_STATE_LAYOUT", "DS")
    get_conv_state_layout.cache_clear()
    yield
    get_conv_state_layout.cache_clear()


@pytest.mark.parametrize("layouts", ["LBHNC->LBNHC", "LBNHC->LBHNC", "LBNHC->LBNHC"])
@pytest.mark.parametrize("kinds", ["mfmf", "mmmfmmmf", "fmfmm"])
def test_a_mamba_hybrids_attention_is_post_processed_and_its_state_read_as_it_lies(
    vllm_env, copying, mamba_conv_state, layouts, kinds
):
    """A model of attention and Mamba state, as vLLM plans and allocates it: a state block is
    a page of the memory an attention block of that id uses in each tensor. vLLM reads both
    (its own descriptors for the state); kvhost rearranges the attention groups' blocks from
    the sender's layout and never touches a state block. Every token and every state byte
    sent lands as the sender held it; no other block changes."""

    sender_layout, decode_layout = layouts.split("->")
    specs = mamba_specs(kinds)
    _, prefill, prefill_caches = make_worker(vllm_env, sender_layout, blocks=48, wrapper=copying, hybrid=specs)
    connector, worker, caches = make_worker(vllm_env, decode_layout, blocks=24, wrapper=copying, hybrid=specs)
    groups = worker.kv_cache_config.transfer_groups
    assert worker._has_mamba and worker._state_groups and len(worker._state_groups) < len(groups)
    assert all("mixer" not in name for name in worker._memories)
    for i, view in enumerate(prefill_caches.values()):
        fill_random(view, 10 + i)
    for i, view in enumerate(caches.values()):
        fill_random(view, 20 + i)
    before = {name: raw(view).clone() for name, view in caches.items()}
    fake_handshakes(worker, {"p": handshake_payload(prefill, "p")})
    counts = [1 if g in worker._state_groups else 5 for g in range(len(groups))]  # a state block, a prompt's 5
    local, remote, steps = read_one_request(connector, worker, counts)
    ours = [block for ids in local for block in ids]
    state_bytes = next(spec for spec in specs.values() if "Mamba" in type(spec).__name__).real_page_size_bytes
    for g, group in enumerate(groups):
        for name in group.layer_names:
            if name not in caches:  # vLLM pads a group of fewer layers with names of no layer
                continue
            if g in worker._state_groups:
                got, want = raw(caches[name])[local[g]], raw(prefill_caches[name])[remote[g]]
                assert torch.equal(got.flatten(1)[:, :state_bytes], want.flatten(1)[:, :state_bytes]), name
            else:
                got = tokens_of({name: caches[name]}, local[g], BLOCK)
                assert torch.equal(got, tokens_of({name: prefill_caches[name]}, remote[g], BLOCK)), name
    untouched = [b for b in range(24) if b not in ours]
    for name, view in caches.items():
        assert torch.equal(raw(view)[untouched], before[name][untouched]), name
    attention = sorted(b for g, ids in enumerate(local) if g not in worker._state_groups for b in ids)
    posted = [args for _, _, calls in steps for called, args in calls if called == "post_process"]
    assert_one_call_per_step(steps, "post_process")  # of the same layout too: it moves nothing
    assert sorted(posted[0][0]["p"]["r"]) == attention  # every attention group's, no state block


def test_mamba_hybrids_kvhost_cannot_serve_are_refused(vllm_env, copying, mamba_conv_state):
    """Refused at registration, before anything is described or registered: Mamba state
    without attention (nothing of kvhost's to do), in a layout whose state vLLM registers
    at the wrong stride or places apart from the attention's blocks, in host-buffer mode,
    or beside MLA. Refused at the handshake: a sender of such a layout."""
    config = make_config(vllm_env, "LBNHC")
    for layout, specs, change, refusal in (
        ("LBNHC", mamba_specs("mm"), None, r"only of full and sliding-window attention .*got 1: group 0: MambaSpec"),
        ("BLNHC", mamba_specs("mfmf"), None, r"Mamba state, but not with a BLNHC KV cache \(one of LBNHC, LBHNC"),
        ("LHBNC", mamba_specs("mfmf"), None, r"Mamba state, but not with a LHBNC KV cache"),
        ("LBNHC", mamba_specs("mfmf"), "use_host_buffer", r"Mamba state, but not with host buffers"),
        ("LBNHC", mamba_specs("mfmf"), "use_mla", r"Mamba state, but not with MLA attention"),
    ):
        config = make_config(vllm_env, layout)
        kv_cache_config, caches = allocate_hybrid(config, layout, specs=specs)
        connector = make_connector(config, kv_cache_config)
        worker = connector.connector_worker
        if change is not None:
            setattr(worker, change, True)
        with vllm_worker_made(config), pytest.raises(LayoutError, match=refusal):
            connector.register_kv_caches(caches)
        assert worker.kvhost is None and not worker.device_kv_caches and worker.num_regions == 0

    _, worker, _ = make_worker(vllm_env, "LBNHC", wrapper=copying, hybrid=mamba_specs("mfmf"))
    _, alike, _ = make_worker(vllm_env, "LBHNC", wrapper=copying, hybrid=mamba_specs("mfmf"))
    for layout in ("BLNHC", "BLHNC", "LHBNC", "BHLNC"):
        payload = dataclasses.replace(handshake_payload(alike, f"p-{layout}"), kv_cache_layout=layout)
        with pytest.raises(LayoutError, match=rf"engine 'p-{layout}': a {layout} KV cache; with Mamba state"):
            worker.add_remote_agent(payload, 0, 1)
        assert f"p-{layout}" not in worker.remote_engines and f"p-{layout}" not in worker._remote_agents
    worker.add_remote_agent(handshake_payload(alike, "p"), 0, 1)  # LBHNC: taken, rearranged
    assert "p" in worker.remote_engines


@pytest.mark.parametrize("fails", ["post_process", "load_from_host"])
def test_a_step_whose_kvhost_work_fails_reports_its_requests_failed(vllm_env, copying, fails):
    """When kvhost's post-process or host load raises for a step, the requests it was for
    are reported finished and failed (their blocks invalid, as vLLM reports a failed read),
    the error is logged for each, and later steps go on."""
    host_buffer = fails == "load_from_host"
    senders = {"s": ("LBHNC", 32)}
    _, payloads = sender_workers(vllm_env, senders, host_buffer=host_buffer)
    connector, worker, _ = make_worker(
        vllm_env, "LBNHC", block_size=64, blocks=64, host_buffer=host_buffer, wrapper=copying
    )
    fake_handshakes(worker, payloads)
    assert not set().union(*(f for _, f, _ in drive(connector, worker, {"first": ([1], [2, 3], "s")})))
    if fails == "post_process":  # a size kvhost refuses: 48 tokens do not divide our 64
        worker.remote_engines["s"] = dataclasses.replace(worker.remote_engines["s"], block_size=48)
    else:  # host buffers smaller than the ids loaded
        registered = worker.host_xfer_buffers
        worker.host_xfer_buffers = worker.kvhost.host_buffers(num_blocks=8)
    # Ids of a client's choosing (vLLM builds a request's id from its X-Request-Id header).
    requests = {"user/a": ([30, 9], [0, 5, 2, 7], "s"), "user/b": ([40], [6, 1], "s")}
    with patch.object(worker, "_log_failure", wraps=worker._log_failure) as logged:
        steps = drive(connector, worker, requests)
    finished = set().union(*(f for f, _, _ in steps))
    failed = set().union(*(f for _, f, _ in steps))
    assert finished == failed == {"user/a", "user/b"}
    assert worker.get_block_ids_with_load_errors() == {30, 9, 40}
    assert worker.last_post_process is None
    kind = {"post_process": "post_process_failed", "load_from_host": "host_load_failed"}[fails]
    logged_failures = sorted((c.kwargs["req_id"], c.kwargs["failure_type"]) for c in logged.call_args_list)
    assert logged_failures == [("user/a", kind), ("user/b", kind)]
    assert all(isinstance(c.kwargs["error"], RequestError) for c in logged.call_args_list)
    if fails == "load_from_host":
        worker.host_xfer_buffers = registered
    else:
        worker.remote_engines["s"] = dataclasses.replace(worker.remote_engines["s"], block_size=32)
    steps = drive(connector, worker, {"c": ([3], [4, 8], "s")})  # the next step works as usual
    assert not set().union(*(f for _, f, _ in steps))


def test_engines_vllm_drops_are_forgotten_and_their_requests_keep_their_senders(vllm_env, copying):
    """vLLM drops an engine (TTL, a replaced or invalid peer): its notes go with it, so that
    a decoder meeting a new engine id at every prefill restart does not grow; a request read
    from an engine dropped in the very step that finishes it (a replaced peer) is
    post-processed as its read was posted, and reads its sender's tokens."""
    connector, worker, caches = make_worker(vllm_env, "LBNHC", block_size=64, blocks=64, wrapper=copying)
    senders = {"old": ("LBHNC", 128)}
    prefill, payloads = sender_workers(vllm_env, senders)
    for i in range(20):
        engine = f"restart-{i}"
        name = worker.add_remote_agent(dataclasses.replace(payloads["old"], engine_id=engine), 0, 1)
        worker._remote_agents[engine] = {(0, 0): name}  # what vLLM's handshake keeps of it
        worker._cleanup_remote_engine(engine)
    assert worker.remote_engines == {} and worker.larger_remote_blocks == {} and not worker._dropped_engines

    from vllm.distributed.kv_transfer.kv_connector.v1.nixl import NixlConnectorMetadata

    fake_handshakes(worker, payloads)
    for i, view in enumerate(caches.values()):
        fill_random(view, 100 + i)
    before = {name: raw(view).clone() for name, view in caches.items()}
    requests = {"r": ([3, 9, 12], [5, 1], "old")}
    metadata = NixlConnectorMetadata()
    metadata.add_new_req_to_recv(
        "r",
        ([3, 9, 12],),
        {
            "remote_block_ids": ([5, 1],),
            "remote_engine_id": "old",
            "remote_request_id": "r",
            "remote_host": "localhost",
            "remote_port": 1,
            "remote_tp_size": 1,
        },
    )
    done = set()
    for step in range(200):
        connector.bind_connector_metadata(metadata if step == 0 else NixlConnectorMetadata())
        connector.start_load_kv(None)
        if "r" in worker._recving_transfers:  # its read is posted: a new engine now serves the address
            worker._engine_by_address[("localhost", 1)] = "new"
            assert "old" in worker.remote_engines
        results = worker.get_transfer_results()
        connector.clear_connector_metadata()
        done |= set(results.finished_recving)
        if done:
            break
        time.sleep(0.02)
    assert done == {"r"} and not results.failed_recving
    assert "old" not in worker._remote_agents  # vLLM dropped it in that very step
    assert worker.last_post_process is not None and worker.last_post_process.requests == 2  # r/0 and r/2
    assert worker.remote_engines == {} and worker.larger_remote_blocks == {}
    check_tokens(caches, 64, requests, {}, senders, prefill, before, set())

    # Dropped while it shakes hands again: its notes wait for that handshake. One that
    # succeeds notes the engine anew, and its notes stay; one that fails leaves none.
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl import NixlConnectorWorker

    for succeeds in (True, False):
        name = worker.add_remote_agent(dataclasses.replace(payloads["old"], engine_id="back"), 0, 1)
        worker._remote_agents["back"] = {(0, 0): name}
        worker._handshake_futures["back"] = object()  # shaking hands again (a replaced peer)...
        worker._cleanup_remote_engine("back")  # ...as vLLM drops it
        assert "back" in worker.remote_engines and worker._dropped_engines == {"back"}
        meta = dataclasses.replace(payloads["old"], engine_id="back")
        if succeeds:
            worker.add_remote_agent(meta, 0, 1)
            worker._remote_agents["back"] = {(0, 0): name}  # vLLM's done callback, with the next line
        else:
            refusing = patch.object(NixlConnectorWorker, "add_remote_agent", side_effect=RuntimeError("unreachable"))
            with refusing, pytest.raises(RuntimeError):
                worker.add_remote_agent(meta, 0, 1)
        del worker._handshake_futures["back"]
        if succeeds:
            worker._forget_dropped_engines()
        else:
            worker.get_transfer_results()  # each step looks again, once the handshake is done
        assert set(worker.remote_engines) == set(worker.larger_remote_blocks) == ({"back"} if succeeds else set())
        assert not worker._dropped_engines
        if succeeds:
            worker._cleanup_remote_engine("back")  # no handshake under way: forgotten at once
        assert worker.remote_engines == {} and not worker._dropped_engines


def documented_sender_layouts() -> dict[str, tuple[set[str], bool]]:
    """docs/integrations.md's table of sender layouts: decoder -> (senders, of our block size only)."""
    import re
    from pathlib import Path

    text = (Path(__file__).resolve().parents[1] / "docs" / "integrations.md").read_text()
    table = text.split("<!-- sender-layouts:", 1)[1].split("\n\n", 1)[0]
    rows = {}
    for decoder, senders in re.findall(r"^\| `(\w+)` \| (.+) \|$", table, flags=re.M):
        rows[decoder] = (set(re.findall(r"`(\w+)`", senders)), "our block size only" in senders)
    return rows


def test_the_sender_layouts_the_docs_list_are_the_ones_taken(vllm_env, copying):
    """Every decoder layout against every sender layout, at sender blocks of half, once and
    twice ours: the handshake takes exactly the pairs docs/integrations.md lists, and a
    refused one notes nothing (the sender's requests then fail, as vLLM fails them)."""
    documented = documented_sender_layouts()
    assert set(documented) == set(LAYOUTS)
    taken, expected = set(), set()
    for decoder in LAYOUTS:
        senders, same_size_only = documented[decoder]
        for layout in LAYOUTS:
            for size in (32, 64, 128):
                _, worker, _ = make_worker(vllm_env, decoder, block_size=64, blocks=64, wrapper=copying)
                _, payloads = sender_workers(vllm_env, {"s": (layout, size)})
                if layout in senders and (size == 64 or not same_size_only):
                    expected.add((decoder, layout, size))
                try:
                    worker.add_remote_agent(payloads["s"], 0, 1)
                    taken.add((decoder, layout, size))
                except (AssertionError, LayoutError):  # vLLM's refusal, or kvhost's
                    assert not worker.remote_engines and not worker.larger_remote_blocks
    assert sorted(taken) == sorted(expected)


def test_cpu_attentions_repack_runs_after_kvhosts_post_process(vllm_env, copying):
    """A CPU_ATTN decoder repacks blocks from a sender of another attention backend into
    its own format after the receive post-process, as vLLM's own worker orders it: kvhost's
    load and post-process come first, then one repack per request, and the bytes are the
    ones vLLM's own connector leaves. (The platform's repack is a native op this CPU wheel
    lacks; it is played by one that, like it, rewrites [B, H, N, 2D] blocks as K rows then V
    rows.)"""
    from vllm.config import KVTransferConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl import NixlConnectorMetadata
    from vllm.platforms import current_platform

    order = []

    def repack(cls, kv_cache, indices):
        order.append(("repack", sorted(indices.tolist())))
        blocks, heads, tokens, fused = kv_cache.shape
        packed = kv_cache.index_select(0, indices)
        packed = torch.cat([packed[..., : fused // 2], packed[..., fused // 2 :]], dim=2)
        kv_cache.view(blocks, heads, 2 * tokens, fused // 2).index_copy_(0, indices, packed)

    senders = {"gpu": ("LBHNC", 32)}
    requests = {"a": ([3, 9], [0, 5, 2, 7], "gpu"), "b": ([4, 11], [6, 1, 3, 8], "gpu")}
    received = {}
    vllms_config = make_config
    with patch.object(type(current_platform), "pack_kv_cache", classmethod(repack), create=True):
        for which in ("vllm", "kvhost", "failing"):  # failing: kvhost's post-process raises
            _, payloads = sender_workers(vllm_env, senders)
            payloads["gpu"] = dataclasses.replace(payloads["gpu"], attn_backend_name="FLASH_ATTN")
            if which == "vllm":

                def own_connector(*args, **kwargs):
                    config = vllms_config(*args, **kwargs)
                    config.kv_transfer_config = KVTransferConfig(kv_connector="NixlConnector", kv_role="kv_both")
                    return config

                with patch(f"{__name__}.make_config", own_connector):
                    connector, worker, caches = make_worker(
                        vllm_env, "LBHNC", block_size=64, blocks=64, wrapper=copying
                    )
            else:
                connector, worker, caches = make_worker(vllm_env, "LBHNC", block_size=64, blocks=64, wrapper=copying)
                original = worker.kvhost.post_process

                def recorded(*args, _post_process=original, _fails=which == "failing", **kwargs):
                    order.append(("post_process", None))
                    if _fails:
                        raise RequestError("refused for this test")
                    return _post_process(*args, **kwargs)

                worker.kvhost.post_process = recorded
            assert worker.backend_name == "CPU_ATTN"
            fake_handshakes(worker, payloads)
            for i, view in enumerate(caches.values()):
                fill_random(view, 100 + i)
            order.clear()
            metadata = NixlConnectorMetadata()
            for req, (local_ids, remote_ids, engine) in requests.items():
                params = {
                    "remote_block_ids": (remote_ids,),
                    "remote_engine_id": engine,
                    "remote_request_id": req,
                    "remote_host": "localhost",
                    "remote_port": 1,
                }
                metadata.add_new_req_to_recv(req, (local_ids,), params)
            done = set()
            for step in range(200):
                connector.bind_connector_metadata(metadata if step == 0 else NixlConnectorMetadata())
                connector.start_load_kv(None)
                done |= set(worker.get_transfer_results().finished_recving)
                connector.clear_connector_metadata()
                if done >= set(requests):
                    break
                time.sleep(0.02)
            received[which] = {name: raw(view)[[3, 9, 4, 11]].clone() for name, view in caches.items()}
            if which == "kvhost":
                assert order[0] == ("post_process", None) and sorted(order[1:]) == [
                    ("repack", [3, 9]),
                    ("repack", [3, 9]),
                    ("repack", [4, 11]),
                    ("repack", [4, 11]),
                ]  # one repack per request and layer, after the one post-process
            if which == "failing":  # failed requests' blocks are not repacked
                assert order == [("post_process", None)] * 3  # the batch, then each request alone
    assert all(torch.equal(received["vllm"][name], received["kvhost"][name]) for name in received["vllm"])


class HoldingNixlWrapper(CopyingNixlWrapper):
    """The copying agent, but a transfer posted while ``holding`` stays in flight (its bytes
    landed) until its handle leaves ``held``."""

    holding: ClassVar[bool] = False
    held: ClassVar[set[int]] = set()

    def transfer(self, handle, *args, **kwargs):
        if self.holding:
            self.held.add(handle)
        return super().transfer(handle, *args, **kwargs)

    def check_xfer_state(self, handle):
        return "PROC" if handle in self.held else super().check_xfer_state(handle)


@pytest.mark.parametrize("case", ["accepted", "accepted, both ending in one step", "refused"])
def test_a_read_in_flight_across_its_engines_new_handshake_is_post_processed_as_it_was_read(vllm_env, copying, case):
    """An engine registers its cache again (a bumped registration generation: vLLM drops it
    and shakes hands anew) with another layout while a read of its old blocks is in flight.
    That read lands the old layout's bytes and is post-processed as the old layout, whether
    vLLM takes the new registration (and a read of it ends in a later step, or in the same
    one) or its checks, on the handshake thread, refuse it while the read ends on the main
    thread (a step never sees a layout vLLM has not accepted)."""
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl import NixlConnectorMetadata
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl.base_worker import NixlBaseConnectorWorker

    HoldingNixlWrapper.held.clear()
    HoldingNixlWrapper.holding = True
    connector, worker, caches = make_worker(vllm_env, "LBNHC", block_size=64, blocks=64, wrapper=HoldingNixlWrapper)
    prefill, payloads = sender_workers(vllm_env, {"p": ("LBHNC", 64), "again": ("LBNHC", 64)})
    registrations = [payloads["p"], handshake_payload(prefill["again"][0], "p")]  # one engine id, two layouts

    def handshake(host, port, remote_tp_size, expected_engine_id, *args, **kwargs):
        return {(0, 0): worker.add_remote_agent(registrations[0], 0, remote_tp_size)}, 0.0

    def step(requests=None, generation=0):
        metadata = NixlConnectorMetadata()
        for req_id, (local_ids, remote_ids) in (requests or {}).items():
            sender = {"remote_block_ids": (remote_ids,), "remote_engine_id": "p", "remote_request_id": req_id}
            sender |= {"remote_host": "localhost", "remote_port": 1, "remote_tp_size": 1}
            sender["remote_registration_generation"] = generation
            metadata.add_new_req_to_recv(req_id, (local_ids,), sender, awaiting_kvs=True)
        connector.bind_connector_metadata(metadata)
        connector.start_load_kv(None)
        results = worker.get_transfer_results()
        connector.clear_connector_metadata()
        return results

    def posted(req_id):  # its bytes landed, and it is held in flight
        for _ in range(200):
            if worker._recving_transfers.get(req_id):
                return
            time.sleep(0.02)
            step()
        raise AssertionError(f"{req_id} was never posted")

    worker._nixl_handshake = handshake
    try:
        step({"r1": ([3], [5])})
        posted("r1")
        registrations.pop(0)
        if case == "accepted":
            HoldingNixlWrapper.holding = False
            done = set()
            for _ in range(200):
                done |= step({"r2": ([7], [6])} if not done else None, generation=1).finished_recving
                if "r2" in done:
                    break
                time.sleep(0.02)
            assert worker.remote_engines["p"].kv_cache_layout == "LBNHC"  # the new registration's
            HoldingNixlWrapper.held.clear()
            results = step()
        elif case == "accepted, both ending in one step":
            step({"r2": ([7], [6])}, generation=1)
            posted("r2")
            HoldingNixlWrapper.holding = False
            HoldingNixlWrapper.held.clear()
            results = step()
            assert {"r1", "r2"} <= set(results.finished_recving) and not results.failed_recving
            assert torch.equal(tokens_of(caches, [7], 64), tokens_of(prefill["again"][1], [6], 64))
        else:
            HoldingNixlWrapper.holding = False
            checking, refuse = threading.Event(), threading.Event()

            def checks_then_refuses(self, meta, *args, **kwargs):  # vLLM's checks, slow, then a refusal
                checking.set()
                refuse.wait(30)
                raise AssertionError("Number of KV layers must match between prefill and decode")

            with patch.object(NixlBaseConnectorWorker, "_validate_remote_agent_handshake", checks_then_refuses):
                step({"r2": ([7], [6])}, generation=1)
                assert checking.wait(30)
                HoldingNixlWrapper.held.clear()  # r1 ends while the new registration is being checked
                results = step()
                refuse.set()
                for _ in range(200):
                    if not worker._handshake_futures:
                        break
                    time.sleep(0.02)
            assert "p" not in worker._remote_agents
    finally:
        HoldingNixlWrapper.holding = False
        HoldingNixlWrapper.held.clear()
    assert "r1" in results.finished_recving and "r1" not in results.failed_recving
    assert torch.equal(tokens_of(caches, [3], 64), tokens_of(prefill["p"][1], [5], 64))
    assert worker.last_post_process is not None and worker.last_post_process.bytes_moved > 0
    assert worker._read_from == {}  # a request's sender is kept while vLLM receives it, no longer


def test_a_request_received_without_a_read_posted_here_is_refused_by_name(vllm_env, copying_worker):
    """Every read is posted through _read_blocks, which notes its sender; a finished request
    without one is a KVHostError naming it (then tried alone, failing alone), not a KeyError."""
    _, worker, _ = copying_worker
    _, payloads = sender_workers(vllm_env, {"hnd": ("LBHNC", 64)})
    worker.add_remote_agent(payloads["hnd"], 0, 1)
    with pytest.raises(RequestError, match=r"request 'x': received from 'hnd', but no read of it was posted here"):
        worker._post_process_batch({"x": received_request([3], [5])})


def test_a_read_from_an_engine_with_no_handshake_noted_fails_its_request(vllm_env, copying):
    """vLLM posts a read only after a handshake kvhost noted; one that came without fails its
    request as vLLM fails a read it cannot set up, noting nothing and posting nothing."""
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl.tp_mapping import ReadSpec

    _, worker, _ = make_worker(vllm_env, "LBNHC", block_size=64, blocks=64, wrapper=copying)
    posted = dict(CopyingNixlWrapper.posted)
    read = ReadSpec(remote_rank=0, local_block_ids=[[3]], remote_block_ids=[[5]])
    assert worker._read_blocks(read, "never-met", "r") is False
    assert "r" in worker._recv_failures and "r" not in worker._read_from
    assert CopyingNixlWrapper.posted == posted


def test_a_shutdown_with_a_read_in_flight_frees_nothing_the_read_may_write_into(vllm_env, copying, monkeypatch):
    """NIXL's release of a read in flight does not stop it, and vLLM's shutdown releases
    every read, deregisters the memory and drops the host buffers: the read would land in
    freed memory. With one in flight, shutdown (and sleep's deregistration) lets go of
    nothing and keeps the worker to the process's end; once the read is over, shutdown is
    vLLM's."""
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl import NixlConnectorMetadata

    import kvhost.integrations.vllm_connector as connector_module
    from kvhost.nixl import TransferError

    HoldingNixlWrapper.held.clear()
    HoldingNixlWrapper.holding = True
    _, payloads = sender_workers(vllm_env, {"p": ("LBHNC", 64)})
    connector, worker, _ = make_worker(
        vllm_env, "LBNHC", block_size=64, blocks=64, host_buffer=True, wrapper=HoldingNixlWrapper
    )
    worker.copy_blocks = forbid_vllm_copies
    fake_handshakes(worker, payloads)
    kept, released, deregistered = [], [], []
    monkeypatch.setattr(connector_module, "keep_past_exit", kept.append)  # the test's own process lives on
    monkeypatch.setattr(worker.nixl_wrapper, "release_xfer_handle", released.append, raising=False)
    monkeypatch.setattr(worker.nixl_wrapper, "deregister_memory", deregistered.append, raising=False)
    buffers = dict(worker.host_xfer_buffers)
    try:
        for step in range(200):
            metadata = NixlConnectorMetadata()
            if step == 0:  # once: vLLM holds it while the handshake runs (slowly, traced), then reads it
                sender = {"remote_block_ids": ([5, 6],), "remote_engine_id": "p", "remote_request_id": "r"}
                sender |= {"remote_host": "localhost", "remote_port": engine_port("p"), "remote_tp_size": 1}
                metadata.add_new_req_to_recv("r", ([3, 4],), sender)
            connector.bind_connector_metadata(metadata)
            connector.start_load_kv(None)
            worker.get_transfer_results()
            connector.clear_connector_metadata()
            if worker._recving_transfers.get("r"):
                break
            time.sleep(0.02)
        (handle,) = worker._recving_transfers["r"]
        assert worker.reads_in_flight() == 1
        with pytest.raises(TransferError, match=r"1 NIXL read\(s\) still in flight may write into the KV caches"):
            worker.unregister_kv_caches()
        worker.shutdown()
        assert kept == [worker] and released == [] and deregistered == []
        assert worker._recving_transfers == {"r": [handle]} and worker.host_xfer_buffers == buffers
        HoldingNixlWrapper.held.clear()  # the read lands
        assert worker.reads_in_flight() == 0
        worker.shutdown()
        assert released == [handle] and deregistered and worker.host_xfer_buffers == {} and kept == [worker]
    finally:
        HoldingNixlWrapper.holding = False
        HoldingNixlWrapper.held.clear()
