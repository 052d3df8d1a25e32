"""A ``clflush`` loop over (address, bytes) rows, compiled by numba for x86.

Its own module, at module level, so that numba caches the machine code on disk
(``cache=True``): a closure is compiled anew in every process, a quarter of a second
of every decode's start-up. Importing it needs numba and llvmlite; calling it needs
an x86 LLVM target (``machine.line_evictor`` checks both).
"""

from __future__ import annotations

from llvmlite import ir
from numba import njit, types
from numba.extending import intrinsic


@intrinsic
def _clflush(typingctx, address):  # type: ignore[no-untyped-def]
    def codegen(context, builder, signature, args):  # type: ignore[no-untyped-def]
        byte_ptr = ir.IntType(8).as_pointer()
        flush = builder.module.declare_intrinsic(
            "llvm.x86.sse2.clflush", fnty=ir.FunctionType(ir.VoidType(), [byte_ptr])
        )
        builder.call(flush, [builder.inttoptr(args[0], byte_ptr)])

    return types.void(types.int64), codegen


@intrinsic
def _mfence(typingctx):  # type: ignore[no-untyped-def]
    def codegen(context, builder, signature, args):  # type: ignore[no-untyped-def]
        mfence = builder.module.declare_intrinsic("llvm.x86.sse2.mfence", fnty=ir.FunctionType(ir.VoidType(), []))
        builder.call(mfence, [])

    return types.void(), codegen


@njit(nogil=True, cache=True)
def evict_lines(ranges):  # type: ignore[no-untyped-def]
    """Flush every 64-byte line of each (address, bytes) row from every cache level."""
    for row in range(ranges.shape[0]):
        first = ranges[row, 0] - ranges[row, 0] % 64
        for line in range(first, ranges[row, 0] + ranges[row, 1], 64):
            _clflush(line)  # type: ignore[call-arg]
    _mfence()  # type: ignore[call-arg]
