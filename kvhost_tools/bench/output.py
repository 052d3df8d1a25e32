"""The results as tables, a JSON file and a PNG plot."""

from __future__ import annotations

import json
import math
import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from kvhost_tools.bench.machine import MiB
from kvhost_tools.bench.methods import (
    BASELINE,
    BASELINE_1T,
    IN_PLACE_1T,
    KVHOST,
    KVHOST_FN,
    ROOFLINE,
    ROOFLINE_1T,
)
from kvhost_tools.bench.targets import front_end_share, worst

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
    "kvhost/in-place",
    "speedup",
)


def table(rows: list[dict[str, Any]], extra_methods: Sequence[str] = ()) -> str:
    """The side-by-side table of every point with a roofline: GB/s, fraction of memcpy, speedup."""
    columns = list(TABLE_COLUMNS)
    for name in extra_methods:
        columns.insert(-2, f"{name}/roof")
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
        roof = row.get("roofline_best") or ROOFLINE
        roof_mark = "*" if roof == ROOFLINE_1T else ""
        every = "~" if row.get("every_round") else ""

        cells = [
            row["scenario"],
            row["label"] + every,
            str(row["requests"]),
            str(row["blocks"]),
            f"{row['bytes'] / MiB:.0f}",
            gbps(roof) + roof_mark,
            gbps(best) + mark,
            gbps(KVHOST),
            gbps(KVHOST_FN),
            frac(best) + mark,
            frac(KVHOST),
            frac(KVHOST_FN),
            *[frac(name) for name in extra_methods],
            f"{methods[KVHOST]['in_place']:.2f}" if "in_place" in methods[KVHOST] else "-",
            f"{methods[KVHOST]['speedup']:.1f}x",
        ]
        lines.append(cells)
    note = (
        "memcpy and baseline: the faster of torch's threads and one thread (*: one thread; memcpy on one thread is "
        "C's memcpy); in-place: a receive's bytes rewritten where they lie, its own floor (receives only); "
        "speedup: baseline / kvhost; ~: too few calls undisturbed by other processes, every round counted"
    )
    return format_table(lines) + "\n" + note


Column = tuple[str, Callable[[dict[str, Any]], str]]


def text(key: str) -> Callable[[dict[str, Any]], str]:
    return lambda row: str(row[key])


def scaled(key: str, scale: float, spec: str) -> Callable[[dict[str, Any]], str]:
    return lambda row: format(row[key] * scale, spec)


def median(method: str, scale: float, spec: str) -> Callable[[dict[str, Any]], str]:
    return lambda row: format(row["methods"][method]["median_s"] * scale, spec)


IDENTITY_COLUMNS: tuple[Column, ...] = (
    ("identity", text("label")),
    ("requests", text("requests")),
    ("blocks", text("blocks")),
    ("bytes moved", text("bytes")),
    ("empty us", median("empty", 1e6, ".1f")),
    ("visit us", median("visit", 1e6, ".1f")),
    ("kvhost us", median(KVHOST, 1e6, ".1f")),
    ("kvhost-fn us", median(KVHOST_FN, 1e6, ".1f")),
    ("noise us", lambda row: format(row.get("empty_noise_s", math.nan) * 1e6, ".1f")),
)
FRONT_END_COLUMNS: tuple[Column, ...] = (
    ("front end", text("label")),
    ("requests", text("requests")),
    ("blocks", text("blocks")),
    ("MiB", scaled("bytes", 1 / MiB, ".0f")),
    ("front end ms", median("front end", 1e3, ".2f")),
    ("transform ms", median("transform", 1e3, ".2f")),
    ("kvhost ms", median(KVHOST, 1e3, ".2f")),
    ("share", lambda row: format(front_end_share(row["methods"]), ".2%")),
)


def other_tables(rows: list[dict[str, Any]]) -> str:
    """The identity and front-end points, each kind in its own table."""
    out = []
    for kind, columns in (("identity", IDENTITY_COLUMNS), ("frontend", FRONT_END_COLUMNS)):
        chosen = [r for r in rows if r["kind"] == kind]
        if chosen:
            out.append(column_table(chosen, columns))
    return "\n\n".join(out)


def column_table(rows: list[dict[str, Any]], columns: Sequence[Column]) -> str:
    """One line per row, a cell per column from the column's function."""
    return format_table([[name for name, _ in columns], *[[cell(row) for _, cell in columns] for row in rows]])


def target_table(results: list[dict[str, Any]]) -> str:
    lines = [["scenario", "target", "worst", "verdict"]]
    for result in results:
        failed = [c for c in result["checks"] if not c["passed"]]
        shown = failed[0] if failed else worst(result["checks"])
        figure = f"{shown['what']} {shown['value']:.3g} at {shown['point']}" if shown else "-"
        lines.append([result["scenario"], result["target"], figure, "PASS" if result["passed"] else "FAIL"])
    return format_table(lines)


def format_table(lines: list[list[str]]) -> str:
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
        methods = [m for m in rows[0]["methods"] if m not in (ROOFLINE, ROOFLINE_1T, IN_PLACE_1T)] if rows else []
        for method in methods:
            xs = [r["requests"] for r in rows]
            ys = [r["methods"][method]["fraction"] for r in rows]
            ax.plot(xs, ys, marker="o", label=method)
        ax.axhline(1.0, color="black", linewidth=1, label="memcpy (roofline: the faster copy)")
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
    # The format named: matplotlib would add ".png" to a name without it (parse() asks for one).
    write_whole(path, lambda partial: figure.savefig(partial, dpi=110, format="png"))
    plt.close(figure)


def write_whole(path: Path, write: Callable[[Path], object]) -> None:
    """``write(partial)`` next to ``path``, then the partial file renamed to it: a run stopped
    while writing leaves ``path`` as it was (or absent), never half written. What is not a
    plain file (``/dev/stdout``) is written as it is; a symbolic link keeps pointing where it did."""
    path = Path(os.path.realpath(path))
    if path.exists() and not path.is_file():
        write(path)
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(f".{path.name}.{os.getpid()}.partial")
    try:
        write(partial)
        os.replace(partial, path)
    finally:
        partial.unlink(missing_ok=True)


def write_text_whole(path: Path, text: str) -> None:
    write_whole(path, lambda partial: partial.write_text(text))


SIGNIFICANT_DIGITS = 5
# What a value derived from up to three rounded ones (a ratio of two medians, itself rounded) may
# differ by, relatively: half a unit in the last kept digit, three times over.
ROUNDING_TOLERANCE = 3 * 0.5 * 10 ** (1 - SIGNIFICANT_DIGITS)


def to_json(value: Any) -> str:
    """Indented JSON with every list of numbers on one line, and floats to SIGNIFICANT_DIGITS
    significant digits."""
    if isinstance(value, dict):
        items = [f"{json.dumps(key)}: {to_json(item)}" for key, item in value.items()]
        return "{\n" + ",\n".join(" " + item.replace("\n", "\n ") for item in items) + "\n}"
    if isinstance(value, list) and value and all(isinstance(v, (int, float, bool)) for v in value):
        return "[" + ", ".join(to_json(v) for v in value) + "]"
    if isinstance(value, list):
        return "[\n" + ",\n".join(" " + to_json(v).replace("\n", "\n ") for v in value) + "\n]"
    if isinstance(value, float) and math.isfinite(value):
        return json.dumps(float(f"{value:.{SIGNIFICANT_DIGITS}g}"))
    return json.dumps(value)
