"""XLA scaling: a receive or copy of n blocks must cost O(n), not O(cache size).

``measure_scaling`` times, on an XLA device, a receive (remote HND block N/4 -> local
NHD block N) and the two staging copies (``load``: host -> XLA, ``save``: XLA -> host)
of ``n`` random blocks, for caches of several sizes, next to a whole-cache clone on the
same device (the cost of one O(cache) pass). If the indexed updates rewrote the whole
cache, the times would grow with the cache like the clone does; in place, they stay flat.

Every time is the median of ``repeats`` calls after one warm-up call (which compiles).
Run it with ``python -m kvhost_tools.device_checks.xla_scaling`` (``PJRT_DEVICE=CPU`` for the host's XLA).
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass

import numpy as np
import torch
from kvhost_tpu import xla

import kvhost
from kvhost.testing import make_cache

OPERATIONS = ("receive", "load", "save")


@dataclass(frozen=True)
class ScalingRow:
    """One operation at one cache size: medians in seconds per call."""

    operation: str  # receive | load (host -> XLA) | save (XLA -> host)
    dtype: str
    cache_blocks: int
    cache_bytes: int  # all layers
    blocks: int  # blocks moved per call
    seconds: float
    cache_clone_seconds: float  # one whole-cache clone on the device: what O(cache) costs

    def as_dict(self) -> dict[str, object]:
        return asdict(self)


def measure_scaling(
    cache_blocks: Sequence[int] = (512, 2048, 8192),
    blocks: Sequence[int] = (16, 64),
    *,
    dtype: torch.dtype = torch.float16,
    layers: int = 2,
    block_tokens: int = 16,
    heads: int = 4,
    head_dim: int = 64,
    repeats: int = 7,
    operations: Sequence[str] = OPERATIONS,
    device: torch.device | str | None = None,
    seed: int = 0,
    progress: Callable[[str], None] | None = None,
) -> list[ScalingRow]:
    """Time receive/load/save of ``n`` blocks for every cache size and every ``n``.

    Caches are ``layers`` tensors ``[2, B, block_tokens, heads, head_dim]`` (KBNHC) of
    ``dtype`` on ``device`` (the default XLA device). ``blocks`` must not exceed the
    smallest cache. Returns one row per (operation, n, cache size), in that order.
    """
    unknown = sorted(set(operations) - set(OPERATIONS))
    if unknown:
        raise ValueError(f"unknown operation(s) {unknown}; known: {OPERATIONS}")
    if max(blocks) > min(cache_blocks):
        raise ValueError(f"{max(blocks)} blocks do not fit the smallest cache of {min(cache_blocks)} blocks")
    target = torch.device(device) if device is not None else xla.module().device()
    threads = torch.get_num_threads()
    if xla.hardware(target) == "CPU":
        # The XLA:CPU runtime's threads and torch's own compete for the same cores; the
        # host side of a staging copy is small, so torch gets one.
        torch.set_num_threads(1)
    try:
        return _measure(
            cache_blocks,
            blocks,
            dtype,
            layers,
            block_tokens,
            heads,
            head_dim,
            repeats,
            operations,
            target,
            seed,
            progress,
        )
    finally:
        torch.set_num_threads(threads)


def _measure(
    cache_blocks: Sequence[int],
    blocks: Sequence[int],
    dtype: torch.dtype,
    layers: int,
    block_tokens: int,
    heads: int,
    head_dim: int,
    repeats: int,
    operations: Sequence[str],
    target: torch.device,
    seed: int,
    progress: Callable[[str], None] | None,
) -> list[ScalingRow]:
    rng = np.random.default_rng(seed)
    rows: list[ScalingRow] = []
    for size in cache_blocks:
        sizes = dict(K=2, B=size, N=block_tokens, H=heads, C=head_dim)
        caches = {f"layer{i}": _random_cache([sizes[a] for a in "KBNHC"], dtype, rng).to(target) for i in range(layers)}
        xla.sync()
        host = kvhost.KVHost(caches, axes="KBNHC", backend="tpu")
        clone = _median(lambda: _clone_all(caches), repeats)  # noqa: B023  (called before the loop moves on)
        cache_bytes = sum(c.numel() * c.element_size() for c in caches.values())
        for n in blocks:
            calls = _calls(host, n, rng)
            for operation in operations:
                seconds = _median(calls[operation], repeats)
                row = ScalingRow(operation, str(dtype).removeprefix("torch."), size, cache_bytes, n, seconds, clone)
                rows.append(row)
                if progress is not None:
                    progress(format_row(row))
    order = {op: i for i, op in enumerate(OPERATIONS)}
    return sorted(rows, key=lambda r: (order[r.operation], r.blocks, r.cache_blocks))


def _calls(host: kvhost.KVHost, n: int, rng: np.random.Generator) -> dict[str, Callable[[], object]]:
    """One call per operation, each on ``n`` fresh random blocks of ``host``'s caches."""
    layout = host.caches.layout
    sizes = dict(layout.logical_sizes(), B=n)
    dtype = host.caches.members[0].tensor.dtype
    staging = {name: make_cache("KBNHC", "KBHNC", sizes, dtype, "cpu").zero_() for name in host.caches.layers}
    slots = np.arange(n)

    def ids() -> np.ndarray:
        return rng.choice(layout.num_blocks, n, replace=False)

    return {
        # Sender blocks of N/4 tokens, head-major: a real rearrangement.
        "receive": lambda: host.receive({"r": ids()}, remote_order="HNC", remote_block_size=layout.block_size // 4),
        "load": lambda: host.copy_from(staging, slots, ids(), src_axes="KBNHC"),
        "save": lambda: host.copy_to(staging, ids(), slots, dst_axes="KBNHC"),
    }


def _random_cache(shape: list[int], dtype: torch.dtype, rng: np.random.Generator) -> torch.Tensor:
    raw = rng.integers(0, 256, size=(*shape, dtype.itemsize), dtype=np.uint8)
    return torch.from_numpy(raw).view(dtype).squeeze(-1)


def _clone_all(caches: dict[str, torch.Tensor]) -> None:
    copies = [cache.clone() for cache in caches.values()]
    xla.sync()
    del copies


def _median(call: Callable[[], object], repeats: int) -> float:
    call()  # warm-up: compiles the graph for this shape
    xla.wait()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        call()
        xla.wait()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def growth(rows: Sequence[ScalingRow], operation: str, blocks: int) -> float:
    """Time at the largest cache over time at the smallest, for one operation and ``n``."""
    picked = sorted((r for r in rows if r.operation == operation and r.blocks == blocks), key=lambda r: r.cache_blocks)
    if len(picked) < 2:
        raise ValueError(f"need two cache sizes for {operation} of {blocks} blocks, have {len(picked)}")
    return picked[-1].seconds / picked[0].seconds


HEADER = f"{'operation':<9} {'dtype':<8} {'cache blocks':>12} {'cache MB':>9} {'n':>5} {'ms/call':>9} {'clone ms':>9}"


def format_row(row: ScalingRow) -> str:
    return (
        f"{row.operation:<9} {row.dtype:<8} {row.cache_blocks:>12} {row.cache_bytes / 2**20:>9.1f} "
        f"{row.blocks:>5} {row.seconds * 1e3:>9.3f} {row.cache_clone_seconds * 1e3:>9.3f}"
    )


def format_table(rows: Sequence[ScalingRow]) -> str:
    """The rows as a text table, then each operation's growth from the smallest to the largest cache."""
    lines = [HEADER, *(format_row(r) for r in rows)]
    sizes = sorted({r.cache_blocks for r in rows})
    if len(sizes) > 1:
        lines.append(f"growth from {sizes[0]} to {sizes[-1]} cache blocks ({sizes[-1] / sizes[0]:g}x the cache):")
        for operation in dict.fromkeys(r.operation for r in rows):
            for n in sorted({r.blocks for r in rows if r.operation == operation}):
                lines.append(f"  {operation} of {n} blocks: {growth(rows, operation, n):.2f}x")
        clones = sorted({(r.cache_blocks, r.cache_clone_seconds) for r in rows})
        lines.append(f"  whole-cache clone: {clones[-1][1] / clones[0][1]:.2f}x")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m kvhost_tools.device_checks.xla_scaling", description=__doc__ and __doc__.split("\n\n")[0]
    )
    parser.add_argument("--cache-blocks", type=int, nargs="+", default=[512, 2048, 8192])
    parser.add_argument("--blocks", type=int, nargs="+", default=[16, 64])
    parser.add_argument("--dtype", default="float16", help="torch dtype name, e.g. float16, bfloat16, float32")
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args(argv)
    rows = measure_scaling(
        args.cache_blocks,
        args.blocks,
        dtype=getattr(torch, args.dtype),
        repeats=args.repeats,
        progress=lambda line: print(line, flush=True),
    )
    print(format_table(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
