"""Huge pages under registered host memory (kvhost.nixl.hugepages): what the kernel really did,
read back from /proc/self/smaps, and the contents left as they were."""

from __future__ import annotations

import ctypes
import errno
import mmap
import os
import re
import subprocess
import sys

import numpy as np
import pytest
import torch
from test_nixl import needs_nixl

from kvhost.errors import ArgumentError
from kvhost.nixl import hugepages
from kvhost.nixl.hugepages import (
    HugePages,
    back_host_tensors_with_huge_pages,
    back_with_huge_pages,
    collapse_works,
    huge_page_bytes,
)

PAGE = huge_page_bytes()


def kernel_collapses() -> bool:
    """Linux 6.1 or later (MADV_COLLAPSE), from the release alone: what the tests expect of
    ``collapse_works``, never decided by it."""
    if not sys.platform.startswith("linux"):
        return False
    major, minor = (int(part) for part in re.match(r"(\d+)\.(\d+)", os.uname().release).groups())
    return (major, minor) >= (6, 1)


linux_only = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="madvise and smaps are Linux's")
needs_collapse = pytest.mark.skipif(not kernel_collapses(), reason="this kernel has no MADV_COLLAPSE (Linux 6.1)")


@pytest.fixture
def fresh_probes():
    """The module's cached probes forgotten before and after a test that changes what they read."""
    probes = (hugepages.huge_page_bytes, hugepages._madvise, hugepages.collapse_works)
    for probe in probes:
        probe.cache_clear()
    yield
    for probe in probes:
        probe.cache_clear()


def huge_bytes_in(first: int, last: int) -> int:
    """AnonHugePages of this process's mappings that overlap [first, last), from smaps."""
    total, overlaps = 0, False
    with open("/proc/self/smaps") as smaps:
        for line in smaps:
            head = line.split(maxsplit=1)[0]
            if "-" in head and not head.endswith(":"):
                start, end = (int(x, 16) for x in head.split("-"))
                overlaps = start < last and end > first
            elif overlaps and head == "AnonHugePages:":
                total += int(line.split()[1]) << 10
    return total


class Mapping:
    """An anonymous mapping of ``pages`` + 1 huge pages, so ``pages`` whole ones lie inside
    it from ``first`` to ``last``; ``array`` is all of it."""

    def __init__(self, pages: int) -> None:
        self.region = mmap.mmap(-1, (pages + 1) * PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        self.array = np.frombuffer(self.region, dtype=np.uint8)
        self.address = self.array.ctypes.data
        self.first = -(-self.address // PAGE) * PAGE
        self.last = self.first + pages * PAGE

    def span(self) -> tuple[int, int]:
        """The aligned interior: where the mapping itself happens to be aligned, it holds one
        huge page more."""
        return self.first, self.last - self.first


def test_whole_pages_inside_each_span() -> None:
    assert hugepages._whole_pages([(PAGE, 3 * PAGE)], PAGE) == [(PAGE, 4 * PAGE)]
    assert hugepages._whole_pages([(PAGE + 1, 3 * PAGE)], PAGE) == [(2 * PAGE, 4 * PAGE)]
    assert hugepages._whole_pages([(PAGE, 3 * PAGE - 1)], PAGE) == [(PAGE, 3 * PAGE)]
    assert hugepages._whole_pages([(PAGE - 1, PAGE + 2)], PAGE) == [(PAGE, 2 * PAGE)]


def test_huge_page_size_from_the_kernel(tmp_path, monkeypatch, fresh_probes) -> None:
    size_file = tmp_path / "hpage_pmd_size"
    monkeypatch.setattr(hugepages, "PMD_SIZE_FILE", str(size_file))
    for text, expected in (("4194304\n", 4 << 20), ("0\n", 2 << 20), ("x", 2 << 20), (None, 2 << 20)):
        if text is None:
            size_file.unlink()
        else:
            size_file.write_text(text)
        huge_page_bytes.cache_clear()
        assert huge_page_bytes() == expected, text


@needs_collapse
def test_collapse_works_where_the_kernel_has_it() -> None:
    assert collapse_works() is True


@needs_collapse
def test_the_probe_needs_no_open_file() -> None:
    """The probe maps anonymous memory: a daemon started with its standard input closed
    gets the same answer (a probe handed a file descriptor would fail there)."""
    probe = "import os; os.close(0); from kvhost.nixl.hugepages import collapse_works; print(collapse_works())"
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60, check=False)
    assert (done.returncode, done.stdout.strip()) == (0, "True"), done.stderr


def test_no_madvise_off_linux(monkeypatch, fresh_probes) -> None:
    monkeypatch.setattr(hugepages.sys, "platform", "darwin")
    assert hugepages._madvise() is None
    assert collapse_works() is False


def test_spans_without_a_whole_huge_page_ask_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    def no_call(*args: object) -> int:
        raise AssertionError("madvise called for a span with no whole huge page")

    monkeypatch.setattr(hugepages, "_madvise", lambda: no_call)
    assert back_with_huge_pages([(PAGE + 1, PAGE), (5 * PAGE + 7, PAGE - 7)]) == HugePages()
    assert back_with_huge_pages([]) == HugePages()


@needs_collapse
def test_touched_memory_is_collapsed_and_keeps_its_bytes() -> None:
    mapping = Mapping(4)
    values = np.random.default_rng(5).integers(0, 256, mapping.array.nbytes, dtype=np.uint8)
    mapping.array[:] = values
    assert huge_bytes_in(mapping.first, mapping.last) == 0  # nothing asked yet: small pages ([madvise])
    done = back_with_huge_pages([mapping.span()])
    assert done == HugePages(4 * PAGE, 4 * PAGE, "")
    assert huge_bytes_in(mapping.first, mapping.last) >= 4 * PAGE
    assert np.array_equal(mapping.array, values)


@needs_collapse
def test_memory_not_touched_is_reported_and_huge_once_touched() -> None:
    mapping = Mapping(3)
    mapping.array[mapping.first - mapping.address : mapping.first - mapping.address + PAGE] = 7  # the first page only
    done = back_with_huge_pages([mapping.span()])
    assert (done.asked, done.collapsed) == (3 * PAGE, PAGE)
    assert (
        done.reason
        == f"{(2 * PAGE) >> 20} MiB not collapsed: not touched yet (huge when first touched, where the kernel allows)"
    )
    with open("/sys/kernel/mm/transparent_hugepage/enabled") as file:
        mode = file.read()
    if "[never]" not in mode:  # MADV_HUGEPAGE: the pages touched now come huge
        mapping.array[:] = 1
        assert huge_bytes_in(mapping.first, mapping.last) >= 3 * PAGE


@linux_only
def test_a_refusal_is_reported_per_huge_page_never_raised(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[tuple[int, int, int]] = []

    def refusing(address: int, length: int, advice: int) -> int:
        calls.append((address, length, advice))
        if advice == hugepages.MADV_COLLAPSE and address == 2 * PAGE:
            ctypes.set_errno(errno.EAGAIN)
            return -1
        if advice == hugepages.MADV_HUGEPAGE and address == 8 * PAGE:
            ctypes.set_errno(errno.EPERM)
            return -1
        return 0

    monkeypatch.setattr(hugepages, "_madvise", lambda: refusing)
    # Three spans: three whole huge pages, none whole (nothing asked), one whose hint is refused.
    done = back_with_huge_pages([(PAGE, 3 * PAGE), (5 * PAGE + 1, PAGE), (8 * PAGE, PAGE)])
    mib = PAGE >> 20
    assert done == HugePages(
        4 * PAGE,
        3 * PAGE,
        f"{mib} MiB not collapsed: MADV_COLLAPSE EAGAIN (Resource temporarily unavailable); "
        f"{mib} MiB MADV_HUGEPAGE EPERM (Operation not permitted)",
    )
    hint, collapse = hugepages.MADV_HUGEPAGE, hugepages.MADV_COLLAPSE
    assert calls == [
        (PAGE, 3 * PAGE, hint),
        *[(address, PAGE, collapse) for address in (PAGE, 2 * PAGE, 3 * PAGE)],
        (8 * PAGE, PAGE, hint),
        (8 * PAGE, PAGE, collapse),
    ]


def test_no_madvise_is_a_reason(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(hugepages, "_madvise", lambda: None)
    monkeypatch.setattr(hugepages.sys, "platform", "plan9")
    assert back_with_huge_pages([(0, 2 * PAGE)]) == HugePages(2 * PAGE, 0, "no madvise on plan9")
    assert back_with_huge_pages([(1, PAGE)]) == HugePages()  # nothing asked, nothing to explain


def test_reports_add_up() -> None:
    one = HugePages(4 * PAGE, 2 * PAGE, "2 MiB not collapsed: x")
    other = HugePages(2 * PAGE, 2 * PAGE, "")
    assert one + other == HugePages(6 * PAGE, 4 * PAGE, "2 MiB not collapsed: x")
    assert one + one == HugePages(8 * PAGE, 4 * PAGE, "2 MiB not collapsed: x")
    assert HugePages(3 << 21, 1 << 21).describe() == "huge pages: 2 of 6 MiB"
    assert one.describe() == f"huge pages: {(2 * PAGE) >> 20} of {(4 * PAGE) >> 20} MiB (2 MiB not collapsed: x)"


def test_only_host_memory_is_asked_for(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[list[tuple[int, int]]] = []
    monkeypatch.setattr(hugepages, "back_with_huge_pages", lambda spans: seen.append(list(spans)) or HugePages())
    host = torch.zeros(3 * PAGE, dtype=torch.uint8)
    device = torch.empty(3 * PAGE, dtype=torch.uint8, device="meta")
    back_host_tensors_with_huge_pages([host, device, host[PAGE:]])
    assert seen == [[(host.data_ptr(), 3 * PAGE)]]


@needs_nixl
@needs_collapse
def test_agent_registration_backs_host_caches() -> None:
    from kvhost.nixl import Agent

    small = {f"layer{i}": torch.ones(2, 8, 16, 8, 64, dtype=torch.bfloat16) for i in range(2)}  # 256 KiB each
    big = {f"layer{i}": torch.ones(2, 256, 16, 8, 64, dtype=torch.bfloat16) for i in range(2)}  # 8 MiB each
    with Agent("huge-pages-on", progress_thread=False) as agent:
        agent.register(small, "KBNHC")
        assert agent.huge_pages == HugePages()  # no whole huge page inside
        agent.register(big, "KBNHC")
        on = agent.huge_pages
    with Agent("huge-pages-off", progress_thread=False) as agent:
        agent.register(big, "KBNHC", huge_pages=False)
        assert agent.huge_pages == HugePages()
    spans = [(t.data_ptr(), t.nbytes) for t in big.values()]
    whole = sum(last - first for first, last in hugepages._whole_pages(spans, PAGE))
    assert whole >= 2 * PAGE and on.asked >= whole and on.collapsed >= whole
    for tensor in big.values():
        first = -(-tensor.data_ptr() // PAGE) * PAGE
        assert huge_bytes_in(first, first + PAGE) >= PAGE
        assert bool((tensor == 1).all())


def test_spans_are_checked_before_the_kernel_is_asked() -> None:
    """A span of 2**63 bytes was asked of the kernel a huge page at a time (a call that never
    ended); spans that are no (address, bytes) pair of ints in the address space are refused."""
    buffer = torch.zeros(1 << 20, dtype=torch.uint8)
    bad = [
        [(buffer.data_ptr(), 2**63)],
        [(2.5, 4096)],
        [(True, 4096)],
        [(-1, 4096)],
        [(4096, -1)],
        [(4096,)],
        [None],
        [(1 << 57, 1)],
    ]
    for spans in bad:
        with pytest.raises(ArgumentError, match=r"span 0: .* is not \(address, bytes\) within the address space"):
            back_with_huge_pages(spans)  # type: ignore[arg-type]
    with pytest.raises(ArgumentError, match="spans must be a list of"):
        back_with_huge_pages(None)  # type: ignore[arg-type]
    with pytest.raises(ArgumentError, match="takes tensors"):
        back_host_tensors_with_huge_pages([None])  # type: ignore[list-item]
    assert back_with_huge_pages([(np.int64(buffer.data_ptr()), 4096)]).asked == 0  # inside one page: nothing asked
    edges = [(0, 0), (buffer.data_ptr(), 0), ((1 << 57) - 4096, 4096)]  # empty spans, the address space's last page
    assert back_with_huge_pages(edges).asked == 0
