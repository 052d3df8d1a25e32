"""The transfer section's results: ``summarise`` (medians, fractions of memcpy, speedups,
descriptor counts, the setting, the targets) and ``table`` (what ``kvhost bench --transfer``
prints)."""

from __future__ import annotations

import argparse
import os
from typing import TYPE_CHECKING, Any

import numpy as np

from kvhost.nixl import MAX_DESCRIPTOR_BYTES
from kvhost_tools.bench.machine import machine
from kvhost_tools.bench.methods import ROOFLINE, fastest, roofline_best
from kvhost_tools.bench.output import format_table
from kvhost_tools.bench.targets import check
from kvhost_tools.bench.timing import Measured, per_round, sample_entry
from kvhost_tools.bench.ways import (
    BATCH,
    HANDOFF,
    HANDOFF_PACKED,
    KVHOST,
    LAYERED,
    PACKED,
    PER_PIECE,
    PREPPED,
    UNMERGED,
    layered_descriptors,
)

if TYPE_CHECKING:
    from kvhost_tools.bench.transfer import Setup


def summarise(
    args: argparse.Namespace,
    setup: Setup,
    measured: Measured,
    nbytes: int,
    transfers: list[str],
    parts: dict[str, list[float]],
    load_before: float,
    span_descriptors: dict[str, int],
) -> dict[str, Any]:
    samples = measured.used_samples()
    roof_name = roofline_best(samples) or ROOFLINE
    roof = samples[roof_name].median
    # The baseline: the fastest of the ways engines post a block's pieces (one operation per
    # piece, built per transfer or prepared; or prepared and merged by NIXL itself, vLLM's
    # way), which the targets hold kvhost to. vLLM's way is reported alone too ("vs_prepped").
    best = fastest(samples, (PER_PIECE, UNMERGED, PREPPED)) or PER_PIECE  # all three are always timed
    methods: dict[str, Any] = {}
    for name, sample in samples.items():
        entry = sample_entry(measured, name, sample)
        if not name.startswith(("build ", "plan ")):
            entry["gbps"] = nbytes / sample.median / 1e9
            entry["fraction"] = roof / sample.median
            entry["fraction_rounds_p25_p75"] = per_round(measured, roof_name, name)
        if name in transfers or name in (HANDOFF, LAYERED, HANDOFF_PACKED):
            entry["speedup"] = samples[best].median / sample.median
            entry["speedup_rounds_p25_p75"] = per_round(measured, best, name)
            entry["vs_prepped"] = samples[PREPPED].median / sample.median
        reader_name = name.removeprefix("build ").removeprefix("plan ")
        if reader_name in setup.readers:
            entry["descriptors"] = setup.descriptors(reader_name)
        if name in span_descriptors:
            entry["descriptors"] = span_descriptors[name]
        methods[name] = entry
    # Each part over the calls its whole's median uses (not the warm-up calls, nor the rounds
    # left out as disturbed).
    for whole, part, key in (
        (HANDOFF, "transfer", "transfer_median_s"),
        (HANDOFF, "receive", "receive_median_s"),
        (LAYERED, "tail", "tail_median_s"),
        (HANDOFF_PACKED, "pack", "pack_median_s"),
        (HANDOFF_PACKED, "packed_read", "read_median_s"),
    ):
        methods[whole][key] = float(np.median(measured.used_parts(whole, parts[part])))
    methods[HANDOFF_PACKED]["descriptors"] = methods[PACKED]["descriptors"]
    methods[LAYERED]["descriptors"] = layered_descriptors(setup.readers[KVHOST], setup.batch)
    where = "two network namespaces over TCP" if args.peer_netns else "same host"
    speedup = methods[BATCH]["speedup"]
    checks = [check(where, "kvhost-batch / fastest engine way", speedup, ">=", 2.0 if args.peer_netns else 3.0)]
    if not args.peer_netns:
        checks.append(check(where, "kvhost-batch / memcpy", methods[BATCH]["fraction"], ">=", 0.7))
        checks.append(check(where, "hand-off / memcpy", methods[HANDOFF]["fraction"], ">=", 0.5))
    c = setup.batch.setting
    m, w = c.model, c.workload
    return {
        "where": where,
        "command": " ".join(["kvhost bench", *args.argv]),
        "demo": args.demo,
        "model": f"{m.layers} layers x {'K/V x ' if m.kv == 2 else ''}{m.heads} heads x {m.head_dim} channels, "
        f"{m.dtype_name}",
        "sender": f"{c.prefill.layout} blocks of {c.prefill.block_size} tokens{c.prefill.layers_note}",
        "receiver": f"{c.decode.layout} blocks of {c.decode.block_size} tokens{c.decode.layers_note}",
        "cross_layer": c.prefill.cross_layer,
        "requests": len(setup.batch.remote_ids),
        "block_ids": f"{w.block_ids}" + (f" of 1..{w.max_run}" if w.block_ids == "runs" else ""),
        "bytes": nbytes,
        "pieces": setup.descriptors(PER_PIECE),
        "piece_bytes": setup.plan.chunk_bytes,
        "max_descriptor_bytes": MAX_DESCRIPTOR_BYTES,
        "inflight": args.inflight,
        "progress": args.progress,
        "threads": args.threads,
        "huge_pages": {
            "asked": args.huge_pages,
            "sender": setup.peer.huge_pages,
            "receiver": setup.agent.huge_pages.describe(),
        },
        "ucx": {k: v for k, v in os.environ.items() if k.startswith("UCX_")},
        "peer_netns": args.peer_netns,
        "peer_env": list(args.peer_env),
        "cache": args.cache,
        "load_average": [load_before, os.getloadavg()[0]],
        "machine": machine(),
        "rounds_run": len(next(iter(measured.samples.values())).seconds),
        "baseline_best": best,
        "roofline_best": roof_name,
        "every_round": measured.every_round,
        "methods": methods,
        "targets": {"checks": checks, "passed": all(c["passed"] for c in checks)},
    }


def table(result: dict[str, Any]) -> str:
    """One line per method: descriptors, time, GB/s, fraction of memcpy (with its spread over
    rounds), speedup over the fastest way engines post, and over vLLM's."""
    lines = [["method", "descriptors", "median ms", "GB/s", "x memcpy", "rounds p25-p75", "x engines", "x prepped"]]
    for name, m in result["methods"].items():
        spread = m.get("fraction_rounds_p25_p75") or []
        lines.append(
            [
                name,
                f"{m['descriptors']:,}" if "descriptors" in m else "-",
                f"{m['median_s'] * 1e3:.1f}",
                f"{m['gbps']:.2f}" if "gbps" in m else "-",
                f"{m['fraction']:.2f}" if "fraction" in m else "-",
                f"{spread[0]:.2f}-{spread[1]:.2f}" if spread else "-",
                f"{m['speedup']:.1f}x" if "speedup" in m else "-",
                f"{m['vs_prepped']:.2f}x" if "vs_prepped" in m else "-",
            ]
        )
    h, p = result["methods"][HANDOFF], result["methods"][HANDOFF_PACKED]
    head = (
        f"transfer ({result['where']}): {result['requests']} requests, {result['bytes'] / 1e6:,.1f} MB, "
        f"{result['model']}, {result['sender']} -> {result['receiver']}, block ids {result['block_ids']}; "
        f"{result['pieces']:,} pieces of {result['piece_bytes']:,} bytes; load {result['load_average'][0]:.1f}"
    )
    tail = (
        f"hand-off = transfer {h['transfer_median_s'] * 1e3:.1f} ms + receive {h['receive_median_s'] * 1e3:.1f} ms "
        f"(medians); hand-off-layered: receive after the last layer landed "
        f"{result['methods'][LAYERED]['tail_median_s'] * 1e3:.1f} ms; {PACKED}: the sender first copies the "
        f"batch's blocks into one buffer, request after request (its round trip included), then one transfer "
        f"reads them; {HANDOFF_PACKED} = pack {p['pack_median_s'] * 1e3:.1f} ms + read "
        f"{p['read_median_s'] * 1e3:.1f} ms + receive; build: creating every request's NIXL "
        f"transfer, unposted; plan: its descriptors (rows, or indices into prepared lists) alone, without "
        f"NIXL; x engines: against the fastest way engines post ({result['baseline_best']}, of {PER_PIECE}, "
        f"{UNMERGED} and {PREPPED}); x prepped: against {PREPPED} (vLLM's), whose neighbouring descriptors "
        f"NIXL joins itself; x memcpy: against the faster of torch's copy_ and C's memcpy on one thread "
        f"({result.get('roofline_best', ROOFLINE)})"
        + ("; too few calls undisturbed by other processes: every round counted" if result.get("every_round") else "")
    )
    verdicts = [
        f"{c['what']} {c['value']:.2f} {c['op']} {c['limit']}: {'PASS' if c['passed'] else 'FAIL'}"
        for c in result["targets"]["checks"]
    ]
    return "\n".join([head, format_table(lines), tail, *verdicts])
