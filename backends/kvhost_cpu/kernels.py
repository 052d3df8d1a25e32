"""Compiled CPU kernels (numba): one pass over memory, work shared by all cores.

Kernels take absolute byte addresses, so one call serves every tensor of every layer and
any dtype. Receive copies a unit's regions into a small per-thread scratch (it stays in
cache) and writes them back rearranged: one read and one write of every byte, the same
memory traffic as a memcpy. Addresses come from validated ids (the front end checks them
before any call) and the caller keeps the tensors alive.
"""

from __future__ import annotations

import numba
import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.core import cgutils
from numba.extending import intrinsic

MAX_DIMS = 6  # region letters (L K N H C) with N split in two, less nothing: at most six loops
SHORT_RUN = 1024  # runs up to this many bytes are copied inline
SERIAL_BYTES = 1 << 20  # jobs below this run on the calling thread
SKEW = 2048  # scratch and region differ by this modulo 4 KiB: no false store-to-load aliasing


@intrinsic
def _memcpy(typingctx, dst, src, nbytes):  # type: ignore[no-untyped-def]
    """memcpy(dst, src, nbytes) on int64 addresses."""
    sig = types.void(types.int64, types.int64, types.int64)

    def codegen(context, builder, signature, args):  # type: ignore[no-untyped-def]
        byte_ptr = ir.IntType(8).as_pointer()
        d, s, n = args
        cgutils.raw_memcpy(builder, builder.inttoptr(d, byte_ptr), builder.inttoptr(s, byte_ptr), n, 1)

    return sig, codegen


@intrinsic
def _copy32(typingctx, dst, src):  # type: ignore[no-untyped-def]
    """A 32-byte copy of constant size, which LLVM turns into a pair of vector moves."""
    sig = types.void(types.int64, types.int64)

    def codegen(context, builder, signature, args):  # type: ignore[no-untyped-def]
        byte_ptr = ir.IntType(8).as_pointer()
        d, s = args
        size = context.get_constant(types.intp, 32)
        cgutils.raw_memcpy(builder, builder.inttoptr(d, byte_ptr), builder.inttoptr(s, byte_ptr), size, 1)

    return sig, codegen


@njit(inline="always")
def _copy_run(dst, src, nbytes):  # type: ignore[no-untyped-def]
    """Short runs by inline vector moves (a libc call per run costs more than the copy)."""
    if nbytes <= SHORT_RUN and nbytes % 32 == 0:
        for offset in range(0, nbytes, 32):
            _copy32(dst + offset, src + offset)
    else:
        _memcpy(dst, src, nbytes)


@intrinsic
def _address_of(typingctx, array):  # type: ignore[no-untyped-def]
    """The address of an array's first byte (``.ctypes.data`` would defeat caching)."""
    sig = types.int64(array)

    def codegen(context, builder, signature, args):  # type: ignore[no-untyped-def]
        data = context.make_array(signature.args[0])(context, builder, args[0]).data
        return builder.ptrtoint(data, ir.IntType(64))

    return sig, codegen


@njit(inline="always")
def _strided_copy(dst, src, shape, dst_strides, src_strides, run):  # type: ignore[no-untyped-def]
    """For every index of the six-dim ``shape``, copy ``run`` bytes.

    The two inner dims are loops; the four outer ones are walked by one flat counter.
    Measured here, six nested loops ran 1.4x slower than this form.
    """
    outer = shape[0] * shape[1] * shape[2] * shape[3]
    for flat in range(outer):
        i3 = flat % shape[3]
        rest = flat // shape[3]
        i2 = rest % shape[2]
        rest //= shape[2]
        i1 = rest % shape[1]
        i0 = rest // shape[1]
        d = dst + i0 * dst_strides[0] + i1 * dst_strides[1] + i2 * dst_strides[2] + i3 * dst_strides[3]
        s = src + i0 * src_strides[0] + i1 * src_strides[1] + i2 * src_strides[2] + i3 * src_strides[3]
        for i4 in range(shape[4]):
            d4 = d + i4 * dst_strides[4]
            s4 = s + i4 * src_strides[4]
            for i5 in range(shape[5]):
                _copy_run(d4 + i5 * dst_strides[5], s4 + i5 * src_strides[5], run)


@njit(inline="always")
def _rearrange_span(  # type: ignore[no-untyped-def]
    unit_addresses, first, last, region_bytes, pieces, piece_bytes, part_stride, shape, src_strides, dst_strides, run
):
    """Rewrite units ``first .. last - 1`` in place through one scratch of their own."""
    parts = unit_addresses.shape[1]
    span = parts if pieces == 1 else 1  # regions one piece covers
    scratch = np.empty(piece_bytes + 4096, dtype=np.uint8)  # one piece is at most one unit
    start = _address_of(scratch)
    for unit in range(first, last):
        if span == 1:
            for piece in range(pieces):
                offset = piece * piece_bytes
                address = unit_addresses[unit, offset // region_bytes] + offset % region_bytes
                base = start + ((address - start + SKEW) & 4095)
                _memcpy(base, address, piece_bytes)
                _strided_copy(address, base, shape, dst_strides, src_strides, run)
        else:
            base = start + ((unit_addresses[unit, 0] - start + SKEW) & 4095)
            for k in range(parts):
                _memcpy(base + k * region_bytes, unit_addresses[unit, k], region_bytes)
            for k in range(parts):
                _strided_copy(unit_addresses[unit, k], base + k * part_stride, shape, dst_strides, src_strides, run)


@njit(parallel=True, nogil=True, cache=True)
def rearrange_units(  # type: ignore[no-untyped-def]
    unit_addresses, region_bytes, pieces, piece_bytes, part_stride, shape, src_strides, dst_strides, run, threads
):
    """Rewrite every unit in place; row ``u`` of ``unit_addresses`` holds its region addresses.

    Each piece (see ``kvhost.transform.WriteBack``) is copied to a per-thread scratch and
    written back through the loops. ``threads`` comes from the caller (numba's own query
    would defeat caching).
    """
    units = unit_addresses.shape[0]
    threads = min(threads, max(units, 1))
    share = (units + threads - 1) // threads
    for thread in prange(threads):
        first, last = thread * share, min(units, (thread + 1) * share)
        _rearrange_span(
            unit_addresses,
            first,
            last,
            region_bytes,
            pieces,
            piece_bytes,
            part_stride,
            shape,
            src_strides,
            dst_strides,
            run,
        )


@njit(nogil=True, cache=True)
def rearrange_units_serial(  # type: ignore[no-untyped-def]
    unit_addresses, region_bytes, pieces, piece_bytes, part_stride, shape, src_strides, dst_strides, run, threads
):
    """``rearrange_units`` on the calling thread alone (``threads`` is ignored)."""
    _rearrange_span(
        unit_addresses,
        0,
        unit_addresses.shape[0],
        region_bytes,
        pieces,
        piece_bytes,
        part_stride,
        shape,
        src_strides,
        dst_strides,
        run,
    )


@njit(inline="always")
def _copy_span(  # type: ignore[no-untyped-def]
    first, last, src_addresses, dst_addresses, counts, src_block, dst_block, merge, shape, src_strides, dst_strides, run
):
    for i in range(first, last):
        count = counts[i]
        if merge:
            _strided_copy(dst_addresses[i], src_addresses[i], shape, dst_strides, src_strides, count * run)
        else:
            for b in range(count):
                _strided_copy(
                    dst_addresses[i] + b * dst_block,
                    src_addresses[i] + b * src_block,
                    shape,
                    dst_strides,
                    src_strides,
                    run,
                )


@njit(parallel=True, nogil=True, cache=True)
def copy_runs(  # type: ignore[no-untyped-def]
    src_addresses, dst_addresses, counts, src_block, dst_block, merge, shape, src_strides, dst_strides, run, threads
):
    """Copy ``counts[i]`` consecutive blocks from ``src_addresses[i]`` to ``dst_addresses[i]``.

    With ``merge`` each loop index of a run is a single copy of ``count * run`` bytes.
    """
    items = counts.shape[0]
    threads = min(threads, max(items, 1))
    share = (items + threads - 1) // threads
    for thread in prange(threads):
        first, last = thread * share, min(items, (thread + 1) * share)
        _copy_span(
            first,
            last,
            src_addresses,
            dst_addresses,
            counts,
            src_block,
            dst_block,
            merge,
            shape,
            src_strides,
            dst_strides,
            run,
        )


@njit(nogil=True, cache=True)
def copy_runs_serial(  # type: ignore[no-untyped-def]
    src_addresses, dst_addresses, counts, src_block, dst_block, merge, shape, src_strides, dst_strides, run, threads
):
    """``copy_runs`` on the calling thread alone (``threads`` is ignored)."""
    _copy_span(
        0,
        counts.shape[0],
        src_addresses,
        dst_addresses,
        counts,
        src_block,
        dst_block,
        merge,
        shape,
        src_strides,
        dst_strides,
        run,
    )


def threads() -> int:
    return int(numba.get_num_threads())


def launcher(kernel_name: str, nbytes: int) -> tuple[object, int]:
    """The kernel for a job of ``nbytes`` and its thread count.

    Small jobs run on the calling thread: a parallel launch costs microseconds on an idle
    machine and up to a scheduler time slice (milliseconds) on a busy one, more than the
    copy itself.
    """
    if nbytes < SERIAL_BYTES or threads() == 1:
        return globals()[kernel_name + "_serial"], 1
    return globals()[kernel_name], threads()


def padded(shape: tuple[int, ...], *strides: tuple[int, ...]) -> list[tuple[int, ...]]:
    """Loop shape and strides as tuples of MAX_DIMS, padded in front with size-1 dims.

    Tuples, not arrays: they reach the kernel by value, so the compiler keeps them in
    registers instead of reloading them after every copy (which might alias an array).
    """
    pad = MAX_DIMS - len(shape)
    return [(1,) * pad + tuple(shape)] + [(0,) * pad + tuple(s) for s in strides]
