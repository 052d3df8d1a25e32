"""Where a cold one-request staging copy spends its time: the copy, and everything before it.

    python experiments/cold_call_parts.py [--runs 3] [--rounds 41] [--ids runs|scattered]

Issue 13 asks one request's staging copy (4 blocks of the bench's geometry: 16 layers,
1 MiB a block, 4 MiB) to reach 0.8 of memcpy with whole-cache eviction (``kvhost bench
--only stage --requests 1 --cache all``). This times, side by side in the bench's way
(its workspace, eviction of everything before each call, interleaved rounds in a random
order, medians of the calls that did not wait for a core), the parts of that call:

- ``memcpy``: the bench's roofline, a plain copy of the same 4 MiB;
- ``kvhost``: ``KVHost.copy_to(buffer, src_ids, dst_ids).wait()``, as the bench times it;
- ``backend``: the CPU backend's ``copy`` of the job the front end planned for that call
  (the kernel and its launch, nothing before);
- ``front end``: ``plan_copy_batch`` alone for the same call (ids checked, grouped, the job made);
- ``checks``: the registered caches' and the host buffer's in-place checks alone
  (``CacheSet.check_current`` and ``describes``: address, shape, strides and storage
  size of each of the 32 tensors).

Each part is timed from a cold cache on its own, so the parts add up to more than the
whole: a part after another finds some of its code and objects warm. What the figures
show is how much of the whole is not the copy (``kvhost`` - ``backend``) and how large
each part is cold. Nothing here is imported by kvhost.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys

import numpy as np
import torch

import kvhost
from kvhost.batch import plan_copy_batch
from kvhost.caches import CacheSet
from kvhost_tools.bench.machine import Device
from kvhost_tools.bench.methods import Workspace
from kvhost_tools.bench.timing import measure
from kvhost_tools.bench.workloads import PRESETS, Geometry, allocator_ids

BLOCKS = 4
NUM_BLOCKS = 1024


def main() -> None:
    if "OMP_WAIT_POLICY" not in os.environ:  # as kvhost bench measures: torch's parked workers sleep
        os.execve(sys.executable, [sys.executable, *sys.argv], dict(os.environ, OMP_WAIT_POLICY="PASSIVE"))
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=41)
    parser.add_argument("--ids", choices=("runs", "scattered"), default="runs")
    args = parser.parse_args()
    device = Device("cpu", cache="all")
    space = Workspace(device)
    geometry = Geometry(block_size=16)
    cache = space.caches("cache", geometry, geometry.physical, NUM_BLOCKS)
    buffer = space.caches("host", geometry, geometry.physical, BLOCKS)
    src_ids = allocator_ids(NUM_BLOCKS, BLOCKS, args.ids, np.random.default_rng(0)).tolist()
    dst_ids = list(range(BLOCKS))
    host = kvhost.KVHost(cache, axes=geometry.axes)
    host.copy_to(buffer, src_ids, dst_ids).wait()  # the buffer's set is known from here on
    backend = host.backend
    peer = CacheSet(buffer, geometry.axes, role="dst")
    job = plan_copy_batch(host.caches, peer, src_ids, dst_ids, False).jobs[0]

    def checks() -> None:
        host.caches.check_current()
        assert peer.describes(buffer)

    methods = {
        "memcpy": space.memcpy(BLOCKS * geometry.block_bytes, device.device, torch.device("cpu")),
        "kvhost": lambda: host.copy_to(buffer, src_ids, dst_ids).wait(),
        "backend": lambda: backend.copy(job).wait(),
        "front end": lambda: plan_copy_batch(host.caches, peer, src_ids, dst_ids, False),
        "checks": checks,
    }
    print(f"{geometry.describe()}, {BLOCKS} blocks ({args.ids}: {src_ids}), backend {backend.name}; medians in us")
    rng = random.Random(0)
    for run in range(args.runs):
        used = measure(methods, device, PRESETS["full"], args.rounds, rng).used_samples()
        us = {name: statistics.median(sample.seconds) * 1e6 for name, sample in used.items()}
        parts = "  ".join(f"{name} {value:6.1f}" for name, value in us.items())
        print(
            f"run {run + 1}: {parts}  | kvhost {us['memcpy'] / us['kvhost']:.2f} of memcpy, "
            f"backend {us['memcpy'] / us['backend']:.2f}, not the copy {us['kvhost'] - us['backend']:.0f} us"
        )


if __name__ == "__main__":
    main()
