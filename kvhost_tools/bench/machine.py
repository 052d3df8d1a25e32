"""The machine the bench runs on: its cache sizes, a description for the results, and a
device that synchronises and evicts the bytes a timed call touches."""

from __future__ import annotations

import os
import platform
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from kvhost.caches import CacheSet

MiB = 1 << 20
DEVICE_FLUSH_BYTES = 256 * MiB  # read on an accelerator to evict its caches (``Device``)


def last_level_cache_bytes() -> int:
    """Size of the largest CPU cache from sysfs (32 MiB when it cannot be read)."""
    sizes = []
    for index in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*"):
        try:
            text = (index / "size").read_text().strip()
        except OSError:
            continue
        units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
        sizes.append(int(text[:-1]) * units[text[-1]] if text[-1] in units else int(text))
    return max(sizes, default=32 * MiB)


def host_flush_bytes() -> int:
    """What ``Device`` reads on the host to evict the last call's bytes: three times the largest cache."""
    return max(3 * last_level_cache_bytes(), 64 * MiB)


def machine() -> dict[str, Any]:
    model = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    info: dict[str, Any] = {
        "cpu": model,
        "cores": os.cpu_count(),
        "last_level_cache_mib": last_level_cache_bytes() // MiB,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "OMP_WAIT_POLICY": os.environ.get("OMP_WAIT_POLICY"),
    }
    try:
        import numba

        info["numba"] = numba.__version__
    except ImportError:
        info["numba"] = None
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name()
    return info


class Device:
    """What timing needs from a device: synchronisation and a cache flush before each call.

    ``cache`` says what a flush evicts:

    - ``data`` (default): exactly the bytes the methods read or write (``clflush`` of each
      64-byte line), as in a serving process whose KV bytes just arrived from the network
      while its interpreter and code stay warm. Where lines cannot be flushed one by one
      (not x86, not the host, numba missing) it falls back to ``all``; ranges larger than
      four times the last level cache are left alone (they evict themselves).
    - ``all``: everything, by reading three times the last level cache: data and code are
      cold, which also charges every Python-level step of a call with cache misses.
    - ``warm``: nothing.
    """

    def __init__(self, name: str, cache: str = "data") -> None:
        self.device = torch.device(name)
        module = getattr(torch, self.device.type, None)
        self._sync: Callable[[], None] = getattr(module, "synchronize", None) or (lambda: None)
        if self.device.type == "cpu":
            self._sync = lambda: None
        self._evict = line_evictor() if cache == "data" and self.device.type == "cpu" else None
        self.cache = "all" if cache == "data" and self._evict is None else cache
        self._flush: list[torch.Tensor] = []
        if self.cache in ("all", "data"):
            # Reading three times the largest cache evicts what the last call left there.
            self._flush = [torch.ones(host_flush_bytes() // 8, dtype=torch.int64)]
            if self.device.type != "cpu":
                self._flush.append(torch.ones(DEVICE_FLUSH_BYTES // 8, dtype=torch.int64, device=self.device))
        self._self_evicting = 4 * last_level_cache_bytes()

    @property
    def cold(self) -> bool:
        return self.cache != "warm"

    @property
    def is_host(self) -> bool:
        return self.device.type == "cpu"

    def synchronize(self) -> None:
        self._sync()

    def flush(self, touched: np.ndarray | None = None) -> None:
        """Evict what ``cache`` says; ``touched`` rows are (address, bytes) the methods use."""
        if self.cache == "warm":
            return
        if self.cache == "data" and self._evict is not None and touched is not None:
            if int(touched[:, 1].sum()) <= self._self_evicting:
                self._evict(touched)
            return
        for buffer in self._flush:
            buffer.sum()
        self.synchronize()


def line_evictor() -> Callable[[np.ndarray], None] | None:
    """A compiled ``clflush`` loop over (address, bytes) rows, or None where there is none."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return None
    try:
        from kvhost_tools.bench.evict import evict_lines
    except ImportError:
        return None
    try:
        evict_lines(np.zeros((0, 2), dtype=np.int64))
    except Exception:  # an LLVM without the x86 intrinsics
        return None
    result: Callable[[np.ndarray], None] = evict_lines
    return result


def block_ranges(caches: dict[str, torch.Tensor], axes: str, ids: np.ndarray) -> np.ndarray:
    """(address, bytes) of every region of blocks ``ids`` in every layer of ``caches``."""
    rows = []
    for member in CacheSet(caches, axes).members:
        layout = member.layout
        starts = (
            member.tensor.data_ptr() + layout.outer_offsets_bytes[:, None] + ids[None, :] * layout.block_stride_bytes
        )
        rows.append(np.stack([starts.reshape(-1), np.full(starts.size, layout.region_bytes)], axis=1))
    return np.concatenate(rows).astype(np.int64)
