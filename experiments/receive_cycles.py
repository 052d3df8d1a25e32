"""A receive's pieces through a scratch copy or in place by their cycles, side by side.

    python experiments/receive_cycles.py [rows] [per-layer] [--rounds 9]

The CPU kernels rewrite a piece (``kvhost.transform.WriteBack``) either by copying it to a
per-thread scratch and writing it back through byte loops, or in place cycle by cycle with
one run set aside (``WriteBack.cycles``). This times both on the same caches, each a
``KVHost`` on a ``CpuBackend`` made to take one way for every piece, interleaved with a
memcpy of the same bytes in a random order each round (16 MiB of other data is written
between calls, so the caches start cold), and prints medians as fractions of memcpy:

- ``rows``: block regions holding every layer (vLLM's ``BLNHC``, layers x 64 tokens x 8
  heads x C bf16 channels), received from rows of half the tokens (``LNHC``, r = 2: runs
  of a layer's sub-block) and from heads-first rows of the same size (``HLNC``: runs of
  one head's channels), for 4-64 layers and 32-512 channels: pieces of 256 KiB to 8 MiB;
- ``per-layer``: per-layer ``KBNHC`` caches (8 heads), head-major senders into head-major
  or token-major blocks of 64: pieces of 32-256 KiB, runs of 128 B to 16 KiB.

What it measured decided ``CYCLE_RUN_BYTES`` and ``CYCLE_PIECE_BYTES`` in
``backends/kvhost_cpu/backend.py`` (figures in docs/performance.md). Nothing here is
imported by kvhost.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

import torch
from kvhost_cpu import CpuBackend

import kvhost
from kvhost.testing import make_cache

TOTAL_BYTES = 256 << 20  # the caches' size for each case: many times the last-level cache


def measure(axes: str, physical: str, sizes: dict[str, int], order: str, remote: int, rounds: int) -> str:
    caches = {"c": make_cache(axes, physical, sizes, torch.bfloat16)}
    ways = {
        "scratch": CpuBackend(cycle_piece_bytes=1 << 62, cycle_run_bytes=1 << 62),
        "cycles": CpuBackend(cycle_piece_bytes=0, cycle_run_bytes=0),
    }
    hosts = {name: kvhost.KVHost(caches, axes=axes, backend=backend) for name, backend in ways.items()}
    blocks = sizes["B"]
    g = max(1, remote // sizes["N"])
    ids = list(range(blocks - blocks % g))
    random.Random(0).shuffle(ids)
    nbytes = caches["c"].untyped_storage().nbytes() // blocks * len(ids)
    src = torch.ones(nbytes, dtype=torch.int8)
    dst = torch.empty_like(src)
    other = torch.empty(16 << 20, dtype=torch.int8)
    times: dict[str, list[float]] = {name: [] for name in [*ways, "memcpy"]}
    for round_ in range(rounds):
        names = list(times)
        random.Random(round_).shuffle(names)
        for name in names:
            other.add_(1)
            start = time.perf_counter()
            if name == "memcpy":
                dst.copy_(src)
            else:
                hosts[name].receive({"r": ids}, remote_order=order, remote_block_size=remote)
            times[name].append(time.perf_counter() - start)
    memcpy = statistics.median(times["memcpy"])
    (group,) = hosts["scratch"].caches.receive_groups(order, remote)
    write_back = group.rearrangement.write_back
    ratios = ", ".join(f"{name} {memcpy / statistics.median(times[name]):.2f}" for name in ways)
    return f"piece {write_back.piece_bytes >> 10} KiB, runs {write_back.loops.run_bytes} B: {ratios} of memcpy"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("sets", nargs="*", default=["rows", "per-layer"])
    parser.add_argument("--rounds", type=int, default=9)
    args = parser.parse_args()
    if "rows" in args.sets:
        for layers, channels in ((4, 128), (16, 128), (16, 256), (16, 512), (32, 64), (64, 64)):
            row = layers * 64 * 8 * channels * 2
            sizes = dict(L=layers, B=max(16, TOTAL_BYTES // row), N=64, H=8, C=channels)
            for order, remote in (("LNHC", 32), ("HLNC", 64)):
                result = measure("LBHNC", "BLNHC", sizes, order, remote, args.rounds)
                print(f"rows L={layers} C={channels} from {order} {remote}: {result}", flush=True)
    if "per-layer" in args.sets:
        for physical, order, remote, channels in (
            ("KBNHC", "HNC", 16, 128),
            ("KBNHC", "HNC", 16, 256),
            ("KBHNC", "HNC", 16, 128),
            ("KBHNC", "HNC", 128, 128),
            ("KBNHC", "HNC", 32, 64),
        ):
            sizes = dict(K=2, B=TOTAL_BYTES // (2 * 64 * 8 * channels * 2), N=64, H=8, C=channels)
            result = measure("KBNHC", physical, sizes, order, remote, args.rounds)
            print(f"per-layer {physical} C={channels} from {order} {remote}: {result}", flush=True)


if __name__ == "__main__":
    main()
