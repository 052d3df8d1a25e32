"""Figures from one run on a GPU: staging bandwidth, and the Triton kernels against the torch path and memcpy.

    python -m kvhost_cuda.gpucheck [--device cuda] [--quick] [--json PATH]

Every figure is a ratio measured side by side in this one process (medians of several
repetitions, the device synchronized around each): a receive or device copy against a
device-to-device ``copy_`` of the same bytes (memcpy, the roofline: an in-place
rearrangement reads and writes every byte once), host staging against a plain ``copy_``
of a contiguous pinned tensor of the same size, each way. ``ci/gpu-check.sh`` runs it
after the cuda-marked conformance suite; ``measure`` also runs on the CPU (tests).
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
import torch

import kvhost
from kvhost.backend import Backend
from kvhost.testing import make_cache


@dataclass(frozen=True)
class Sizes:
    layers: int = 16
    heads: int = 8
    channels: int = 128
    receive_units: int = 512  # units per receive call (requests x blocks)
    staging_blocks: int = 512  # blocks per staging call
    repeats: int = 15


QUICK = Sizes(layers=4, receive_units=128, staging_blocks=128, repeats=5)


@dataclass(frozen=True)
class Row:
    workload: str
    method: str
    seconds: float  # median
    bytes: int
    fraction: float  # time of the reference (memcpy, or a plain pinned copy_ for staging) / this time

    @property
    def gbps(self) -> float:
        return self.bytes / self.seconds / 1e9


def median_seconds(run: Callable[[], object], device: torch.device, repeats: int) -> float:
    """Median wall time of ``run`` with the device drained before and after each repetition."""

    def sync() -> None:
        if device.type != "cpu":
            torch.accelerator.synchronize(device)

    run()  # warm-up: compiles kernels, fills allocator caches
    times = []
    for _ in range(repeats):
        sync()
        start = time.perf_counter()
        run()
        sync()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def memcpy_seconds(device: torch.device, nbytes: int, repeats: int) -> float:
    """The roofline: one device-to-device ``copy_`` of ``nbytes`` contiguous bytes."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    return median_seconds(lambda: dst.copy_(src), device, repeats)


def compare(
    rows: list[Row],
    workload: str,
    calls: Mapping[str, Callable[[], Any]],
    reference: Callable[[int], float],
    device: torch.device,
    repeats: int,
) -> None:
    """Time every method of one workload against ``reference(bytes)``; bytes come from kvhost's own result."""
    nbytes = next(iter(calls.values()))().bytes_moved
    baseline = reference(nbytes)
    rows.append(Row(workload, "memcpy", baseline, nbytes, 1.0))
    for method, call in calls.items():
        seconds = median_seconds(call, device, repeats)
        rows.append(Row(workload, method, seconds, nbytes, baseline / seconds))


def cache_set(device: torch.device, sizes: Sizes, physical: str, blocks: int, tokens: int) -> dict[str, torch.Tensor]:
    shape = dict(K=2, B=blocks, N=tokens, H=sizes.heads, C=sizes.channels)
    caches = {f"l{i}": make_cache("KBNHC", physical, shape, torch.bfloat16, device) for i in range(sizes.layers)}
    for t in caches.values():
        t.normal_()
    return caches


def measure(device: torch.device, backends: dict[str, Backend], sizes: Sizes) -> list[Row]:
    """Every workload, every method; ``backends`` maps a method name ("triton", "torch") to a backend."""
    rows: list[Row] = []
    rng = np.random.default_rng(1)

    def memcpy(nbytes: int) -> float:
        return memcpy_seconds(device, nbytes, sizes.repeats)

    for workload, local, remote in (("receive HND16->NHD64", 64, 16), ("receive HND64->NHD16 (g=4)", 16, 64)):
        parts = max(remote // local, 1)
        caches = cache_set(device, sizes, "KBNHC", sizes.receive_units * parts + 8, local)
        ids = rng.permutation(sizes.receive_units * parts + 8)[: sizes.receive_units * parts]
        requests = {f"r{i}": ids[i : i + 4 * parts] for i in range(0, ids.size, 4 * parts)}
        calls = {
            method: functools.partial(
                kvhost.receive,
                caches,
                requests,
                axes="KBNHC",
                remote_order="HNC",
                remote_block_size=remote,
                backend=backend,
            )
            for method, backend in backends.items()
        }
        compare(rows, workload, calls, memcpy, device, sizes.repeats)
        del caches, calls

    # Scattered blocks between two layouts on the device (what a staged copy does on the device).
    blocks = sizes.staging_blocks
    src = cache_set(device, sizes, "KBNHC", 2 * blocks, 16)
    dst = cache_set(device, sizes, "KBHNC", 2 * blocks, 16)
    src_ids, dst_ids = rng.permutation(2 * blocks)[:blocks], rng.permutation(2 * blocks)[:blocks]
    copies = {
        method: functools.partial(kvhost.copy_blocks, src, dst, src_ids, dst_ids, axes="KBNHC", backend=backend)
        for method, backend in backends.items()
    }
    compare(rows, "device copy, scattered, NHD->HND", copies, memcpy, device, sizes.repeats)
    del dst
    rows += _staging(device, backends, sizes, src, rng)
    return rows


def _staging(
    device: torch.device, backends: dict[str, Backend], sizes: Sizes, on_device: dict[str, torch.Tensor], rng: Any
) -> list[Row]:
    """Host <-> device through kvhost against a plain ``copy_`` of a contiguous pinned tensor of the same bytes."""
    rows: list[Row] = []
    blocks = sizes.staging_blocks
    pin = device.type != "cpu"

    def plain(way: str) -> Callable[[int], float]:
        def seconds(nbytes: int) -> float:
            host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pin)
            there = torch.empty(nbytes, dtype=torch.uint8, device=device)
            a, b = (there, host) if way == "load" else (host, there)
            return median_seconds(lambda: a.copy_(b, non_blocking=True), device, sizes.repeats)

        return seconds

    runs = np.concatenate([np.arange(s, s + 32) for s in range(0, 2 * blocks, 64)])[:blocks]  # allocator-like
    scattered = rng.permutation(2 * blocks)[:blocks]
    slots = np.arange(blocks)
    for pinned in (True, False) if pin else (False,):
        host = cache_set(torch.device("cpu"), sizes, "KBNHC", blocks, 16)
        if pinned:
            host = {name: t.pin_memory() for name, t in host.items()}
        for ids_name, device_ids in (("runs", runs), ("scattered", scattered)):
            for way in ("load", "save"):
                src, dst, src_ids, dst_ids = (
                    (host, on_device, slots, device_ids) if way == "load" else (on_device, host, device_ids, slots)
                )
                calls = {
                    method: functools.partial(kvhost.copy_blocks, src, dst, src_ids, dst_ids, axes="KBNHC", backend=b)
                    for method, b in backends.items()
                }
                workload = f"staging {way}, {ids_name} device ids, {'pinned' if pinned else 'pageable'} host"
                compare(rows, workload, calls, plain(way), device, sizes.repeats)
    return rows


def table(rows: list[Row]) -> str:
    lines = [f"{'workload':48} {'method':8} {'ms':>9} {'GB/s':>8} {'x ref':>7}"]
    for row in rows:
        lines.append(f"{row.workload:48} {row.method:8} {row.seconds * 1e3:9.3f} {row.gbps:8.1f} {row.fraction:7.2f}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvhost_cuda.gpucheck", description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda", help="cuda or xpu (default cuda)")
    parser.add_argument("--quick", action="store_true", help="small sizes, few repetitions")
    parser.add_argument("--json", help="write the rows and the machine here")
    args = parser.parse_args(argv)
    device = torch.device(args.device, 0)
    if device.type not in ("cuda", "xpu"):
        parser.error(f"--device must be cuda or xpu, not {args.device!r}")
    chosen = kvhost.get_backend(device)
    if chosen.name != device.type:
        print(f"gpucheck: the {device.type} backend cannot run here (kvhost picked {chosen.name!r})", file=sys.stderr)
        return 1
    backends = {"triton": chosen, "torch": type(chosen)(use_triton=False)}  # type: ignore[call-arg]
    print(f"gpucheck: {chosen.describe()}", flush=True)
    sizes = QUICK if args.quick else Sizes()
    rows = measure(device, backends, sizes)
    print(table(rows))
    if args.json:
        machine = {
            "device": device.type,
            "name": torch.cuda.get_device_name(device) if device.type == "cuda" else str(device),
            "torch": torch.__version__,
            "backend": chosen.describe(),
            "sizes": asdict(sizes),
        }
        rows_out = [asdict(row) | {"gbps": row.gbps} for row in rows]
        with open(args.json, "w") as out:
            json.dump({"machine": machine, "rows": rows_out}, out, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
