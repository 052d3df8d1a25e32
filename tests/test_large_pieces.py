"""Large pieces on every backend, each case in a process of its own, under a strict malloc.

The conformance suite's shapes are small: pieces (``kvhost.transform.WriteBack``) of a few
hundred bytes. Memory used after it was freed goes unnoticed there: glibc serves such
requests from its heap, and a freed chunk that nobody has reused still holds what was
written through it. A large request that the heap cannot serve gets a mapping of its own,
which ``free`` unmaps, and writing through it then faults. That is how the numba receive
kernel's in-kernel scratch (fixed in ad6d914: numba released it right after its address
was taken) crashed on pieces of about 1 MiB, and only in some processes: glibc's mmap
threshold rises to the largest chunk freed so far, so where large buffers had been freed
before, the scratch came from the heap and the same bug passed.

Here every case has pieces (or copied blocks) of at least 1 MiB or 8 MiB, asserted from
the planner, and runs in a fresh interpreter (``large_pieces_worker.py``: the same Python
and environment) whose malloc is made strict (``STRICT_MALLOC``), so that neither the heap
state other tests leave behind nor the oracle's own temporaries can hide a use after free:
with the kernel of ad6d914^ every receive case here dies of SIGSEGV. The bytes are checked
by the conformance oracle; a crash fails the test with the case's name and the signal.
``test_strict_malloc_faults_on_use_after_free`` checks that the setting still has that
effect on this machine.
"""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch

from kvhost.layout import Layout
from kvhost.testing import make_cache
from kvhost.transform import plan_copy, plan_receive

WORKER = Path(__file__).with_name("large_pieces_worker.py")
KiB, MiB = 1 << 10, 1 << 20
# glibc's malloc made strict (the same settings as ci/memcheck.sh). A chunk of 4 KiB or more
# that malloc cannot carve from memory it already holds gets a mapping of its own, unmapped
# when freed; the threshold is fixed, so it does not rise (as glibc's default one does) to
# the size of the largest chunk freed so far, which moves later large requests onto the heap:
# without this, the fresh worker passes with the broken kernel too, because the oracle frees
# cache-sized temporaries before the call. The heap grows by what is asked and gives its top
# back on every free (top_pad, trim_threshold), so little is held to carve large requests
# from; freed chunks are overwritten with 0xa5. Other C libraries ignore the variable.
STRICT_MALLOC = {
    "GLIBC_TUNABLES": "glibc.malloc.mmap_threshold=4096:glibc.malloc.top_pad=0:glibc.malloc.trim_threshold=0"
    ":glibc.malloc.perturb=165"
}
# Triton's interpreter costs per operation: tiles of 64 KiB (2 KiB in the conformance
# target) make megabyte pieces affordable and still take 16 tiles per MiB.
INTERPRETER_TILE_BYTES = 64 * KiB
DTYPES = {"bf16": "bfloat16", "fp8": "float8_e4m3fn", "fp32": "float32"}


@dataclass(frozen=True)
class ReceiveCase:
    """Caches ``[*axes]`` (shape order = memory order), ``units`` units received from a
    sender with ``order``/``remote`` tokens; pieces of at least ``min_piece`` bytes."""

    axes: str
    sizes: dict[str, int]  # all but B
    dtype: str
    order: str
    remote: int
    min_piece: int
    layers: int = 1
    units: int = 1
    interpreter_tiles: int | None = INTERPRETER_TILE_BYTES  # None: the conformance target's own

    @property
    def parts(self) -> int:
        """Local blocks per unit: g when the sender's block is larger, else 1."""
        return max(1, self.remote // self.sizes["N"])

    @property
    def blocks(self) -> int:
        return self.units * self.parts + 2  # one untouched block at each end

    def spec(self) -> dict[str, Any]:
        ids = list(range(self.blocks - 2, 0, -1))  # scattered, in reverse; 0 and the last untouched
        per = self.parts
        requests = {f"req{u}": ids[u * per : (u + 1) * per] for u in range(self.units)}
        return {
            "op": "receive",
            "axes": self.axes,
            "sizes": dict(self.sizes, B=self.blocks),
            "dtype": DTYPES[self.dtype],
            "layers": self.layers,
            "order": self.order,
            "remote": self.remote,
            "requests": requests,
            "triton_tile_bytes": self.interpreter_tiles or 0,  # 0: the conformance target's own tiles
        }

    def piece_bytes(self) -> int:
        layout = _layout(self.axes, dict(self.sizes, B=self.blocks), self.dtype)
        plan = plan_receive(layout, self.order, self.remote)
        assert plan is not None, "an identity transform moves no byte"
        return plan.write_back.piece_bytes


@dataclass(frozen=True)
class CopyCase:
    """``copy_blocks`` from ``src_axes`` to ``dst_axes`` caches; blocks of at least ``min_region`` bytes
    per outer index."""

    src_axes: str
    dst_axes: str
    sizes: dict[str, int]  # all but B
    dtype: str
    min_region: int
    src_ids: list[int] = field(default_factory=lambda: [5, 0, 2, 3])  # a run (2, 3) and scattered ids
    dst_ids: list[int] = field(default_factory=lambda: [1, 4, 2, 3])
    layers: int = 1

    def spec(self, src_device: str, dst_device: str) -> dict[str, Any]:
        return {
            "op": "copy",
            "src_axes": self.src_axes,
            "dst_axes": self.dst_axes,
            "sizes": dict(self.sizes, B=6),
            "dst_blocks": 6,
            "dtype": DTYPES[self.dtype],
            "layers": self.layers,
            "src_ids": self.src_ids,
            "dst_ids": self.dst_ids,
            "src_device": src_device,
            "dst_device": dst_device,
            "triton_tile_bytes": INTERPRETER_TILE_BYTES,
        }

    def region_bytes(self) -> tuple[int, int]:
        """Bytes a block holds per outer index, on each side."""
        src = _layout(self.src_axes, dict(self.sizes, B=6), self.dtype)
        dst = _layout(self.dst_axes, dict(self.sizes, B=6), self.dtype)
        plan_copy(src, dst)  # the pair is a valid copy
        return src.region_bytes, dst.region_bytes


def _layout(axes: str, sizes: dict[str, int], dtype: str) -> Layout:
    """The layout of such a cache, read from a tensor without memory."""
    return Layout.of(make_cache(axes, axes, sizes, getattr(torch, DTYPES[dtype]), "meta"), axes)


RECEIVE_CASES = {
    # The shapes that crashed the numba kernel: 32 heads x 128 channels, 64 <- 256 (g = 4).
    "g4-NHD64-from-HND256-h32c128-bf16": ReceiveCase(
        "KBNHC", dict(K=2, N=64, H=32, C=128), "bf16", "HNC", 256, 2 * MiB, layers=2, units=2
    ),
    # 8 x 128, 64 <- 512 (g = 8); K and V kept apart (one tensor per member): one piece, one item.
    "g8-BNHC64-from-HNC512-h8c128-bf16": ReceiveCase(
        "BNHC", dict(N=64, H=8, C=128), "bf16", "HNC", 512, 1 * MiB, interpreter_tiles=None
    ),
    # 128 x 256, 64 <- 16 (r = 4): four pieces of 1 MiB per unit.
    "r4-NHD64-from-HND16-h128c256-bf16": ReceiveCase(
        "KBNHC", dict(K=2, N=64, H=128, C=256), "bf16", "HNC", 16, 1 * MiB
    ),
    # Five units of the same: 40 pieces of 1 MiB, which on an H200 take 40 MiB of slots, past
    # the 32 MiB a scratch is kept to unless it grows (test_grown_scratch_case_grows_on_an_h200).
    "r4-NHD64-from-HND16-h128c256-bf16-grown": ReceiveCase(
        "KBNHC", dict(K=2, N=64, H=128, C=256), "bf16", "HNC", 16, 1 * MiB, units=5
    ),
    # r = 8: eight pieces of 1 MiB per unit.
    "r8-NHD256-from-HND32-h128c128-bf16": ReceiveCase(
        "KBNHC", dict(K=2, N=256, H=128, C=128), "bf16", "HNC", 32, 1 * MiB
    ),
    # g = 32, fp8 as 1-byte: 32 regions of 64 KiB make one 2 MiB piece.
    "g32-NHD16-from-HND512-h32c128-fp8": ReceiveCase("KBNHC", dict(K=2, N=16, H=32, C=128), "fp8", "HNC", 512, 2 * MiB),
    # Head-major local blocks from a token-major sender, fp32, g = 4: four 1 MiB pieces.
    "g4-HND64-from-NHD256-h32c128-fp32": ReceiveCase(
        "KBHNC", dict(K=2, N=64, H=32, C=128), "fp32", "NHC", 256, 1 * MiB
    ),
    # K and V interleaved per head (TPU-style), g = 4.
    "g4-NHKC64-from-HKNC256-h32c128-bf16": ReceiveCase(
        "BNHKC", dict(N=64, H=32, K=2, C=128), "bf16", "HKNC", 256, 4 * MiB
    ),
    # 8 MiB pieces: K inside the block, r = 8.
    "r8-KNHC512-from-HKNC64-h32c128-bf16": ReceiveCase(
        "BKNHC", dict(K=2, N=512, H=32, C=128), "bf16", "HKNC", 64, 8 * MiB
    ),
    # g = 32 with 256 channels: 32 regions of 256 KiB, one 8 MiB piece.
    "g32-NHD16-from-HND512-h32c256-bf16": ReceiveCase(
        "KBNHC", dict(K=2, N=16, H=32, C=256), "bf16", "HNC", 512, 8 * MiB
    ),
    # Head-major local blocks, token-major sender, fp32, r = 8: one 8 MiB piece.
    "r8-HND256-from-NHD32-h64c128-fp32": ReceiveCase(
        "KBHNC", dict(K=2, N=256, H=64, C=128), "fp32", "NHC", 32, 8 * MiB
    ),
    # Rows of every layer (vLLM's BLNHC): a block region of 16 layers, one 2 MiB piece; from
    # rows of half the tokens (runs of 64 KiB) and from heads-first rows (runs of 256 B, in place by the cycles too).
    "r2-rows-LNHC64-from-LNHC32-l16h8c128-bf16": ReceiveCase(
        "BLNHC", dict(L=16, N=64, H=8, C=128), "bf16", "LNHC", 32, 2 * MiB, units=2
    ),
    "rows-LNHC64-from-HLNC64-l16h8c128-bf16": ReceiveCase(
        "BLNHC", dict(L=16, N=64, H=8, C=128), "bf16", "HLNC", 64, 2 * MiB, units=2
    ),
}

COPY_CASES = {
    # Head-major to token-major, 1 MiB per K/V half of a block.
    "HND-to-NHD-h32c128-bf16": CopyCase("KBHNC", "KBNHC", dict(K=2, N=128, H=32, C=128), "bf16", 1 * MiB, layers=2),
    # Token-major to K-inside head-major (BKHNC), fp8: blocks of 4 MiB per K/V half, 8 MiB whole.
    "NHD-to-KHND-h64c256-fp8": CopyCase("KBNHC", "BKHNC", dict(K=2, N=256, H=64, C=256), "fp8", 4 * MiB),
    # Token-major to head-major, 8 heads, 1 MiB per K/V half: the CPU kernels walk the source's
    # order (the destination's would read it 2 KiB apart).
    "NHD-to-HND-h8c128-bf16": CopyCase("KBNHC", "KBHNC", dict(K=2, N=512, H=8, C=128), "bf16", 1 * MiB),
    # Heads of 64 and 96 bf16 channels: streamed runs of 128 B (the source's walk: the
    # destination's would read them 1 KiB apart) and 192 B (the destination's walk).
    "NHD-to-HND-h8c64-bf16": CopyCase("KBNHC", "KBHNC", dict(K=2, N=1024, H=8, C=64), "bf16", 1 * MiB),
    "HND-to-NHD-h24c96-bf16": CopyCase("KBHNC", "KBNHC", dict(K=2, N=256, H=24, C=96), "bf16", 1 * MiB),
    # Same layout, fp32: whole 8 MiB regions, runs merged.
    "NHD-to-NHD-h64c128-fp32": CopyCase("KBNHC", "KBNHC", dict(K=2, N=256, H=64, C=128), "fp32", 8 * MiB),
}


def run_worker(target: Any, spec: dict[str, Any], what: str, env: dict[str, str] | None = None) -> dict[str, Any]:
    """Run one case in a fresh interpreter; fail with the case's name if it crashes or a byte is wrong."""
    from kvhost_cpu import CpuBackend

    if isinstance(target.backend, CpuBackend):  # an instance of its own: the worker makes the same
        ways = {name: getattr(target.backend, name) for name in ("cycle_piece_bytes", "cycle_run_bytes", "copy_walk")}
        spec = dict(spec, cpu_ways=ways)
    command = [sys.executable, "-X", "faulthandler", str(WORKER), target.name, target.device, json.dumps(spec)]
    done = subprocess.run(
        command, capture_output=True, text=True, timeout=600, env={**os.environ, **STRICT_MALLOC, **(env or {})}
    )
    tail = "\n".join(done.stderr.strip().splitlines()[-25:])
    if done.returncode < 0:
        name = signal.Signals(-done.returncode).name
        pytest.fail(
            f"{what} on {target}: the worker process was killed by {name} (memory used after it was freed, "
            f"or out of bounds?)\nstderr:\n{tail}",
            pytrace=False,
        )
    if done.returncode != 0:
        pytest.fail(f"{what} on {target}: the worker exited with {done.returncode}\nstderr:\n{tail}", pytrace=False)
    report: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    assert report["backend"] == target.name, report
    if target.name == "cpu" and importlib.util.find_spec("numba") is not None:
        assert report["describe"] == "numba kernels", report  # the compiled kernels ran, not the torch fallback
    return report


@pytest.mark.parametrize("case", list(RECEIVE_CASES), ids=list(RECEIVE_CASES))
def test_receive_large_pieces(target, case):
    spec_case = RECEIVE_CASES[case]
    piece = spec_case.piece_bytes()
    assert piece >= spec_case.min_piece, f"{case}: pieces of {piece} bytes, meant to be >= {spec_case.min_piece}"
    spec = spec_case.spec()
    run_worker(target, spec, f"receive {case} (pieces of {piece / MiB:g} MiB)")


@pytest.mark.parametrize("case", list(COPY_CASES), ids=list(COPY_CASES))
def test_copy_large_blocks(target, case):
    copy_case = COPY_CASES[case]
    regions = copy_case.region_bytes()
    assert min(regions) >= copy_case.min_region, f"{case}: regions of {regions} bytes"
    # Host and device sides: on a CPU target all three directions are the same copy.
    directions = [("device", "device")]
    if target.device != "cpu":
        directions += [("host", "device"), ("device", "host")]
    for src, dst in directions:
        run_worker(target, copy_case.spec(src, dst), f"copy {case} {src}->{dst} (blocks of {min(regions) / MiB:g} MiB)")


def test_grown_scratch_case_grows_on_an_h200():
    """The -grown case, planned for an H200 (132 SMs) with the CUDA backend's limits: one
    launch whose slots take more than the 32 MiB scratch budget, so the suite's device run
    reads and writes grown scratch."""
    from dataclasses import replace

    from kvhost_accelerator.backend import AcceleratorBackend
    from kvhost_accelerator.launch import plan_receive_launch

    case = RECEIVE_CASES["r4-NHD64-from-HND16-h128c256-bf16-grown"]
    h200 = replace(AcceleratorBackend.limits, programs=132 * 4, processors=132, barrier=True)
    layout = _layout(case.axes, dict(case.sizes, B=case.blocks), case.dtype)
    plan = plan_receive(layout, case.order, case.remote)
    launch = plan_receive_launch(plan, members=case.layers, outer=2, units=case.units, alignment=256, limits=h200)
    scratch = launch.scratch_words * launch.word_bytes
    assert launch.mode == "slots" and launch.launches == 1 and launch.programs == 40
    assert scratch == 40 * MiB > h200.scratch_bytes


@pytest.mark.parametrize("case", list(RECEIVE_CASES), ids=list(RECEIVE_CASES))
def test_cpu_receive_large_pieces_through_a_scratch(case):
    """Every large piece through the numba kernels' scratch copy too: by default the pieces
    with long runs are rewritten in place by their cycles instead (the ``cpu`` target), and
    the ``cpu-other-ways`` target takes the cycles for every piece."""
    from conftest import Target
    from kvhost_cpu import CpuBackend

    spec_case = RECEIVE_CASES[case]
    scratch_only = CpuBackend(cycle_piece_bytes=1 << 62, cycle_run_bytes=1 << 62)
    run_worker(Target(scratch_only, "cpu"), spec_case.spec(), f"receive {case} through a scratch")


SERIAL_CASES = ["g4-NHD64-from-HND256-h32c128-bf16", "r8-KNHC512-from-HKNC64-h32c128-bf16"]


@pytest.mark.parametrize("case", SERIAL_CASES, ids=SERIAL_CASES)
def test_cpu_serial_kernel_large_pieces(case):
    """The numba kernels' calling-thread variant (one thread: every job takes it)."""
    from conftest import Target

    spec_case = RECEIVE_CASES[case]
    assert spec_case.piece_bytes() >= spec_case.min_piece
    report = run_worker(
        Target("cpu", "cpu"), spec_case.spec(), f"receive {case}, one numba thread", {"NUMBA_NUM_THREADS": "1"}
    )
    assert report["describe"] == "numba kernels"


CANARY = """
import ctypes
libc = ctypes.CDLL(None)
libc.malloc.restype = ctypes.c_void_p
libc.malloc.argtypes = [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
libc.free(libc.malloc(4 << 20))  # by default this raises glibc's mmap threshold to 4 MiB
chunk = libc.malloc(1 << 20)
libc.free(chunk)
ctypes.memset(chunk, 1, 1 << 20)  # use after free
print("the write through freed memory went unnoticed")
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="GLIBC_TUNABLES is glibc's")
def test_strict_malloc_faults_on_use_after_free():
    """The workers' malloc setting turns a write through a freed 1 MiB chunk into a crash.

    If a C library ignored it, the large-piece tests would pass by luck again: this fails first.
    """
    import platform

    if platform.libc_ver()[0] != "glibc":
        pytest.skip(f"C library {platform.libc_ver()} is not glibc")
    done = subprocess.run(
        [sys.executable, "-c", CANARY], capture_output=True, text=True, timeout=60, env={**os.environ, **STRICT_MALLOC}
    )
    assert done.returncode == -signal.SIGSEGV, (done.returncode, done.stdout, done.stderr)


@pytest.mark.parametrize("threads", ["all", "1"])
def test_cpu_copy_many_runs(threads):
    """4096 runs of one block each: the copy kernel's run tables (``_split_into_runs`` returns
    slices of two arrays it allocates) take 32 KiB each, so under the strict malloc a slice
    that outlived its array would fault or read wrong ids."""
    from conftest import Target

    count = 4096
    spec = {
        "op": "copy",
        "src_axes": "KBHNC",
        "dst_axes": "KBNHC",
        "sizes": dict(K=2, B=count, N=8, H=2, C=32),
        "dst_blocks": count,
        "dtype": "bfloat16",
        "layers": 2,
        "src_ids": [(i * 7) % count for i in range(count)],  # no two consecutive: one run per block
        "dst_ids": list(range(count)),
        "src_device": "device",
        "dst_device": "device",
    }
    env = {"NUMBA_NUM_THREADS": "1"} if threads == "1" else {}
    report = run_worker(Target("cpu", "cpu"), spec, f"copy of {count} one-block runs, {threads} numba threads", env)
    assert report["bytes_moved"] == 2 * count * 2 * 8 * 2 * 32 * 2  # layers x blocks x K x N x H x C x bf16
