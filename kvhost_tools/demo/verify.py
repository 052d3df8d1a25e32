"""Decode's check of what arrived: every token of every request on every rank, bit for bit.

The values are recomputed from the options (``values.token_values``), never taken from
prefill; blocks no request owns must still hold the sentinel byte.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, TextIO

import torch

from kvhost.caches import CacheSet
from kvhost.testing import raw
from kvhost_tools.demo.config import Model
from kvhost_tools.demo.report import Outcome, ProgressBar
from kvhost_tools.demo.values import SENTINEL_BYTE, layer_views, read_tokens_fast, token_values

if TYPE_CHECKING:
    from kvhost_tools.demo.pull import Rank, Request


def verify(
    model: Model,
    axes: str,
    seed: int,
    ranks: Sequence[Rank],
    arrived: Sequence[Request],
    spare: Sequence[int],
    outcome: Outcome,
    *,
    progress: TextIO | None = None,
) -> None:
    """Every token of every arrived request on every rank (its heads), bit for bit; spare
    blocks must hold the sentinel. ``axes``: the letters of the ranks' caches
    (``Model.axes_for``: with ``L`` first for cross-layer caches)."""
    started = time.perf_counter()
    cache_sets = [CacheSet(rank.caches, axes) for rank in ranks]
    rank_layers = [layer_views(cache_set) for cache_set in cache_sets]
    itemsize = cache_sets[0].layout.itemsize
    bar = ProgressBar("verify", len(arrived), progress or sys.stderr, progress is not None)
    for done, request in enumerate(arrived, 1):
        problem = None
        for layer in range(len(rank_layers[0])):
            whole = token_values(
                seed, request.number, layer, request.tokens, model.heads, model.head_dim, itemsize, kv=model.kv
            )
            for number, (rank, layers) in enumerate(zip(ranks, rank_layers)):
                name, tensor, layer_axes = layers[layer]
                got = read_tokens_fast(tensor, layer_axes, request.local_ids)[: request.tokens]
                want = whole.narrow(2, rank.first_head, rank.heads)  # [tokens, K, H, C]
                if not torch.equal(got, want):
                    bad = (got != want).nonzero()[0].tolist()
                    where = f"rank {number} " if len(ranks) > 1 else ""
                    problem = (
                        f"{where}{name} token {bad[0]} K/V {bad[1]} "
                        f"head {rank.first_head + bad[2]} channel {bad[3]} differs"
                    )
                    break
            if problem is not None:
                break
        if problem is None:
            outcome.verified.append(request.name)
        else:
            outcome.mismatched[request.name] = problem
        bar.update(done)
    bar.close(len(arrived))
    untouched = True
    if spare:
        index = torch.as_tensor(list(spare))
        for member in (m for cache_set in cache_sets for m in cache_set.members):
            at = member.layout.axes.index("B")
            blocks = raw(member.tensor).index_select(at, index).contiguous().view(torch.uint8)
            untouched &= bool((blocks == SENTINEL_BYTE).all())
    if not untouched:
        outcome.mismatched["spare blocks"] = "a block no request owns was written"
    outcome.figures.update(
        verify_seconds=time.perf_counter() - started,
        spare_untouched=untouched,
        verified_tokens=sum(r.tokens for r in arrived if r.name in outcome.verified),
        layers=model.layers,
        kv=model.kv,
    )
