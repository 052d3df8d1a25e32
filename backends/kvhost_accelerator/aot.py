"""The Triton kernels compiled ahead of time for GPUs that are not here: the code, its registers, its compile keys.

Triton compiles to PTX and cubin (NVIDIA, with the ptxas it ships), AMDGCN (ROCm) and,
with Intel's Triton, SPIR-V, on any machine: only running needs the device. The tests
use this to check the code a launch would run (barriers, vector widths, registers and
spills) and how many kernels a stream of batches compiles (``compile_key``: what Triton's
launcher caches a compiled kernel under). ``python -m kvhost_accelerator.aot`` prints the
figures. It turns a ``KernelCall`` into a compile with Triton's launch binder, an
internal API (Triton 3.3 and later), so it is for tests and figures, never for serving.
"""

from __future__ import annotations

import re
import subprocess
import tempfile
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from types import ModuleType
from typing import Any

try:
    import triton  # noqa: F401  # the compiler this tool drives, imported by the kernels below too
except ImportError as err:
    if __name__ == "__main__":
        raise SystemExit(
            f"python -m kvhost_accelerator.aot needs Triton: pip install 'kvhost[triton]' ({err})"
        ) from None
    raise

from kvhost_accelerator.backend import AcceleratorBackend
from kvhost_accelerator.kernels import KernelCall
from kvhost_accelerator.launch import Limits
from kvhost_accelerator.runtime import DeviceRuntime, SynchronousRuntime

# name -> (Triton backend, arch, threads per warp)
TARGETS: dict[str, tuple[str, Any, int]] = {
    "sm_80": ("cuda", 80, 32),
    "sm_90": ("cuda", 90, 32),
    "gfx942": ("hip", "gfx942", 64),
    # Intel's Triton takes the device's properties; these are a Data Center GPU Max's.
    "xpu": ("xpu", {"architecture": 0, "sub_group_sizes": [16, 32], "max_work_group_size": 1024}, 16),
}


def gpu_target(name: str) -> Any:
    """A ``triton.backends.compiler.GPUTarget`` for one of ``TARGETS``."""
    from triton.backends.compiler import GPUTarget

    return GPUTarget(*TARGETS[name])


_BACKENDS: dict[str, Any] = {}
_BINDERS: dict[tuple[Any, str], Any] = {}


def _backend(target: Any) -> Any:
    """Triton's compiler backend for ``target`` (cached by its repr: an XPU target's arch is a dict)."""
    from triton.compiler import make_backend

    if repr(target) not in _BACKENDS:
        _BACKENDS[repr(target)] = make_backend(target)
    return _BACKENDS[repr(target)]


def _binder(kernel: Any, target: Any) -> Any:
    from triton.runtime.jit import create_function_from_signature

    key = (kernel, repr(target))
    if key not in _BINDERS:
        _BINDERS[key] = create_function_from_signature(kernel.signature, kernel.params, _backend(target))
    return _BINDERS[key]


def bind(call: KernelCall, target: Any) -> tuple[Any, list[tuple[str, Any]], Any]:
    """What a launch of ``call`` binds: (arguments by name, specialization per argument, options)."""
    return _binder(call.kernel, target)(*call.args, **call.constants)  # type: ignore[no-any-return]


def compile_key(call: KernelCall, target: Any) -> str:
    """The key Triton's launcher caches compiled kernels under: a new key is a new compile.

    Per argument, its type and specialization (an integer equal to 1 becomes a constant,
    one divisible by 16 or a 16-byte aligned pointer gets a hint, one past 2**31 another
    type) and the value of every compile-time constant; then the options (warps, stages).
    """
    _, specialization, options = bind(call, target)
    return f"{call.kernel.__name__}{tuple(specialization)}{options}"


def compile_call(call: KernelCall, target: Any) -> Any:
    """Compile ``call`` for ``target`` exactly as its launch would (a ``CompiledKernel``)."""
    import triton
    from triton.compiler import ASTSource
    from triton.runtime.jit import find_paths_if, get_iterable_path

    fn = call.kernel
    backend = _backend(target)
    bound, specialization, _ = bind(call, target)
    options = backend.parse_options({k: v for k, v in call.constants.items() if k in ("num_warps", "num_stages")})
    kinds = [kind for kind, _ in specialization]
    signature = {param.name: kind for param, kind in zip(fn.params, kinds)}
    constexprs = {
        path: get_iterable_path(list(bound.values()), path)
        for path in find_paths_if(kinds, lambda _, kind: kind == "constexpr")
    }
    hints = ["" if kind == "constexpr" else hint for kind, hint in specialization]
    attrs = {
        path: backend.parse_attr(get_iterable_path(hints, path))
        for path in find_paths_if(hints, lambda _, hint: isinstance(hint, str))
    }
    return triton.compile(ASTSource(fn, signature, constexprs, attrs), target=target, options=options.__dict__)


@dataclass(frozen=True)
class Resources:
    """Per thread: registers (NVIDIA: all; AMD: vector registers) and bytes spilled to memory."""

    registers: int
    spill_bytes: int


def resources(compiled: Any) -> Resources:
    """Registers and spills of compiled code: ptxas's own count (NVIDIA) or the AMDGCN metadata (ROCm)."""
    target = compiled.metadata.target
    if target.backend == "cuda":
        return _ptxas_resources(compiled.asm["ptx"], target.arch)
    assembly = compiled.asm["amdgcn"]

    def field(name: str) -> int:
        found = re.search(rf"\.{name}:\s*(\d+)", assembly)
        return int(found.group(1)) if found else 0

    # A spilled register is 4 bytes per lane.
    return Resources(field("vgpr_count"), 4 * (field("vgpr_spill_count") + field("sgpr_spill_count")))


PTXAS_S = 600.0  # one kernel's ptxas run (seconds, usually); a hung one fails the check


def _ptxas_resources(ptx: str, arch: int) -> Resources:
    from triton.backends.nvidia.compiler import get_ptxas, sm_arch_from_capability

    with tempfile.TemporaryDirectory() as folder:
        source = Path(folder) / "kernel.ptx"
        source.write_text(ptx)
        command = [get_ptxas(arch).path, "-v", f"--gpu-name={sm_arch_from_capability(arch)}", str(source)]
        command += ["-o", str(source.with_suffix(".cubin"))]
        # The allocator level Triton 3.9 passes to its ptxas 13 (older ones lack the option).
        done = subprocess.run([*command, "--regAllocOptLevel=2"], capture_output=True, text=True, timeout=PTXAS_S)
        if done.returncode:
            done = subprocess.run(command, capture_output=True, text=True, check=True, timeout=PTXAS_S)
        log = done.stderr
    registers = re.search(r"Used (\d+) registers", log)
    spills = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", log)
    if registers is None or spills is None:
        raise RuntimeError(f"no register count in ptxas -v output:\n{log}")
    return Resources(int(registers.group(1)), int(spills.group(1)) + int(spills.group(2)))


# --- the conformance suite's layouts at serving sizes ------------------------------------

# tests/test_receive.py's layouts (axes, physical order) that rearrange anything, and a
# cache whose last axis is not the channels; each with a sender whose region order swaps
# tokens and heads (head-major to token-major and back).
LAYOUTS: dict[str, tuple[str, str, str]] = {
    "KBNHC/NHD": ("KBNHC", "KBNHC", "HNC"),
    "KBNHC/HND": ("KBNHC", "KBHNC", "NHC"),
    "BKNHC": ("BKNHC", "BKNHC", "KHNC"),
    "BKNHC/BKHNC": ("BKNHC", "BKHNC", "KNHC"),
    "BHNC/BNHC": ("BHNC", "BNHC", "HNC"),
    "LBHNC/BLHNC": ("LBHNC", "BLHNC", "LNHC"),
    "BNHKC": ("BNHKC", "BNHKC", "HNKC"),
    "KBNHC/NCH": ("KBNHC", "KBNCH", "HNC"),
}
SERVING = dict(L=4, K=2, B=64, H=8, C=128)


@dataclass(frozen=True)
class Case:
    """One receive to compile: a layout at serving sizes, a dtype, a sender, how misaligned."""

    layout: str
    dtype: str
    local: int  # tokens per local block
    remote: int  # tokens per remote block
    skip: int = 0  # items between the allocation's start and the cache's (0: aligned)

    @property
    def name(self) -> str:
        shift = f" +{self.skip}" if self.skip else ""
        return f"{self.layout} {self.dtype}{shift} remote {self.remote} -> local {self.local}"


def receive_cases() -> list[Case]:
    """Every layout with r = 4 (16 -> 64) and g = 4 (64 -> 16) in bf16; dtypes and misalignment on the common one."""
    cases = [Case(name, "bfloat16", local, remote) for name in LAYOUTS for local, remote in ((64, 16), (16, 64))]
    for dtype in ("float8_e4m3fn", "float32", "int8"):
        cases += [Case("KBNHC/NHD", dtype, 64, 16), Case("KBNHC/NHD", dtype, 16, 64)]
    cases += [Case("KBNHC/NHD", "bfloat16", 64, 16, skip=1), Case("KBNHC/NHD", "float8_e4m3fn", 64, 16, skip=3)]
    cases += [Case("KBNHC/NHD", "float8_e4m3fn", 16, 64, skip=3), Case("KBNHC/HND", "bfloat16", 64, 16, skip=1)]
    return cases


def receive_calls_for(case: Case, limits: Any) -> tuple[Any, list[KernelCall]]:
    """The launch plan and kernel calls the backend would make for ``case`` (CPU tables stand in)."""
    import torch

    from kvhost.layout import Layout
    from kvhost.testing import make_cache
    from kvhost.transform import plan_receive
    from kvhost_accelerator import kernels
    from kvhost_accelerator.launch import plan_receive_launch

    axes, physical, remote_order = LAYOUTS[case.layout]
    dtype = getattr(torch, case.dtype)
    sizes = {a: SERVING.get(a, case.local) for a in axes}
    cache = make_cache(axes, physical, sizes, dtype)
    layout = Layout.of(cache, axes)
    plan = plan_receive(layout, remote_order, case.remote)
    if plan is None:
        raise ValueError(f"{case.name}: nothing to rearrange")
    units = 8
    alignment = 256 | case.skip * cache.element_size()
    launch = plan_receive_launch(
        plan, members=4, outer=layout.outer_count, units=units, alignment=alignment, limits=limits
    )
    table = torch.zeros(max(layout.outer_count, 4, units * plan.parts), dtype=torch.int64)
    calls = kernels.receive_calls(
        launch,
        bases=table[:4],
        outer_offsets=table[: layout.outer_count],
        ids=table[: units * plan.parts],
        scratch=torch.zeros(max(launch.scratch_words, 1), dtype=kernels.TORCH_WORDS[launch.word_bytes]),
        units=units,
        block_stride=layout.block_stride_bytes,
    )
    return launch, calls


# tests/test_copy.py's layout pairs at serving sizes: (source axes, physical), (destination axes, physical).
COPY_PAIRS: dict[str, tuple[tuple[str, str], tuple[str, str]]] = {
    "HND->NHD": (("KBNHC", "KBHNC"), ("KBNHC", "KBNHC")),
    "KBNHC->BKHNC": (("KBNHC", "KBNHC"), ("BKNHC", "BKHNC")),
    "BHNC/HBNC->BNHC": (("BHNC", "HBNC"), ("BNHC", "BNHC")),
    "cross-layer": (("LBHNC", "BLHNC"), ("LBNHC", "LBNHC")),
    "NCH->NHD": (("KBNHC", "KBNCH"), ("KBNHC", "KBNHC")),
}


def copy_cases() -> list[Case]:
    """Each pair in bf16 (``Case.layout`` names the pair), the first also in fp8 and misaligned."""
    cases = [Case(pair, "bfloat16", 16, 16) for pair in COPY_PAIRS]
    cases += [Case("HND->NHD", "float8_e4m3fn", 16, 16), Case("HND->NHD", "float8_e4m3fn", 16, 16, skip=3)]
    return [*cases, Case("HND->NHD", "bfloat16", 16, 16, skip=1)]


def copy_call_for(case: Case, limits: Any) -> tuple[Any, KernelCall]:
    """The launch plan and kernel call of a scattered copy between the pair's layouts (CPU tables)."""
    import torch

    from kvhost.layout import Layout
    from kvhost.testing import make_cache
    from kvhost.transform import plan_copy
    from kvhost_accelerator import kernels
    from kvhost_accelerator.launch import plan_copy_launch

    dtype = getattr(torch, case.dtype)
    layouts = [
        Layout.of(make_cache(axes, physical, {a: SERVING.get(a, case.local) for a in axes}, dtype), axes)
        for axes, physical in COPY_PAIRS[case.layout]
    ]
    plan = plan_copy(*layouts)
    alignment = 256 | case.skip * dtype.itemsize
    launch = plan_copy_launch(plan, pairs=4, blocks=10, alignment=alignment, limits=limits)
    table = torch.zeros(10, dtype=torch.int64)
    call = kernels.copy_call(
        launch,
        src_bases=table[:4],
        dst_bases=table[:4],
        src_ids=table,
        dst_ids=table,
        blocks=10,
        src_block_stride=plan.src_block_stride,
        dst_block_stride=plan.dst_block_stride,
    )
    return launch, call


# --- compiles over a stream of batches -----------------------------------------------------


class CompileCounter(AcceleratorBackend):
    """The accelerator backend on CPU tensors that records what each launch would compile, launching nothing.

    Everything up to the launch is the real code (front end, plans, staging, id tables);
    ``keys`` collects ``compile_key`` for ``target``. Kernels move no bytes here, so what
    lands in the caches is not checked (the interpreter's tests do that).
    """

    name = "compile-counter"
    device_types = ("cpu",)

    def __init__(self, target: Any, limits: Limits | None = None) -> None:
        super().__init__()
        self.target = target
        self.keys: set[str] = set()
        if limits is not None:
            self.limits = limits  # type: ignore[misc]

    def triton_compilers(self) -> tuple[str, ...]:
        return ()

    @cached_property
    def runtime(self) -> DeviceRuntime:
        return SynchronousRuntime()

    @cached_property
    def kernels(self) -> ModuleType | None:
        from kvhost_accelerator import kernels

        if kernels.interpreted():
            raise RuntimeError("TRITON_INTERPRET=1 is set: the kernels are not compiled here")
        return kernels

    @cached_property
    def kernels_missing(self) -> str:
        return ""

    def launch(self, call: Any) -> None:
        self.keys.add(compile_key(call, self.target))

    def compile(self, call: Any) -> None:
        """Nothing: there is no device to load a kernel onto; its launch records its key."""


def batch_flows(counter: CompileCounter) -> dict[str, Callable[[int], None]]:
    """Each flow serves ``n`` blocks: receives (r = 4, g = 4), staged host copies both ways and routes, device copies.

    Small caches (the plans, not the sizes, decide what compiles). Staged copies go
    straight to ``copy_host`` (on the CPU stand-in both sides share a device). Ids are
    scattered on the device side and consecutive on the host side, as an offload has them.
    """
    import numpy as np
    import torch

    import kvhost
    from kvhost.batch import plan_copy_batch
    from kvhost.caches import CacheSet
    from kvhost.testing import make_cache

    blocks = 4 * 1000 + 8
    sizes = dict(K=2, B=blocks, H=2, C=8)
    scattered = np.random.default_rng(0).permutation(blocks)
    flows: dict[str, Callable[[int], None]] = {}
    for local, remote in ((64, 16), (16, 64)):
        caches = {"l0": make_cache("KBNHC", "KBNHC", dict(sizes, N=local), torch.bfloat16)}
        parts = max(remote // local, 1)

        def receive(n: int, caches: Any = caches, parts: int = parts, remote: int = remote) -> None:
            ids = scattered[: n * parts]
            kvhost.receive(caches, {"r": ids}, axes="KBNHC", remote_order="HNC", remote_block_size=remote,
                           backend=counter)  # fmt: skip

        flows[f"receive HND {remote} -> NHD {local}"] = receive
    device_caches = {"l0": make_cache("KBNHC", "KBNHC", dict(sizes, N=16), torch.bfloat16)}
    device = CacheSet(device_caches, "KBNHC")
    host = CacheSet({"l0": make_cache("KBNHC", "KBHNC", dict(sizes, N=16), torch.bfloat16)}, "KBNHC")
    for non_blocking, route in ((False, "host spans"), (True, "bounce")):
        for to_device, way in ((False, "save"), (True, "load")):

            def staged(n: int, non_blocking: bool = non_blocking, to_device: bool = to_device) -> None:
                slots, ids = np.arange(8, 8 + n), scattered[:n]
                src, dst, src_ids, dst_ids = (host, device, slots, ids) if to_device else (device, host, ids, slots)
                for job in plan_copy_batch(src, dst, src_ids, dst_ids, non_blocking).jobs:
                    finish = counter.copy_host(job, to_device=to_device, keep=[])
                    if finish is not None:
                        finish()

            flows[f"staged {way}, {route}"] = staged
    other = {"l0": make_cache("KBNHC", "KBHNC", dict(sizes, N=16), torch.bfloat16)}
    shuffled = np.random.default_rng(1).permutation(blocks)

    def on_device(n: int) -> None:  # scattered ids on both sides: two id tables
        kvhost.copy_blocks(device_caches, other, scattered[:n], shuffled[:n], axes="KBNHC", backend=counter)

    flows["device copy, scattered"] = on_device
    return flows


def count_compiles(target: Any, batches: Iterable[int], limits: Limits | None = None) -> dict[str, int]:
    """Per flow of ``batch_flows``: how many kernels serving every batch size in ``batches`` compiles."""
    counter = CompileCounter(target, limits)
    counts = {}
    for name, flow in batch_flows(counter).items():
        counter.keys = set()
        for n in batches:
            flow(n)
        counts[name] = len(counter.keys)
    return counts


def main(argv: list[str] | None = None) -> int:
    import argparse

    summary = __doc__ and __doc__.splitlines()[0]  # None under python -OO
    parser = argparse.ArgumentParser(prog="python -m kvhost_accelerator.aot", description=summary)
    parser.add_argument("--target", action="append", choices=sorted(TARGETS), help="default: sm_90")
    parser.add_argument("--programs", type=int, default=132 * 4, help="the device's program cap (default 528)")
    parser.add_argument("--batches", type=int, default=1000, help="compiles for every batch of 1..N blocks")
    args = parser.parse_args(argv)
    limits = Limits(programs=args.programs)
    print(f"{'case':52} {'target':7} {'mode':9} {'word':>4} {'tile':>9} {'warps':>5} {'regs':>4} {'spill B':>7}")
    for case in receive_cases():
        launch, calls = receive_calls_for(case, limits)
        for name in args.target or ["sm_90"]:
            used = resources(compile_call(calls[0], gpu_target(name)))
            tile = f"{launch.tile.rows}x{launch.tile.run}"
            print(
                f"{case.name:52} {name:7} {launch.mode:9} {launch.word_bytes:4} {tile:>9} {launch.num_warps:5} "
                f"{used.registers:4} {used.spill_bytes:7}",
                flush=True,
            )
    for case in copy_cases():
        launch, call = copy_call_for(case, limits)
        for name in args.target or ["sm_90"]:
            used = resources(compile_call(call, gpu_target(name)))
            tile = f"{launch.tile.rows}x{launch.tile.run}"
            label = f"copy {case.layout} {case.dtype}" + (f" +{case.skip}" if case.skip else "")
            print(
                f"{label:52} {name:7} {'copy':9} {launch.word_bytes:4} {tile:>9} {launch.num_warps:5} "
                f"{used.registers:4} {used.spill_bytes:7}",
                flush=True,
            )
    print(f"\nkernels compiled serving every batch of 1..{args.batches} blocks (sm_90 keys):")
    for flow, count in count_compiles(gpu_target("sm_90"), range(1, args.batches + 1), limits).items():
        print(f"  {flow:40} {count}", flush=True)
    return 0


if __name__ == "__main__":
    import sys

    sys.exit(main())
