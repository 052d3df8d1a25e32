"""What a run allocates, estimated before anything is: a run this machine cannot hold is
refused up front in one line, not ended partway by the allocator (or the OOM killer).

The estimate follows what ``methods.Workspace`` keeps: one set of caches at a time (the
largest a scenario's points need, on the device), one host buffer set for staging, the
memcpy roofline's buffers and the eviction's; and, for the point being measured, the host
copies its check against the baseline reads, and the bookkeeping of its block ids.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kvhost_tools.bench.machine import DEVICE_FLUSH_BYTES, host_flush_bytes
from kvhost_tools.bench.methods import Workspace
from kvhost_tools.bench.sender import Setting
from kvhost_tools.bench.workloads import Geometry, Point, Scenario
from kvhost_tools.demo.config import blocks_for, cache_bytes, memory_available, memory_needed, pool_for

# The first point of a scenario is checked against the baseline on host copies of its
# blocks: the starting bytes, the baseline's result, each method's, and (staging) a blank.
VERIFY_COPIES = 4
VERIFIED_KINDS = ("receive", "stage")


def bookkeeping_bytes(geometry: Geometry) -> int:
    """Per block: its ids (a few int64 arrays), its place in a request's Python list, and an
    (address, bytes) row per region of each layer for the eviction."""
    return 256 + 32 * geometry.layers


@dataclass(frozen=True)
class Footprint:
    host: int  # bytes of host memory
    device: int  # bytes of the accelerator's memory (0 where the caches are host memory)
    largest: str  # the largest cache set, for a refusal to name


def gigabytes(count: int) -> str:
    return f"{count / 1e9:,.1f} GB"


def scenarios_footprint(chosen: Sequence[Scenario], device: torch.device, cache: str) -> Footprint:
    """The most the scenarios' run holds at once, on the host and on ``device``."""
    on_host = device.type == "cpu"
    host = host_flush_bytes() if cache != "warm" else 0
    on_device = DEVICE_FLUSH_BYTES if cache != "warm" and not on_host else 0
    for ends in {_ring_ends(point, on_host) for scenario in chosen for point in scenario.points}:
        for end_on_host in ends:  # a ring is kept for each pair of ends a memcpy copies between
            if end_on_host:
                host += Workspace.RING
            else:
                on_device += Workspace.RING
    caches = buffers = working = 0
    largest = ""
    for scenario in chosen:
        num_blocks = max(point.blocks for point in scenario.points)
        biggest = max(scenario.points, key=lambda point: point.blocks)
        for index, point in enumerate(scenario.points):
            cache_bytes = point.geometry.block_bytes * num_blocks
            if cache_bytes > caches:
                caches = cache_bytes
                batch = f"{biggest.requests} requests x {biggest.blocks_per_request} blocks"
                largest = f"its largest caches, {scenario.name} at {batch}, hold {gigabytes(cache_bytes)}"
            if point.kind == "stage":  # a host buffer shaped like the cache
                buffers = max(buffers, cache_bytes)
            verified = index == 0 and point.kind in VERIFIED_KINDS
            copies = VERIFY_COPIES * point.geometry.block_bytes * point.blocks if verified else 0
            working = max(working, copies + num_blocks * bookkeeping_bytes(point.geometry))
    host += buffers + working + (caches if on_host else 0)
    on_device += 0 if on_host else caches
    return Footprint(host, on_device, largest)


def _ring_ends(point: Point, device_is_host: bool) -> tuple[bool, ...]:
    """Whether each end of the memcpy roofline's buffers is host memory (none: no roofline)."""
    if point.kind == "receive":
        return (device_is_host, device_is_host)
    if point.kind == "stage":
        return (device_is_host, True) if point.direction == "save" else (True, device_is_host)
    return ()


def host_refusal(footprint: Footprint, remedy: str) -> str | None:
    """Why this machine's memory cannot hold the run (one line), or None."""
    available = memory_available()
    if available is None or footprint.host <= available:
        return None
    return (
        f"this run needs about {gigabytes(footprint.host)} of memory ({footprint.largest}), more than the "
        f"{gigabytes(available)} available here: {remedy}"
    )


def device_refusal(footprint: Footprint, device: torch.device, remedy: str) -> str | None:
    """Why ``device``'s free memory cannot hold the run's share of it (one line), or None; None
    too where its runtime does not say how much is free."""
    if not footprint.device:
        return None
    try:
        free = int(torch.get_device_module(device).mem_get_info(device)[0])
    except Exception:  # a runtime without mem_get_info, or one that cannot answer: its allocator will say
        return None
    if footprint.device <= free:
        return None
    return (
        f"--device {device}: this run needs about {gigabytes(footprint.device)} of device memory "
        f"({footprint.largest}), more than the {gigabytes(free)} free there: {remedy}"
    )


def transfer_bytes(setting: Setting) -> int:
    """What the transfer section allocates on this host, in both processes: the demo's estimate
    for one prefill and one decode engine, and the bench's own: the sender's pack buffer and the
    receiver's copy of the sender's cache to check against (each at most a prefill cache),
    memcpy's buffers, and each process's eviction buffer."""
    model, workload, prefill = setting.model, setting.workload, setting.prefill
    blocks = [blocks_for(tokens, prefill.block_size) for tokens in workload.lengths()]
    prefill_cache = cache_bytes(model, pool_for(blocks), prefill.block_size)
    engines = memory_needed(model, workload, prefill, setting.decode, staging=False)
    return engines + 2 * prefill_cache + 2 * Workspace.RING + 2 * host_flush_bytes()
