"""What decode tells the user: a progress bar while it works, the outcome, and the report.

``Outcome`` holds what decode measured and found; ``print_report`` writes it as the lines
``kvhost demo`` prints, ``write_json`` as ``--json`` saves it. Rates are also given as
shares of a memcpy measured in the same run (``memcpy_gbps``), since on a shared machine
absolute figures mean little.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass, field
from typing import Any, TextIO

import torch

from kvhost.nixl import Hello, TransferPlan
from kvhost_tools.demo.config import LAYOUTS, Config


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


def memcpy_gbps(nbytes: int, repeats: int = 5) -> float:
    """This machine's copy rate right now (median of a few): the yardstick for the figures above."""
    size = min(max(nbytes, 1 << 20), 64 << 20)
    source, target = torch.ones(size, dtype=torch.uint8), torch.empty(size, dtype=torch.uint8)
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        target.copy_(source)
        times.append(time.perf_counter() - started)
    return size / sorted(times)[repeats // 2] / 1e9


def describe_setup(config: Config, plan: TransferPlan, hello: Hello, outcome: Outcome) -> None:
    """The lines that say what runs: both processes, the model, the batch and the blocks."""
    f = outcome.figures
    lengths = [r.tokens for r in hello.requests]
    local, remote = plan.local, plan.remote
    ratio = local.block_size / remote.block_size
    if ratio > 1:
        relation = f"r = {int(ratio)} sender blocks per decode block"
    elif ratio < 1:
        relation = f"g = {round(1 / ratio)} decode blocks per sender block"
    else:
        relation = "same block size"
    mode = "into a host buffer shaped like the cache" if config.via_host else "straight into the decode cache"
    outcome.lines += [
        f"prefill   pid {hello.pid}: {config.prefill_layout} (memory {LAYOUTS[config.prefill_layout]}), "
        f"block {remote.block_size} tokens, {remote.num_blocks} blocks; filled in {f['fill_seconds']:.2f} s, "
        f"said hello {f['hello_seconds']:.2f} s after the start",
        f"decode    pid {os.getpid()}: {config.decode_layout} (memory {LAYOUTS[config.decode_layout]}), "
        f"block {config.decode_block_size} tokens, {f['pool']} blocks"
        + (
            f"; {f['decode_ranks']} ranks of {config.heads // f['decode_ranks']} heads each"
            if f["decode_ranks"] > 1
            else ""
        ),
        f"model     {config.layers} layers x K/V x {config.heads} heads x {config.head_dim} channels, "
        f"{config.dtype_name}",
        f"requests  {f['requests']} ({min(lengths)}..{max(lengths)} tokens, {f['tokens']:,} in all)",
        f"blocks    {f['prefill_blocks']:,} prefill -> {f['decode_blocks']:,} decode ({relation}); "
        f"{f['descriptors']:,} descriptors of {plan.chunk_bytes:,} bytes, {mode}",
    ]


def print_report(outcome: Outcome, stream: TextIO) -> None:
    f = outcome.figures
    devices = f.get("ucx_net_devices", "lo")
    where = "127.0.0.1" if devices == "lo" else f"UCX_NET_DEVICES={devices}"
    stream.write(f"kvhost demo: prefill -> decode over NIXL (UCX, {where}), two processes\n")
    for line in outcome.lines:
        stream.write(f"  {line}\n")
    if "transfer_seconds" in f:
        stream.write(
            f"  transfer  {_gb(f['transfer_bytes'])} in {f['transfer_seconds']:.3f} s = "
            f"{_rate(f['transfer_bytes'], f['transfer_seconds'])}{_ratio(f, 'transfer')} (NIXL READ)\n"
        )
    if "post_seconds" in f:
        stream.write(
            f"  post      {f['post_what']}, backend {f['backend']}: {_gb(f['post_bytes'])} in "
            f"{f['post_seconds']:.3f} s = {_rate(f['post_bytes'], f['post_seconds'])}{_ratio(f, 'post')} "
            f"(first call on scratch blocks before it: {f['warm_up_seconds']:.2f} s)\n"
        )
    if "memcpy_gbps" in f:
        stream.write(f"  memcpy    {f['memcpy_gbps']:.2f} GB/s on this machine now (median of 5 copies)\n")
    if "verify_seconds" in f:
        spare = "untouched" if f["spare_untouched"] else "CHANGED"
        stream.write(
            f"  verify    {len(outcome.verified)}/{f['requests']} requests, {f['verified_tokens']:,} tokens x "
            f"{f['layers']} layers x K/V bit for bit in {f['verify_seconds']:.2f} s; "
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
        stream.write("  result    FAILED: the hand-off did not run\n")
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
    with open(path, "w") as out:
        json.dump(data, out, indent=1)


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
