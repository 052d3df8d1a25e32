"""Huge pages under registered host memory: what lets a same-host read run near memcpy.

On one machine UCX moves host memory between processes with CMA (``process_vm_readv`` /
``writev``): one copy by the kernel, which pins the other process's pages as it goes.
Pinning 4 KiB pages one by one held that copy to 0.53 of memcpy here in 1 MiB pieces;
with the memory read from backed by 2 MiB transparent huge pages the same reads ran at
0.88-0.94, while huge pages on the reading side alone changed nothing
(``experiments/cma_floor.py``). Many kernels hand out huge pages only where a program
asks (``[madvise]`` in /sys/kernel/mm/transparent_hugepage/enabled), so a registered
cache is asked for them:

- ``MADV_HUGEPAGE``: pages first touched later come as huge pages;
- ``MADV_COLLAPSE`` (Linux 6.1 and later): pages already there are copied into huge pages
  now, contents unchanged; its cost is about that of copying the memory once (36 ms for
  122 MiB here). Pages of the range never touched become resident.

Both are advice: a kernel without them, memory that cannot move (pinned for a device) or no
free huge pages leave the memory as it was, and the outcome is reported, never raised.
Only the whole huge pages inside each span are asked for; a span's ragged ends keep their
small pages.
"""

from __future__ import annotations

import ctypes
import errno
import mmap
import os
import sys
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from functools import cache
from typing import Any

import torch

from kvhost.errors import ArgumentError, shown
from kvhost.ids import integer_value
from kvhost.nixl.tables import memory_spans

MADV_HUGEPAGE = 14
MADV_COLLAPSE = 25
PMD_SIZE_FILE = "/sys/kernel/mm/transparent_hugepage/hpage_pmd_size"
DEFAULT_HUGE_PAGE = 2 << 20


@dataclass(frozen=True)
class HugePages:
    """What asking for huge pages did: ``asked`` bytes (whole huge pages inside the spans),
    ``collapsed`` bytes the kernel now backs with them, and why not all (``reason``)."""

    asked: int = 0
    collapsed: int = 0
    reason: str = ""

    def __add__(self, other: HugePages) -> HugePages:
        reasons = [r for r in (self.reason, other.reason) if r]
        return HugePages(self.asked + other.asked, self.collapsed + other.collapsed, "; ".join(dict.fromkeys(reasons)))

    def describe(self) -> str:
        text = f"huge pages: {self.collapsed >> 20} of {self.asked >> 20} MiB"
        return f"{text} ({self.reason})" if self.reason else text


ADDRESS_SPACE = 1 << 57  # bytes a process may address (x86-64 with five-level paging)


@cache
def huge_page_bytes() -> int:
    """The size of a transparent huge page (2 MiB on x86-64; larger on some arm64 kernels)."""
    try:
        with open(PMD_SIZE_FILE) as file:
            return int(file.read()) or DEFAULT_HUGE_PAGE
    except (OSError, ValueError):
        return DEFAULT_HUGE_PAGE


@cache
def _madvise() -> Any:
    if not sys.platform.startswith("linux"):
        return None
    libc = ctypes.CDLL(None, use_errno=True)
    madvise = libc.madvise
    madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]  # returns an int, ctypes' default
    return madvise


def back_with_huge_pages(spans: Sequence[tuple[int, int]]) -> HugePages:
    """Ask the kernel to back the whole huge pages inside each (address, bytes) span of this
    process's memory with huge pages, now and for pages touched later; report what it did.

    Pages are collapsed one huge page at a time, so one that cannot be (nothing of it
    touched yet, which the kernel answers EINVAL; no free huge page) leaves the others be.
    """
    page = huge_page_bytes()
    inner = [(first, last) for first, last in _whole_pages(_checked_spans(spans), page) if last > first]
    asked = sum(last - first for first, last in inner)
    if not asked:
        return HugePages()
    madvise = _madvise()
    if madvise is None:
        return HugePages(asked, 0, f"no madvise on {sys.platform}")
    collapsed, failed = 0, Counter[str]()
    for first, last in inner:
        if madvise(first, last - first, MADV_HUGEPAGE) != 0:
            failed[f"MADV_HUGEPAGE {_error()}"] += last - first
        for start in range(first, last, page):
            if madvise(start, page, MADV_COLLAPSE) == 0:
                collapsed += page
            else:
                failed[_collapse_error()] += page
    reason = "; ".join(f"{nbytes >> 20} MiB {why}" for why, nbytes in failed.items())
    return HugePages(asked, collapsed, reason)


def back_host_tensors_with_huge_pages(tensors: Iterable[torch.Tensor]) -> HugePages:
    """``back_with_huge_pages`` over the memory of ``tensors`` in host memory; tensors on a
    device, or pinned for one, are left as they are."""
    tensors = list(tensors)
    if not all(isinstance(t, torch.Tensor) for t in tensors):
        raise ArgumentError("back_host_tensors_with_huge_pages takes tensors")
    host = [t for t in tensors if t.device.type == "cpu" and not t.is_pinned()]
    return back_with_huge_pages(memory_spans(host))


def _checked_spans(spans: Sequence[tuple[int, int]]) -> list[tuple[int, int]]:
    """The (address, bytes) spans as ints within a process's address space, or an ArgumentError:
    a span of 2**63 bytes would be asked of the kernel one huge page at a time, for ever."""
    if not isinstance(spans, (list, tuple)):
        raise ArgumentError(f"spans must be a list of (address, bytes) pairs, got {type(spans).__name__}")
    checked = []
    for i, span in enumerate(spans):
        pair = span if isinstance(span, (list, tuple)) and len(span) == 2 else (None, None)
        address, nbytes = integer_value(pair[0]), integer_value(pair[1])
        if address is None or nbytes is None or address < 0 or nbytes < 0 or address + nbytes > ADDRESS_SPACE:
            raise ArgumentError(f"span {i}: {shown(span)} is not (address, bytes) within the address space")
        checked.append((address, nbytes))
    return checked


def _whole_pages(spans: Sequence[tuple[int, int]], page: int) -> list[tuple[int, int]]:
    """(first, last) of the huge-page-aligned interior of each span."""
    return [(-(-start // page) * page, (start + length) // page * page) for start, length in spans]


def _error() -> str:
    code = ctypes.get_errno()
    return f"{errno.errorcode.get(code, code)} ({os.strerror(code)})"


def _collapse_error() -> str:
    if ctypes.get_errno() == errno.EINVAL and collapse_works():
        return "not collapsed: not touched yet (huge when first touched, where the kernel allows)"
    return f"not collapsed: MADV_COLLAPSE {_error()}"


@cache
def collapse_works() -> bool:
    """Whether this kernel collapses pages (``MADV_COLLAPSE``, Linux 6.1): tried once on a
    mapping of its own, since a kernel without it answers EINVAL, as it does for a huge
    page with nothing touched."""
    madvise, page = _madvise(), huge_page_bytes()
    if madvise is None:
        return False
    with mmap.mmap(-1, 2 * page, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS) as region:
        base = ctypes.addressof(ctypes.c_char.from_buffer(region))
        aligned = -(-base // page) * page
        region.write(b"\1" * len(region))
        return bool(madvise(aligned, page, MADV_COLLAPSE) == 0)
