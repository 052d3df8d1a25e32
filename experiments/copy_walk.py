"""Staging copies between layouts walked in the destination's order or the source's, side by side.

    python experiments/copy_walk.py [--rounds 9]

A copy between two layouts (a token-major cache and a head-major host buffer) walks one
side's memory in order; on the other it reads or writes runs out of order, at the stride
of its innermost loop there. This times the CPU kernels' three ways
(``CpuBackend(copy_walk=...)``: the destination's order, the source's, and ``auto``, the
choice of ``walk_order`` by the stride the destination's walk reads at) on the same caches,
interleaved with a memcpy of the same bytes in a random order each round, timed as ``kvhost
bench`` times (``kvhost_tools.bench.timing.measure``: every line the calls touch flushed
before each, calls that waited for a core left out), for saves into and loads out of the
buffer, several block sizes, head counts and channels; prints medians as fractions of
memcpy, and the stride the destination's walk reads at.

What it measured decided ``walk_order`` in ``backends/kvhost_cpu/backend.py`` (figures in
docs/performance.md). Nothing here is imported by kvhost.
"""

from __future__ import annotations

import argparse
import os
import random
from collections.abc import Callable

# Idle OpenMP workers parked, as kvhost bench runs: spinning numba workers would take the
# cores from torch's memcpy after every kvhost call.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import numpy as np
import torch
from kvhost_cpu import CpuBackend
from kvhost_cpu.backend import COPY_WALKS, walk_order

import kvhost
from kvhost.layout import Layout
from kvhost.testing import make_cache
from kvhost.transform import plan_copy
from kvhost_tools.bench import timing
from kvhost_tools.bench.machine import Device
from kvhost_tools.bench.workloads import PRESETS

TOTAL_BYTES = 64 << 20  # the bytes each call moves
AXES = "KBNHC"
SHAPES = (  # tokens x heads x channels
    "16x8x128,64x8x128,32x8x128,8x8x128,16x16x128,8x16x128,16x32x128,64x2x128,16x4x256,16x8x256,4x8x256,16x2x512,"
    "16x8x64"
)


def measure(direction: str, sizes: dict[str, int], rounds: int) -> str:
    cache_layout, host_layout = "KBNHC", "KBHNC"
    cache = {"c": make_cache(AXES, cache_layout, sizes, torch.bfloat16)}
    buffer = {"c": make_cache(AXES, host_layout, sizes, torch.bfloat16)}
    for tensor in (*cache.values(), *buffer.values()):
        tensor.fill_(1)  # every page mapped: an untouched page reads as the one shared zero page
    hosts = {walk: kvhost.KVHost(cache, axes=AXES, backend=CpuBackend(copy_walk=walk)) for walk in COPY_WALKS}
    blocks = sizes["B"]
    cache_ids = list(range(blocks))
    random.Random(0).shuffle(cache_ids)
    buffer_ids = list(range(blocks))
    nbytes = cache["c"].untyped_storage().nbytes()
    src = torch.ones(nbytes, dtype=torch.int8)
    dst = torch.empty_like(src)
    touched = np.array(
        [(t.data_ptr(), t.untyped_storage().nbytes()) for t in (cache["c"], buffer["c"], src, dst)], dtype=np.int64
    )
    methods: dict[str, Callable[[], object]] = {"memcpy": lambda: dst.copy_(src)}
    for walk, host in hosts.items():
        if direction == "save":
            methods[walk] = lambda host=host: host.copy_to(buffer, cache_ids, buffer_ids)
        else:
            methods[walk] = lambda host=host: host.copy_from(buffer, buffer_ids, cache_ids)
    used = timing.measure(methods, Device("cpu"), PRESETS["full"], rounds, random.Random(0), touched).used_samples()
    memcpy = used["memcpy"].median
    ratios = ", ".join(f"{name} {memcpy / used[name].median:.2f}" for name in COPY_WALKS)
    src_tensor, dst_tensor = (cache["c"], buffer["c"]) if direction == "save" else (buffer["c"], cache["c"])
    loops = plan_copy(Layout.of(src_tensor, AXES), Layout.of(dst_tensor, AXES)).loops
    chosen = "source" if walk_order(loops) is not loops else "destination"
    return f"{ratios} of memcpy; the destination's walk reads at a stride of {loops.src_strides[-1]} B; {chosen} chosen"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--shapes", default=SHAPES, help="NxHxC,...")
    parser.add_argument("--directions", default="save,load")
    args = parser.parse_args()
    for shape in args.shapes.split(","):
        tokens, heads, channels = (int(x) for x in shape.split("x"))
        block = 2 * tokens * heads * channels * 2
        sizes = dict(K=2, B=TOTAL_BYTES // block, N=tokens, H=heads, C=channels)
        for direction in args.directions.split(","):
            result = measure(direction, sizes, args.rounds)
            print(f"{direction} N={tokens} H={heads} C={channels}: {result}", flush=True)


if __name__ == "__main__":
    main()
