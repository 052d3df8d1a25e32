"""The methods compared at each point, made runnable on caches allocated once per geometry."""

from __future__ import annotations

import gc
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

import kvhost
from kvhost.batch import ReceiveBatch, plan_receive_batch
from kvhost_tools.bench.baseline import PerRequestReceiver, PerRequestStager
from kvhost_tools.bench.machine import Device, MiB, block_ranges
from kvhost_tools.bench.verify import same_copy, same_result
from kvhost_tools.bench.workloads import Geometry, Point, allocator_ids

ROOFLINE = "memcpy"
ROOFLINE_1T = "memcpy-1t"
IN_PLACE = "in-place"
IN_PLACE_1T = "in-place-1t"
BASELINE = "baseline"
BASELINE_1T = "baseline-1t"
KVHOST = "kvhost"
KVHOST_FN = "kvhost-fn"
METHODS = {
    ROOFLINE: "a plain copy of the same bytes between two buffers, torch's copy_ on its threads",
    ROOFLINE_1T: "the same copy by C's memcpy on one thread (host to host); the roofline is the faster of the two",
    IN_PLACE: "a receive's own floor: the same bytes rewritten where they lie, in one pass (torch's add_ of 0 on "
    "its threads), as an in-place receive reads and writes every byte in place; kvhost's share of it is in_place",
    IN_PLACE_1T: "the same pass by numpy on one thread (host only); a receive's floor is the faster of the two",
    BASELINE: "per request, per layer, per K/V half: gather -> permute copy -> scatter (staging: index, assign)",
    BASELINE_1T: "the baseline with torch on one thread (its small ops gain nothing from waking a second one)",
    KVHOST: "kvhost.KVHost registered once: .receive / .copy_to / .copy_from",
    KVHOST_FN: "module-level kvhost.receive / kvhost.copy_blocks (the caches validated on every call)",
    "empty": "KVHost.receive with no requests (identity scenario)",
    "visit": "type() of every request id, len() and type() of every request's ids: the least a call handed the "
    "batch can do and still refuse a name that is no string or a container it cannot count (identity)",
    "front end": "kvhost.batch.plan_receive_batch alone: validation, grouping, concatenation (front-end scenario)",
    "transform": "the backend's work for the batch the front end prepared (front-end scenario)",
}


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
        return self._in_pieces(nbytes, lambda count: dest[:count].copy_(source[:count]))

    def in_place_methods(self, nbytes: int, device: torch.device) -> dict[str, Callable[[], None]]:
        """``nbytes`` of a buffer on ``device`` read and written back where they lie, in ring-sized
        pieces: the least an in-place rewrite of that many bytes costs (half a copy's footprint).
        By torch on its threads and, on the host, by numpy on one (``in_place_best``)."""
        _, buffer = self._ring(device, device)
        methods = {IN_PLACE: self._in_pieces(nbytes, lambda count: buffer[:count].add_(0))}
        if device.type == "cpu":
            array = buffer.numpy()
            methods[IN_PLACE_1T] = self._in_pieces(
                nbytes, lambda count: np.bitwise_or(array[:count], 0, out=array[:count])
            )
        return methods

    def _in_pieces(self, nbytes: int, piece: Callable[[int], object]) -> Callable[[], None]:
        """A pass over ``nbytes`` through the ring: ``piece(count)`` copies or rewrites its first ``count`` bytes."""

        def run() -> None:
            for start in range(0, nbytes, self.RING):
                piece(min(self.RING, nbytes - start))

        return run

    def memcpy_methods(self, nbytes: int, src: torch.device, dst: torch.device) -> dict[str, Callable[[], None]]:
        """The roofline's copies of ``nbytes`` from ``src`` to ``dst``: torch's ``copy_`` and,
        host to host, the C library's ``memcpy`` on one thread (numpy's copy of contiguous
        bytes), which a busy or small machine can run faster than two threads. Each point's
        roofline is the faster of them (``roofline_best``)."""
        methods = {ROOFLINE: self.memcpy(nbytes, src, dst)}
        if src.type == dst.type == "cpu":
            source, dest = (t.numpy() for t in self._ring(src, dst))
            methods[ROOFLINE_1T] = self._in_pieces(nbytes, lambda count: np.copyto(dest[:count], source[:count]))
        return methods

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
        # What a call moves, as it says (the target's "nothing moved" check must be able to fail).
        moved = host.receive(requests, remote_order=order, remote_block_size=size).bytes_moved
        return Prepared(
            {
                "empty": lambda: host.receive({}, remote_order=order, remote_block_size=size),
                # Three passes at C speed: counting alone would take a string or a 2-D tensor at its
                # len(), and a name that is no string.
                "visit": lambda: (
                    set(map(type, requests)),
                    set(map(type, requests.values())),
                    sum(map(len, requests.values())),
                ),
                KVHOST: lambda: host.receive(requests, remote_order=order, remote_block_size=size),
                KVHOST_FN: lambda: kvhost.receive(
                    caches, requests, axes=geometry.axes, remote_order=order, remote_block_size=size
                ),
            },
            nbytes=moved,
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
    here, copied = space.device.device, point.blocks * geometry.block_bytes  # what the roofline moves
    methods: dict[str, Callable[[], object]] = {
        **space.memcpy_methods(copied, here, here),
        **space.in_place_methods(copied, here),
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
        return same_result(
            caches, geometry.axes, ids, methods[BASELINE], [methods[KVHOST], methods[KVHOST_FN]], seed=seed
        )

    touched = np.concatenate([touched, space.memcpy_ranges(copied, here, here)])
    return Prepared(methods, nbytes=stats.bytes_moved, verify=verify, stats={"groups": stats.groups}, touched=touched)


def fastest(samples: Mapping[str, Any], names: Sequence[str]) -> str | None:
    """Which of ``names`` has the least median among a point's samples (``Sample``s), or None
    where none was timed: the roofline of the two copies, the baseline of its two ways."""
    timed = [name for name in names if name in samples]
    return min(timed, key=lambda name: samples[name].median) if timed else None


def roofline_best(samples: Mapping[str, Any]) -> str | None:
    """The faster roofline copy of a point's samples, or None without one."""
    return fastest(samples, (ROOFLINE, ROOFLINE_1T))


def in_place_best(samples: Mapping[str, Any]) -> str | None:
    """The faster in-place pass of a receive's samples, or None where there is none."""
    return fastest(samples, (IN_PLACE, IN_PLACE_1T))


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
        **space.memcpy_methods(point.blocks * geometry.block_bytes, *(devices if save else devices[::-1])),
        BASELINE: lambda: baseline.copy(per_request),
        KVHOST: connector(host),
        KVHOST_FN: lambda: kvhost.copy_blocks(src, dst, src_list, dst_list, axes=axes).wait(),
    }
    for name in extra_backends:
        methods[f"kvhost[{name}]"] = connector(kvhost.KVHost(cache, axes=axes, backend=name))
    _add_single_threaded(methods, space.device)
    result = kvhost.copy_blocks(src, dst, src_list, dst_list, axes=axes).wait()

    def verify() -> bool:
        return same_copy(src, dst, axes, src_ids, dst_ids, methods[BASELINE], [methods[KVHOST], methods[KVHOST_FN]])

    ends = devices if save else devices[::-1]
    touched = np.concatenate(
        [
            block_ranges(cache, axes, cache_ids) if space.device.is_host else np.zeros((0, 2), dtype=np.int64),
            block_ranges(buffer, axes, buffer_ids),
            space.memcpy_ranges(point.blocks * geometry.block_bytes, *ends),
        ]
    )
    return Prepared(methods, nbytes=result.bytes_moved, verify=verify, stats={"runs": result.runs}, touched=touched)
