"""What the bench measures: cache geometries, points, scenarios and their targets, presets.

The scenario list is a table (``SCENARIOS``): each entry names a base point and the points
it varies into; ``scenarios()`` turns them into points for one preset.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import torch

from kvhost_tools.blocks import free_list


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
    """What a scenario's points are held to."""

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

# Where a scenario's points are taken: one per batch size asked for, at the preset's sweep
# batch size, or at the preset's front-end batch.
BATCHES, SWEEP, FRONT_END = "batches", "sweep", "front end"


@dataclass(frozen=True)
class ScenarioSpec:
    """One scenario, declared: a base point (``Point`` fields, ``geometry`` as changes to the
    preset's), where its batch sizes come from, and the changes that make each point."""

    name: str
    title: str  # formatted with sweep_requests, front_requests, front_blocks, front_layers
    base: Mapping[str, Any]
    at: str = BATCHES
    points: tuple[Mapping[str, Any], ...] = ({},)
    target: Target | None = None
    plot: bool = False


RECEIVE_R4 = {
    "kind": "receive",
    "blocks_per_request": 4,
    "remote_order": "HNC",
    "remote_block_size": 16,
    "label": "HND16->NHD64",
}
STAGE = {"kind": "stage", "geometry": {"block_size": 16}, "blocks_per_request": 4}
FRACTION_AND_SPEEDUP = Target(
    ">= 0.8 of memcpy and >= 4x the baseline at every batch size", min_fraction=0.8, min_speedup=4.0
)

SCENARIOS = (
    ScenarioSpec(
        "receive-r4",
        "receive, remote HND 16 -> local NHD 64 (r = 4), requests of 4 blocks",
        RECEIVE_R4,
        target=FRACTION_AND_SPEEDUP,
        plot=True,
    ),
    ScenarioSpec(
        "receive-g4",
        "receive, remote HND 64 -> local NHD 16 (g = 4), requests of 4 blocks",
        {**RECEIVE_R4, "geometry": {"block_size": 16}, "remote_block_size": 64, "label": "HND64->NHD16"},
        target=Target(">= 0.7 of memcpy at every batch size", min_fraction=0.7),
        plot=True,
    ),
    ScenarioSpec(
        "stage-runs",
        "staging copy cache -> host buffer, allocator-like runs of ids, requests of 4 blocks of 16",
        {**STAGE, "ids": "runs", "label": "save, runs"},
        target=FRACTION_AND_SPEEDUP,
        plot=True,
    ),
    ScenarioSpec(
        "stage-scattered",
        "staging copy cache -> host buffer, scattered single blocks, requests of 4 blocks of 16",
        {**STAGE, "ids": "scattered", "label": "save, scattered"},
        target=Target(">= 0.6 of memcpy at every batch size", min_fraction=0.6),
        plot=True,
    ),
    ScenarioSpec(
        "identity",
        "receive whose transform is the identity (token-major NHD 16 -> NHD 64): nothing to copy",
        {**RECEIVE_R4, "kind": "identity", "remote_order": "NHC", "label": "NHD16->NHD64"},
        target=Target(
            "zero bytes moved; time within noise (the larger IQR) of an empty call plus a look at each request",
            identity=True,
        ),
    ),
    ScenarioSpec(
        "front-end",
        "front end for {front_requests} requests x {front_blocks} blocks (HND 16 -> NHD 16, "
        "{front_layers} layer(s): fewer layers make the transform smaller and the share larger)",
        {**RECEIVE_R4, "kind": "frontend", "geometry": {"block_size": 16}, "label": "HND16->NHD16"},
        at=FRONT_END,
        target=Target("front end < 5% of the transform it prepares", max_front_share=0.05),
    ),
    ScenarioSpec(
        "sweep-blocks",
        "receive HND 16 -> NHD 64, {sweep_requests} requests, blocks per request",
        RECEIVE_R4,
        at=SWEEP,
        points=tuple({"blocks_per_request": b, "label": f"{b} blocks/request"} for b in (1, 4, 16)),
    ),
    ScenarioSpec(
        "sweep-ratio",
        "receive HND -> NHD 64, {sweep_requests} requests of 4 blocks, block-size ratio",
        RECEIVE_R4,
        at=SWEEP,
        points=tuple(
            {"remote_block_size": size, "label": label}
            for size, label in ((64, "r=1"), (32, "r=2"), (16, "r=4"), (8, "r=8"), (128, "g=2"), (256, "g=4"))
        ),
    ),
    ScenarioSpec(
        "sweep-layout",
        "receive r = 4, {sweep_requests} requests of 4 blocks, layout pairs (remote -> local)",
        RECEIVE_R4,
        at=SWEEP,
        points=(
            {"label": "HND->NHD"},
            {"geometry": {"physical": "KBHNC"}, "remote_order": "NHC", "label": "NHD->HND"},
            {"geometry": {"physical": "KBHNC"}, "remote_order": "HNC", "label": "HND->HND"},
            {"geometry": {"axes": "BKNHC", "physical": "BKNHC"}, "remote_order": "KHNC", "label": "KHND->KNHD"},
        ),
    ),
    ScenarioSpec(
        "sweep-dtype",
        "receive HND 16 -> NHD 64, {sweep_requests} requests of 4 blocks, dtype",
        RECEIVE_R4,
        at=SWEEP,
        points=tuple(
            {"geometry": {"dtype": dtype}, "label": dtype} for dtype in ("float8_e4m3fn", "bfloat16", "float32")
        ),
    ),
    ScenarioSpec(
        "sweep-stage",
        "staging, {sweep_requests} requests of 4 blocks of 16: direction and host layout",
        STAGE,
        at=SWEEP,
        points=tuple(
            {"direction": direction, "host_physical": host, "label": f"{direction}{', host HND' if host else ''}"}
            for direction, host in (("save", ""), ("load", ""), ("save", "KBHNC"), ("load", "KBHNC"))
        ),
    ),
)


def scenarios(preset: Preset, requests: Sequence[int]) -> list[Scenario]:
    """The target scenarios, then (where the preset has them) the sweeps, for ``preset``."""
    front_requests, front_blocks, front_layers = preset.front_end
    batches: dict[str, tuple[Mapping[str, Any], ...]] = {
        BATCHES: tuple({"requests": n} for n in requests),
        SWEEP: ({"requests": preset.sweep_requests},),
        FRONT_END: (
            {"requests": front_requests, "blocks_per_request": front_blocks, "geometry": {"layers": front_layers}},
        ),
    }
    names = {
        "sweep_requests": preset.sweep_requests,
        "front_requests": front_requests,
        "front_blocks": front_blocks,
        "front_layers": front_layers,
    }
    out = []
    for spec in SCENARIOS:
        if spec.at == SWEEP and not preset.sweeps:
            continue
        points = tuple(
            _point(preset.geometry, spec.name, spec.base, batch, change)
            for change in spec.points
            for batch in batches[spec.at]
        )
        out.append(Scenario(spec.name, spec.title.format(**names), points, spec.target, spec.plot))
    return out


def _point(geometry: Geometry, scenario: str, *changes: Mapping[str, Any]) -> Point:
    """A point from ``changes`` applied in turn, ``geometry`` changed key by key."""
    fields: dict[str, Any] = {}
    geometry_changes: dict[str, Any] = {}
    for change in changes:
        fields |= {k: v for k, v in change.items() if k != "geometry"}
        geometry_changes |= change.get("geometry", {})
    return Point(scenario=scenario, geometry=replace(geometry, **geometry_changes), **fields)


def allocator_ids(num_blocks: int, count: int, kind: str, rng: np.random.Generator) -> np.ndarray:
    """The first ``count`` block ids an allocator hands out (``kvhost_tools.blocks.free_list``):
    ``runs`` of 1-8 consecutive free blocks in random order, or ``scattered``."""
    return free_list(num_blocks, rng, kind)[:count]
