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
    return _agree(
        lambda: _put_block_bytes(caches, axes, ids, start), lambda: _block_bytes(caches, axes, ids), baseline, others
    )


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
    return _agree(
        lambda: _put_block_bytes(dst, axes, dst_ids, blank),
        lambda: _block_bytes(dst, axes, dst_ids),
        baseline,
        others,
        unchanged=blank,
    )


def _agree(
    reset: Callable[[], None],
    read: Callable[[], list[torch.Tensor]],
    baseline: Callable[[], object],
    others: list[Callable[[], object]],
    unchanged: list[torch.Tensor] | None = None,
) -> bool:
    """Each of ``others``, run after ``reset``, leaves in ``read()`` what ``baseline`` left;
    with ``unchanged``, the baseline must also have changed those bytes."""
    reset()
    baseline()
    want = read()
    if unchanged is not None and _equal(want, unchanged):
        return False  # the baseline did nothing: nothing to compare against
    for method in others:
        reset()
        method()
        if not _equal(want, read()):
            return False
    return True


def _equal(first: list[torch.Tensor], second: list[torch.Tensor]) -> bool:
    return all(torch.equal(a, b) for a, b in zip(first, second))
