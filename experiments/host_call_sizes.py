"""Where torch's threads start to pay on this host: one layer's copy or gather, by size.

    python experiments/host_call_sizes.py [--rounds 15] [--sizes 1,2,4,8,16,32]

The torch path's host bounds (``TorchBackend.host_thread_bytes``, ``host_split_bytes``) trade
a wake of torch's parked workers (``OMP_WAIT_POLICY=PASSIVE``, as ``kvhost bench`` runs)
against a second thread's bandwidth. Both depend on the machine: a wake cost 50-80 us on
one 2-core VM and 200-300 us on another. For one layer of the bench's blocks (K = 2 outside
B, 32 KiB per K and block, int64 as the torch path views them), every id apart in the
source and a run in the destination, this times side by side, in interleaved rounds with
96 MiB written between calls (the touched bytes out of cache), medians in microseconds:

- ``copy_``: torch's copy of the same bytes as one run (over the threads from 32,768 elements);
- ``copyto``: numpy's, on the calling thread;
- ``select B``: one ``index_select`` along B (the torch path's gather under ``host_split_bytes``);
- ``select K``: one ``index_select`` per index of K (dense slices, a memcpy per id; over it);
- ``take K``: numpy's ``take`` per index of K, on the calling thread.

Nothing here is imported by kvhost.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import time
from collections.abc import Callable

import numpy as np
import torch


def main() -> None:
    if "OMP_WAIT_POLICY" not in os.environ:  # read once, when torch loads its OpenMP runtime: start again
        os.execve(sys.executable, [sys.executable, *sys.argv], dict(os.environ, OMP_WAIT_POLICY="PASSIVE"))
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--sizes", default="1,2,4,8,16,32", help="MiB a layer")
    args = parser.parse_args()
    flush = np.ones(96 << 20, np.uint8)
    order = random.Random(0)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; median us of {args.rounds} rounds")
    for mib in (int(size) for size in args.sizes.split(",")):
        methods = layer_methods(mib)
        seconds: dict[str, list[float]] = {name: [] for name in methods}
        for _ in range(args.rounds):
            names = list(methods)
            order.shuffle(names)
            for name in names:
                np.add(flush, 1, out=flush)
                start = time.perf_counter()
                methods[name]()
                seconds[name].append(time.perf_counter() - start)
        row = "  ".join(f"{name} {statistics.median(times) * 1e6:7.0f}" for name, times in seconds.items())
        print(f"{mib:3d} MiB  {row}")


def layer_methods(mib: int) -> dict[str, Callable[[], object]]:
    """The five ways to move ``mib`` MiB of one layer, on tensors made here."""
    count = mib * 16  # blocks of 64 KiB: 2 x 32 KiB
    source = torch.ones(2, 3 * count, 4096, dtype=torch.int64)
    dest = torch.zeros(2, count, 4096, dtype=torch.int64)
    ids = torch.arange(count, 3 * count, 2)
    source_array, dest_array, id_array = source.numpy(), dest.numpy(), ids.numpy()

    def select_k() -> None:
        for k in range(2):
            torch.index_select(source[k], 0, ids, out=dest[k])

    def take_k() -> None:
        for k in range(2):
            np.take(source_array[k], id_array, axis=0, out=dest_array[k], mode="clip")

    return {
        "copy_": lambda: dest.copy_(source[:, :count]),
        "copyto": lambda: np.copyto(dest_array, source_array[:, :count]),
        "select B": lambda: torch.index_select(source, 1, ids, out=dest),
        "select K": select_k,
        "take K": take_k,
    }


if __name__ == "__main__":
    main()
