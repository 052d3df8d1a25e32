"""Do the baseline and kvhost leave the same bytes? Each run from the same random bytes."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from kvhost.caches import CacheSet
from kvhost.testing import fill_random, raw


def _block_bytes(caches: dict[str, torch.Tensor], axes: str, ids: np.ndarray) -> list[torch.Tensor]:
    index = torch.from_numpy(ids)
    return [
        raw(m.tensor).index_select(m.layout.axes.index("B"), index.to(m.tensor.device)).cpu()
        for m in CacheSet(caches, axes).members
    ]


def _put_block_bytes(caches: dict[str, torch.Tensor], axes: str, ids: np.ndarray, values: list[torch.Tensor]) -> None:
    index = torch.from_numpy(ids)
    for member, value in zip(CacheSet(caches, axes).members, values):
        b = member.layout.axes.index("B")
        raw(member.tensor).index_copy_(b, index.to(member.tensor.device), value.to(member.tensor.device))


def same_result(
    caches: dict[str, torch.Tensor],
    axes: str,
    ids: np.ndarray,
    baseline: Callable[[], object],
    others: list[Callable[[], object]],
    seed: int,
) -> bool:
    """Baseline and each kvhost method, run on the same random wire bytes, leave the same bytes."""
    start = [fill_random(t, seed + i) for i, t in enumerate(_block_bytes(caches, axes, ids))]
    _put_block_bytes(caches, axes, ids, start)
    baseline()
    want = _block_bytes(caches, axes, ids)
    for method in others:
        _put_block_bytes(caches, axes, ids, start)
        method()
        if not all(torch.equal(w, g) for w, g in zip(want, _block_bytes(caches, axes, ids))):
            return False
    return True


def same_copy(
    src: dict[str, torch.Tensor],
    dst: dict[str, torch.Tensor],
    axes: str,
    src_ids: np.ndarray,
    dst_ids: np.ndarray,
    baseline: Callable[[], object],
    others: list[Callable[[], object]],
) -> bool:
    """Baseline and each kvhost copy write the same bytes into the destination blocks."""
    start = [fill_random(t, 7 + i) for i, t in enumerate(_block_bytes(src, axes, src_ids))]
    _put_block_bytes(src, axes, src_ids, start)
    blank = [torch.zeros_like(t) for t in _block_bytes(dst, axes, dst_ids)]
    _put_block_bytes(dst, axes, dst_ids, blank)
    baseline()
    want = _block_bytes(dst, axes, dst_ids)
    if all(torch.equal(w, b) for w, b in zip(want, blank)):
        return False  # the baseline copied nothing: nothing to compare against
    for method in others:
        _put_block_bytes(dst, axes, dst_ids, blank)
        method()
        if not all(torch.equal(w, g) for w, g in zip(want, _block_bytes(dst, axes, dst_ids))):
            return False
    return True
