"""Compiled CPU kernels (numba): a memcpy's memory traffic, work shared by all cores.

Kernels work on raw bytes at absolute addresses (each tensor's base address, its outer
offsets, block ids times the block stride), so one call serves every tensor of every
layer and any dtype. Receive copies a piece of a unit into a small per-thread scratch (it
stays in cache) and writes it back rearranged: one read and one write of every byte, the
traffic of a memcpy; a piece whose runs are long, or which is too large for a core's
cache (a block region holding every layer), is rewritten in place cycle by cycle instead
(``kvhost.transform.ChunkCycles``), with one run of scratch. On x86, copies of 1 MiB and
more write their runs of ``STREAM_RUN`` bytes or more with stores that bypass the caches
(``STREAM_BYTES``), which a plain memcpy of that size does not. Ids come validated from
the front end and the caller keeps the tensors alive.

Each kernel takes its integer parameters packed in one int64 array (``receive_params``,
``copy_params``): a call then costs one dispatch over a handful of arrays, which matters
for small batches.
"""

from __future__ import annotations

import os
import platform
import sys
from functools import cache

import numba
import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.core import cgutils
from numba.extending import intrinsic
from numba.np.ufunc import parallel as numba_parallel

from kvhost.transform import MAX_LOOP_DIMS, Loops
from kvhost_cpu.cache_dir import ensure_writable_cache

ensure_writable_cache(__file__)  # before the first decorator: a read-only install caches elsewhere

SHORT_RUN = 1024  # runs up to this many bytes are copied inline
# Copies of at least STREAM_BYTES write their runs of at least STREAM_RUN bytes with stores
# that bypass the caches: a staging copy's destination is written once and read later by
# someone else (a NIC, another engine, the next step), and a cached store would first
# read every destination line it overwrites. Measured here (kvhost bench --only stage),
# 1.1-1.2x the throughput of cached stores at 4 MiB, 1.4-1.5x at 64-128 MiB, whatever the
# caches held beforehand. Runs of 128-192 B (a head of 64 or 96 bf16 channels between
# layouts, experiments/copy_walk.py) gained 1.08-1.6x streamed and walked by the
# backend's walk_order; saves that read them less than a page apart gained nothing
# streamed in the destination's order, which that walk avoids.
STREAM_BYTES = 1 << 20
STREAM_RUN = 128
# Measured on x86 only: elsewhere (aarch64, arm64 macOS) copies use cached stores, and the
# fence after a streamed copy is LLVM's own, not x86's sfence, which no other target has
# (LLVM aborts the process compiling it there).
X86 = platform.machine().lower() in ("x86_64", "amd64", "i386", "i686")
SERIAL_BYTES = 1 << 20  # jobs below this run on the calling thread
SKEW = 2048  # scratch and region differ by this modulo 4 KiB: no false store-to-load aliasing


@intrinsic
def _memcpy(typingctx, dst, src, nbytes):
    """memcpy(dst, src, nbytes) on int64 addresses."""
    sig = types.void(types.int64, types.int64, types.int64)

    def codegen(context, builder, signature, args):
        byte_ptr = ir.IntType(8).as_pointer()
        d, s, n = args
        cgutils.raw_memcpy(builder, builder.inttoptr(d, byte_ptr), builder.inttoptr(s, byte_ptr), n, 1)

    return sig, codegen


@intrinsic
def _copy32(typingctx, dst, src):
    """A 32-byte copy of constant size, which LLVM turns into a pair of vector moves."""
    sig = types.void(types.int64, types.int64)

    def codegen(context, builder, signature, args):
        byte_ptr = ir.IntType(8).as_pointer()
        d, s = args
        size = context.get_constant(types.intp, 32)
        cgutils.raw_memcpy(builder, builder.inttoptr(d, byte_ptr), builder.inttoptr(s, byte_ptr), size, 1)

    return sig, codegen


@intrinsic
def _stream32(typingctx, dst, src):
    """32 bytes from ``src`` (any alignment) to ``dst`` (32-byte aligned) by a store that
    bypasses the caches."""
    sig = types.void(types.int64, types.int64)

    def codegen(context, builder, signature, args):
        vector = ir.VectorType(ir.IntType(64), 4)
        d, s = (builder.inttoptr(a, vector.as_pointer()) for a in args)
        store = builder.store(builder.load(s, align=1), d, align=32)
        store.set_metadata("nontemporal", builder.module.add_metadata([ir.Constant(ir.IntType(32), 1)]))

    return sig, codegen


def emit_store_fence(builder: ir.IRBuilder, x86: bool) -> None:
    """Streamed stores are visible to every core before what follows: ``sfence`` on x86 (the
    lightest fence that orders them there), LLVM's sequentially consistent fence elsewhere."""
    if x86:
        fence = builder.module.declare_intrinsic("llvm.x86.sse.sfence", fnty=ir.FunctionType(ir.VoidType(), []))
        builder.call(fence, [])
    else:
        builder.fence("seq_cst")


@intrinsic
def _store_fence(typingctx):
    """The fence after streamed stores (``emit_store_fence``) for this machine."""

    def codegen(context, builder, signature, args):
        emit_store_fence(builder, X86)

    return types.void(), codegen


# How a run is copied: each way moves the same bytes, at its own speed.


@njit(inline="always")
def _streams(nbytes, stream):
    """Whether a run is written around the caches: a long run of a streamed copy."""
    return stream and nbytes >= STREAM_RUN


@njit(inline="always")
def _inline(nbytes):
    """Whether a run is copied by inline 32-byte moves (a libc call per run costs more than
    the copy): a short run of whole 32-byte words."""
    return nbytes <= SHORT_RUN and nbytes % 32 == 0


@njit(inline="always")
def _aligned_body(dst, nbytes):
    """(lead, body) of a streamed run: the bytes before ``dst``'s next 32-byte boundary, then
    as many whole 32-byte words as follow it (the rest is the ragged tail)."""
    lead = (32 - dst % 32) % 32
    return lead, (nbytes - lead) // 32 * 32


@njit(inline="always")
def _copy_run(dst, src, nbytes, stream):
    """One run of ``nbytes``: streamed (the aligned body by stores that bypass the caches, the
    ragged ends by memcpy), by inline moves, or by memcpy."""
    if _streams(nbytes, stream):
        lead, body = _aligned_body(dst, nbytes)
        _memcpy(dst, src, lead)
        for offset in range(lead, lead + body, 32):
            _stream32(dst + offset, src + offset)
        _memcpy(dst + lead + body, src + lead + body, nbytes - lead - body)
    elif _inline(nbytes):
        for offset in range(0, nbytes, 32):
            _copy32(dst + offset, src + offset)
    else:
        _memcpy(dst, src, nbytes)


@intrinsic
def _address_of(typingctx, array):
    """The address of an array's first byte (``.ctypes.data`` would defeat caching)."""
    sig = types.int64(array)

    def codegen(context, builder, signature, args):
        data = context.make_array(signature.args[0])(context, builder, args[0]).data
        return builder.ptrtoint(data, ir.IntType(64))

    return sig, codegen


@njit(inline="always")
def _strided_copy(dst, src, shape, dst_strides, src_strides, run, stream):
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
                _copy_run(d4 + i5 * dst_strides[5], s4 + i5 * src_strides[5], run, stream)


@njit(inline="always")
def _loops(params, at):
    """Loop shape and both strides, six dims each, from ``params[at:at + 18]``, as tuples.

    Tuples live in registers; read from the array inside the loops they would be reloaded
    after every copy (the copies might alias the array, as far as the compiler knows).
    """
    shape = (params[at], params[at + 1], params[at + 2], params[at + 3], params[at + 4], params[at + 5])
    src = (params[at + 6], params[at + 7], params[at + 8], params[at + 9], params[at + 10], params[at + 11])
    dst = (params[at + 12], params[at + 13], params[at + 14], params[at + 15], params[at + 16], params[at + 17])
    return shape, src, dst


@njit(inline="always")
def _skewed(start, address):
    """Where in a scratch row starting at ``start`` a copy of the bytes at ``address`` goes:
    within the row's first 4 KiB, ``SKEW`` past ``address`` modulo 4 KiB (a load from the
    region and a store to the scratch then never look alike to the CPU's aliasing check)."""
    return start + ((address - start + SKEW) & 4095)


@njit(inline="always")
def _workers(items, threads):
    """Threads a parallel kernel starts for ``items`` work items: one at least, and no more
    than there are items."""
    return min(threads, max(items, 1))


@njit(inline="always")
def _share(items, threads, thread):
    """Work items ``first .. last - 1`` of ``thread``: the items cut into ``threads``
    consecutive shares, as even as whole items allow (the last may be short or empty)."""
    share = (items + threads - 1) // threads
    return thread * share, min(items, (thread + 1) * share)


@njit(inline="always")
def _chunk_at(origin, regions, offset, region_bytes, block_stride):
    """The address of byte ``offset`` of a unit whose regions are the blocks ``regions``."""
    return origin + regions[offset // region_bytes] * block_stride + offset % region_bytes


@njit(inline="always")
def _rotate_cycles(origin, regions, piece_offset, region_bytes, block_stride, chunk, order, starts, spare):
    """Rewrite the piece at ``piece_offset`` of a unit in place, cycle by cycle (see
    ``kvhost.transform.ChunkCycles``): a cycle's first chunk is kept at ``spare`` while
    each of its chunks takes the next one's bytes, the last taking the first's."""
    for cycle in range(starts.shape[0] - 1):
        first, end = starts[cycle], starts[cycle + 1]
        head = _chunk_at(origin, regions, piece_offset + order[first] * chunk, region_bytes, block_stride)
        _memcpy(spare, head, chunk)
        to = head
        for at in range(first + 1, end):
            source = _chunk_at(origin, regions, piece_offset + order[at] * chunk, region_bytes, block_stride)
            _memcpy(to, source, chunk)
            to = source
        _memcpy(to, spare, chunk)


@njit(nogil=True, cache=True)
def _rearrange_span(bases, outer, unit_ids, params, cycle_order, cycle_starts, scratch, first, last):
    """Rewrite in place work items ``first .. last - 1``: one unit of one tensor's outer index.

    Each piece (see ``kvhost.transform.WriteBack``) goes to ``scratch`` (this span's own
    row of the caller's scratch, ``scratch_bytes`` long) and back through the loops; or,
    where ``params`` names a chunk size, it is rewritten in place by its cycles
    (``cycle_order``, ``cycle_starts``), one chunk at a time through the scratch. A
    function of its own, not inlined into the parallel kernels: their array analysis
    would otherwise have to look through it.
    """
    block_stride, region_bytes, pieces, piece_bytes, part_stride, run = (
        params[0],
        params[1],
        params[2],
        params[3],
        params[4],
        params[5],
    )
    shape, src_strides, dst_strides = _loops(params, 6)
    chunk = params[24]
    units, parts = unit_ids.shape
    per_tensor = outer.shape[0] * units
    span = parts if pieces == 1 else 1  # regions one piece covers
    # The scratch is an argument, owned by the Python caller for the whole call. An array
    # made here would be released after its last use as an array, which is the address
    # taken just below: every copy through that address would then write freed memory.
    start = _address_of(scratch)
    for item in range(first, last):
        unit = item % units
        origin = bases[item // per_tensor] + outer[(item // units) % outer.shape[0]]
        if chunk:
            for piece in range(pieces):
                _rotate_cycles(
                    origin,
                    unit_ids[unit],
                    piece * piece_bytes,
                    region_bytes,
                    block_stride,
                    chunk,
                    cycle_order,
                    cycle_starts,
                    start,
                )
        elif span == 1:
            for piece in range(pieces):
                address = _chunk_at(origin, unit_ids[unit], piece * piece_bytes, region_bytes, block_stride)
                base = _skewed(start, address)
                _memcpy(base, address, piece_bytes)
                _strided_copy(address, base, shape, dst_strides, src_strides, run, False)
        else:
            base = _skewed(start, origin + unit_ids[unit, 0] * block_stride)
            for k in range(parts):
                _memcpy(base + k * region_bytes, origin + unit_ids[unit, k] * block_stride, region_bytes)
            for k in range(parts):
                address = origin + unit_ids[unit, k] * block_stride
                _strided_copy(address, base + k * part_stride, shape, dst_strides, src_strides, run, False)


@njit(parallel=True, nogil=True, cache=True)
def rearrange_units(bases, outer, unit_ids, params, cycle_order, cycle_starts, scratch, threads):
    """Rewrite, in place, every unit of ``unit_ids`` at every outer offset of every tensor.

    ``bases``: tensor addresses; ``outer``: byte offsets of the outer indices; ``unit_ids``:
    ``[units, parts]`` block ids; ``params``: ``receive_params``; ``cycle_order`` and
    ``cycle_starts``: a piece's ``ChunkCycles`` where ``params`` names a chunk size
    (otherwise unread); ``scratch``: ``[threads, scratch_bytes(params)]`` bytes, one row
    per thread, allocated and kept by the caller. ``threads`` comes from the caller
    (numba's own query would defeat caching).
    """
    items = bases.shape[0] * outer.shape[0] * unit_ids.shape[0]
    threads = min(_workers(items, threads), scratch.shape[0])
    for thread in prange(threads):
        first, last = _share(items, threads, thread)
        _rearrange_span(bases, outer, unit_ids, params, cycle_order, cycle_starts, scratch[thread], first, last)


@njit(nogil=True, cache=True)
def rearrange_units_serial(bases, outer, unit_ids, params, cycle_order, cycle_starts, scratch, threads):
    """``rearrange_units`` on the calling thread alone, with ``scratch[0]`` (``threads`` is ignored)."""
    items = bases.shape[0] * outer.shape[0] * unit_ids.shape[0]
    _rearrange_span(bases, outer, unit_ids, params, cycle_order, cycle_starts, scratch[0], 0, items)


@njit(nogil=True, cache=True)
def _split_into_runs(src_ids, dst_ids, most):
    """Positions and lengths of the runs of ids consecutive on both sides, at most ``most`` long.

    The slices returned share their arrays' reference count, so the arrays live as long as
    a slice does; callers use them as arrays (no address of them is taken).
    """
    count = src_ids.shape[0]
    starts = np.empty(count, dtype=np.int64)
    lengths = np.empty(count, dtype=np.int64)
    runs = 0
    i = 0
    while i < count:
        j = i + 1
        while j < count and j - i < most and src_ids[j] == src_ids[j - 1] + 1 and dst_ids[j] == dst_ids[j - 1] + 1:
            j += 1
        starts[runs] = i
        lengths[runs] = j - i
        runs += 1
        i = j
    return starts[:runs], lengths[:runs]


@njit(nogil=True, cache=True)
def _copy_span(src_bases, dst_bases, src_ids, dst_ids, starts, lengths, params, first, last):
    """Copy work items ``first .. last - 1``: one run of blocks of one tensor pair."""
    src_block, dst_block, merge, run, stream = params[0], params[1], params[2], params[3], params[5] != 0
    shape, src_strides, dst_strides = _loops(params, 6)
    runs = starts.shape[0]
    for item in range(first, last):
        pair, at = item // runs, starts[item % runs]
        count = lengths[item % runs]
        src = src_bases[pair] + src_ids[at] * src_block
        dst = dst_bases[pair] + dst_ids[at] * dst_block
        if merge:
            _strided_copy(dst, src, shape, dst_strides, src_strides, count * run, stream)
        else:
            for b in range(count):
                _strided_copy(dst + b * dst_block, src + b * src_block, shape, dst_strides, src_strides, run, stream)
    if stream:
        _store_fence()


@njit(parallel=True, nogil=True, cache=True)
def copy_runs(src_bases, dst_bases, src_ids, dst_ids, params, threads):
    """Block ``dst_ids[i]`` of every destination tensor receives ``src_ids[i]`` of its source.

    Runs of ids consecutive on both sides are found here, cut to ``params[4]`` blocks so
    the cores share the work; with ``merge`` (``params[2]``) each loop index of a run is a
    single copy of ``count * run`` bytes; with ``stream`` (``params[5]``) runs of
    ``STREAM_RUN`` bytes or more are written around the caches, fenced before a thread ends.
    """
    starts, lengths = _split_into_runs(src_ids, dst_ids, params[4])
    items = src_bases.shape[0] * starts.shape[0]
    threads = _workers(items, threads)
    for thread in prange(threads):
        first, last = _share(items, threads, thread)
        _copy_span(src_bases, dst_bases, src_ids, dst_ids, starts, lengths, params, first, last)


@njit(nogil=True, cache=True)
def copy_runs_serial(src_bases, dst_bases, src_ids, dst_ids, params, threads):
    """``copy_runs`` on the calling thread alone (``threads`` is ignored)."""
    starts, lengths = _split_into_runs(src_ids, dst_ids, src_ids.shape[0])
    items = src_bases.shape[0] * starts.shape[0]
    _copy_span(src_bases, dst_bases, src_ids, dst_ids, starts, lengths, params, 0, items)


def unusable() -> str | None:
    """Why these kernels cannot run in this process, or None: under ``NUMBA_DISABLE_JIT``
    numba compiles nothing, and the intrinsics the kernels stand on have no Python form."""
    if getattr(numba.config, "DISABLE_JIT", False):  # set from NUMBA_DISABLE_JIT when numba loads
        return "NUMBA_DISABLE_JIT is set: numba compiles nothing"
    return None


@cache
def threads() -> int:
    """numba's thread count, read once (the query costs microseconds on every call); 1
    where numba's threading layer cannot load (``threading_problem`` says why)."""
    return 1 if threading_problem() else int(numba.get_num_threads())


@cache
def threading_problem() -> str | None:
    """Why numba cannot run kernels on several threads here (a ``NUMBA_THREADING_LAYER``
    whose library is absent, or unknown), or None. Asking starts numba's threads."""
    try:
        numba.get_num_threads()
    except ValueError as err:  # numba's words for a layer it cannot load
        return " ".join(str(err).split())
    return None


def _forked() -> None:
    """In a child forked after the kernels ran GNU OpenMP threads (numba's ``omp`` layer on
    Linux), whose runtime cannot start threads again there (numba ends such a child at its
    first parallel launch): every kernel runs on the calling thread. ``workqueue`` and
    ``tbb`` start their threads again in a child."""
    global _serial_only
    try:
        layer = numba_parallel.threading_layer()
    except ValueError:  # no parallel launch yet: the child starts the runtime afresh
        return
    if layer == "omp" and sys.platform.startswith("linux"):
        _serial_only = True


_serial_only = False
os.register_at_fork(after_in_child=_forked)


# Each kernel a backend launches by name: its parallel form and its form for the calling thread.
KERNELS = {
    "rearrange_units": (rearrange_units, rearrange_units_serial),
    "copy_runs": (copy_runs, copy_runs_serial),
}


def launcher(kernel_name: str, nbytes: int) -> tuple[object, int]:
    """The kernel for a job of ``nbytes`` and its thread count.

    Small jobs run on the calling thread: a parallel launch costs microseconds on an idle
    machine and up to a scheduler time slice (milliseconds) on a busy one, more than the
    copy itself. So does every job of a child forked after GNU OpenMP ran (``_forked``).
    """
    parallel, serial = KERNELS[kernel_name]
    if nbytes < SERIAL_BYTES or threads() == 1 or _serial_only:
        return serial, 1
    return parallel, threads()


def receive_params(
    block_stride: int,
    region_bytes: int,
    pieces: int,
    piece_bytes: int,
    part_stride: int,
    loops: Loops,
    cycle_chunk: int = 0,
) -> np.ndarray:
    """The int64 parameters of ``rearrange_units``; ``cycle_chunk``: the chunk size of the
    pieces' cycles, to rewrite them in place by their cycles (0: through a scratch)."""
    return np.array(
        [block_stride, region_bytes, pieces, piece_bytes, part_stride, loops.run_bytes, *_padded(loops), cycle_chunk]
    )


def scratch_bytes(params: np.ndarray) -> int:
    """Bytes of one thread's scratch row for ``rearrange_units``: a piece (at most one unit),
    or one chunk of its cycles, plus room to place a piece at a skew against the region it
    mirrors (a cycle's chunk is set aside at the row's start: one copy a cycle)."""
    return int(params[24] or params[3]) + 4096


def copy_params(
    src_block: int, dst_block: int, merge: bool, most_blocks: int, loops: Loops, stream: bool
) -> np.ndarray:
    """The int64 parameters of ``copy_runs``: ``most_blocks`` caps one work item; ``stream``
    writes long runs with stores that bypass the caches (on x86 only)."""
    streamed = int(stream and X86)
    return np.array([src_block, dst_block, int(merge), loops.run_bytes, most_blocks, streamed, *_padded(loops)])


def _padded(loops: Loops) -> list[int]:
    """Shape and both strides padded in front to MAX_LOOP_DIMS dims (size 1, stride 0), flat."""
    pad = MAX_LOOP_DIMS - len(loops.shape)
    return [1] * pad + list(loops.shape) + [0] * pad + list(loops.src_strides) + [0] * pad + list(loops.dst_strides)
