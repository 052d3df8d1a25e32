"""kvhost's connector where vLLM's attention kernel blocks are smaller than its logical blocks
(r = logical / kernel > 1, as GPU attention backends often choose), with and without Mamba
state beside the attention. CPU attention never picks r > 1 on its own: vLLM's choice
(``select_common_block_size``, which its NIXL worker calls in ``_sync_block_size_with_kernel``)
is forced to the kernel size, and the caches are allocated as vLLM's GPU model runner
allocates them (``allocate_kv_cache(..., kernel_block_sizes)``: attention views of r x the
logical blocks, Mamba views of logical blocks).

The truth is computed here from vLLM's plan alone (each KV cache tensor's offset, layer
stride, logical block stride) and the layout's letters, never from vLLM's views or
kvhost's descriptions: token ``t`` of logical block ``b`` lies in kernel block
``b * r + t // K`` at position ``t % K`` (vLLM's virtual block splitting), and a state
block's bytes are the first ``real_page_size_bytes`` of logical page ``b``. Every byte of
the decode side's one buffer is checked: the request's attention tokens are the sender's,
its state bytes the sender's, and every other byte (other blocks, the padded rest of each
state page, the padding past each tensor) is the random sentinel it held before.
"""

from __future__ import annotations

import contextlib
import itertools
from unittest.mock import patch

import numpy as np
import pytest
import test_vllm_connector as base
import torch
from test_vllm_connector import (
    HEAD_DIM,
    HEADS,
    drive,
    fake_handshakes,
    handshake_payload,
    make_config,
    make_connector,
    mamba_specs,
    vllm_worker_made,
)

# The fixtures of test_vllm_connector.py, used here as there.
vllm_env, copying, mamba_conv_state = base.vllm_env, base.copying, base.mamba_conv_state

pytestmark = base.pytestmark  # the vllm marker, and a skip where vLLM is not installed

BASE = "vllm.distributed.kv_transfer.kv_connector.v1.nixl.base_worker"
LOGICAL = 64  # logical blocks of 64 tokens; kernel blocks of 64 (r = 1, the control), 32 (r = 2), 16 (r = 4)
ITEM = 2  # bfloat16
C = 2 * HEAD_DIM  # K and V packed in the content dim


@contextlib.contextmanager
def kernel_block_size(size: int):
    """vLLM's NIXL worker picks ``size`` as its attention kernel block size."""
    with patch(f"{BASE}.select_common_block_size", lambda block_size, backends, specs: size):
        yield


def attention_specs(kinds: str, block_size: int):
    """Full attention for each ``f`` of ``kinds``, a sliding window of 128 tokens for each ``s``."""
    from vllm.v1.kv_cache_interface import FullAttentionSpec, SlidingWindowSpec

    shape = {"block_size": block_size, "num_kv_heads": HEADS, "head_size": HEAD_DIM, "dtype": torch.bfloat16}
    full, sliding = FullAttentionSpec(**shape), SlidingWindowSpec(**shape, sliding_window=128)
    return {f"model.layers.{i}.self_attn.attn": sliding if kind == "s" else full for i, kind in enumerate(kinds)}


def allocate_with_kernel_blocks(config, layout: str, specs, blocks: int, kernel: int):
    """vLLM's plan of ``specs`` over one pool of ``blocks`` logical blocks, allocated as the GPU
    model runner does: attention groups in kernel blocks of ``kernel`` tokens, Mamba groups
    in their logical blocks (``prepare_kernel_block_sizes``)."""
    from vllm.config import set_current_vllm_config
    from vllm.v1.core.kv_cache_planning import get_kv_cache_config_from_groups, get_kv_cache_groups
    from vllm.v1.kv_cache_interface import MambaSpec
    from vllm.v1.kv_cache_layout import KVCacheLayout
    from vllm.v1.worker.utils import allocate_kv_cache

    with set_current_vllm_config(config):
        groups = get_kv_cache_groups(config, dict(specs))
        page = max(spec.page_size_bytes for spec in specs.values())
        tensors = max(len(group.layer_names) for group in groups)
        kv_cache_config = get_kv_cache_config_from_groups(config, groups, page * blocks * tensors)
        kernels = [
            group.kv_cache_spec.block_size if isinstance(group.kv_cache_spec, MambaSpec) else kernel
            for group in kv_cache_config.kv_cache_groups
        ]
        caches = allocate_kv_cache(kv_cache_config, torch.device("cpu"), KVCacheLayout[layout], kernels)
    assert kv_cache_config.num_blocks == blocks, kv_cache_config.num_blocks
    return kv_cache_config, caches


def make_kernel_worker(model, layout, specs, blocks, wrapper, kernel, logical=LOGICAL):
    config = make_config(model, layout, logical)
    kv_cache_config, caches = allocate_with_kernel_blocks(config, layout, specs, blocks, kernel)
    with kernel_block_size(kernel):
        connector = make_connector(config, kv_cache_config, wrapper)
    worker = connector.connector_worker
    with vllm_worker_made(config, wrapper):
        connector.register_kv_caches(caches)
    return connector, worker, caches, kv_cache_config


def flat_buffer(caches) -> torch.Tensor:
    """The one int8 buffer every view of ``caches`` lies in (vLLM allocates one)."""
    storages = {view.untyped_storage().data_ptr() for view in caches.values()}
    assert len(storages) == 1, storages
    view = next(iter(caches.values()))
    return torch.empty(0, dtype=torch.uint8).set_(view.untyped_storage())


def token_offsets(tensor, layer: int, layout: str, logical_block: int, kernel: int, r: int) -> np.ndarray:
    """Byte offsets in the buffer of one logical block's tokens of one layer: [tokens, H, C*ITEM],
    from vLLM's plan (offset, layer stride, logical block stride) and the layout's letters."""
    base = tensor.offset + layer * tensor.layer_stride + logical_block * tensor.block_stride
    kernel_bytes = tensor.block_stride // r
    assert kernel_bytes == HEADS * kernel * C * ITEM  # dense kernel pages (the layouts taken with r > 1)
    t = np.arange(kernel * r)[:, None, None]
    h = np.arange(HEADS)[None, :, None]
    byte = np.arange(C * ITEM)[None, None, :]
    n = t % kernel
    inner = (n * HEADS + h) * C * ITEM if layout.endswith("NHC") else (h * kernel + n) * C * ITEM
    return base + (t // kernel) * kernel_bytes + inner + byte


def layer_places(kv_cache_config):
    """layer name -> (its KV cache tensor, its index there)."""
    return {name: (tensor, i) for tensor in kv_cache_config.kv_cache_tensors for i, name in enumerate(tensor.layers)}


def expected_buffer(
    before, sender_flat, decode_cfg, sender_cfg, decode_layout, sender_layout, local, remote, state_bytes, kernel
):
    """The decode buffer as it must be after the request: ``before`` with the sender's tokens of
    the request's attention blocks and the sender's state of its state blocks written in."""
    from vllm.v1.kv_cache_interface import MambaSpec

    r = LOGICAL // kernel
    want = before.clone().numpy()
    got_from = sender_flat.numpy()
    ours, theirs = layer_places(decode_cfg), layer_places(sender_cfg)
    # vLLM reads a state group's blocks in every region that holds a Mamba layer of any
    # state group (its SSM regions), also where this group's layer there is padding (a
    # group of fewer layers): those pages are the group's own block, no layer's state.
    state_names = [
        name
        for group in decode_cfg.kv_cache_groups
        if isinstance(group.kv_cache_spec, MambaSpec)
        for name in group.layer_names
        if name in ours
    ]
    for g, group in enumerate(decode_cfg.kv_cache_groups):
        state = isinstance(group.kv_cache_spec, MambaSpec)
        for name in state_names if state else group.layer_names:
            if name not in ours:  # a padded group's name of no layer
                continue
            (dt, dl), (st, sl) = ours[name], theirs[name]
            for mine, sent in zip(local[g], remote[g], strict=True):
                if state:
                    at = dt.offset + dl * dt.layer_stride + mine * dt.block_stride
                    src = st.offset + sl * st.layer_stride + sent * st.block_stride
                    want[at : at + state_bytes] = got_from[src : src + state_bytes]
                else:
                    to = token_offsets(dt, dl, decode_layout, mine, kernel, r)
                    src = token_offsets(st, sl, sender_layout, sent, kernel, r)
                    want[to] = got_from[src]
    return torch.from_numpy(want)


def one_request(worker, counts, sender_blocks, blocks, seed=7):
    import random

    rng = random.Random(seed)
    sent, ours = rng.sample(range(sender_blocks), sum(counts)), rng.sample(range(blocks), sum(counts))
    spans = list(itertools.pairwise(np.cumsum([0, *counts])))
    return tuple(sent[a:b] for a, b in spans), tuple(ours[a:b] for a, b in spans)


CASES = {  # layouts, layer kinds (m Mamba2, f full attention; "" attention-only one group)
    "mamba-mfmf-LBHNC->LBNHC": ("LBHNC->LBNHC", "mfmf"),
    "mamba-mfmf-LBNHC->LBHNC": ("LBNHC->LBHNC", "mfmf"),
    "mamba-mfmf-LBNHC->LBNHC": ("LBNHC->LBNHC", "mfmf"),
    "mamba-mmmfmmmf-LBHNC->LBNHC": ("LBHNC->LBNHC", "mmmfmmmf"),
    "mamba-fmfmm-LBNHC->LBHNC": ("LBNHC->LBHNC", "fmfmm"),
    "attention-ff-LBHNC->LBNHC": ("LBHNC->LBNHC", "ff"),
    "attention-ff-LBNHC->LBHNC": ("LBNHC->LBHNC", "ff"),
    "attention-ff-LBNHC->LBNHC": ("LBNHC->LBNHC", "ff"),
    "attention-fsfs-LBHNC->LBNHC": ("LBHNC->LBNHC", "fsfs"),  # full and sliding-window groups, one pool
}


@pytest.mark.parametrize("kernel", [64, 32, 16], ids=["r1", "r2", "r4"])
@pytest.mark.parametrize("case", list(CASES))
def test_kernel_blocks_smaller_than_logical_blocks_land_every_token_and_state_byte(
    vllm_env, copying, request, case, kernel
):
    layouts, kinds = CASES[case]
    sender_layout, decode_layout = layouts.split("->")
    mamba = "m" in kinds
    if mamba:
        request.getfixturevalue("mamba_conv_state")
    specs = mamba_specs(kinds, LOGICAL) if mamba else attention_specs(kinds, LOGICAL)
    r = LOGICAL // kernel
    sender_blocks, blocks = 24, 12
    _, prefill, prefill_caches, prefill_cfg = make_kernel_worker(
        vllm_env, sender_layout, specs, sender_blocks, copying, kernel
    )
    connector, worker, caches, decode_cfg = make_kernel_worker(vllm_env, decode_layout, specs, blocks, copying, kernel)

    # vLLM's worker took the forced kernel size: blocks of KERNEL tokens, r a logical block.
    for w in (prefill, worker):
        assert w.block_size == kernel and w._physical_blocks_per_logical_kv_block == r
    assert worker.kvhost is not None
    groups = worker.kv_cache_config.transfer_groups
    if mamba:
        assert worker._has_mamba and worker._state_groups
    else:
        assert not worker._state_groups and len(groups) == (2 if "s" in kinds else 1)
    for name, view in caches.items():
        if "mixer" not in name:
            assert view.shape[0] == blocks * r and view.shape[2] == kernel, (name, tuple(view.shape))

    sender_flat, flat = flat_buffer(prefill_caches), flat_buffer(caches)
    sender_flat.copy_(
        torch.randint(0, 256, sender_flat.shape, dtype=torch.uint8, generator=torch.Generator().manual_seed(1))
    )
    flat.copy_(torch.randint(0, 256, flat.shape, dtype=torch.uint8, generator=torch.Generator().manual_seed(2)))
    before = flat.clone()

    fake_handshakes(worker, {"p": handshake_payload(prefill, "p")})
    counts = [1 if g in worker._state_groups else 3 for g in range(len(groups))]  # 3 logical blocks: 6 kernel
    remote, local = one_request(worker, counts, sender_blocks, blocks)
    steps = drive(connector, worker, {"r": (local, remote, "p")})
    assert not set().union(*(failed for _, failed, _ in steps)), steps
    assert set().union(*(done for done, _, _ in steps)) == {"r"}

    # (a), (b): kvhost is called once, with the attention groups' kernel blocks and no state block.
    posted = [args for _, _, calls in steps for called, args in calls if called == "post_process"]
    assert len(posted) == 1, posted
    kernel_ids = sorted(
        b * r + k for g, ids in enumerate(local) if g not in worker._state_groups for b in ids for k in range(r)
    )
    assert sorted(posted[0][0]["p"]["r"]) == kernel_ids
    assert set(posted[0][1]) == {"p"} and posted[0][1]["p"].block_size == kernel
    assert posted[0][1]["p"].kv_cache_layout == sender_layout

    # (c): every byte of the buffer.
    state_bytes = 0
    if mamba:
        state_bytes = next(s for s in specs.values() if "Mamba" in type(s).__name__).real_page_size_bytes
    want = expected_buffer(
        before, sender_flat, decode_cfg, prefill_cfg, decode_layout, sender_layout, local, remote, state_bytes, kernel
    )
    changed = (want != before).sum().item()
    assert changed > 0
    diff = (flat != want).nonzero().flatten()
    assert diff.numel() == 0, f"{diff.numel()} bytes differ, first at {diff[:8].tolist()}"


def test_a_mamba_hybrid_in_kernel_blocks_takes_only_senders_of_its_kernel_and_logical_sizes(
    vllm_env, copying, mamba_conv_state
):
    """A decoder of logical blocks of 64 in kernel blocks of 32 (r = 2) beside Mamba state:
    a sender of the same sizes is taken; one of kernel blocks of 64 (r = 1), or of logical
    blocks of 32 in kernel blocks of 32 (r = 1), is refused at the handshake, nothing noted
    (vLLM's lists of each side's blocks would pair other tokens)."""
    from kvhost.errors import LayoutError

    specs = mamba_specs("mfmf", LOGICAL)
    _, worker, _, _ = make_kernel_worker(vllm_env, "LBNHC", specs, 12, copying, 32)
    assert worker._is_hma_required and worker._state_groups
    _, alike, _, _ = make_kernel_worker(vllm_env, "LBHNC", specs, 12, copying, 32)
    _, whole, _, _ = make_kernel_worker(vllm_env, "LBHNC", specs, 12, copying, 64)
    _, small, _, _ = make_kernel_worker(vllm_env, "LBHNC", mamba_specs("mfmf", 32), 24, copying, 32, logical=32)
    for engine, sender, sizes in (("p-64x1", whole, "64 tokens, 1"), ("p-32x1", small, "32 tokens, 1")):
        with pytest.raises(LayoutError, match=rf"engine '{engine}': blocks of {sizes} a logical block; ours 32, 2"):
            worker.add_remote_agent(handshake_payload(sender, engine), 0, 1)
        assert engine not in worker.remote_engines and engine not in worker._remote_agents
    worker.add_remote_agent(handshake_payload(alike, "p"), 0, 1)
    assert "p" in worker.remote_engines
