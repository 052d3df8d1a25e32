"""Block ids as allocators hand them out: the order a pool's free blocks are given to requests.

An engine's block allocator starts with its blocks in order and, after requests come and
go, hands out runs of consecutive blocks that were freed together, in no particular order.
``free_list`` draws such an order for a pool, or a fully scattered one; the demo and the
bench take requests' block ids from it, one request after another.
"""

from __future__ import annotations

import numpy as np

BLOCK_ID_KINDS = ("runs", "scattered")
MAX_RUN = 8  # runs of 1..MAX_RUN consecutive blocks by default


def free_list(pool: int, rng: np.random.Generator, kind: str = "runs", max_run: int = MAX_RUN) -> np.ndarray:
    """Every block id of a pool of ``pool`` blocks, once, in the order an allocator hands them out.

    ``runs``: runs of 1..``max_run`` consecutive blocks (uniformly), in random order: the
    smaller ``max_run``, the more fragmented the pool (1: every block on its own).
    ``scattered``: a random permutation, so neighbours in the list are (almost) never
    neighbours in memory.
    """
    if kind not in BLOCK_ID_KINDS:
        raise ValueError(f"block ids are {' or '.join(BLOCK_ID_KINDS)}, not {kind!r}")
    if kind == "scattered":
        return rng.permutation(pool).astype(np.int64)
    if max_run < 1:
        raise ValueError(f"max_run must be at least 1, got {max_run}")
    lengths = rng.integers(1, max_run + 1, size=pool)
    starts = np.cumsum(lengths) - lengths
    starts, lengths = starts[starts < pool], lengths[starts < pool]
    order = rng.permutation(starts.size)
    runs = [np.arange(s, min(s + n, pool)) for s, n in zip(starts[order], lengths[order])]
    return np.concatenate(runs).astype(np.int64)
