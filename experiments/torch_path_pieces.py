"""Where the torch path's time goes in a cold one-request staging copy.

    python experiments/torch_path_pieces.py [--rounds 61] [--requests 1] [--scattered]

The workload of ``kvhost bench``'s stage-runs point (16 layers, KBNHC, bf16, blocks of 16
tokens x 8 heads x 128 channels, requests of 4 consecutive blocks into a host buffer that
fills in order; with ``--scattered`` no two source blocks adjacent, so the torch path
gathers, and the rows below its ``copy`` still time one run), timed with everything evicted
before each call (``--cache all``), in interleaved rounds (medians), side by side:

- memcpy of the same bytes (the roofline);
- ``KVHost.copy_to`` on the torch path, and on the CPU backend (numba) for reference;
- the torch backend's ``copy`` alone, on a job the front end planned in advance;
- its ``copy_`` calls alone, on views made in advance;
- the views alone (the ``narrow`` calls the backend makes per layer and run);
- the same copies through numpy (basic slicing makes views for a fraction of torch's cost,
  but ``np.copyto`` runs on one thread): with its views, and on views made before.

Each is reported as a fraction of memcpy and in microseconds. Nothing here is imported by
kvhost. Like ``kvhost bench``, it runs with ``OMP_WAIT_POLICY=PASSIVE`` unless the variable
is set (torch's workers parked between calls; until 3 December this experiment ran with
them spinning, and missed what a wake costs each ``copy_``).
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys

import numpy as np
from kvhost_torch.backend import TorchBackend, _pair_views

import kvhost
from kvhost.batch import plan_copy_batch
from kvhost.caches import CacheSet
from kvhost_tools.bench.machine import Device, block_ranges
from kvhost_tools.bench.methods import Workspace
from kvhost_tools.bench.timing import measure
from kvhost_tools.bench.workloads import PRESETS, Geometry


def main() -> None:
    if "OMP_WAIT_POLICY" not in os.environ:  # read once, when torch loads its OpenMP runtime: start again
        os.execve(sys.executable, [sys.executable, *sys.argv], dict(os.environ, OMP_WAIT_POLICY="PASSIVE"))
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=61)
    parser.add_argument("--requests", type=int, default=1)
    parser.add_argument("--scattered", action="store_true", help="source ids one block apart (the path gathers)")
    args = parser.parse_args()

    geometry = Geometry(block_size=16)
    blocks = 4 * args.requests
    device = Device("cpu", cache="all")
    space = Workspace(device)
    cache = space.caches("cache", geometry, geometry.physical, 4 * blocks)
    buffer = space.caches("host", geometry, geometry.physical, blocks)
    src_ids = list(range(blocks, 2 * blocks))  # one run: what an allocator hands a short prompt
    if args.scattered:
        src_ids = list(range(blocks, 3 * blocks, 2))  # no two adjacent: index_select into the buffer's run
    dst_ids = list(range(blocks))
    torch_host = kvhost.KVHost(cache, axes=geometry.axes, backend="torch")
    numba_host = kvhost.KVHost(cache, axes=geometry.axes, backend="cpu")
    backend = torch_host.backend
    assert isinstance(backend, TorchBackend)
    peer = CacheSet(buffer, geometry.axes, role="dst")
    job = plan_copy_batch(torch_host.caches, peer, src_ids, dst_ids, False).jobs[0]
    views = _pair_views(job)
    made = [(dest.narrow(b, 0, blocks), source.narrow(b, blocks, blocks)) for source, dest, b, *_ in views]

    def copies_alone() -> None:
        for dest, source in made:
            dest.copy_(source)

    def views_alone() -> None:
        for source, dest, b, *_ in views:
            dest.narrow(b, 0, blocks)
            source.narrow(b, blocks, blocks)

    arrays = [(source.numpy(), dest.numpy(), b) for source, dest, b, *_ in views]

    def numpy_views(source: np.ndarray, dest: np.ndarray, b: int) -> tuple[np.ndarray, np.ndarray]:
        """The run's (destination, source) views, as the torch path's ``narrow`` pair."""
        lead = (slice(None),) * b
        return dest[(*lead, slice(0, blocks))], source[(*lead, slice(blocks, 2 * blocks))]

    numpy_made = [numpy_views(*array) for array in arrays]

    def numpy_with_views() -> None:
        for array in arrays:
            np.copyto(*numpy_views(*array))

    def numpy_copies_alone() -> None:
        for dest, source in numpy_made:
            np.copyto(dest, source)

    nbytes = blocks * geometry.block_bytes
    methods = {
        "memcpy": space.memcpy(nbytes, device.device, device.device),
        "KVHost.copy_to, torch path": lambda: torch_host.copy_to(buffer, src_ids, dst_ids).wait(),
        "KVHost.copy_to, CPU backend (numba)": lambda: numba_host.copy_to(buffer, src_ids, dst_ids).wait(),
        "torch backend's copy alone": lambda: backend.copy(job).wait(),
        "its copy_ calls alone (views made before)": copies_alone,
        "its views alone (narrow per layer and side)": views_alone,
        "numpy: views and np.copyto": numpy_with_views,
        "numpy: np.copyto alone (views made before)": numpy_copies_alone,
    }
    touched = np.concatenate(
        [
            block_ranges(cache, geometry.axes, np.array(src_ids)),
            block_ranges(buffer, geometry.axes, np.array(dst_ids)),
            space.memcpy_ranges(nbytes, device.device, device.device),
        ]
    )
    measured = measure(methods, device, PRESETS["full"], args.rounds, random.Random(0), touched)
    medians = {name: statistics.median(sample.seconds) for name, sample in measured.samples.items()}
    roof = medians["memcpy"]
    print(f"{args.requests} request(s) of 4 blocks, {nbytes / 2**20:.0f} MiB, {geometry.describe()}, cache all")
    print(f"{'':46s} {'median us':>10s} {'x memcpy':>9s}")
    for name, seconds in medians.items():
        print(f"{name:46s} {seconds * 1e6:10.1f} {roof / seconds:9.2f}")


if __name__ == "__main__":
    main()
