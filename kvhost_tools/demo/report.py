"""What decode tells the user: a progress bar while it works, the outcome, and the report.

``Outcome`` holds what decode measured and found; ``print_report`` writes it as the lines
``kvhost demo`` prints, ``write_json`` as ``--json`` saves it. Rates are also given as
shares of a memcpy measured in the same run (``Yardstick``), since on a shared machine
absolute figures mean little.
"""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TextIO

import numpy as np
import torch

from kvhost_tools.demo.config import EngineShape, Model, yardstick_bytes
from kvhost_tools.demo.options import write_json_file

if TYPE_CHECKING:
    from kvhost.nixl.peers import Offer
    from kvhost_tools.demo.pull import Engine


class ProgressBar:
    """``label [#####-----] done/total detail`` on one terminal line; silent when not on a terminal."""

    def __init__(self, label: str, total: int, stream: TextIO, enabled: bool) -> None:
        self.label, self.total, self.stream, self.enabled = label, max(total, 1), stream, enabled
        self.shown = 0.0

    def update(self, done: int, detail: str = "", *, force: bool = False) -> None:
        now = time.monotonic()
        if not self.enabled or (not force and now - self.shown < 0.05):
            return
        self.shown = now
        filled = round(24 * done / self.total)
        self.stream.write(f"\r{self.label:<9} [{'#' * filled}{'-' * (24 - filled)}] {done}/{self.total} {detail}\x1b[K")
        self.stream.flush()

    def close(self, done: int, detail: str = "") -> None:
        if self.enabled:
            self.update(done, detail, force=True)
            self.stream.write("\n")
            self.stream.flush()


@dataclass
class Outcome:
    """What the decode side measured and found: the report prints it, ``--json`` saves it."""

    figures: dict[str, Any] = field(default_factory=dict)
    failed: dict[str, str] = field(default_factory=dict)
    received: list[str] = field(default_factory=list)
    verified: list[str] = field(default_factory=list)
    mismatched: dict[str, str] = field(default_factory=dict)
    lines: list[str] = field(default_factory=list)
    error: str | None = None

    @property
    def ok(self) -> bool:
        return not (self.failed or self.mismatched or self.error) and len(self.verified) == self.figures.get("requests")


def prefill_pid(offer: Offer) -> int:
    """The pid a prefill engine's offer names, 0 where it names none: kvhost's prefill adds
    it for the report, and an engine that leaves it out is still served."""
    extra = offer.fields
    return extra.integer("pid") if extra is not None and "pid" in extra.data else 0


class Yardstick:
    """This machine's memcpy of a batch's size (1 to 64 MiB), its lines evicted before each
    copy as the bench does (bytes that just arrived are not in cache): timed before the
    pull and after it, so that the rate the figures are shares of spans the run."""

    def __init__(self, nbytes: int) -> None:
        from kvhost_tools.bench.machine import line_evictor

        self.size = yardstick_bytes(nbytes)
        self.source = torch.ones(self.size, dtype=torch.uint8)
        self.target = torch.empty(self.size, dtype=torch.uint8)
        self.touched = np.array([[t.data_ptr(), self.size] for t in (self.source, self.target)], dtype=np.int64)
        self.evict = line_evictor()  # None off x86: the copies are then as warm as they come
        self.seconds: list[float] = []

    def time(self, repeats: int = 5) -> None:
        for _ in range(repeats):
            if self.evict is not None:
                self.evict(self.touched)
            started = time.perf_counter()
            self.target.copy_(self.source)
            self.seconds.append(time.perf_counter() - started)

    def gbps(self) -> float:
        return self.size / float(np.median(self.seconds)) / 1e9


def ratio(remote_block_size: int, block_size: int) -> str:
    if block_size > remote_block_size:
        return f"r = {block_size // remote_block_size}"
    if block_size < remote_block_size:
        return f"g = {remote_block_size // block_size}"
    return "same block size"


def describe_decode(model: Model, shape: EngineShape, engines: Sequence[Engine], outcome: Outcome) -> None:
    """The lines that say what runs: every prefill engine, this decode engine, the model, the batch."""
    f = outcome.figures
    for engine in engines:
        offer = engine.session.offer
        spec = offer.spec
        extra = offer.fields
        pid = prefill_pid(offer)
        filled = extra.seconds("fill_seconds", default=0.0) if extra is not None else 0.0
        feeds = sorted({s.rank for plan in engine.plans for s in plan.sources})
        sender = EngineShape.of_order(spec.layout, spec.block_size, spec.tp_size)
        cache = sender.describe() if sender else f"{spec.layout} blocks of {spec.block_size} tokens"
        outcome.lines.append(
            f"prefill   {engine.index} at {engine.session.address} (pid {pid}): "
            f"{cache}; {len(offer.requests)} requests, "
            f"filled in {filled:.2f} s; {ratio(spec.block_size, shape.block_size)}, ranks {feeds} read"
        )
    heads = "the latent" if model.kind == "mla" else f"{model.heads // shape.tp} heads"
    ranks = f"; {shape.tp} ranks of {heads} each" if shape.tp > 1 else ""
    outcome.lines += [
        f"decode    pid {os.getpid()}: {shape.describe()}, {f['pool']} blocks{ranks}",
        f"model     {model.kind}: {model.layers} layers x "
        + (
            f"K/V x {model.heads} heads x {model.head_dim} channels"
            if model.kind == "mha"
            else f"latent {model.head_dim}"
        )
        + f", {model.dtype_name}",
        f"requests  {f['requests']} ({f['tokens']:,} tokens in all); said hello to every prefill "
        f"{f['hello_seconds']:.2f} s after the start",
        f"blocks    {f['prefill_blocks']:,} prefill -> {f['decode_blocks']:,} decode",
    ]


def print_report(outcome: Outcome, stream: TextIO) -> None:
    f = outcome.figures
    engines = len(f.get("prefill_pids", [])) or "the"
    plural = "s" if engines != 1 else ""
    network = f", {f['network']}" if f.get("network") else ""  # none before a connection was made
    stream.write(f"kvhost decode: {engines} prefill engine{plural} -> this decode engine over NIXL (UCX{network})\n")
    for line in outcome.lines:
        stream.write(f"  {line}\n")
    if "transfer_seconds" in f:
        stream.write(
            f"  transfer  {_gb(f['transfer_bytes'])} in {f['transfer_seconds']:.3f} s = "
            f"{_rate(f['transfer_bytes'], f['transfer_seconds'])}{_ratio(f, 'transfer')} (NIXL READ, "
            f"{f.get('descriptors', 0):,} descriptors)\n"
        )
    if "post_seconds" in f:
        stream.write(
            f"  post      {f['post_steps']} step(s), each one call per rank for what had arrived: {f['post_what']}, "
            f"backend {f['backend'] or '-'}: {_gb(f['post_bytes'])} in {f['post_seconds']:.3f} s = "
            f"{_rate(f['post_bytes'], f['post_seconds'])}{_ratio(f, 'post')} "
            f"(kernels loaded before the hello: {f.get('compile_seconds', 0):.2f} s; first calls on scratch "
            f"blocks: {f.get('warm_up_seconds', 0):.2f} s)\n"
        )
    if "memcpy_gbps" in f:
        stream.write(
            f"  memcpy    {f['memcpy_gbps']:.2f} GB/s on this machine now (median of 10 copies from cold caches, "
            "5 before the pull and 5 after)\n"
        )
    if "verify_seconds" in f:
        spare = "untouched" if f["spare_untouched"] else "CHANGED"
        stream.write(
            f"  verify    {len(outcome.verified)}/{f['requests']} requests, {f['verified_tokens']:,} tokens x "
            f"{f['layers']} layers{' x K/V' if f.get('kv', 2) == 2 else ' (one latent a token)'} bit for bit in "
            f"{f['verify_seconds']:.2f} s; "
            f"{f['spare_blocks']} spare blocks {spare}\n"
        )
    causes: dict[str, list[str]] = {}
    for name, why in outcome.failed.items():
        causes.setdefault(why, []).append(name)
    for why, names in causes.items():
        stream.write(f"  failed    {_names(names)}: {why}\n")
    for name, why in outcome.mismatched.items():
        stream.write(f"  MISMATCH  {name}: {why}\n")
    if outcome.error:
        stream.write(f"  error     {outcome.error}\n")
        arrived = len(outcome.received)  # a stop (SIGTERM) or an error may come midway
        ended = f"stopped after {arrived} request(s) arrived" if arrived else "did not run"
        stream.write(f"  result    FAILED: the hand-off {ended}\n")
    elif outcome.ok:
        stream.write("  result    OK: every byte of every request verified\n")
    else:
        stream.write(
            f"  result    FAILED: {len(outcome.failed)} of {f.get('requests')} requests did not arrive "
            f"(not marked received); {len(outcome.verified)} of the {len(outcome.received)} that arrived "
            f"verified bit for bit, {len(outcome.mismatched)} mismatched\n"
        )
    stream.flush()


def write_json(path: str, outcome: Outcome) -> None:
    data = {
        "ok": outcome.ok,
        "error": outcome.error,
        "figures": outcome.figures,
        "received": outcome.received,
        "verified": outcome.verified,
        "failed": outcome.failed,
        "mismatched": outcome.mismatched,
    }
    write_json_file(path, data)


def _names(names: list[str]) -> str:
    shown = ", ".join(names) if len(names) <= 4 else f"{', '.join(names[:2])} ... {names[-1]}"
    return f"{shown} ({len(names)} request{'s' if len(names) > 1 else ''})"


def _ratio(f: dict[str, Any], what: str) -> str:
    """`` = 0.12 x memcpy``: a rate as a share of this run's own copy rate."""
    if not f.get("memcpy_gbps") or not f[f"{what}_seconds"]:
        return ""
    return f" = {f[f'{what}_bytes'] / f[f'{what}_seconds'] / 1e9 / f['memcpy_gbps']:.2f} x memcpy"


def _gb(nbytes: int) -> str:
    return f"{nbytes / 1e6:,.1f} MB"


def _rate(nbytes: int, seconds: float) -> str:
    return f"{nbytes / max(seconds, 1e-9) / 1e9:.2f} GB/s"
