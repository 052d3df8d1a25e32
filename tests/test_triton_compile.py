"""The Triton kernels compiled ahead of time for real GPUs (no GPU needed), as the backend launches them.

Triton compiles to PTX/cubin (NVIDIA) and AMDGCN here; only running needs a device. The
interpreter checks what the kernels compute; this checks that the compiled code is what
the in-place design relies on: in register mode every word of a piece is loaded before
the barrier and stored after it, scratch mode has a barrier between its phases, and
loads are 16-byte vectors where rows allow. Uses Triton's launch binder (an internal API)
to turn the backend's exact arguments into a compile. Skipped under TRITON_INTERPRET=1.
"""

from __future__ import annotations

import dataclasses
import itertools
import re

import pytest
import torch
from kvhost_accelerator.backend import load_kernels
from kvhost_accelerator.launch import Limits, plan_copy_launch, plan_receive_launch

from kvhost.layout import Layout
from kvhost.testing import make_cache
from kvhost.transform import plan_copy, plan_receive

kernels = load_kernels()
RECEIVE_CASES: list[object] = []
COPY_CASES: list[object] = []
ROCM_CASES: list[object] = []
if kernels is not None and not kernels.interpreted():
    from kvhost_accelerator import aot

    RECEIVE_CASES = aot.receive_cases()  # type: ignore[assignment]
    COPY_CASES = aot.copy_cases()
    # The two that had the most registers before tiles were sized by register cost.
    ROCM_CASES = [aot.Case("KBNHC/NCH", "bfloat16", 64, 16), aot.Case("KBNHC/NHD", "float8_e4m3fn", 64, 16, skip=3)]
pytestmark = [
    pytest.mark.skipif(kernels is None, reason="triton is not installed"),
    pytest.mark.skipif(kernels is not None and kernels.interpreted(), reason="TRITON_INTERPRET=1 is set"),
    pytest.mark.timeout(300),
]


def compile_call(call, backend_name: str, arch: int | str, warp_size: int):
    """Compile ``call`` (a KernelCall) for a GPU target exactly as a launch would (Triton 3.3 and later)."""
    from triton.backends.compiler import GPUTarget

    return aot.compile_call(call, GPUTarget(backend_name, arch, warp_size))


def int64(n: int) -> torch.Tensor:
    return torch.zeros(n, dtype=torch.int64)


def receive_call(physical: str, tokens: int, remote_order: str, remote_size: int, limits: Limits):
    """The launch plan and its first kernel call (split receives have several, all of one kernel)."""
    layout = Layout.of(make_cache("KBNHC", physical, dict(K=2, B=64, N=tokens, H=8, C=128)), "KBNHC")
    plan = plan_receive(layout, remote_order, remote_size)
    launch = plan_receive_launch(plan, members=4, outer=2, units=8, alignment=256, limits=limits)
    scratch = torch.zeros(max(launch.scratch_words, 1), dtype=kernels.TORCH_WORDS[launch.word_bytes])
    calls = kernels.receive_calls(
        launch,
        bases=int64(4),
        outer_offsets=int64(2),
        ids=int64(8 * plan.parts),
        scratch=scratch,
        units=8,
        block_stride=layout.block_stride_bytes,
    )
    return launch, calls[0]


def memory_ops(ptx: str) -> list[str]:
    return re.findall(r"ld\.global[.\w]*|st\.global[.\w]*|bar\.sync|barrier\.sync[.\w]*", ptx)


def test_register_mode_reads_every_word_before_writing_any():
    """HND block 16 -> NHD block 64: the whole 32 KB piece is read, barrier, then written."""
    launch, call = receive_call("KBNHC", 64, "HNC", 16, Limits(programs=528))
    assert launch.in_registers
    ops = memory_ops(compile_call(call, "cuda", 90, 32).asm["ptx"])
    barrier = ops.index("bar.sync")
    assert ops.count("bar.sync") == 1
    tile_loads = [op for op in ops if op.startswith("ld.global.v")]
    assert tile_loads and all(ops.index(op) < barrier for op in set(tile_loads))
    assert all(i > barrier for i, op in enumerate(ops) if op.startswith("st.global"))
    assert "ld.global.v2.b64" in ops and "st.global.v2.b64" in ops  # 16-byte accesses


def test_scratch_mode_has_a_barrier_between_its_phases():
    """Remote block 64 -> local 16 (g = 4): through the scratch slot; compiles for A100 too.

    128 programs: the budget's 256 slots serve them all (528 would take the split mode).
    """
    launch, call = receive_call("KBNHC", 16, "HNC", 64, Limits(programs=128))
    assert not launch.in_registers and launch.mode == "slots"
    for arch in (80, 90):
        ops = memory_ops(compile_call(call, "cuda", arch, 32).asm["ptx"])
        assert ops.count("bar.sync") >= 2
        first, last = ops.index("bar.sync"), len(ops) - 1 - ops[::-1].index("bar.sync")
        assert any(op.startswith("st.global") for op in ops[:first])  # into the slot
        assert any(op.startswith("st.global") for op in ops[first:last])  # back into the cache
        # The slot is written and read by one kernel: its loads must not take the non-coherent path.
        assert not any(".nc" in op for op in ops)


def test_the_probe_kernel_compiles_to_one_load_and_one_store():
    """The kernel the backend builds and loads before any real one (its launcher and the
    driver checked by doing) compiles, and does no more than it says."""
    call = kernels.KernelCall(kernels._probe_kernel, (1,), (torch.zeros(1, dtype=torch.int32),))
    ops = memory_ops(compile_call(call, "cuda", 90, 32).asm["ptx"])
    assert [op.split(".")[0] for op in ops] == ["ld", "st"]


@pytest.mark.parametrize("staging", [None, "dst", "src"], ids=["indexed", "into-staging", "from-staging"])
def test_copy_kernel_compiles_with_wide_accesses(staging):
    """Either side may be a staging buffer (its id table None: block ``i``); the kernel is
    still handed a real table there, so its id parameters are pointers in every case."""
    src = Layout.of(make_cache("KBNHC", "KBHNC", dict(K=2, B=512, N=16, H=8, C=128)), "KBNHC")
    dst = Layout.of(make_cache("KBNHC", "KBNHC", dict(K=2, B=32, N=16, H=8, C=128)), "KBNHC")
    plan = plan_copy(src, dst)
    launch = plan_copy_launch(plan, pairs=4, blocks=10, alignment=256, limits=Limits(programs=528))
    call = kernels.copy_call(
        launch,
        src_bases=int64(4),
        dst_bases=int64(4),
        src_ids=None if staging == "src" else int64(10),
        dst_ids=None if staging == "dst" else int64(10),
        blocks=10,
        src_block_stride=plan.src_block_stride,
        dst_block_stride=plan.dst_block_stride,
    )
    assert all(isinstance(table, torch.Tensor) for table in call.args[:4])
    assert (call.constants["SRC_INDEXED"], call.constants["DST_INDEXED"]) == (staging != "src", staging != "dst")
    ops = memory_ops(compile_call(call, "cuda", 90, 32).asm["ptx"])
    assert "ld.global.v2.b64" in ops and "st.global.v2.b64" in ops


@pytest.mark.skipif(kernels is None or "amd" not in kernels.compiler_targets(), reason="no AMD Triton backend")
def test_kernels_compile_for_rocm():
    # 304 CUs x 4 programs; the g = 4 case with one slot per program of the budget's 256 (split: below).
    for physical, tokens, order, remote, programs in (("KBNHC", 64, "HNC", 16, 1216), ("KBNHC", 16, "HNC", 64, 256)):
        _, call = receive_call(physical, tokens, order, remote, Limits(programs=programs))
        try:
            assembly = compile_call(call, "hip", "gfx942", 64).asm["amdgcn"]
        except Exception as err:  # older Triton wheels leave the final link to a ROCm install
            if "ld.lld not found" in str(err):
                pytest.skip(f"no ROCm linker for this Triton: {err}")
            raise
        assert "s_barrier" in assembly


def rocm(call):
    """AMDGCN and LLVM IR for gfx942, or a skip where this Triton leaves the link to a ROCm install."""
    if "amd" not in kernels.compiler_targets():
        pytest.skip("no AMD Triton backend")
    try:
        return compile_call(call, "hip", "gfx942", 64)
    except Exception as err:
        if "ld.lld not found" in str(err):
            pytest.skip(f"no ROCm linker for this Triton: {err}")
        raise


# --- split receives: no barrier, the device full -------------------------------------------


def test_split_mode_needs_no_barrier_and_moves_wide_words():
    """32 heads, remote 64 -> local 16 on 132 SMs: 512 KB pieces, split into chunks; compiles for A100, H100, MI300."""
    layout = Layout.of(make_cache("KBNHC", "KBNHC", dict(K=2, B=64, N=16, H=32, C=128)), "KBNHC")
    plan = plan_receive(layout, "HNC", 64)
    launch = plan_receive_launch(plan, members=4, outer=2, units=8, alignment=256, limits=Limits(programs=528))
    assert launch.mode == "split"
    calls = kernels.receive_calls(
        launch,
        bases=int64(4),
        outer_offsets=int64(2),
        ids=int64(8 * plan.parts),
        scratch=torch.zeros(launch.scratch_words, dtype=kernels.TORCH_WORDS[launch.word_bytes]),
        units=8,
        block_stride=layout.block_stride_bytes,
    )
    assert len(calls) == launch.launches >= 2
    keys = {aot.compile_key(call, aot.gpu_target("sm_90")) for call in calls}
    assert len(keys) == 1  # every round runs the same compiled kernel
    for arch in (80, 90):
        ops = memory_ops(compile_call(calls[0], "cuda", arch, 32).asm["ptx"])
        assert "bar.sync" not in ops and not any(op.startswith("barrier") for op in ops)
        assert "ld.global.v2.b64" in ops and "st.global.v2.b64" in ops
    assert "s_barrier" not in rocm(calls[0]).asm["amdgcn"]


# --- the barrier the in-kernel modes rely on -------------------------------------------------


def test_the_barrier_orders_global_memory_on_nvidia_and_amd():
    """Registers and slots exchange words through global memory across ``tl.debug_barrier``.

    NVIDIA: ``bar.sync``, which orders every prior memory access of the participating
    threads, global included (PTX ISA, barrier). AMD: LLVM's workgroup-scope release and
    acquire fences around ``s_barrier``, for every address space (no ``!mmra`` limiting
    them to LDS); on gfx942 outside thread-group split mode the waves of a work-group share
    one vector L1 in order, so LLVM's memory model needs no wait on global accesses there.
    A compiler that narrows either fails here (then ``Limits.barrier`` must be False).
    """
    _, call = receive_call("KBNHC", 64, "HNC", 16, Limits(programs=528))
    assert re.search(r"\bbar\.sync\s+0;", compile_call(call, "cuda", 90, 32).asm["ptx"])
    llir = rocm(call).asm["llir"].splitlines()
    barriers = [i for i, line in enumerate(llir) if "@llvm.amdgcn.s.barrier()" in line and "call" in line]
    assert barriers
    for i in barriers:
        before = next(line for line in reversed(llir[:i]) if "fence" in line)
        after = next(line for line in llir[i + 1 :] if "fence" in line)
        assert 'fence syncscope("workgroup") release' in before and "!mmra" not in before
        assert 'fence syncscope("workgroup") acquire' in after and "!mmra" not in after


@pytest.mark.xpu  # Intel's Triton comes with torch's XPU wheels: ci/xpu.sh runs it (compiled only, no device needed)
@pytest.mark.skipif(kernels is None or "intel" not in kernels.compiler_targets(), reason="no Intel Triton backend")
def test_intel_barrier_fences_global_memory_exactly_when_the_backend_says():
    """Intel's Triton lowers ``tl.debug_barrier`` to OpenCL ``barrier(flags)``: 1 = local memory, 2 = global.

    Through 3.7.0 the flag is 1 (work-group local memory only), from 3.7.1 it is 3. The XPU
    backend relies on the in-kernel barrier only where it fences global memory.
    """
    from kvhost_xpu import XpuBackend

    _, call = receive_call("KBNHC", 64, "HNC", 16, Limits(programs=512))
    llir = aot.compile_call(call, aot.gpu_target("xpu")).asm["llir"]
    flags = {int(flag) for flag in re.findall(r"call spir_func void @_Z7barrierj\(i32 (\d+)\)", llir)}
    assert flags and len(flags) == 1
    assert bool(flags.pop() & 2) == XpuBackend().barrier_orders_global_memory()
    # What runs where the barrier does not fence global memory: the split kernel, no barrier in it.
    launch, call = receive_call("KBNHC", 64, "HNC", 16, Limits(programs=512, barrier=False))
    assert launch.mode == "split"
    assert "_Z7barrierj" not in aot.compile_call(call, aot.gpu_target("xpu")).asm["llir"]


# --- registers and spills, compiles per batch size -------------------------------------------


@pytest.mark.parametrize("case", RECEIVE_CASES, ids=lambda case: case.name)
def test_receive_kernels_stay_within_their_registers(case):
    """The conformance suite's layouts at serving sizes, dtypes and misaligned caches, on H100/H200 (sm_90).

    Before tiles were sized by register cost, a cache whose last axis is not the channels
    compiled to 255 registers a thread and a misaligned fp8 one to 239, a misaligned bf16
    one to 128 with spills. Now no kernel spills and none needs more than 96 registers
    (the common HND 16 -> NHD 64: 64, as before).
    """
    launch, calls = aot.receive_calls_for(case, Limits(programs=528))
    used = aot.resources(aot.compile_call(calls[0], aot.gpu_target("sm_90")))
    assert used.spill_bytes == 0, f"{case.name}: {launch.mode}, tile {launch.tile}: spills {used}"
    assert used.registers <= 96, f"{case.name}: {launch.mode}, tile {launch.tile}: {used}"
    if case == aot.Case("KBNHC/NHD", "bfloat16", 64, 16):
        assert launch.in_registers and used.registers == 64


@pytest.mark.parametrize("case", COPY_CASES, ids=lambda case: f"{case.layout} {case.dtype} +{case.skip}")
def test_copy_kernels_stay_within_their_registers(case):
    """Scattered copies between the copy suite's layout pairs at serving sizes (staging's device side)."""
    launch, call = aot.copy_call_for(case, Limits(programs=528))
    used = aot.resources(aot.compile_call(call, aot.gpu_target("sm_90")))
    assert used.spill_bytes == 0 and used.registers <= 96, f"{case.name}: tile {launch.tile}: {used}"


@pytest.mark.parametrize("case", ROCM_CASES, ids=lambda case: case.name)
def test_receive_kernels_stay_within_their_registers_on_rocm(case):
    launch, calls = aot.receive_calls_for(case, Limits(programs=1216))
    used = aot.resources(rocm(calls[0]))
    assert used.spill_bytes == 0 and used.registers <= 128, f"{case.name}: {launch.mode}: {used}"


@pytest.mark.timeout(600)
@pytest.mark.parametrize("barrier", [True, False], ids=["barrier", "split"])
def test_batches_of_1_to_1000_blocks_compile_one_kernel_per_transform(barrier):
    """Serving every batch size from 1 to 1000 blocks compiles each transform's kernel once.

    Before: integer arguments specialized on 1 and on divisibility by 16, a pointer on
    16-byte alignment that flipped with the batch's parity, and the staging buffer's outer
    stride (a power of two of blocks) a compile-time constant: 4 kernels per receive
    transform, 18 per staged host-span copy, 3 per bounced one, 4 per scattered device copy.
    """
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny host copies: a thread pool only adds wake-ups
    try:
        counts = aot.count_compiles(aot.gpu_target("sm_90"), range(1, 1001), Limits(programs=528, barrier=barrier))
    finally:
        torch.set_num_threads(threads)
    assert len(counts) == 7 and all(count == 1 for count in counts.values()), counts


def test_the_backend_s_compile_key_separates_every_kernel_triton_compiles_apart():
    """The backend compiles a receive's kernels before any launches, once per
    ``KernelCall.compile_key``: that key must tell apart every two calls that Triton's
    launcher compiles apart (else a kernel would first compile at its launch, after other
    jobs ran), and be no finer than it across batch sizes (else every call compiles again).
    Over the flows' receives and copies, batches of 1 to 300 blocks, both receive modes
    (copies' block strides are values in ours, classes in Triton's: finer across layouts)."""
    target = aot.gpu_target("sm_90")
    pairs: set[tuple[object, str]] = set()

    class Recorder(aot.CompileCounter):
        def launch(self, call):
            pairs.add((call.compile_key(), aot.compile_key(call, target)))

    every: set[tuple[object, str]] = set()
    for barrier in (True, False):
        recorder = Recorder(target, Limits(programs=528, barrier=barrier))
        for name, flow in aot.batch_flows(recorder).items():
            pairs.clear()
            for n in (1, 2, 3, 16, 17, 32, 255, 300):
                flow(n)
            assert len({key for key, _ in pairs}) == len({key for _, key in pairs}) == 1, name
            every |= pairs
    assert len({key for key, _ in every}) == len(every) >= 7  # each of our keys names one of Triton's


def test_the_backend_s_compile_key_follows_triton_s_specialization_of_each_argument():
    """Calls that differ in one argument: a pointer off 16 bytes, a specialized integer of
    another class (1, a multiple of 16, past 2**31) or value, a run-time count of another
    value (one kernel) or width (another, at each edge of i32, i64 and u64): ours equal
    exactly where Triton's are."""
    target = aot.gpu_target("sm_90")
    _, call = receive_call("KBNHC", 64, "HNC", 16, Limits())
    names = call.kernel.arg_names
    ids, items, stride = names.index("ids"), names.index("items"), names.index("block_stride")
    variants = [call]
    edges = [(1 << 31) - 1, 1 << 31, -(1 << 31), -(1 << 31) - 1, (1 << 63) - 1, 1 << 63]
    changes = [(ids, int64(9)[1:]), *((stride, v) for v in (1, 32, 48, 24, 1 << 40))]
    for index, value in changes + [(items, v) for v in (5, 1, 1 << 40, *edges)]:
        args = list(call.args)
        args[index] = value
        variants.append(dataclasses.replace(call, args=tuple(args)))
    for a, b in itertools.combinations(variants, 2):
        same = aot.compile_key(a, target) == aot.compile_key(b, target)
        assert (a.compile_key() == b.compile_key()) == same or (same and a.args[stride] != b.args[stride])
    # items 5, 1, 2**31 - 1 and -2**31 as the call's (i32); the other widths i64 (four) or u64 (2**63)
    assert len({v.compile_key() for v in variants}) == 9
