"""``kvhost bench``: memcpy (the roofline), the per-request baseline and kvhost, side by side.

For every workload point the methods run in one process on the same bytes, interleaved
in a random order per round, each call starting with the bytes the methods touch out of
every cache (``--cache data``, see ``Device``: small batches would otherwise be served
from this machine's 32 MiB L3 for one method and not another). Results are medians over
rounds, leaving out calls that waited for a core another process held (see ``disturbed``).

- ``memcpy``: one plain copy of the same number of bytes between two buffers, on the
  same device(s) and threads: an in-place rearrangement needs one read and one write of
  every byte, the traffic of a copy. A plain copy also fetches each destination line
  before writing it, which an in-place rewrite need not, so kvhost can pass 1.0.
- ``baseline``: ``kvhost.baseline``, the engines' per-request path, with torch's threads;
  ``baseline-1t`` the same on one thread (its many small ops can be faster so). Speedups
  are over the faster of the two at each point.
- ``kvhost``: a ``kvhost.KVHost`` registered once, as a connector holds it;
  ``kvhost-fn``: the module-level calls (``kvhost.receive``, ``kvhost.copy_blocks``).

Named scenarios carry the targets of issue 5 and report PASS or FAIL; sweeps vary
blocks per request, block-size ratio, layout pair, dtype and copy direction. Writes a
JSON file and a PNG plot (fraction of roofline against batch size).

The measuring runs in a child process with ``OMP_WAIT_POLICY=PASSIVE`` unless the
variable is set: torch and numba each bring an OpenMP runtime whose idle workers spin,
and on a shared two-core machine a spinning worker turns every parallel region into a
wait for a scheduler time slice (8-16 ms per call measured here under load).
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import platform
import random
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch

import kvhost
from kvhost.baseline import PerRequestReceiver, PerRequestStager
from kvhost.batch import ReceiveBatch, plan_receive_batch
from kvhost.caches import CacheSet
from kvhost.testing import fill_random, raw

MiB = 1 << 20
ROOFLINE = "memcpy"
BASELINE = "baseline"
BASELINE_1T = "baseline-1t"
KVHOST = "kvhost"
KVHOST_FN = "kvhost-fn"
METHODS = {
    ROOFLINE: "a plain copy of the same bytes between two buffers (the roofline)",
    BASELINE: "per request, per layer, per K/V half: gather -> permute copy -> scatter (staging: index, assign)",
    BASELINE_1T: "the baseline with torch on one thread (its small ops gain nothing from waking a second one)",
    KVHOST: "kvhost.KVHost registered once: .receive / .copy_to / .copy_from",
    KVHOST_FN: "module-level kvhost.receive / kvhost.copy_blocks (the caches validated on every call)",
    "empty": "KVHost.receive with no requests (identity scenario)",
    "visit": "one pass over the batch's mapping, len() of every request: the least a call handed it can do (identity)",
    "front end": "kvhost.batch.plan_receive_batch alone: validation, grouping, concatenation (front-end scenario)",
    "transform": "the backend's work for the batch the front end prepared (front-end scenario)",
}
TABLE_COLUMNS = (
    "scenario",
    "point",
    "requests",
    "blocks",
    "MiB",
    "memcpy GB/s",
    "baseline GB/s",
    "kvhost GB/s",
    "kvhost-fn GB/s",
    "baseline/roof",
    "kvhost/roof",
    "kvhost-fn/roof",
    "speedup",
)


# --- workloads ------------------------------------------------------------------------


@dataclass(frozen=True)
class Geometry:
    """The layer tensors of one cache: letters, memory order, sizes, dtype."""

    axes: str = "KBNHC"
    physical: str = "KBNHC"
    block_size: int = 64
    heads: int = 8
    head_dim: int = 128
    layers: int = 16
    dtype: str = "bfloat16"

    @property
    def torch_dtype(self) -> torch.dtype:
        dtype = getattr(torch, self.dtype)
        assert isinstance(dtype, torch.dtype)
        return dtype

    def sizes(self, num_blocks: int) -> dict[str, int]:
        every = {"L": 1, "K": 2, "B": num_blocks, "N": self.block_size, "H": self.heads, "C": self.head_dim}
        return {a: every[a] for a in self.axes}

    @property
    def block_bytes(self) -> int:
        """Bytes of one block id over every layer tensor."""
        per_layer = math.prod(size for a, size in self.sizes(1).items() if a != "B")
        return self.layers * per_layer * self.torch_dtype.itemsize

    def describe(self) -> str:
        memory = f" (memory {self.physical})" if self.physical != self.axes else ""
        sizes = f"N={self.block_size} H={self.heads} C={self.head_dim}"
        return f"{self.axes}{memory} {self.dtype} {sizes} x {self.layers} layers"


@dataclass(frozen=True)
class Point:
    """One measured workload: a batch of requests on one cache geometry."""

    scenario: str
    kind: str  # receive | stage | identity | frontend
    geometry: Geometry
    requests: int
    blocks_per_request: int
    remote_order: str = ""
    remote_block_size: int = 0
    ids: str = "runs"  # runs: allocator-like runs of consecutive ids; scattered: a random permutation
    host_physical: str = ""  # stage: the host buffer's memory order ("" = the cache's)
    direction: str = "save"  # stage: save (cache -> host buffer) or load (host buffer -> cache)
    label: str = ""

    @property
    def blocks(self) -> int:
        return self.requests * self.blocks_per_request


@dataclass(frozen=True)
class Target:
    """A target of issue 5 that a scenario's points are held to."""

    text: str
    min_fraction: float | None = None  # kvhost / memcpy, at every point
    min_speedup: float | None = None  # baseline / kvhost, at every point
    identity: bool = False  # zero bytes moved, within noise of an empty call
    max_front_share: float | None = None  # front end / transform


@dataclass(frozen=True)
class Scenario:
    name: str
    title: str
    points: tuple[Point, ...]
    target: Target | None = None
    plot: bool = False  # a batch-size sweep drawn in the PNG


@dataclass(frozen=True)
class Preset:
    name: str
    geometry: Geometry
    requests: tuple[int, ...]
    sweep_requests: int
    front_end: tuple[int, int, int]  # requests, blocks per request, layers
    min_rounds: int
    max_rounds: int
    seconds_per_point: float
    sweeps: bool


PRESETS = {
    "full": Preset(
        "full",
        Geometry(),
        requests=(1, 2, 4, 8, 16, 32, 64, 128, 256),
        sweep_requests=32,
        front_end=(1024, 16, 2),
        min_rounds=7,
        max_rounds=31,
        seconds_per_point=2.5,
        sweeps=True,
    ),
    "quick": Preset(
        "quick",
        Geometry(heads=2, head_dim=64, layers=2),
        requests=(1, 4, 16),
        sweep_requests=4,
        front_end=(64, 16, 1),
        min_rounds=3,
        max_rounds=5,
        seconds_per_point=0.05,
        sweeps=True,
    ),
}


def scenarios(preset: Preset, requests: Sequence[int]) -> list[Scenario]:
    """The named target scenarios of issue 5, then the sweeps."""
    nhd64 = preset.geometry
    nhd16 = replace(nhd64, block_size=16)
    receive = Point("", "receive", nhd64, 1, 4, "HNC", 16, label="HND16->NHD64")

    def batch_sweep(point: Point) -> tuple[Point, ...]:
        return tuple(replace(point, requests=n) for n in requests)

    out = [
        Scenario(
            "receive-r4",
            "receive, remote HND 16 -> local NHD 64 (r = 4), requests of 4 blocks",
            batch_sweep(replace(receive, scenario="receive-r4")),
            Target(">= 0.8 of memcpy and >= 4x the baseline at every batch size", min_fraction=0.8, min_speedup=4.0),
            plot=True,
        ),
        Scenario(
            "receive-g4",
            "receive, remote HND 64 -> local NHD 16 (g = 4), requests of 4 blocks",
            batch_sweep(Point("receive-g4", "receive", nhd16, 1, 4, "HNC", 64, label="HND64->NHD16")),
            Target(">= 0.7 of memcpy at every batch size", min_fraction=0.7),
            plot=True,
        ),
        Scenario(
            "stage-runs",
            "staging copy cache -> host buffer, allocator-like runs of ids, requests of 4 blocks of 16",
            batch_sweep(Point("stage-runs", "stage", nhd16, 1, 4, ids="runs", label="save, runs")),
            Target(">= 0.8 of memcpy and >= 4x the baseline at every batch size", min_fraction=0.8, min_speedup=4.0),
            plot=True,
        ),
        Scenario(
            "stage-scattered",
            "staging copy cache -> host buffer, scattered single blocks, requests of 4 blocks of 16",
            batch_sweep(Point("stage-scattered", "stage", nhd16, 1, 4, ids="scattered", label="save, scattered")),
            Target(">= 0.6 of memcpy at every batch size", min_fraction=0.6),
            plot=True,
        ),
        Scenario(
            "identity",
            "receive whose transform is the identity (token-major NHD 16 -> NHD 64): nothing to copy",
            batch_sweep(Point("identity", "identity", nhd64, 1, 4, "NHC", 16, label="NHD16->NHD64")),
            Target(
                "zero bytes moved; time within noise (the larger IQR) of an empty call plus one pass over the batch",
                identity=True,
            ),
        ),
    ]
    front_requests, front_blocks, front_layers = preset.front_end
    out.append(
        Scenario(
            "front-end",
            f"front end for {front_requests} requests x {front_blocks} blocks (HND 16 -> NHD 16, "
            f"{front_layers} layer(s): fewer layers make the transform smaller and the share larger)",
            (
                Point(
                    "front-end",
                    "frontend",
                    replace(nhd16, layers=front_layers),
                    front_requests,
                    front_blocks,
                    "HNC",
                    16,
                    label="HND16->NHD16",
                ),
            ),
            Target("front end < 5% of the transform it prepares", max_front_share=0.05),
        )
    )
    if not preset.sweeps:
        return out
    at = replace(receive, requests=preset.sweep_requests)
    out += [
        Scenario(
            "sweep-blocks",
            f"receive HND 16 -> NHD 64, {preset.sweep_requests} requests, blocks per request",
            tuple(
                replace(at, scenario="sweep-blocks", blocks_per_request=b, label=f"{b} blocks/request")
                for b in (1, 4, 16)
            ),
        ),
        Scenario(
            "sweep-ratio",
            f"receive HND -> NHD 64, {preset.sweep_requests} requests of 4 blocks, block-size ratio",
            tuple(
                replace(at, scenario="sweep-ratio", remote_block_size=size, label=label)
                for size, label in ((64, "r=1"), (32, "r=2"), (16, "r=4"), (8, "r=8"), (128, "g=2"), (256, "g=4"))
            ),
        ),
        Scenario(
            "sweep-layout",
            f"receive r = 4, {preset.sweep_requests} requests of 4 blocks, layout pairs (remote -> local)",
            (
                replace(at, scenario="sweep-layout", label="HND->NHD"),
                replace(
                    at,
                    scenario="sweep-layout",
                    geometry=replace(nhd64, physical="KBHNC"),
                    remote_order="NHC",
                    label="NHD->HND",
                ),
                replace(
                    at,
                    scenario="sweep-layout",
                    geometry=replace(nhd64, physical="KBHNC"),
                    remote_order="HNC",
                    label="HND->HND",
                ),
                replace(
                    at,
                    scenario="sweep-layout",
                    geometry=replace(nhd64, axes="BKNHC", physical="BKNHC"),
                    remote_order="KHNC",
                    label="KHND->KNHD",
                ),
            ),
        ),
        Scenario(
            "sweep-dtype",
            f"receive HND 16 -> NHD 64, {preset.sweep_requests} requests of 4 blocks, dtype",
            tuple(
                replace(at, scenario="sweep-dtype", geometry=replace(nhd64, dtype=dtype), label=dtype)
                for dtype in ("float8_e4m3fn", "bfloat16", "float32")
            ),
        ),
        Scenario(
            "sweep-stage",
            f"staging, {preset.sweep_requests} requests of 4 blocks of 16: direction and host layout",
            tuple(
                replace(
                    Point("sweep-stage", "stage", nhd16, preset.sweep_requests, 4),
                    direction=direction,
                    host_physical=host,
                    label=f"{direction}{', host HND' if host else ''}",
                )
                for direction, host in (("save", ""), ("load", ""), ("save", "KBHNC"))
            ),
        ),
    ]
    return out


def allocator_ids(num_blocks: int, count: int, kind: str, rng: np.random.Generator) -> np.ndarray:
    """``count`` block ids as an allocator hands them out after some churn.

    ``runs``: runs of 1-8 consecutive free blocks in random order; ``scattered``: a random
    permutation, so neighbours in the batch are (almost) never neighbours in memory.
    """
    if kind == "scattered":
        return rng.permutation(num_blocks)[:count].astype(np.int64)
    lengths = rng.integers(1, 9, size=num_blocks)
    starts = np.cumsum(lengths) - lengths
    starts, lengths = starts[starts < num_blocks], lengths[starts < num_blocks]
    order = rng.permutation(starts.size)
    runs = [np.arange(s, min(s + n, num_blocks)) for s, n in zip(starts[order], lengths[order])]
    return np.concatenate(runs)[:count].astype(np.int64)


# --- the machine -------------------------------------------------------------------------


def last_level_cache_bytes() -> int:
    """Size of the largest CPU cache from sysfs (32 MiB when it cannot be read)."""
    sizes = []
    for index in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*"):
        try:
            text = (index / "size").read_text().strip()
        except OSError:
            continue
        units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
        sizes.append(int(text[:-1]) * units[text[-1]] if text[-1] in units else int(text))
    return max(sizes, default=32 * MiB)


def machine() -> dict[str, Any]:
    model = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    info: dict[str, Any] = {
        "cpu": model,
        "cores": os.cpu_count(),
        "last_level_cache_mib": last_level_cache_bytes() // MiB,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "OMP_WAIT_POLICY": os.environ.get("OMP_WAIT_POLICY"),
    }
    try:
        import numba

        info["numba"] = numba.__version__
    except ImportError:
        info["numba"] = None
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name()
    return info


class Device:
    """What timing needs from a device: synchronisation and a cache flush before each call.

    ``cache`` says what a flush evicts:

    - ``data`` (default): exactly the bytes the methods read or write (``clflush`` of each
      64-byte line), as in a serving process whose KV bytes just arrived from the network
      while its interpreter and code stay warm. Where lines cannot be flushed one by one
      (not x86, not the host, numba missing) it falls back to ``all``; ranges larger than
      four times the last level cache are left alone (they evict themselves).
    - ``all``: everything, by reading three times the last level cache: data and code are
      cold, which also charges every Python-level step of a call with cache misses.
    - ``warm``: nothing.
    """

    def __init__(self, name: str, cache: str = "data") -> None:
        self.device = torch.device(name)
        module = getattr(torch, self.device.type, None)
        self._sync: Callable[[], None] = getattr(module, "synchronize", None) or (lambda: None)
        if self.device.type == "cpu":
            self._sync = lambda: None
        self._evict = line_evictor() if cache == "data" and self.device.type == "cpu" else None
        self.cache = "all" if cache == "data" and self._evict is None else cache
        self._flush: list[torch.Tensor] = []
        if self.cache in ("all", "data"):
            # Reading three times the largest cache evicts what the last call left there.
            flush_bytes = max(3 * last_level_cache_bytes(), 64 * MiB)
            self._flush = [torch.ones(flush_bytes // 8, dtype=torch.int64)]
            if self.device.type != "cpu":
                self._flush.append(torch.ones(256 * MiB // 8, dtype=torch.int64, device=self.device))
        self._self_evicting = 4 * last_level_cache_bytes()

    @property
    def cold(self) -> bool:
        return self.cache != "warm"

    @property
    def is_host(self) -> bool:
        return self.device.type == "cpu"

    def synchronize(self) -> None:
        self._sync()

    def flush(self, touched: np.ndarray | None = None) -> None:
        """Evict what ``cache`` says; ``touched`` rows are (address, bytes) the methods use."""
        if self.cache == "warm":
            return
        if self.cache == "data" and self._evict is not None and touched is not None:
            if int(touched[:, 1].sum()) <= self._self_evicting:
                self._evict(touched)
            return
        for buffer in self._flush:
            buffer.sum()
        self.synchronize()


def line_evictor() -> Callable[[np.ndarray], None] | None:
    """A compiled ``clflush`` loop over (address, bytes) rows, or None where there is none."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return None
    try:
        from llvmlite import ir
        from numba import njit, types
        from numba.extending import intrinsic
    except ImportError:
        return None

    @intrinsic
    def clflush(typingctx, address):  # type: ignore[no-untyped-def]
        def codegen(context, builder, signature, args):  # type: ignore[no-untyped-def]
            byte_ptr = ir.IntType(8).as_pointer()
            flush = builder.module.declare_intrinsic(
                "llvm.x86.sse2.clflush", fnty=ir.FunctionType(ir.VoidType(), [byte_ptr])
            )
            builder.call(flush, [builder.inttoptr(args[0], byte_ptr)])

        return types.void(types.int64), codegen

    @intrinsic
    def fence(typingctx):  # type: ignore[no-untyped-def]
        def codegen(context, builder, signature, args):  # type: ignore[no-untyped-def]
            mfence = builder.module.declare_intrinsic("llvm.x86.sse2.mfence", fnty=ir.FunctionType(ir.VoidType(), []))
            builder.call(mfence, [])

        return types.void(), codegen

    @njit(nogil=True)
    def evict(ranges):  # type: ignore[no-untyped-def]
        for row in range(ranges.shape[0]):
            first = ranges[row, 0] - ranges[row, 0] % 64
            for line in range(first, ranges[row, 0] + ranges[row, 1], 64):
                clflush(line)  # type: ignore[call-arg]
        fence()  # type: ignore[call-arg]

    try:
        evict(np.zeros((0, 2), dtype=np.int64))
    except Exception:  # an LLVM without the x86 intrinsics
        return None
    result: Callable[[np.ndarray], None] = evict
    return result


def block_ranges(caches: dict[str, torch.Tensor], axes: str, ids: np.ndarray) -> np.ndarray:
    """(address, bytes) of every region of blocks ``ids`` in every layer of ``caches``."""
    rows = []
    for member in CacheSet(caches, axes).members:
        layout = member.layout
        starts = (
            member.tensor.data_ptr() + layout.outer_offsets_bytes[:, None] + ids[None, :] * layout.block_stride_bytes
        )
        rows.append(np.stack([starts.reshape(-1), np.full(starts.size, layout.region_bytes)], axis=1))
    return np.concatenate(rows).astype(np.int64)


# --- methods -------------------------------------------------------------------------------


@dataclass
class Sample:
    seconds: list[float] = field(default_factory=list)
    waits: list[float] = field(default_factory=list)  # run-queue wait during each call

    @property
    def median(self) -> float:
        return statistics.median(self.seconds)

    def quantile(self, q: float) -> float:
        return float(np.quantile(self.seconds, q))


class Workspace:
    """Caches and copy buffers, allocated once per geometry and reused by its points."""

    RING = 256 * MiB  # the memcpy roofline copies through buffers this large, in pieces

    def __init__(self, device: Device) -> None:
        self.device = device
        self._caches: dict[tuple[str, Geometry, str], tuple[int, dict[str, torch.Tensor]]] = {}
        self._rings: dict[tuple[str, str], tuple[torch.Tensor, torch.Tensor]] = {}

    def caches(self, role: str, geometry: Geometry, physical: str, num_blocks: int) -> dict[str, torch.Tensor]:
        """Layer tensors for ``role`` (``cache`` on the device, ``host`` buffers), every page touched.

        One set per role is kept: a set with enough blocks is reused, any other is freed first.
        """
        key = (role, geometry, physical)
        held = self._caches.get(key)
        if held is not None and held[0] >= num_blocks:
            return held[1]
        for old in [k for k in self._caches if k[0] == role]:
            del self._caches[old]
        held = None
        gc.collect()
        on_host = role == "host"
        device = torch.device("cpu") if on_host else self.device.device
        pinned = on_host and not self.device.is_host
        sizes = geometry.sizes(num_blocks)
        layers = {}
        for i in range(geometry.layers):
            memory = torch.empty(
                [sizes[a] for a in physical], dtype=geometry.torch_dtype, device=device, pin_memory=pinned
            )
            memory.view(torch.uint8).fill_(i + 1)
            layers[f"layer{i}"] = memory.permute([physical.index(a) for a in geometry.axes])
        self._caches[key] = (num_blocks, layers)
        return layers

    def memcpy(self, nbytes: int, src: torch.device, dst: torch.device) -> Callable[[], None]:
        """A plain copy of ``nbytes`` from a buffer on ``src`` to one on ``dst``, in ring-sized pieces."""
        source, dest = self._ring(src, dst)

        def copy() -> None:
            for start in range(0, nbytes, self.RING):
                count = min(self.RING, nbytes - start)
                dest[:count].copy_(source[:count])

        return copy

    def memcpy_ranges(self, nbytes: int, src: torch.device, dst: torch.device) -> np.ndarray:
        """(address, bytes) of what ``memcpy(nbytes, src, dst)`` reads and writes (host buffers only)."""
        rows = [(t.data_ptr(), min(nbytes, self.RING)) for t in self._ring(src, dst) if t.device.type == "cpu"]
        return np.array(rows, dtype=np.int64).reshape(-1, 2)

    def _ring(self, src: torch.device, dst: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        key = (str(src), str(dst))
        if key not in self._rings:
            pinned = not self.device.is_host
            self._rings[key] = tuple(  # type: ignore[assignment]
                torch.ones(self.RING, dtype=torch.uint8, device=d, pin_memory=pinned and d.type == "cpu")
                for d in (src, dst)
            )
        return self._rings[key]


@dataclass
class Prepared:
    """A point made runnable: its methods, the bytes they move, and how to verify them."""

    methods: dict[str, Callable[[], object]]
    nbytes: int
    verify: Callable[[], bool] | None = None
    stats: dict[str, Any] = field(default_factory=dict)
    touched: np.ndarray | None = None  # (address, bytes) rows the methods read or write


def prepare(point: Point, space: Workspace, extra_backends: Sequence[str], num_blocks: int, seed: int) -> Prepared:
    rng = np.random.default_rng(seed)
    geometry = point.geometry
    ids = allocator_ids(num_blocks, point.blocks, point.ids, rng)
    chunks = [ids[i : i + point.blocks_per_request] for i in range(0, ids.size, point.blocks_per_request)]
    if point.kind == "stage":
        return _prepare_stage(point, space, extra_backends, num_blocks, chunks)
    caches = space.caches("cache", geometry, geometry.physical, num_blocks)
    requests = {f"req-{i}": chunk.tolist() for i, chunk in enumerate(chunks)}
    order, size = point.remote_order, point.remote_block_size
    host = kvhost.KVHost(caches, axes=geometry.axes)
    touched = block_ranges(caches, geometry.axes, ids)
    if point.kind == "identity":
        return Prepared(
            {
                "empty": lambda: host.receive({}, remote_order=order, remote_block_size=size),
                "visit": lambda: sum(map(len, requests.values())),
                KVHOST: lambda: host.receive(requests, remote_order=order, remote_block_size=size),
                KVHOST_FN: lambda: kvhost.receive(
                    caches, requests, axes=geometry.axes, remote_order=order, remote_block_size=size
                ),
            },
            nbytes=0,
            touched=touched,
        )
    if point.kind == "frontend":
        planned: list[ReceiveBatch] = [plan_receive_batch(host.caches, requests, order, size)]

        def front_end() -> None:
            planned[0] = plan_receive_batch(host.caches, requests, order, size)

        def transform() -> None:
            for job in planned[0].jobs:
                host.backend.receive(job)

        return Prepared(
            {
                "front end": front_end,
                "transform": transform,
                KVHOST: lambda: host.receive(requests, remote_order=order, remote_block_size=size),
            },
            nbytes=planned[0].bytes_moved,
            touched=touched,
        )
    baseline = PerRequestReceiver(caches, geometry.axes)
    methods: dict[str, Callable[[], object]] = {
        ROOFLINE: space.memcpy(point.blocks * geometry.block_bytes, space.device.device, space.device.device),
        BASELINE: lambda: baseline.receive(requests, remote_order=order, remote_block_size=size),
        KVHOST: lambda: host.receive(requests, remote_order=order, remote_block_size=size),
        KVHOST_FN: lambda: kvhost.receive(
            caches, requests, axes=geometry.axes, remote_order=order, remote_block_size=size
        ),
    }
    for name in extra_backends:
        methods[f"kvhost[{name}]"] = _receiver(kvhost.KVHost(caches, axes=geometry.axes, backend=name), point, requests)
    _add_single_threaded(methods, space.device)
    stats = host.receive(requests, remote_order=order, remote_block_size=size)

    def verify() -> bool:
        return _same_result(
            caches, geometry.axes, ids, methods[BASELINE], [methods[KVHOST], methods[KVHOST_FN]], seed=seed
        )

    here = space.device.device
    touched = np.concatenate([touched, space.memcpy_ranges(point.blocks * geometry.block_bytes, here, here)])
    return Prepared(methods, nbytes=stats.bytes_moved, verify=verify, stats={"groups": stats.groups}, touched=touched)


def _add_single_threaded(methods: dict[str, Callable[[], object]], device: Device) -> None:
    """Add the baseline on one torch thread, where torch has more than one on the host."""
    threads = torch.get_num_threads()
    if not device.is_host or threads == 1:
        return
    baseline = methods[BASELINE]

    def single_threaded() -> None:
        torch.set_num_threads(1)
        try:
            baseline()
        finally:
            torch.set_num_threads(threads)

    methods[BASELINE_1T] = single_threaded


def _receiver(registered: kvhost.KVHost, point: Point, requests: dict[str, list[int]]) -> Callable[[], object]:
    return lambda: registered.receive(
        requests, remote_order=point.remote_order, remote_block_size=point.remote_block_size
    )


def _prepare_stage(
    point: Point, space: Workspace, extra_backends: Sequence[str], num_blocks: int, chunks: list[np.ndarray]
) -> Prepared:
    geometry = point.geometry
    cache = space.caches("cache", geometry, geometry.physical, num_blocks)
    buffer = space.caches("host", geometry, point.host_physical or geometry.physical, num_blocks)
    cache_ids = np.concatenate(chunks)
    buffer_ids = np.arange(point.blocks, dtype=np.int64)  # a staging buffer fills in order
    save = point.direction == "save"
    src, dst = (cache, buffer) if save else (buffer, cache)
    src_ids, dst_ids = (cache_ids, buffer_ids) if save else (buffer_ids, cache_ids)
    per_request = [
        (src_ids[i : i + point.blocks_per_request], dst_ids[i : i + point.blocks_per_request])
        for i in range(0, point.blocks, point.blocks_per_request)
    ]
    src_list, dst_list = src_ids.tolist(), dst_ids.tolist()
    axes = geometry.axes
    host = kvhost.KVHost(cache, axes=axes)
    baseline = PerRequestStager(src, dst, axes=axes)
    devices = (space.device.device, torch.device("cpu"))

    def connector(registered: kvhost.KVHost) -> Callable[[], object]:
        if save:
            return lambda: registered.copy_to(buffer, src_list, dst_list).wait()
        return lambda: registered.copy_from(buffer, src_list, dst_list).wait()

    methods: dict[str, Callable[[], object]] = {
        ROOFLINE: space.memcpy(point.blocks * geometry.block_bytes, *(devices if save else devices[::-1])),
        BASELINE: lambda: baseline.copy(per_request),
        KVHOST: connector(host),
        KVHOST_FN: lambda: kvhost.copy_blocks(src, dst, src_list, dst_list, axes=axes).wait(),
    }
    for name in extra_backends:
        methods[f"kvhost[{name}]"] = connector(kvhost.KVHost(cache, axes=axes, backend=name))
    _add_single_threaded(methods, space.device)
    result = kvhost.copy_blocks(src, dst, src_list, dst_list, axes=axes).wait()

    def verify() -> bool:
        return _same_copy(src, dst, axes, src_ids, dst_ids, methods[BASELINE], [methods[KVHOST], methods[KVHOST_FN]])

    ends = devices if save else devices[::-1]
    touched = np.concatenate(
        [
            block_ranges(cache, axes, cache_ids) if space.device.is_host else np.zeros((0, 2), dtype=np.int64),
            block_ranges(buffer, axes, buffer_ids),
            space.memcpy_ranges(point.blocks * geometry.block_bytes, *ends),
        ]
    )
    return Prepared(methods, nbytes=result.bytes_moved, verify=verify, stats={"runs": result.runs}, touched=touched)


def _block_bytes(caches: dict[str, torch.Tensor], axes: str, ids: np.ndarray) -> list[torch.Tensor]:
    index = torch.from_numpy(ids)
    return [
        raw(m.tensor).index_select(m.layout.axes.index("B"), index.to(m.tensor.device)).cpu()
        for m in CacheSet(caches, axes).members
    ]


def _put_block_bytes(caches: dict[str, torch.Tensor], axes: str, ids: np.ndarray, values: list[torch.Tensor]) -> None:
    index = torch.from_numpy(ids)
    for member, value in zip(CacheSet(caches, axes).members, values):
        b = member.layout.axes.index("B")
        raw(member.tensor).index_copy_(b, index.to(member.tensor.device), value.to(member.tensor.device))


def _same_result(
    caches: dict[str, torch.Tensor],
    axes: str,
    ids: np.ndarray,
    baseline: Callable[[], object],
    others: list[Callable[[], object]],
    seed: int,
) -> bool:
    """Baseline and each kvhost method, run on the same random wire bytes, leave the same bytes."""
    start = [fill_random(t, seed + i) for i, t in enumerate(_block_bytes(caches, axes, ids))]
    _put_block_bytes(caches, axes, ids, start)
    baseline()
    want = _block_bytes(caches, axes, ids)
    for method in others:
        _put_block_bytes(caches, axes, ids, start)
        method()
        if not all(torch.equal(w, g) for w, g in zip(want, _block_bytes(caches, axes, ids))):
            return False
    return True


def _same_copy(
    src: dict[str, torch.Tensor],
    dst: dict[str, torch.Tensor],
    axes: str,
    src_ids: np.ndarray,
    dst_ids: np.ndarray,
    baseline: Callable[[], object],
    others: list[Callable[[], object]],
) -> bool:
    """Baseline and each kvhost copy write the same bytes into the destination blocks."""
    start = [fill_random(t, 7 + i) for i, t in enumerate(_block_bytes(src, axes, src_ids))]
    _put_block_bytes(src, axes, src_ids, start)
    blank = [torch.zeros_like(t) for t in _block_bytes(dst, axes, dst_ids)]
    _put_block_bytes(dst, axes, dst_ids, blank)
    baseline()
    want = _block_bytes(dst, axes, dst_ids)
    if all(torch.equal(w, b) for w, b in zip(want, blank)):
        return False  # the baseline copied nothing: nothing to compare against
    for method in others:
        _put_block_bytes(dst, axes, dst_ids, blank)
        method()
        if not all(torch.equal(w, g) for w, g in zip(want, _block_bytes(dst, axes, dst_ids))):
            return False
    return True


# --- timing --------------------------------------------------------------------------------


@dataclass
class Measured:
    """Every round's samples, and per method which of them its median uses."""

    samples: dict[str, Sample]
    used: dict[str, list[bool]]  # per method and round: undisturbed (or every round, when too few were)

    def used_samples(self) -> dict[str, Sample]:
        return {
            name: Sample(
                [t for t, keep in zip(sample.seconds, self.used[name]) if keep],
                [w for w, keep in zip(sample.waits, self.used[name]) if keep],
            )
            for name, sample in self.samples.items()
        }


DISTURBANCE_S = 1e-3  # waiting this much longer for a core than a method usually does marks a call


def disturbed(sample: Sample) -> list[bool]:
    """Per call: did it wait for a core clearly longer than this method usually waits?

    Waking a worker costs some run-queue wait on every call, and more while the machine
    is busy (the usual wait: the lower quartile); a call that also waited a scheduler time
    slice (4 ms here) for a core another process held is disturbed.
    """
    usual = float(np.quantile(sample.waits, 0.25))
    limit = usual + max(DISTURBANCE_S, 0.05 * min(sample.seconds))
    return [wait > limit for wait in sample.waits]


def measure(
    methods: dict[str, Callable[[], object]],
    device: Device,
    preset: Preset,
    rounds: int | None,
    rng: random.Random,
    touched: np.ndarray | None = None,
) -> Measured:
    """Methods interleaved in a random order per round, each call from a cold cache.

    While some method has fewer undisturbed calls than the rounds planned, rounds go on,
    up to three times the plan. Each method's median uses its undisturbed calls when
    there are at least half the planned number, else all of them.
    """
    estimate = 0.0
    for method in methods.values():  # warm up (compile, plan caches), and time a call to plan the rounds
        for _ in range(2):
            device.flush(touched)
            start = time.perf_counter()
            method()
            device.synchronize()
            took = time.perf_counter() - start
            if took > 1.0:  # long enough that a first call's one-off costs do not matter
                break
        estimate += took
    if rounds is None:
        wanted = preset.seconds_per_point / max(estimate, 1e-6)
        rounds = min(preset.max_rounds, max(preset.min_rounds, int(wanted)))
        rounds |= 1  # odd: the median is a sample
    samples = {name: Sample() for name in methods}
    names = list(methods)
    began = time.perf_counter()
    run = 0
    while True:
        run += 1
        rng.shuffle(names)
        for name in names:
            device.flush(touched)
            waited = run_queue_wait()
            start = time.perf_counter()
            methods[name]()
            device.synchronize()
            samples[name].seconds.append(time.perf_counter() - start)
            samples[name].waits.append(run_queue_wait() - waited)
        if run < rounds:
            continue
        fewest = min(run - sum(disturbed(sample)) for sample in samples.values())
        if fewest >= rounds or run >= 3 * rounds or time.perf_counter() - began > 3 * preset.seconds_per_point:
            break
    used = {}
    for name, sample in samples.items():
        clean = [not flag for flag in disturbed(sample)]
        used[name] = clean if sum(clean) >= max(3, rounds // 2) else [True] * run
    return Measured(samples, used)


def run_queue_wait() -> float:
    """Seconds this process's threads have spent runnable but not running (Linux schedstat; 0 elsewhere).

    Recorded per call: on a shared machine it shows which samples waited for a core.
    """
    total = 0
    try:
        tasks = os.listdir("/proc/self/task")
    except OSError:
        return 0.0
    for task in tasks:
        try:
            with open(f"/proc/self/task/{task}/schedstat") as stat:
                total += int(stat.read().split()[1])
        except (OSError, IndexError, ValueError):
            continue
    return total / 1e9


def summarise(point: Point, prepared: Prepared, measured: Measured) -> dict[str, Any]:
    samples = measured.used_samples()
    row: dict[str, Any] = {
        "scenario": point.scenario,
        "kind": point.kind,
        "label": point.label,
        "requests": point.requests,
        "blocks_per_request": point.blocks_per_request,
        "blocks": point.blocks,
        "bytes": prepared.nbytes,
        "geometry": asdict(point.geometry),
        "remote_order": point.remote_order,
        "remote_block_size": point.remote_block_size,
        "ids": point.ids,
        "direction": point.direction if point.kind == "stage" else None,
        "host_physical": point.host_physical or None,
        "rounds_run": len(next(iter(measured.samples.values())).seconds),
        "load_average": os.getloadavg()[0] if hasattr(os, "getloadavg") else None,
        **prepared.stats,
        "methods": {},
    }
    baselines = [name for name in samples if name in (BASELINE, BASELINE_1T)]
    best = min(baselines, key=lambda name: samples[name].median) if baselines else None
    row["baseline_best"] = best

    def per_round(top: str, bottom: str) -> list[float]:
        """``top / bottom`` in each round where both calls count: the spread of a ratio."""
        pairs = zip(
            measured.samples[top].seconds, measured.samples[bottom].seconds, measured.used[top], measured.used[bottom]
        )
        ratios = [t / b for t, b, keep_t, keep_b in pairs if keep_t and keep_b]
        return [float(np.quantile(ratios, q)) for q in (0.25, 0.75)] if ratios else []

    for name, sample in samples.items():
        entry: dict[str, Any] = {
            "median_s": sample.median,
            "p25_s": sample.quantile(0.25),
            "p75_s": sample.quantile(0.75),
            "min_s": min(sample.seconds),
            "max_s": max(sample.seconds),
            "rounds": len(sample.seconds),
            "samples_s": measured.samples[name].seconds,  # every call; "used" marks those the figures count
            "run_queue_wait_s": measured.samples[name].waits,
            "used": measured.used[name],
        }
        if prepared.nbytes:
            entry["gbps"] = prepared.nbytes / sample.median / 1e9
        if ROOFLINE in samples:
            entry["fraction"] = samples[ROOFLINE].median / sample.median
            entry["fraction_rounds_p25_p75"] = per_round(ROOFLINE, name)
        if best is not None:
            entry["speedup"] = samples[best].median / sample.median
            entry["speedup_rounds_p25_p75"] = per_round(best, name)
        row["methods"][name] = entry
    return row


# --- targets -------------------------------------------------------------------------------


def evaluate(scenario: Scenario, rows: list[dict[str, Any]]) -> dict[str, Any] | None:
    """PASS/FAIL of a scenario's target, with the figure each point was held to."""
    target = scenario.target
    if target is None or not rows:
        return None
    checks: list[dict[str, Any]] = []
    for row in rows:
        methods = row["methods"]
        where = f"{row['requests']} requests"
        if target.min_fraction is not None:
            value = methods[KVHOST]["fraction"]
            checks.append(_check(where, "kvhost/memcpy", value, ">=", target.min_fraction))
        if target.min_speedup is not None:
            value = methods[KVHOST]["speedup"]
            checks.append(_check(where, "baseline/kvhost", value, ">=", target.min_speedup))
        if target.identity:
            checks.append(_check(where, "bytes moved", row["bytes"], "<=", 0))
            empty, same = methods["empty"], methods[KVHOST]
            noise = max(m["p75_s"] - m["p25_s"] for m in (empty, same))
            # A call handed n requests visits each of them once, whatever it does with them.
            extra = same["median_s"] - empty["median_s"] - methods["visit"]["median_s"]
            row["identity_extra_s"], row["empty_noise_s"] = extra, noise
            checks.append(_check(where, "identity - empty - visit (us)", extra * 1e6, "<=", noise * 1e6))
        if target.max_front_share is not None:
            share = methods["front end"]["median_s"] / methods["transform"]["median_s"]
            row["front_end_share"] = share
            checks.append(_check(where, "front end/transform", share, "<", target.max_front_share))
    return {
        "scenario": scenario.name,
        "target": target.text,
        "passed": all(c["passed"] for c in checks),
        "checks": checks,
    }


def _check(where: str, what: str, value: float, op: str, limit: float) -> dict[str, Any]:
    passed = {"<=": value <= limit, ">=": value >= limit, "<": value < limit}[op]
    return {"point": where, "what": what, "value": value, "op": op, "limit": limit, "passed": passed}


# --- output --------------------------------------------------------------------------------


def table(rows: list[dict[str, Any]], extra_methods: Sequence[str] = ()) -> str:
    """The side-by-side table of every point with a roofline: GB/s, fraction of memcpy, speedup."""
    columns = list(TABLE_COLUMNS)
    for name in extra_methods:
        columns.insert(-1, f"{name}/roof")
    lines = [columns]
    for row in rows:
        methods = row["methods"]
        if ROOFLINE not in methods:
            continue

        def gbps(name: str, methods: dict[str, Any] = methods) -> str:
            return f"{methods[name]['gbps']:.1f}" if name in methods else "-"

        def frac(name: str, methods: dict[str, Any] = methods) -> str:
            return f"{methods[name]['fraction']:.2f}" if name in methods else "-"

        best = row["baseline_best"] or BASELINE
        mark = "*" if best == BASELINE_1T else ""

        cells = [
            row["scenario"],
            row["label"],
            str(row["requests"]),
            str(row["blocks"]),
            f"{row['bytes'] / MiB:.0f}",
            gbps(ROOFLINE),
            gbps(best) + mark,
            gbps(KVHOST),
            gbps(KVHOST_FN),
            frac(best) + mark,
            frac(KVHOST),
            frac(KVHOST_FN),
            *[frac(name) for name in extra_methods],
            f"{methods[KVHOST]['speedup']:.1f}x",
        ]
        lines.append(cells)
    note = "baseline: the faster of torch's threads and one thread (*: one thread); speedup: baseline / kvhost"
    return _format(lines) + "\n" + note


def other_tables(rows: list[dict[str, Any]]) -> str:
    out = []
    identity = [r for r in rows if r["kind"] == "identity"]
    if identity:
        header = ["identity", "requests", "blocks", "bytes moved", "empty us", "visit us", "kvhost us", "kvhost-fn us"]
        lines = [[*header, "noise us"]]
        for row in identity:
            m = row["methods"]
            lines.append(
                [
                    row["label"],
                    str(row["requests"]),
                    str(row["blocks"]),
                    str(row["bytes"]),
                    f"{m['empty']['median_s'] * 1e6:.1f}",
                    f"{m['visit']['median_s'] * 1e6:.1f}",
                    f"{m[KVHOST]['median_s'] * 1e6:.1f}",
                    f"{m[KVHOST_FN]['median_s'] * 1e6:.1f}",
                    f"{row.get('empty_noise_s', math.nan) * 1e6:.1f}",
                ]
            )
        out.append(_format(lines))
    front = [r for r in rows if r["kind"] == "frontend"]
    if front:
        lines = [["front end", "requests", "blocks", "MiB", "front end ms", "transform ms", "kvhost ms", "share"]]
        for row in front:
            m = row["methods"]
            share = m["front end"]["median_s"] / m["transform"]["median_s"]
            lines.append(
                [
                    row["label"],
                    str(row["requests"]),
                    str(row["blocks"]),
                    f"{row['bytes'] / MiB:.0f}",
                    f"{m['front end']['median_s'] * 1e3:.2f}",
                    f"{m['transform']['median_s'] * 1e3:.2f}",
                    f"{m[KVHOST]['median_s'] * 1e3:.2f}",
                    f"{share:.2%}",
                ]
            )
        out.append(_format(lines))
    return "\n\n".join(out)


def target_table(results: list[dict[str, Any]]) -> str:
    lines = [["scenario", "target", "worst", "verdict"]]
    for result in results:
        failed = [c for c in result["checks"] if not c["passed"]]
        worst = failed[0] if failed else _worst(result["checks"])
        figure = f"{worst['what']} {worst['value']:.3g} at {worst['point']}" if worst else "-"
        lines.append([result["scenario"], result["target"], figure, "PASS" if result["passed"] else "FAIL"])
    return _format(lines)


def _worst(checks: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The check closest to its limit: the headroom as a share of the limit (an exact
    check against zero that holds has none to report)."""

    def margin(c: dict[str, Any]) -> float:
        value, limit = float(c["value"]), float(c["limit"])
        headroom = value - limit if c["op"] == ">=" else limit - value
        return headroom / abs(limit) if limit else math.inf

    return min(checks, key=margin) if checks else None


def _format(lines: list[list[str]]) -> str:
    widths = [max(len(line[i]) for line in lines) for i in range(len(lines[0]))]
    rendered = [
        "  ".join(cell.ljust(w) if i < 2 else cell.rjust(w) for i, (cell, w) in enumerate(zip(line, widths)))
        for line in lines
    ]
    rendered.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(rendered)


def plot(result: dict[str, Any], path: Path) -> None:
    """Fraction of memcpy against batch size, one line per method, one panel per sweep."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [s for s in result["scenarios"] if s["plot"]]
    columns = 2
    rows_n = max(1, math.ceil(len(panels) / columns))
    figure, axes_grid = plt.subplots(rows_n, columns, figsize=(12, 4.2 * rows_n), squeeze=False)
    for ax, scenario in zip(axes_grid.flat, panels):
        rows = [r for r in result["points"] if r["scenario"] == scenario["name"]]
        methods = [m for m in rows[0]["methods"] if m != ROOFLINE] if rows else []
        for method in methods:
            xs = [r["requests"] for r in rows]
            ys = [r["methods"][method]["fraction"] for r in rows]
            ax.plot(xs, ys, marker="o", label=method)
        ax.axhline(1.0, color="black", linewidth=1, label="memcpy (roofline)")
        target = scenario.get("target") or {}
        if target.get("min_fraction") is not None:
            ax.axhline(target["min_fraction"], color="grey", linestyle="--", linewidth=1, label="target")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("requests per batch")
        ax.set_ylabel("fraction of memcpy bandwidth")
        ax.set_ylim(bottom=0)
        ax.set_title(scenario["name"] + ": " + scenario["title"], fontsize=9, wrap=True)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    for ax in list(axes_grid.flat)[len(panels) :]:
        ax.axis("off")
    info = result["machine"]
    figure.suptitle(
        f"kvhost bench ({result['preset']}): {info['cpu']}, {info['cores']} cores, torch {info['torch']}, "
        f"device {result['device']}, {result['cache']} cache",
        fontsize=10,
    )
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=110)
    plt.close(figure)


# --- the command ---------------------------------------------------------------------------


def parse(argv: Sequence[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="kvhost bench", description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="tiny shapes and few rounds, for CI (a few seconds)")
    parser.add_argument("--device", default="cpu", help="torch device of the caches (default cpu)")
    parser.add_argument("--requests", help="batch sizes to sweep, comma-separated (default 1..256 doubling)")
    parser.add_argument("--only", action="append", default=[], help="run scenarios whose name starts with this")
    parser.add_argument("--rounds", type=int, help="rounds per point (default: adaptive, odd, 7 to 31)")
    parser.add_argument("--backend", action="append", default=[], help="also time KVHost with this backend")
    parser.add_argument(
        "--cache",
        choices=("data", "all", "warm"),
        default="data",
        help="what to evict before each timed call: the bytes the methods touch (default), everything, or nothing",
    )
    parser.add_argument("--no-sweeps", action="store_true", help="only the target scenarios")
    parser.add_argument("--json", type=Path, help="where to write the results (default docs/bench.json)")
    parser.add_argument("--png", type=Path, help="where to write the plot (default docs/bench.png)")
    parser.add_argument("--check", action="store_true", help="exit 1 when a target fails")
    parser.add_argument(
        "--xla-scaling", action="store_true", help="also run kvhost_tpu.scaling.measure_scaling() where present"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--in-process", action="store_true", help="measure in this process (see module docstring)")
    args = parser.parse_args(argv)
    if args.requests is not None:
        given = args.requests
        try:
            args.requests = tuple(int(n) for n in given.split(","))
        except ValueError:
            parser.error(f"--requests {given!r}: give batch sizes as integers separated by commas")
        if min(args.requests) < 1:
            parser.error(f"--requests {given!r}: batch sizes must be at least 1")
    if args.rounds is not None and args.rounds < 1:
        parser.error(f"--rounds {args.rounds}: at least one round")
    try:
        torch.device(args.device)
    except RuntimeError:
        parser.error(f"--device {args.device!r} is not a torch device")
    names = sorted(s.name for s in scenarios(PRESETS["full"], (1,)))
    for prefix in args.only:
        if not any(name.startswith(prefix) for name in names):
            parser.error(f"--only {prefix!r} matches no scenario ({', '.join(names)})")
    default_dir = Path("bench-results") if args.quick else Path("docs")
    stem = "bench-quick" if args.quick else "bench"
    args.json = args.json or default_dir / f"{stem}.json"
    args.png = args.png or default_dir / f"{stem}.png"
    return args


def to_json(value: Any) -> str:
    """Indented JSON with every list of numbers on one line, and floats to 5 significant digits."""
    if isinstance(value, dict):
        items = [f"{json.dumps(key)}: {to_json(item)}" for key, item in value.items()]
        return "{\n" + ",\n".join(" " + item.replace("\n", "\n ") for item in items) + "\n}"
    if isinstance(value, list) and value and all(isinstance(v, (int, float, bool)) for v in value):
        return "[" + ", ".join(to_json(v) for v in value) + "]"
    if isinstance(value, list):
        return "[\n" + ",\n".join(" " + to_json(v).replace("\n", "\n ") for v in value) + "\n]"
    if isinstance(value, float) and math.isfinite(value):
        return json.dumps(float(f"{value:.5g}"))
    return json.dumps(value)


def allocation_order(chosen: list[Scenario]) -> list[Scenario]:
    """Scenarios that start on the same cache geometry run one after another: fewer large allocations."""
    first_seen: dict[Geometry, int] = {}
    for scenario in chosen:
        first_seen.setdefault(scenario.points[0].geometry, len(first_seen))
    return sorted(chosen, key=lambda s: first_seen[s.points[0].geometry])


def measure_xla_scaling() -> dict[str, Any]:
    """Issue 5 part 4, where the TPU backend provides it: ``kvhost_tpu.scaling.measure_scaling()``.

    It runs on an XLA device (``PJRT_DEVICE=CPU`` on a host), so in the TPU job's
    environment; anywhere else the JSON says why it was skipped.
    """
    try:
        from kvhost_tpu.scaling import measure_scaling
    except ImportError as err:
        return {"skipped": f"kvhost_tpu.scaling is not available here: {err}"}
    try:
        rows = measure_scaling(progress=lambda line: print(f"    xla scaling: {line}", file=sys.stderr))
    except Exception as err:  # its own environment (torch_xla) may be missing: report, do not fail the bench
        return {"skipped": f"measure_scaling() failed: {type(err).__name__}: {err}"}
    return {"rows": [row.as_dict() if hasattr(row, "as_dict") else asdict(row) for row in rows]}


def xla_table(result: dict[str, Any]) -> str:
    """Receive/copy time per cache size next to one whole-cache clone: O(n) stays flat, O(cache) grows."""
    if "rows" not in result:
        return f"xla scaling: {result.get('skipped', 'not run')}"
    lines = [["xla scaling", "blocks", "cache blocks", "cache MiB", "ms per call", "clone ms"]]
    for row in result["rows"]:
        lines.append(
            [
                str(row["operation"]),
                str(row["blocks"]),
                str(row["cache_blocks"]),
                f"{row['cache_bytes'] / MiB:.0f}",
                f"{row['seconds'] * 1e3:.3f}",
                f"{row['cache_clone_seconds'] * 1e3:.3f}",
            ]
        )
    return _format(lines)


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse(argv)
    if not args.in_process and "OMP_WAIT_POLICY" not in os.environ:
        env = dict(os.environ, OMP_WAIT_POLICY="PASSIVE")
        command = [sys.executable, "-m", "kvhost.bench", *argv, "--in-process"]
        return subprocess.run(command, env=env, check=False).returncode
    return run(args, argv)


def run(args: argparse.Namespace, argv: Sequence[str]) -> int:
    preset = PRESETS["quick" if args.quick else "full"]
    if args.no_sweeps:
        preset = replace(preset, sweeps=False)
    requests = args.requests or preset.requests
    chosen = [s for s in scenarios(preset, requests) if not args.only or any(s.name.startswith(o) for o in args.only)]
    device = Device(args.device, args.cache)
    space = Workspace(device)
    rng = random.Random(args.seed)
    total = sum(len(s.points) for s in chosen)
    print(
        f"kvhost bench ({preset.name}): {total} points, device {args.device}, "
        f"cache {device.cache}, backend {kvhost.get_backend(device.device).name}",
        file=sys.stderr,
    )
    by_scenario: dict[str, list[dict[str, Any]]] = {}
    done = 0
    began = time.perf_counter()
    for scenario in allocation_order(chosen):
        num_blocks = max(p.blocks for p in scenario.points)
        scenario_rows = []
        for i, point in enumerate(scenario.points):
            done += 1
            started = time.perf_counter()
            prepared = prepare(point, space, args.backend, num_blocks, seed=args.seed + i)
            verified = prepared.verify() if prepared.verify is not None and i == 0 else None
            measured = measure(prepared.methods, device, preset, args.rounds, rng, prepared.touched)
            row = summarise(point, prepared, measured)
            row["verified_against_baseline"] = verified
            scenario_rows.append(row)
            print(f"[{done:>3}/{total}] {_progress(row)} ({time.perf_counter() - started:.1f} s)", file=sys.stderr)
            if verified is False:
                print("    MISMATCH: the baseline and kvhost left different bytes", file=sys.stderr)
            del prepared, measured  # free this point's caches before the next allocates
        by_scenario[scenario.name] = scenario_rows
        gc.collect()
    rows = [row for s in chosen for row in by_scenario[s.name]]
    targets = [t for s in chosen if (t := evaluate(s, by_scenario[s.name])) is not None]
    xla_scaling = measure_xla_scaling() if args.xla_scaling else None
    result = {
        "kvhost_bench": 1,
        "command": " ".join(["kvhost bench", *(a for a in argv if a != "--in-process")]),
        "preset": preset.name,
        "device": args.device,
        "cache": device.cache,
        "backend": kvhost.get_backend(device.device).name,
        "backend_detail": kvhost.get_backend(device.device).describe(),
        "machine": machine(),
        "seconds": time.perf_counter() - began,
        "methods": METHODS,
        "scenarios": [
            {
                "name": s.name,
                "title": s.title,
                "cache": s.points[0].geometry.describe(),
                "plot": s.plot,
                "target": asdict(s.target) if s.target else None,
                "points": len(s.points),
            }
            for s in chosen
        ],
        "points": rows,
        "targets": targets,
        "targets_apply": preset.name == "full",
        "xla_scaling": xla_scaling,
        "verified": all(r["verified_against_baseline"] is not False for r in rows),
        "table": table(rows, [f"kvhost[{b}]" for b in args.backend]),
    }
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(to_json(result) + "\n")
    try:
        plot(result, args.png)
        wrote = f"{args.json} and {args.png}"
    except ImportError as err:  # matplotlib is the bench extra; the figures stand without the plot
        wrote = f"{args.json} (no plot: {err}; pip install 'kvhost[bench]')"
    print(result["table"])
    extra = other_tables(rows)
    if extra:
        print()
        print(extra)
    if xla_scaling is not None:
        print()
        print(xla_table(xla_scaling))
    if targets:
        print()
        print(target_table(targets))
        if preset.name != "full":
            print(f"({preset.name} shapes: the targets are set for the full preset's shapes)")
    print(f"\nwrote {wrote} in {result['seconds']:.0f} s", file=sys.stderr)
    if not result["verified"]:
        return 2
    return 1 if args.check and not all(t["passed"] for t in targets) else 0


def _progress(row: dict[str, Any]) -> str:
    methods = row["methods"]
    head = f"{row['scenario']} {row['label']}, {row['requests']} x {row['blocks_per_request']} blocks"
    if ROOFLINE in methods:
        k = methods[KVHOST]
        return f"{head}: kvhost {k['fraction']:.2f} of memcpy, {k['speedup']:.1f}x baseline"
    if row["kind"] == "identity":
        same, empty = methods[KVHOST]["median_s"], methods["empty"]["median_s"]
        return f"{head}: {same * 1e6:.0f} us vs an empty call's {empty * 1e6:.0f} us"
    share = methods["front end"]["median_s"] / methods["transform"]["median_s"]
    return f"{head}: front end {share:.2%} of the transform"


if __name__ == "__main__":
    raise SystemExit(main())
