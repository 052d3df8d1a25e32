"""Which technology for the CPU receive kernel: numba, C++ with OpenMP, or torch ops.

    python experiments/cpu_kernel_choice/compare.py [--quick] [--requests 1,16,256]

Compiles ``rearrange.cpp`` (the numba kernel's algorithm and parameters, written again in
C++) with the system's g++ at -O3 -march=native -fopenmp, checks on every workload that it
leaves exactly the bytes numba's kernel leaves, then times side by side, with ``kvhost
bench``'s eviction of the touched bytes and its interleaved rounds (medians):

- memcpy of the same bytes (the roofline);
- torch ops (``TorchBackend``: gather, permute, scatter in cache-sized passes);
- numba (``kvhost_cpu``, the shipped CPU backend);
- C++, called through ctypes with the same arrays and the same serial/parallel rule.

The jobs come from kvhost's own front end, so only the kernel differs between the last
two. Nothing here is imported by kvhost.
"""

from __future__ import annotations

import argparse
import ctypes
import random
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from kvhost_cpu.backend import KERNELS, CpuBackend
from kvhost_torch.backend import TorchBackend

import kvhost
from kvhost.batch import ReceiveJob, plan_receive_batch
from kvhost_tools.bench.machine import Device, block_ranges
from kvhost_tools.bench.methods import Workspace
from kvhost_tools.bench.timing import measure
from kvhost_tools.bench.workloads import PRESETS, Point, Preset, allocator_ids, scenarios

SOURCE = Path(__file__).with_name("rearrange.cpp")
WORKLOADS = ("receive-r4", "receive-g4")
METHODS = ("memcpy", "torch ops", "numba", "c++")


def build(directory: Path) -> ctypes.CDLL:
    """Compile ``rearrange.cpp`` into ``directory`` and load it."""
    compiler = shutil.which("g++")
    if compiler is None:
        raise RuntimeError("g++ not found: the C++ side of the comparison needs it")
    library = directory / "rearrange.so"
    flags = ["-O3", "-march=native", "-fopenmp", "-shared", "-fPIC"]
    subprocess.run([compiler, *flags, "-o", str(library), str(SOURCE)], check=True)
    loaded = ctypes.CDLL(str(library))
    loaded.rearrange_units.restype = None
    pointer, count = ctypes.c_void_p, ctypes.c_int64
    loaded.rearrange_units.argtypes = [pointer, count, pointer, count, pointer, count, count, pointer, count]
    return loaded


def cxx_receiver(library: ctypes.CDLL) -> Callable[[ReceiveJob], None]:
    """The C++ kernel as a receive call, with the numba backend's parameters and thread rule."""
    kernels = KERNELS.module
    assert kernels is not None, KERNELS.reason

    scratch_only = CpuBackend(cycle_piece_bytes=1 << 62)

    def receive(job: ReceiveJob) -> None:
        bases = job.members.addresses
        outer = job.layout.outer_offsets_bytes
        units = np.ascontiguousarray(job.unit_ids, dtype=np.int64)
        launch = scratch_only._receive_launch(job)  # the C++ kernel has no cycles: never ask for them
        assert not isinstance(launch, bool)
        params = launch.params
        _, threads = kernels.launcher("rearrange_units", job.bytes_moved)  # numba's own thread rule
        library.rearrange_units(
            bases.ctypes.data,
            bases.size,
            outer.ctypes.data,
            outer.size,
            units.ctypes.data,
            units.shape[0],
            units.shape[1],
            params.ctypes.data,
            threads,
        )

    return receive


def run_jobs(receive: Callable[[ReceiveJob], None], jobs: list[ReceiveJob]) -> Callable[[], None]:
    def call() -> None:
        for job in jobs:
            receive(job)

    return call


def same_bytes(caches: dict[str, torch.Tensor], first: Callable[[], None], second: Callable[[], None]) -> bool:
    """Do ``first`` and ``second`` leave the same bytes, each starting from the same random
    ones (and does ``first`` change any)?"""
    memory = [torch.empty(0, dtype=torch.uint8).set_(t.untyped_storage()) for t in caches.values()]
    start = [torch.randint(0, 256, m.shape, dtype=torch.uint8) for m in memory]

    def after(method: Callable[[], None]) -> list[torch.Tensor]:
        for whole, values in zip(memory, start):
            whole.copy_(values)
        method()
        return [whole.clone() for whole in memory]

    ours, theirs = after(first), after(second)
    changed = any(not torch.equal(a, b) for a, b in zip(ours, start))
    return changed and all(torch.equal(a, b) for a, b in zip(ours, theirs))


def compare(quick: bool, requests: Sequence[int] | None, seed: int = 0) -> list[dict[str, Any]]:
    preset = PRESETS["quick" if quick else "full"]
    chosen = [s for s in scenarios(preset, requests or preset.requests) if s.name in WORKLOADS]
    space = Workspace(Device("cpu", "data"))
    rng = random.Random(seed)
    rows = []
    with tempfile.TemporaryDirectory() as directory:
        cxx = cxx_receiver(build(Path(directory)))
        for scenario in chosen:
            num_blocks = max(p.blocks for p in scenario.points)
            for i, point in enumerate(scenario.points):
                ids = allocator_ids(num_blocks, point.blocks, point.ids, np.random.default_rng(seed + i))
                medians = measure_point(point, ids, num_blocks, space, preset, rng, cxx)
                rows.append({"workload": scenario.name, "requests": point.requests, "median_s": medians})
                print(format_row(rows[-1]), file=sys.stderr)
    return rows


def measure_point(
    point: Point,
    ids: np.ndarray,
    num_blocks: int,
    space: Workspace,
    preset: Preset,
    rng: random.Random,
    cxx: Callable[[ReceiveJob], None],
) -> dict[str, float]:
    """Median seconds of every method on one workload, after checking C++ against numba."""
    geometry, here = point.geometry, space.device.device
    caches = space.caches("cache", geometry, geometry.physical, num_blocks)
    per_request = point.blocks_per_request
    batch = {f"req-{k}": ids[k : k + per_request].tolist() for k in range(0, ids.size, per_request)}
    host = kvhost.KVHost(caches, axes=geometry.axes)
    jobs = plan_receive_batch(host.caches, batch, point.remote_order, point.remote_block_size).jobs
    nbytes = point.blocks * geometry.block_bytes
    methods = {
        "memcpy": space.memcpy(nbytes, here, here),
        "torch ops": run_jobs(TorchBackend().receive, jobs),
        "numba": run_jobs(CpuBackend().receive, jobs),
        "c++": run_jobs(cxx, jobs),
    }
    if not same_bytes(caches, methods["numba"], methods["c++"]):
        raise AssertionError(f"{point.scenario}, {point.requests} requests: C++ and numba left different bytes")
    touched = np.concatenate([block_ranges(caches, geometry.axes, ids), space.memcpy_ranges(nbytes, here, here)])
    measured = measure(methods, space.device, preset, None, rng, touched).used_samples()
    return {name: float(np.median(measured[name].seconds)) for name in METHODS}


def format_row(row: dict[str, Any]) -> str:
    medians = row["median_s"]
    fractions = "  ".join(f"{name} {medians['memcpy'] / medians[name]:.2f}" for name in METHODS[1:])
    return f"{row['workload']:<11} {row['requests']:>4} requests: fraction of memcpy: {fractions}"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="the bench's tiny shapes and few rounds")
    parser.add_argument("--requests", type=lambda s: [int(x) for x in s.split(",")], default=None)
    args = parser.parse_args(argv)
    rows = compare(args.quick, args.requests)
    lines = ["| workload | requests | torch ops | numba | C++ |", "|---|---:|---:|---:|---:|"]
    for row in rows:
        medians = row["median_s"]
        cells = [f"{medians['memcpy'] / medians[name]:.2f}" for name in METHODS[1:]]
        lines.append(f"| {row['workload']} | {row['requests']} | {' | '.join(cells)} |")
    print("fraction of memcpy, medians, same run:\n" + "\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
