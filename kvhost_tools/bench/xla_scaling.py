"""Receive and copy time against cache size on an XLA device, where the TPU backend measures it."""

from __future__ import annotations

import sys
from dataclasses import asdict
from typing import Any

from kvhost_tools.bench.machine import MiB
from kvhost_tools.bench.output import Column, column_table, scaled, text


def measure_xla_scaling() -> dict[str, Any]:
    """``kvhost_tools.device_checks.xla_scaling.measure_scaling()``, where torch_xla runs.

    It runs on an XLA device (``PJRT_DEVICE=CPU`` on a host), so in the TPU job's
    environment; anywhere else the JSON says why it was skipped.
    """
    try:
        from kvhost_tools.device_checks.xla_scaling import measure_scaling
    except ImportError as err:
        return {"skipped": f"kvhost_tools.device_checks.xla_scaling is not available here: {err}"}
    try:
        rows = measure_scaling(progress=lambda line: print(f"    xla scaling: {line}", file=sys.stderr))
    except Exception as err:  # its own environment (torch_xla) may be missing: report, do not fail the bench
        return {"skipped": f"measure_scaling() failed: {type(err).__name__}: {err}"}
    return {"rows": [row.as_dict() if hasattr(row, "as_dict") else asdict(row) for row in rows]}


XLA_COLUMNS: tuple[Column, ...] = (
    ("xla scaling", text("operation")),
    ("blocks", text("blocks")),
    ("cache blocks", text("cache_blocks")),
    ("cache MiB", scaled("cache_bytes", 1 / MiB, ".0f")),
    ("ms per call", scaled("seconds", 1e3, ".3f")),
    ("clone ms", scaled("cache_clone_seconds", 1e3, ".3f")),
)


def xla_table(result: dict[str, Any]) -> str:
    """Receive/copy time per cache size next to one whole-cache clone: O(n) stays flat, O(cache) grows."""
    if "rows" not in result:
        return f"xla scaling: {result.get('skipped', 'not run')}"
    return column_table(result["rows"], XLA_COLUMNS)
