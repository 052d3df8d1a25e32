"""The values prefill writes and decode checks: every token of every layer a seeded hash of its indices.

Both processes compute them from the options alone, so decode verifies bit for bit what
prefill never sent it; decode blocks hold ``SENTINEL_BYTE`` before anything lands.
"""

from __future__ import annotations

import zlib
from collections.abc import Sequence

import numpy as np
import torch

from kvhost.caches import CacheSet
from kvhost.layout import Layout
from kvhost.testing import raw

SENTINEL_BYTE = 0xA5  # what every decode block holds before anything lands in it


def token_values(
    seed: int, request: int, layer: int, tokens: int, heads: int, head_dim: int, itemsize: int, *, kv: int = 2
) -> torch.Tensor:
    """Raw ``[tokens, K, H, C]`` values of one request's layer: a hash of every index, seeded.
    An MLA latent is ``kv`` 1 and ``heads`` 1.

    Each element is a bijective 32-bit mix of its flat index and a key from (seed, request,
    layer), so no two elements of a request's layer agree in 32 bits and a misplaced byte
    shows; the low ``itemsize`` bytes are kept.
    """
    key = np.uint32(zlib.crc32(f"{seed}/{request}/{layer}".encode()))
    x = np.arange(tokens * kv * heads * head_dim, dtype=np.uint32)
    x *= np.uint32(0x9E3779B1)
    x += key
    for shift, multiplier in ((16, 0x85EBCA6B), (13, 0xC2B2AE35)):
        x ^= x >> np.uint32(shift)
        x *= np.uint32(multiplier)
    x ^= x >> np.uint32(16)
    kept = {1: (np.uint8, np.uint8), 2: (np.uint16, np.int16), 4: (np.uint32, np.int32)}[itemsize]
    values = x.astype(kept[0]).view(kept[1]) if itemsize < 4 else x.view(np.int32)
    return torch.from_numpy(values).reshape(tokens, kv, heads, head_dim)


def layer_views(cache_set: CacheSet) -> list[tuple[str, torch.Tensor, str]]:
    """(name, tensor, axes) of every layer in order: each member, or each layer of a member
    that holds them all (an ``L`` axis), selected out of it."""
    views = []
    for member in cache_set.members:
        axes = member.layout.axes
        if "L" not in axes:
            views.append((member.layer, member.tensor, axes))
            continue
        at, rest = axes.index("L"), axes.replace("L", "")
        views += [(f"{member.layer}[{i}]", member.tensor.select(at, i), rest) for i in range(member.tensor.shape[at])]
    return views


def write_tokens(tensor: torch.Tensor, axes: str, block_ids: Sequence[int], values: torch.Tensor) -> None:
    """Store raw ``[tokens, K, H, C]`` values in ``block_ids`` (the last block may be partly used);
    a cache without K or H (an MLA latent) takes them of size 1."""
    memory, letters = memory_order(tensor, axes)
    block_size = memory.shape[letters.index("N")]
    padded = torch.zeros((len(block_ids) * block_size, *values.shape[1:]), dtype=values.dtype)
    padded[: values.shape[0]] = values
    blocks = padded.reshape(len(block_ids), block_size, *values.shape[1:])  # B N K H C
    blocks = blocks.reshape(*blocks.shape[:2], *[blocks.shape[2 + "KHC".index(a)] for a in inner(letters)])
    source = blocks.permute(["BN".index(a) if a in "BN" else 2 + inner(letters).index(a) for a in letters])
    memory.index_copy_(letters.index("B"), torch.as_tensor(block_ids), source)


def read_tokens_fast(tensor: torch.Tensor, axes: str, block_ids: Sequence[int]) -> torch.Tensor:
    """Raw ``[tokens, K, H, C]`` of ``block_ids``, gathered in memory order (fast for any layout);
    K and H of size 1 where the cache has none."""
    memory, letters = memory_order(tensor, axes)
    picked = memory.index_select(letters.index("B"), torch.as_tensor(block_ids))
    for letter in "KH":
        if letter not in letters:
            picked, letters = picked.unsqueeze(-1), letters + letter
    tokens = picked.permute([letters.index(a) for a in "BNKHC"])
    return tokens.reshape(-1, *tokens.shape[2:])


def inner(letters: str) -> str:
    """The letters of ``KHC`` a cache has, in that order."""
    return "".join(a for a in "KHC" if a in letters)


def memory_order(tensor: torch.Tensor, axes: str) -> tuple[torch.Tensor, str]:
    """The raw bytes of ``tensor`` with its dims in memory order, and their letters."""
    letters = Layout.of(tensor, axes).physical
    return raw(tensor).permute([axes.index(a) for a in letters]), letters
