"""Figures from one run on a GPU: staging bandwidth, and the Triton kernels against the torch path and memcpy.

    python -m kvhost_tools.device_checks.gpucheck [--device cuda] [--quick] [--out DIR]

Every figure is a ratio measured side by side in this one process (medians of several
repetitions, the device synchronized around each): a receive or device copy against a
device-to-device ``copy_`` of the same bytes (memcpy, the roofline: an in-place
rearrangement reads and writes every byte once), host staging against a plain ``copy_``
of a contiguous pinned tensor of the same size, each way. Each row also says how many
kernel launches one call made and how many programs the largest had (against the
device's multiprocessors), and whether the method's bytes agree with the torch path's.
Methods: ``triton`` (kvhost with its kernels), ``torch`` (kvhost's torch path, what a
plugin device without kernels runs) and ``per-request`` (the engines' way: one request,
one layer, one K/V half at a time, ``kvhost_tools.bench.baseline``, as ``kvhost bench``
times it on the CPU), all on a ``KVHost`` or baseline built once per set of caches.

A call's time is host work (validation, planning, tables, launches) followed by the
device's. Two more columns part them: ``host ms``, the time until the call returns (a
receive returns once its kernels are queued), and, for the work done on the device
alone, ``kernel x``: memcpy's device time over the device time of the call's recorded
launches replayed by themselves (both timed with events). On the first H200 run the
front end's host time (about 0.3 ms for 16 layers) was ten times a small receive's kernel.

Rows are printed and appended to ``DIR/figures.jsonl`` as they are measured, after
``DIR/machine.json``: a run cut short still leaves every figure it took. Then
``DIR/host-profile.txt``: where a one-request receive's host time goes (``host_profile``),
the figure a decode step's fixed cost hangs on (0.22 ms on the first H200 run, against a
kernel of 0.05). ``ci/gpu-check.sh`` runs it; ``measure`` also runs on the CPU (tests).
"""

from __future__ import annotations

import argparse
import cProfile
import functools
import io
import json
import pstats
import re
import statistics
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

import kvhost
from kvhost.backend import Backend
from kvhost.testing import make_cache, raw
from kvhost_tools.bench.baseline import PerRequestReceiver, PerRequestStager

PER_REQUEST = "per-request"
REQUEST_UNITS = 4  # units (sender blocks) per request in the per-request path and the receives


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
    launches: int = 0  # kernel launches in one call (0: none of kvhost's kernels)
    programs: int = 0  # programs of its largest launch
    agrees: str = ""  # "yes" when the bytes equal the torch path's, "NO" when not, "" when not compared
    host_seconds: float = 0.0  # median time until the call returns (0: not measured)
    kernel_fraction: float = 0.0  # memcpy's device time / the replayed launches' (0: not measured)

    @property
    def gbps(self) -> float:
        return self.bytes / self.seconds / 1e9


Emit = Callable[[Row], None]


def _sync(device: torch.device) -> None:
    if device.type != "cpu":
        torch.accelerator.synchronize(device)


def median_seconds(run: Callable[[], object], device: torch.device, repeats: int) -> float:
    """Median wall time of ``run`` with the device drained before and after each repetition."""
    run()  # warm-up: compiles kernels, fills allocator caches
    times = []
    for _ in range(repeats):
        _sync(device)
        start = time.perf_counter()
        run()
        _sync(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def host_seconds(run: Callable[[], object], device: torch.device, repeats: int) -> float:
    """Median time until ``run`` returns, the device drained before each repetition (and after)."""
    run()
    times = []
    for _ in range(repeats):
        _sync(device)
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
        _sync(device)
    return statistics.median(times)


def device_seconds(run: Callable[[], object], device: torch.device, repeats: int) -> float:
    """Median device time of the work ``run`` queues, between two events on the current stream (CPU: wall time)."""
    if device.type == "cpu":
        return median_seconds(run, device, repeats)
    run()
    times = []
    for _ in range(repeats):
        start, end = (torch.Event(device=device, enable_timing=True) for _ in range(2))
        _sync(device)
        start.record()
        run()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times)


def memcpy_seconds(
    device: torch.device, nbytes: int, repeats: int, timer: Callable[..., float] = median_seconds
) -> float:
    """The roofline: one device-to-device ``copy_`` of ``nbytes`` contiguous bytes."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    return timer(lambda: dst.copy_(src), device, repeats)


class Launches:
    """The kernel calls a backend launches (through ``AcceleratorBackend.launch``) during ``of``."""

    def __init__(self, backends: Mapping[str, Backend]) -> None:
        self.methods: set[str] = set()
        self.recording: list[Any] | None = None  # only while ``of`` runs: a kept call keeps its tables
        for method, backend in backends.items():
            launch = getattr(backend, "launch", None)
            if launch is None:
                continue
            self.methods.add(method)

            def recording(call: Any, launch: Callable[[Any], None] = launch) -> None:
                if self.recording is not None:
                    self.recording.append(call)
                launch(call)

            backend.launch = recording  # type: ignore[attr-defined]

    def of(self, method: str, run: Callable[[], object]) -> list[Any]:
        """The kernel calls (``kernels.KernelCall``) of one call of ``run``, in order; each holds its tables."""
        self.recording = [] if method in self.methods else None
        try:
            run()
            return self.recording or []
        finally:
            self.recording = None


def agreement(outputs: Mapping[str, Mapping[str, torch.Tensor]]) -> dict[str, str]:
    """Per method, whether its bytes equal the torch path's (the first method's where there is none)."""
    reference = outputs.get("torch", next(iter(outputs.values())))

    def same(out: Mapping[str, torch.Tensor]) -> bool:
        return all(torch.equal(raw(out[name]).cpu(), raw(reference[name]).cpu()) for name in reference)

    return {method: "yes" if same(out) else "NO" for method, out in outputs.items()}


def compare(
    rows: list[Row],
    workload: str,
    calls: Mapping[str, Callable[[], Any]],
    reference: Callable[[int], float],
    device: torch.device,
    repeats: int,
    *,
    launches: Launches | None = None,
    agrees: Mapping[str, str] | None = None,
    emit: Emit | None = None,
    device_reference: Callable[[int], float] | None = None,
) -> None:
    """Time every method of one workload against ``reference(bytes)``; bytes come from kvhost's own result.

    With ``device_reference`` (the device time of the roofline), work done on the device
    alone: the recorded launches are replayed by themselves and timed against it.
    """
    nbytes = next(iter(calls.values()))().bytes_moved

    def add(row: Row) -> None:
        rows.append(row)
        if emit is not None:
            emit(row)

    baseline = reference(nbytes)
    add(Row(workload, "memcpy", baseline, nbytes, 1.0))
    on_device = device_reference(nbytes) if device_reference is not None else 0.0
    for method, call in calls.items():
        kernel_calls = launches.of(method, call) if launches is not None else []
        seconds = median_seconds(call, device, repeats)
        returned = host_seconds(call, device, repeats)
        kernel_fraction = 0.0
        if kernel_calls and on_device:
            replayed = device_seconds(functools.partial(_replay, kernel_calls), device, repeats)
            kernel_fraction = on_device / replayed
        programs = max((int(k.grid[0]) for k in kernel_calls), default=0)
        agreed = (agrees or {}).get(method, "")
        add(Row(workload, method, seconds, nbytes, baseline / seconds, len(kernel_calls), programs, agreed,
                returned, kernel_fraction))  # fmt: skip


def _replay(kernel_calls: list[Any]) -> None:
    for call in kernel_calls:
        call.launch()


def cache_set(device: torch.device, sizes: Sizes, physical: str, blocks: int, tokens: int) -> dict[str, torch.Tensor]:
    shape = dict(K=2, B=blocks, N=tokens, H=sizes.heads, C=sizes.channels)
    caches = {f"l{i}": make_cache("KBNHC", physical, shape, torch.bfloat16, device) for i in range(sizes.layers)}
    for t in caches.values():
        t.normal_()
    return caches


def _clone(caches: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A copy with the same strides, pinned where the original is."""
    out = {}
    for name, t in caches.items():
        copy = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=t.device, pin_memory=_pinned(t))
        out[name] = copy.copy_(t)
    return out


def _pinned(t: torch.Tensor) -> bool:
    return t.device.type == "cpu" and torch.accelerator.is_available() and t.is_pinned()


Maker = Callable[[dict[str, torch.Tensor]], Callable[[], object]]


def _calls(
    backends: Mapping[str, Backend],
    writes: dict[str, torch.Tensor],
    make: Callable[[Backend, dict[str, torch.Tensor]], Callable[[], object]],
    per_request: Maker,
) -> tuple[dict[str, Callable[[], object]], dict[str, str]]:
    """Each method's timed call, ``make(backend, writes)`` and last ``per_request(writes)``,
    and whether its bytes agree: each first runs once on its own copy of ``writes``."""
    makers: dict[str, Maker] = {method: functools.partial(make, backend) for method, backend in backends.items()}
    makers[PER_REQUEST] = per_request
    outputs = {}
    for method, maker in makers.items():
        copy = _clone(writes)
        maker(copy)()
        outputs[method] = copy
    return {method: maker(writes) for method, maker in makers.items()}, agreement(outputs)


def _in_requests(src_ids: np.ndarray, dst_ids: np.ndarray) -> list[tuple[np.ndarray, np.ndarray]]:
    """A copy's ids as the per-request path takes them: requests of ``REQUEST_UNITS`` blocks."""
    return [
        (src_ids[i : i + REQUEST_UNITS], dst_ids[i : i + REQUEST_UNITS]) for i in range(0, src_ids.size, REQUEST_UNITS)
    ]


def measure(device: torch.device, backends: dict[str, Backend], sizes: Sizes, emit: Emit | None = None) -> list[Row]:
    """Every workload, every method; ``backends`` maps a method name ("triton", "torch") to a backend."""
    rows: list[Row] = []
    rng = np.random.default_rng(1)
    launches = Launches(backends)
    timed = functools.partial(compare, rows, device=device, repeats=sizes.repeats, launches=launches, emit=emit)

    def memcpy(nbytes: int) -> float:
        return memcpy_seconds(device, nbytes, sizes.repeats)

    def memcpy_on_device(nbytes: int) -> float:
        return memcpy_seconds(device, nbytes, sizes.repeats, device_seconds)

    # Every request of 4 blocks at once, then one request alone (a decode step's receive: the fixed cost).
    receives = (
        ("receive HND16->NHD64", 64, 16, None),
        ("receive HND64->NHD16 (g=4)", 16, 64, None),
        ("receive HND16->NHD64, 1 request of 4 blocks", 64, 16, 1),
    )
    for workload, local, remote, kept in receives:
        parts = max(remote // local, 1)
        caches = cache_set(device, sizes, "KBNHC", sizes.receive_units * parts + 8, local)
        ids = rng.permutation(sizes.receive_units * parts + 8)[: sizes.receive_units * parts]
        step = REQUEST_UNITS * parts
        requests = {f"r{i}": ids[i : i + step] for i in range(0, ids.size, step)}
        requests = dict(list(requests.items())[:kept])
        # Registered once, as a connector does: each call then pays only for the batch.
        receive = functools.partial(_receive_call, requests=requests, remote_block_size=remote)
        per_request = functools.partial(_per_request_receive, requests=requests, remote_block_size=remote)
        calls, agrees = _calls(backends, caches, receive, per_request)
        timed(workload, calls, memcpy, agrees=agrees, device_reference=memcpy_on_device)
        del caches, calls

    # Scattered blocks between two layouts on the device (what a staged copy does on the device).
    blocks = sizes.staging_blocks
    src = cache_set(device, sizes, "KBNHC", 2 * blocks, 16)
    dst = cache_set(device, sizes, "KBHNC", 2 * blocks, 16)
    src_ids, dst_ids = rng.permutation(2 * blocks)[:blocks], rng.permutation(2 * blocks)[:blocks]
    copy = functools.partial(_copy_call, src, src_ids=src_ids, dst_ids=dst_ids)
    per_request = functools.partial(_per_request_copy, src, requests=_in_requests(src_ids, dst_ids))
    copies, agrees = _calls(backends, dst, copy, per_request)
    timed("device copy, scattered, NHD->HND", copies, memcpy, agrees=agrees, device_reference=memcpy_on_device)
    del dst, copies
    _staging(device, backends, sizes, src, rng, timed)
    return rows


def _staging(
    device: torch.device,
    backends: dict[str, Backend],
    sizes: Sizes,
    on_device: dict[str, torch.Tensor],
    rng: Any,
    timed: Callable[..., None],
) -> None:
    """Host <-> device through kvhost against a plain ``copy_`` of a contiguous pinned tensor of the same bytes."""
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
                src_ids, dst_ids = (slots, device_ids) if way == "load" else (device_ids, slots)
                # The device caches registered, the host buffer a peer: a connector's save and load.
                stage = functools.partial(_stage_call, way=way, host=host, on_device=on_device, src_ids=src_ids,
                                          dst_ids=dst_ids)  # fmt: skip
                source = host if way == "load" else on_device
                per_request = functools.partial(_per_request_copy, source, requests=_in_requests(src_ids, dst_ids))
                calls, agrees = _calls(backends, host if way == "save" else on_device, stage, per_request)
                workload = f"staging {way}, {ids_name} device ids, {'pinned' if pinned else 'pageable'} host"
                timed(workload, calls, plain(way), agrees=agrees)


def _receive_call(
    backend: Backend, caches: dict[str, torch.Tensor], *, requests: Any, remote_block_size: int
) -> Callable[[], object]:
    registered = kvhost.KVHost(caches, axes="KBNHC", backend=backend)
    return functools.partial(registered.receive, requests, remote_order="HNC", remote_block_size=remote_block_size)


def _per_request_receive(
    caches: dict[str, torch.Tensor], *, requests: Any, remote_block_size: int
) -> Callable[[], object]:
    receiver = PerRequestReceiver(caches, "KBNHC")
    return functools.partial(receiver.receive, requests, remote_order="HNC", remote_block_size=remote_block_size)


def _per_request_copy(
    src: dict[str, torch.Tensor], dst: dict[str, torch.Tensor], *, requests: Any
) -> Callable[[], object]:
    return functools.partial(PerRequestStager(src, dst, axes="KBNHC").copy, requests)


def _copy_call(
    src: dict[str, torch.Tensor], backend: Backend, dst: dict[str, torch.Tensor], *, src_ids: Any, dst_ids: Any
) -> Callable[[], object]:
    return functools.partial(kvhost.KVHost(src, axes="KBNHC", backend=backend).copy_to, dst, src_ids, dst_ids)


def _stage_call(
    backend: Backend,
    written: dict[str, torch.Tensor],
    *,
    way: str,
    host: Any,
    on_device: Any,
    src_ids: Any,
    dst_ids: Any,
) -> Callable[[], object]:
    """A load from ``host`` into ``written`` (device caches), or a save from ``on_device`` into it (a host buffer)."""
    if way == "load":
        return functools.partial(
            kvhost.KVHost(written, axes="KBNHC", backend=backend).copy_from, host, src_ids, dst_ids
        )
    return functools.partial(kvhost.KVHost(on_device, axes="KBNHC", backend=backend).copy_to, written, src_ids, dst_ids)


def host_profile(run: Callable[[], object], device: torch.device, calls: int = 200, top: int = 30) -> str:
    """Where ``run``'s host time goes: ``calls`` calls under cProfile, the device drained
    before and after them (not between: a connector does not wait either), the functions
    with the most time of their own first. cProfile adds about a microsecond to every
    Python call it sees, so its shares tell more than its absolute times."""
    run()  # warm-up: compiles, allocator caches
    _sync(device)
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(calls):
        run()
    profiler.disable()
    _sync(device)
    text = io.StringIO()
    pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(top)
    return relative_paths(text.getvalue())


def relative_paths(text: str) -> str:
    """File names as the repository and the installed packages name them, not where this
    machine keeps them (the report is committed as a record)."""
    root = f"{Path(kvhost.__file__).resolve().parents[1]}/"
    return re.sub(r"\S*/(?:site|dist)-packages/", "site-packages/", text.replace(root, ""))


def one_request_receive(device: torch.device, backend: Backend, sizes: Sizes) -> Callable[[], object]:
    """A decode step's smallest receive: one request of 4 blocks, HND 16 -> NHD 64, on registered caches."""
    caches = cache_set(device, sizes, "KBNHC", 16, 64)
    return _receive_call(backend, caches, requests={"r0": [3, 7, 1, 12]}, remote_block_size=16)


def table(rows: list[Row]) -> str:
    return "\n".join([header(), *(line(row) for row in rows)])


def header() -> str:
    columns = f"{'ms':>9} {'GB/s':>8} {'x ref':>7} {'launches':>8} {'programs':>8} {'agrees':>6}"
    columns += f" {'host ms':>8} {'kernel x':>8}"
    return f"{'workload':49} {'method':11} {columns}"


def line(row: Row) -> str:
    return (
        f"{row.workload:49} {row.method:11} {row.seconds * 1e3:9.3f} {row.gbps:8.1f} {row.fraction:7.2f} "
        f"{row.launches or '':>8} {row.programs or '':>8} {row.agrees:>6} "
        f"{f'{row.host_seconds * 1e3:.3f}' if row.host_seconds else '':>8} "
        f"{f'{row.kernel_fraction:.2f}' if row.kernel_fraction else '':>8}"
    )


def machine(device: torch.device, chosen: Backend, sizes: Sizes) -> dict[str, Any]:
    """The device (name, multiprocessors, L2, memory), the versions, and the backend's path."""
    props = torch.get_device_module(device.type).get_device_properties(device)
    info: dict[str, Any] = {"name": getattr(props, "name", str(device)), "device": device.type}
    for key, names in (
        ("multiprocessors", ("multi_processor_count", "gpu_subslice_count", "max_compute_units")),
        ("L2_bytes", ("L2_cache_size",)),
        ("memory_bytes", ("total_memory",)),
    ):
        info[key] = next((int(getattr(props, name)) for name in names if getattr(props, name, None)), None)
    info["torch"] = torch.__version__
    try:
        import triton

        info["triton"] = triton.__version__
    except ImportError:
        info["triton"] = None
    info["backend"] = chosen.describe()
    info["sizes"] = asdict(sizes)
    return info


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m kvhost_tools.device_checks.gpucheck", description=__doc__ and __doc__.splitlines()[0]
    )
    parser.add_argument("--device", default="cuda", help="cuda or xpu (default cuda)")
    parser.add_argument("--quick", action="store_true", help="small sizes, few repetitions")
    parser.add_argument("--out", help="write machine.json and figures.jsonl here, each row as it is measured")
    parser.add_argument("--json", help="also write every row and the machine to this file at the end")
    args = parser.parse_args(argv)
    try:
        device = torch.device(args.device)
    except RuntimeError:  # no device name at all
        device = torch.device("meta")
    if device.type not in ("cuda", "xpu"):
        parser.error(f"--device must be cuda or xpu (cuda:1 for another one), not {args.device!r}")
    device = torch.device(device.type, device.index or 0)
    chosen = kvhost.get_backend(device)
    if chosen.name != device.type:
        print(f"gpucheck: the {device.type} backend cannot run here (kvhost picked {chosen.name!r})", file=sys.stderr)
        return 1
    if chosen.kernels is None:  # type: ignore[attr-defined]
        # Every "triton" row would be the torch path's, agreeing with itself: a pass that checked nothing.
        why = chosen.kernels_missing  # type: ignore[attr-defined]
        print(f"gpucheck: the {device.type} backend runs no Triton kernels here ({why})", file=sys.stderr)
        return 1
    backends = {"triton": chosen, "torch": type(chosen)(use_triton=False)}  # type: ignore[call-arg]
    sizes = QUICK if args.quick else Sizes()
    info = machine(device, chosen, sizes)
    print(f"gpucheck: {info}", flush=True)
    out = Path(args.out) if args.out else None
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        (out / "machine.json").write_text(json.dumps(info, indent=2))
        (out / "figures.jsonl").write_text("")

    def emit(row: Row) -> None:
        print(line(row), flush=True)
        if out is not None:
            with open(out / "figures.jsonl", "a") as figures:
                figures.write(json.dumps(asdict(row) | {"gbps": row.gbps}) + "\n")

    print(header(), flush=True)
    rows = measure(device, backends, sizes, emit)
    if args.json:
        with open(args.json, "w") as file:
            json.dump({"machine": info, "rows": [asdict(row) | {"gbps": row.gbps} for row in rows]}, file, indent=2)
    if out is not None:
        profile = host_profile(one_request_receive(device, chosen, sizes), device)
        (out / "host-profile.txt").write_text(f"one request of 4 blocks, HND16->NHD64, {chosen.describe()}\n{profile}")
    disagree = [f"{row.workload} ({row.method})" for row in rows if row.agrees == "NO"]
    if disagree:
        print(f"gpucheck: FAIL: bytes differ from the torch path's: {'; '.join(disagree)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
