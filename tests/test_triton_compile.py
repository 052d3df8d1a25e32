"""The Triton kernels compiled ahead of time for real GPUs (no GPU needed), as the backend launches them.

Triton compiles to PTX/cubin (NVIDIA) and AMDGCN here; only running needs a device. The
interpreter checks what the kernels compute; this checks that the compiled code is what
the in-place design relies on: in register mode every word of a piece is loaded before
the barrier and stored after it, scratch mode has a barrier between its phases, and
loads are 16-byte vectors where rows allow. Uses Triton's launch binder (an internal API)
to turn the backend's exact arguments into a compile. Skipped under TRITON_INTERPRET=1.
"""

from __future__ import annotations

import re

import pytest
import torch
from kvhost_accelerator.backend import load_kernels
from kvhost_accelerator.launch import Limits, plan_copy_launch, plan_receive_launch

from kvhost.layout import Layout
from kvhost.testing import make_cache
from kvhost.transform import plan_copy, plan_receive

kernels = load_kernels()
pytestmark = [
    pytest.mark.skipif(kernels is None, reason="triton is not installed"),
    pytest.mark.skipif(kernels is not None and kernels.interpreted(), reason="TRITON_INTERPRET=1 is set"),
    pytest.mark.timeout(300),
]


def compile_call(call, backend_name: str, arch: int | str, warp_size: int):
    """Compile ``call`` (a KernelCall) for a GPU target exactly as a launch would (Triton 3.3 and later)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, make_backend
    from triton.runtime.jit import create_function_from_signature, find_paths_if, get_iterable_path

    target = GPUTarget(backend_name, arch, warp_size)
    fn = call.kernel
    backend = make_backend(target)
    binder = create_function_from_signature(fn.signature, fn.params, backend)
    bound, specialization, _ = binder(*call.args, **call.constants)
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


def int64(n: int) -> torch.Tensor:
    return torch.zeros(n, dtype=torch.int64)


def receive_call(physical: str, tokens: int, remote_order: str, remote_size: int, limits: Limits):
    layout = Layout.of(make_cache("KBNHC", physical, dict(K=2, B=64, N=tokens, H=8, C=128)), "KBNHC")
    plan = plan_receive(layout, remote_order, remote_size)
    launch = plan_receive_launch(plan, members=4, outer=2, units=8, alignment=256, limits=limits)
    scratch = torch.zeros(max(launch.scratch_words, 1), dtype=kernels.TORCH_WORDS[launch.word_bytes])
    call = kernels.receive_call(
        launch,
        bases=int64(4),
        outer_offsets=int64(2),
        ids=int64(8 * plan.parts),
        scratch=scratch,
        units=8,
        block_stride=layout.block_stride_bytes,
    )
    return launch, call


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
    """Remote block 64 -> local 16 (g = 4): through the scratch slot; compiles for A100 too."""
    launch, call = receive_call("KBNHC", 16, "HNC", 64, Limits(programs=528))
    assert not launch.in_registers
    for arch in (80, 90):
        ops = memory_ops(compile_call(call, "cuda", arch, 32).asm["ptx"])
        assert ops.count("bar.sync") >= 2
        first, last = ops.index("bar.sync"), len(ops) - 1 - ops[::-1].index("bar.sync")
        assert any(op.startswith("st.global") for op in ops[:first])  # into the slot
        assert any(op.startswith("st.global") for op in ops[first:last])  # back into the cache
        # The slot is written and read by one kernel: its loads must not take the non-coherent path.
        assert not any(".nc" in op for op in ops)


@pytest.mark.parametrize("staging", [False, True], ids=["indexed", "staging-side"])
def test_copy_kernel_compiles_with_wide_accesses(staging):
    src = Layout.of(make_cache("KBNHC", "KBHNC", dict(K=2, B=512, N=16, H=8, C=128)), "KBNHC")
    dst = Layout.of(make_cache("KBNHC", "KBNHC", dict(K=2, B=32, N=16, H=8, C=128)), "KBNHC")
    plan = plan_copy(src, dst)
    launch = plan_copy_launch(plan, pairs=4, blocks=10, alignment=256, limits=Limits(programs=528))
    call = kernels.copy_call(
        launch,
        src_bases=int64(4),
        dst_bases=int64(4),
        src_ids=int64(10),
        dst_ids=None if staging else int64(10),
        blocks=10,
        src_block_stride=plan.src_block_stride,
        dst_block_stride=plan.dst_block_stride,
    )
    ops = memory_ops(compile_call(call, "cuda", 90, 32).asm["ptx"])
    assert "ld.global.v2.b64" in ops and "st.global.v2.b64" in ops


@pytest.mark.skipif(kernels is None or "amd" not in kernels.compiler_targets(), reason="no AMD Triton backend")
def test_kernels_compile_for_rocm():
    for physical, tokens, order, remote in (("KBNHC", 64, "HNC", 16), ("KBNHC", 16, "HNC", 64)):
        _, call = receive_call(physical, tokens, order, remote, Limits(programs=1216))
        try:
            assembly = compile_call(call, "hip", "gfx942", 64).asm["amdgcn"]
        except Exception as err:  # older Triton wheels leave the final link to a ROCm install
            if "ld.lld not found" in str(err):
                pytest.skip(f"no ROCm linker for this Triton: {err}")
            raise
        assert "s_barrier" in assembly
