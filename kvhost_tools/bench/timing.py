"""Timing the methods of a point: interleaved rounds from a cold cache, calls that waited
for a core left out, and the figures of one point."""

from __future__ import annotations

import os
import random
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from kvhost_tools.bench.machine import Device
from kvhost_tools.bench.methods import BASELINE, BASELINE_1T, Prepared, fastest, in_place_best, roofline_best
from kvhost_tools.bench.workloads import Point, Preset


@dataclass
class Sample:
    seconds: list[float] = field(default_factory=list)
    waits: list[float] = field(default_factory=list)  # run-queue wait during each call

    @property
    def median(self) -> float:
        return statistics.median(self.seconds)

    def quantile(self, q: float) -> float:
        return float(np.quantile(self.seconds, q))


@dataclass
class Measured:
    """Every round's samples, and per method which of them its median uses."""

    samples: dict[str, Sample]
    used: dict[str, list[bool]]  # per method and round: undisturbed (or every round, when too few were)
    every_round: bool = False  # some method had too few undisturbed calls: every method counts every round

    def used_parts(self, name: str, parts: Sequence[float]) -> list[float]:
        """Timings of a part of ``name``'s calls, one per call in the order made (its warm-up
        calls first): those of the rounds its median uses."""
        rounds = len(self.samples[name].seconds)
        return [t for t, keep in zip(parts[len(parts) - rounds :], self.used[name], strict=True) if keep]

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
    every method has at least half the planned number of them, else every method's uses
    all of its calls.
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
    clean = {name: [not flag for flag in disturbed(sample)] for name, sample in samples.items()}
    if all(sum(flags) >= max(3, rounds // 2) for flags in clean.values()):
        return Measured(samples, clean)
    # Too few undisturbed calls of some method: every method's figures use every round
    # (one method's clean calls against another's disturbed ones would skew their ratio),
    # and the point says so (``Measured.every_round``).
    return Measured(samples, {name: [True] * run for name in samples}, every_round=True)


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


MIN_PAIRED_ROUNDS = 4  # fewer rounds where both calls count give no spread worth printing


def per_round(measured: Measured, top: str, bottom: str) -> list[float]:
    """``top / bottom`` in each round where both calls count: the spread of a ratio (its
    quartiles over rounds); none from fewer than ``MIN_PAIRED_ROUNDS`` such rounds (on a
    busy machine one round can be all that two calls share, and its ratio is no spread)."""
    pairs = zip(
        measured.samples[top].seconds, measured.samples[bottom].seconds, measured.used[top], measured.used[bottom]
    )
    ratios = [t / b for t, b, keep_t, keep_b in pairs if keep_t and keep_b]
    if len(ratios) < MIN_PAIRED_ROUNDS:
        return []
    return [float(np.quantile(ratios, q)) for q in (0.25, 0.75)]


def sample_entry(measured: Measured, name: str, sample: Sample) -> dict[str, Any]:
    """A method's entry in the results: the counted calls' spread (``sample``), and every call."""
    return {
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
    best = fastest(samples, (BASELINE, BASELINE_1T))
    row["baseline_best"] = best
    roof = roofline_best(samples)
    row["roofline_best"] = roof
    row["every_round"] = measured.every_round
    floor = in_place_best(samples)
    row["in_place_best"] = floor

    for name, sample in samples.items():
        entry = sample_entry(measured, name, sample)
        if prepared.nbytes:
            entry["gbps"] = prepared.nbytes / sample.median / 1e9
        if roof is not None:
            entry["fraction"] = samples[roof].median / sample.median
            entry["fraction_rounds_p25_p75"] = per_round(measured, roof, name)
        if floor is not None:  # a receive: its own floor beside the copy's
            entry["in_place"] = samples[floor].median / sample.median
        if best is not None:
            entry["speedup"] = samples[best].median / sample.median
            entry["speedup_rounds_p25_p75"] = per_round(measured, best, name)
        row["methods"][name] = entry
    return row
