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
from kvhost_tools.demo.values import SENTINEL_BYTE, read_tokens_fast, token_values

if TYPE_CHECKING:
    from kvhost_tools.demo.pull import Rank, Request


def verify(
    model: Model,
    seed: int,
    ranks: Sequence[Rank],
    arrived: Sequence[Request],
    spare: Sequence[int],
    outcome: Outcome,
    *,
    progress: TextIO | None = None,
) -> None:
    """Every token of every arrived request on every rank (its heads), bit for bit; spare
    blocks must hold the sentinel."""
    started = time.perf_counter()
    axes = model.axes
    cache_sets = [CacheSet(rank.caches, axes) for rank in ranks]
    bar = ProgressBar("verify", len(arrived), progress or sys.stderr, progress is not None)
    for done, request in enumerate(arrived, 1):
        problem = None
        for layer in range(len(cache_sets[0].members)):
            whole = token_values(
                seed,
                request.number,
                layer,
                request.tokens,
                model.heads,
                model.head_dim,
                cache_sets[0].members[layer].layout.itemsize,
                kv=model.kv,
            )
            for number, (rank, cache_set) in enumerate(zip(ranks, cache_sets)):
                member = cache_set.members[layer]
                got = read_tokens_fast(member.tensor, axes, request.local_ids)[: request.tokens]
                want = whole.narrow(2, rank.first_head, rank.heads)  # [tokens, K, H, C]
                if not torch.equal(got, want):
                    bad = (got != want).nonzero()[0].tolist()
                    where = f"rank {number} " if len(ranks) > 1 else ""
                    problem = (
                        f"{where}{member.layer} token {bad[0]} K/V {bad[1]} "
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
            blocks = raw(member.tensor).index_select(axes.index("B"), index).contiguous().view(torch.uint8)
            untouched &= bool((blocks == SENTINEL_BYTE).all())
    if not untouched:
        outcome.mismatched["spare blocks"] = "a block no request owns was written"
    outcome.figures.update(
        verify_seconds=time.perf_counter() - started,
        spare_untouched=untouched,
        verified_tokens=sum(r.tokens for r in arrived if r.name in outcome.verified),
        layers=model.layers,
    )
