"""Decode's transfer loop: pull every request from its prefill engine, and post-process in steps.

Up to ``--inflight`` requests are read at once, each with one NIXL transfer per decode
rank and remote rank that feeds it (``kvhost.nixl.RankReader``), and each bounded by
``--timeout``: NIXL/UCX may report nothing for minutes when a link goes down, so the
deadline, not the transport, ends a request that does not arrive. A prefill engine that
fails (a transfer failed or timed out) starts nothing more; its requests not yet started
fail at once with the cause, while the other engines' requests go on.

What arrived is post-processed in *steps*, as an engine's scheduler would: every
``--step`` seconds (and at the end), all requests that arrived since the last step, from
every prefill engine and whatever its layout and block size, go to one ``kvhost.receive``
call per decode rank (``--via-host``: one ``kvhost.copy_blocks`` first).
"""

from __future__ import annotations

import subprocess
import sys
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import TextIO

import numpy as np
import torch

import kvhost
from kvhost.nixl import RankPlan, RankReader, Session, Transfer, TransferError
from kvhost.nixl.agent import post_all, release_all
from kvhost_tools.demo.report import Outcome, ProgressBar


@dataclass(eq=False)
class Engine:
    """One prefill engine as decode sees it: its session, and per decode rank its plan and reader."""

    index: int
    session: Session
    plans: list[RankPlan] = field(default_factory=list)
    readers: list[RankReader] = field(default_factory=list)
    lost: str | None = None

    @property
    def name(self) -> str:
        return f"prefill {self.index} ({self.session.address})"


@dataclass(eq=False)
class Request:
    """One request as a prefill engine offered it, and what became of it here."""

    name: str
    number: int
    tokens: int
    engine: Engine | None
    remote_ids: Sequence[int] | np.ndarray
    local_ids: list[int] = field(default_factory=list)
    staging_ids: list[int] = field(default_factory=list)
    transfers: list[Transfer] = field(default_factory=list)
    deadline: float = 0.0
    arrived: bool = False
    failure: str | None = None
    # The beat whose ``held`` answer says prefill still held the blocks when they had landed.
    asked: int | None = None


@dataclass(eq=False)
class Rank:
    """One decode rank: its caches, holding ``heads`` of the model's heads from ``first_head``,
    and the host buffer it lands bytes in (``--via-host``)."""

    caches: dict[str, torch.Tensor]
    heads: int
    first_head: int = 0
    staging: dict[str, torch.Tensor] | None = None


@dataclass
class Settings:
    inflight: int
    timeout: float
    step: float
    axes: str
    backend: str | None
    progress: TextIO | None  # where the progress bar goes (a terminal), or None
    fault_after: int | None = None
    fault_command: str | None = None
    fault_label: str | None = None
    fault_timeout: float = 10.0  # wall clock: a command that stops this process uses it up while it is stopped


@dataclass
class Steps:
    """The post-process so far: steps, bytes, seconds, what the last call did."""

    count: int = 0
    requests: int = 0
    nbytes: int = 0
    seconds: float = 0.0
    groups: int = 0
    copied_runs: int = 0
    backend: str = ""
    sizes: list[int] = field(default_factory=list)  # requests per step
    engines: list[int] = field(default_factory=list)  # prefill engines they came from, per step


def post_step(settings: Settings, ranks: Sequence[Rank], arrived: Sequence[Request], steps: Steps) -> None:
    """One step: every request in ``arrived``, from any engine, in one ``kvhost.receive`` per rank."""
    started = time.perf_counter()
    requests: dict[str, kvhost.Incoming] = {}
    for request in arrived:
        assert request.engine is not None
        plan = request.engine.plans[0]
        requests[request.name] = kvhost.Incoming(
            request.local_ids, plan.remote_order, plan.remote_block_size, tokens=request.tokens
        )
    for rank in ranks:
        if rank.staging is not None:
            loaded = kvhost.copy_blocks(
                rank.staging,
                rank.caches,
                [i for r in arrived for i in r.staging_ids],
                [i for r in arrived for i in r.local_ids],
                axes=settings.axes,
                backend=settings.backend,
            ).wait()
            steps.nbytes += loaded.bytes_moved
            steps.copied_runs += loaded.runs
        stats = kvhost.receive(rank.caches, requests, axes=settings.axes, backend=settings.backend)
        steps.nbytes += stats.bytes_moved
        steps.groups, steps.backend = max(steps.groups, stats.groups), stats.backend
    steps.count += 1
    steps.requests += len(arrived)
    steps.sizes.append(len(arrived))
    steps.engines.append(len({r.engine.index for r in arrived if r.engine is not None}))
    steps.seconds += time.perf_counter() - started


def pull(
    settings: Settings,
    requests: list[Request],
    ranks: Sequence[Rank],
    outcome: Outcome,
    steps: Steps,
    *,
    staging: bool,
) -> None:
    """Read every request, post-process in steps; requests end arrived or failed, each within its deadline."""
    pending = deque(requests)
    inflight: list[Request] = []
    waiting: list[Request] = []  # arrived, not yet post-processed
    arrived_bytes, done = 0, 0
    bar = ProgressBar("transfer", len(requests), settings.progress or sys.stderr, settings.progress is not None)
    started = last_step = time.perf_counter()
    fault = Fault(settings, outcome)

    while pending or inflight or waiting:
        while pending and len(inflight) < settings.inflight:
            request = pending.popleft()
            engine = request.engine
            assert engine is not None
            if engine.lost is not None:
                request.failure = f"not started: {engine.name} had failed"
                continue
            ids = request.staging_ids if staging else request.local_ids
            try:  # every decode rank's part, or none in flight
                request.transfers = post_all(partial(reader.read, ids, request.remote_ids) for reader in engine.readers)
            except kvhost.KVHostError as err:
                # With what post_all adds: the ranks' reads posted before it still in flight.
                request.failure = "; ".join([str(err), *getattr(err, "__notes__", ())])
                if isinstance(err, TransferError) or hasattr(err, "__notes__"):
                    # The link, or a read left in flight: the engine's other requests are not started.
                    engine.lost = request.failure
                continue
            request.deadline = time.monotonic() + settings.timeout
            inflight.append(request)
        progressed = False
        for request in list(inflight):
            engine = request.engine
            assert engine is not None
            try:
                if all([t.poll() for t in request.transfers]):  # a list: every part reports its failure
                    request.arrived, progressed = True, True
                    request.asked = engine.session.ask()
                    arrived_bytes += sum(t.nbytes for t in request.transfers)
                    done += 1
                    waiting.append(request)
                elif time.monotonic() > request.deadline:
                    raise TransferError(f"no completion within {settings.timeout:g} s", timed_out=True)
                else:
                    continue
            except TransferError as err:
                request.failure = str(err)
                engine.lost = engine.lost or str(err)
                progressed = True
            try:
                release_all(request.transfers)
            except TransferError as err:  # one still in flight (never one that landed) may still write
                request.failure = f"{request.failure}; {err}" if request.failure else str(err)
                engine.lost = engine.lost or str(err)
            inflight.remove(request)
            fault.maybe(done)
        now = time.perf_counter()
        if waiting and (now - last_step >= settings.step or not (pending or inflight)):
            post_step(settings, ranks, waiting, steps)
            waiting, last_step = [], time.perf_counter()
        elapsed = time.perf_counter() - started
        bar.update(done, f"{arrived_bytes / 1e6:,.0f} MB {arrived_bytes / max(elapsed, 1e-9) / 1e9:.2f} GB/s")
        if not progressed:
            time.sleep(5e-4)
    seconds = time.perf_counter() - started - steps.seconds
    bar.close(done, f"{arrived_bytes / 1e6:,.0f} MB in {seconds:.2f} s")
    outcome.figures.update(transfer_bytes=arrived_bytes, transfer_seconds=seconds)


class Fault:
    """Runs ``--fault-command`` once ``--fault-after`` requests have arrived (a test's hook:
    kill or stop a prefill, take a link down)."""

    def __init__(self, settings: Settings, outcome: Outcome) -> None:
        self.settings, self.outcome = settings, outcome
        self.done = settings.fault_after is None or not settings.fault_command

    def maybe(self, arrived: int) -> None:
        after = self.settings.fault_after
        if self.done or after is None or arrived < after:
            return
        self.done = True
        command = self.settings.fault_command
        started = time.perf_counter()
        try:
            limit = self.settings.fault_timeout
            result = subprocess.run(command or "", shell=True, capture_output=True, text=True, timeout=limit)
            failed = f" (exit {result.returncode}: {result.stderr.strip()[:200]})" if result.returncode else ""
        except subprocess.TimeoutExpired:
            failed = f" (did not finish within {limit:g} s)"
        label = self.settings.fault_label or f"ran `{command}`"
        self.outcome.figures.update(fault_after=arrived, fault_seconds=time.perf_counter() - started)
        self.outcome.figures["fault_at"] = time.time()
        self.outcome.lines.append(f"fault     {label} after {arrived} requests had landed{failed}")
