"""How a Gaudi-style engine hands its caches to kvhost.

The engine keeps, per layer, K and V as two tensors ``[num_blocks * block_size,
kv_heads, head_dim]``: blocks and tokens fused in the leading dim, so a slot id indexes a
token directly. An fp8 cache is stored as ``uint8`` (the bytes of float8), which the
device's index ops handle. kvhost needs to see blocks, and nothing more:

- ``unflatten(0, (num_blocks, block_size))`` views the same memory as ``[B, N, H, C]``;
- a ``(K, V)`` tuple with ``axes="KBNHC"`` says the tuple index is ``K``;
- fp8 as bytes needs nothing: kvhost moves and rearranges raw bytes, and a host buffer
  or a sender may hold the same bytes as ``float8_e4m3fn``.

The staging copy and the post-process are then kvhost's ``VllmCaches`` (such an engine is
a vLLM platform plugin): the plugin writes neither.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from kvhost.backend import Backend
from kvhost.errors import LayoutError
from kvhost.integrations.vllm import VllmCaches

AXES = "KBNHC"  # each member [B, N, H, C]; the tuple index is K
KVPair = tuple[torch.Tensor, torch.Tensor]


def block_views(kv_caches: Mapping[str, KVPair], block_size: int) -> dict[str, KVPair]:
    """Each layer's (K, V), ``[num_blocks * block_size, H, C]`` each, as ``[B, N, H, C]`` views."""
    views: dict[str, KVPair] = {}
    for name, pair in kv_caches.items():
        if not isinstance(pair, tuple) or len(pair) != 2:
            raise LayoutError(f"layer {name!r} must be a (key, value) tuple, got {type(pair).__name__}")
        key, value = pair
        for tensor in pair:
            if tensor.dim() != 3 or tensor.shape[0] % block_size:
                raise LayoutError(
                    f"layer {name!r}: expected [num_blocks * block_size, heads, head_dim] with block size "
                    f"{block_size}, got shape {tuple(tensor.shape)}"
                )
        blocks = key.shape[0] // block_size
        views[name] = (key.unflatten(0, (blocks, block_size)), value.unflatten(0, (blocks, block_size)))
    return views


class GaudiStyleCaches(VllmCaches):
    """The engine's caches, registered with kvhost once: save, load and post-process in one call each."""

    def __init__(
        self, kv_caches: Mapping[str, KVPair], block_size: int, *, backend: str | Backend | None = None
    ) -> None:
        self.views = block_views(kv_caches, block_size)  # what kvhost sees; the engine keeps its own tensors
        self.block_size = block_size
        super().__init__(self.views, axes=AXES, backend=backend)
