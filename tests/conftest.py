"""Every conformance test runs on every backend present: the targets below.

A target is a backend name and the device its caches live on. Accelerator targets carry
a marker (cuda, xpu, xla) and skip with the reason when their device is absent.
"""

from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass

import pytest
import torch
from kvhost_torch.backend import TorchBackend

import kvhost

# The kernels only move bytes, so floating-point fusion is moot; naming it keeps Triton 3.9
# from warning that its default will change.
os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "0")


@dataclass(frozen=True)
class Target:
    backend: str | kvhost.Backend  # a registered name, or a test-only instance
    device: str

    @property
    def name(self) -> str:
        """The backend's name, as ReceiveStats and CopyResult report it."""
        return self.backend if isinstance(self.backend, str) else self.backend.name

    def __str__(self) -> str:
        return f"{self.name}@{self.device}"


def _targets() -> list[object]:
    cuda = torch.cuda.is_available()
    xpu = hasattr(torch, "xpu") and torch.xpu.is_available()
    xla = importlib.util.find_spec("torch_xla") is not None
    from kvhost_accelerator.interpret import TritonInterpretBackend

    triton_interpret = TritonInterpretBackend()
    triton_reason = triton_interpret.unavailable_reason()
    from kvhost_cpu import CpuBackend

    return [
        pytest.param(Target("cpu", "cpu"), id="cpu"),
        # The CPU kernels' other ways: every receive piece rewritten in place by its cycles
        # (by default only pieces of CYCLE_PIECE_BYTES and more with long runs take them), and
        # every copy walked in its source's order (by default only where the destination's
        # order would read the source at a short stride).
        pytest.param(
            Target(CpuBackend(cycle_piece_bytes=0, cycle_run_bytes=0, copy_walk="source"), "cpu"),
            id="cpu-other-ways",
        ),
        pytest.param(Target("torch", "cpu"), id="torch-cpu"),
        # The same path with torch's ops for every call (by default the host's small calls
        # go through numpy on the calling thread), and every host gather split per index of
        # the dims before B (by default only from 8 MiB a call).
        pytest.param(Target(TorchBackend(host_thread_bytes=0, host_split_bytes=0), "cpu"), id="torch-ops-cpu"),
        pytest.param(
            Target("cuda", "cuda"),
            id="cuda",
            marks=[pytest.mark.cuda, pytest.mark.skipif(not cuda, reason="no CUDA device")],
        ),
        pytest.param(
            Target("xpu", "xpu"),
            id="xpu",
            marks=[pytest.mark.xpu, pytest.mark.skipif(not xpu, reason="no XPU device")],
        ),
        pytest.param(
            Target("tpu", "xla"),
            id="xla",
            marks=[pytest.mark.xla, pytest.mark.skipif(not xla, reason="torch_xla not installed")],
        ),
        # The CUDA/XPU Triton kernels on CPU tensors in Triton's interpreter: a Backend
        # instance, not a registered backend. ci/cpu.sh sets TRITON_INTERPRET=1.
        pytest.param(
            Target(triton_interpret, "cpu"),
            id="triton-interpret",
            marks=[pytest.mark.skipif(triton_reason is not None, reason=str(triton_reason))],
        ),
    ]


TARGETS = _targets()


@pytest.fixture(params=TARGETS)
def target(request: pytest.FixtureRequest) -> Target:
    if request.param.device == "xla":
        import torch_xla  # noqa: F401  (torch knows the XLA device only once torch_xla is imported)
    return request.param  # type: ignore[no-any-return]


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter, exitstatus: int, config: pytest.Config) -> None:
    """One line per reason tests were skipped (a device or tool absent here), most first.

    ``pytest -rs`` lists every skipped test instead; this summary then stays out of its way.
    """
    if "s" in (config.option.reportchars or "") or "a" in (config.option.reportchars or ""):
        return
    counts: dict[str, int] = {}
    for report in terminalreporter.stats.get("skipped", []):
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
        reason = reason.removeprefix("Skipped: ")
        counts[reason] = counts.get(reason, 0) + 1
    if not counts:
        return
    terminalreporter.write_line("skipped, by reason (pytest -rs lists each test):")
    for reason, count in sorted(counts.items(), key=lambda item: -item[1]):
        terminalreporter.write_line(f"  {count:5d}  {reason}")
