"""Triton kernels: receive in place, and block copies (gather/scatter for staging).

Imported only when a backend first needs them (importing ``kvhost_cuda`` does not import
triton). With ``TRITON_INTERPRET=1`` set before this import, Triton's interpreter runs
them on CPU tensors: that is how the conformance suite tests them without a GPU.

Kernels take int64 byte addresses from small tables, one entry per tensor, so a single
launch serves every layer of a job whatever its dtype: data moves as raw words (see
``launch.py``). Programs are persistent: program ``p`` takes items ``p, p + programs, ...``.
Addresses come from ids the front end validated, and the caller keeps the tensors alive.

Compile-time constants are what the transform and the device decide (dims, tile, word,
alignment), never what the batch decides: counts of items, units and blocks, strides of
staging buffers sized by the batch, and split rounds are run-time arguments that Triton
does not specialize (``do_not_specialize``: no variant for a count equal to 1 or
divisible by 16), so a new batch size never compiles a new kernel. Id tables start at
16-byte boundaries (the backend pads them) for the same reason.
"""

from __future__ import annotations

from dataclasses import astuple, dataclass, field
from typing import Any

import torch
import triton
import triton.language as tl

from kvhost_accelerator.launch import WORD_TYPES, CopyLaunch, ReceiveLaunch

OLDEST_TRITON = (3, 2)  # compiled and checked with 3.2.0, 3.3.1 and 3.9.0
TRITON_WORDS = {size: getattr(tl, name) for size, name in WORD_TYPES.items()}
TORCH_WORDS = {size: getattr(torch, name) for size, name in WORD_TYPES.items()}


@triton.jit
def _placed(
    rows, D0: tl.constexpr, D1: tl.constexpr, D2: tl.constexpr, D3: tl.constexpr, D4: tl.constexpr, D5: tl.constexpr,
    S0, S1, S2, S3, S4, S5,
):  # fmt: skip
    """Word offset of each row on a side: its row-major index over D0..D5 dotted with S0..S5.

    One scalar per dim (not a tuple) so that older Triton (3.3, as torch 2.7 ships) compiles it.
    Strides are compile-time constants for a receive (the transform's) and run-time values
    for a copy (a staging buffer's outer strides grow with the batch).
    """
    offset = (rows % D5) * S5
    rest = rows // D5
    if D4 > 1:
        offset += (rest % D4) * S4
        rest = rest // D4
    if D3 > 1:
        offset += (rest % D3) * S3
        rest = rest // D3
    if D2 > 1:
        offset += (rest % D2) * S2
        rest = rest // D2
    if D1 > 1:
        offset += (rest % D1) * S1
        rest = rest // D1
    if D0 > 1:
        offset += (rest % D0) * S0
    return offset


@triton.jit
def _rows_at(addresses, ALIGN: tl.constexpr, WORD: tl.constexpr):
    """Row start byte addresses as word pointers, saying how they are aligned (so loads widen)."""
    # The hint goes on the pointers: through the int-to-pointer cast it would be lost.
    return tl.multiple_of(addresses.to(tl.pointer_type(WORD)), ALIGN)


@triton.jit
def _unit_rows(
    bases, outer_offsets, ids, member, outer, unit, offsets, ok, block_stride,
    PARTS: tl.constexpr, REGION_WORDS: tl.constexpr, ALIGN: tl.constexpr, WORD: tl.constexpr, WORD_BYTES: tl.constexpr,
):  # fmt: skip
    """Pointers to the rows starting at words ``offsets`` of a unit (its ``PARTS`` regions back to back)."""
    base = tl.load(bases + member) + tl.load(outer_offsets + outer)
    if PARTS == 1:
        addresses = base + tl.load(ids + unit) * block_stride + offsets.to(tl.int64) * WORD_BYTES
    else:
        blocks = tl.load(ids + unit * PARTS + offsets // REGION_WORDS, mask=ok, other=0)
        addresses = base + blocks * block_stride + (offsets % REGION_WORDS).to(tl.int64) * WORD_BYTES
    return _rows_at(addresses, ALIGN, WORD)


@triton.jit(do_not_specialize=["items", "units"])
def receive_kernel(
    bases, outer_offsets, ids, scratch, items, units, outer_count, block_stride,
    PARTS: tl.constexpr, PIECES: tl.constexpr, REGION_WORDS: tl.constexpr, ROWS: tl.constexpr, RUN: tl.constexpr,
    D0: tl.constexpr, D1: tl.constexpr, D2: tl.constexpr, D3: tl.constexpr, D4: tl.constexpr, D5: tl.constexpr,
    S0: tl.constexpr, S1: tl.constexpr, S2: tl.constexpr, S3: tl.constexpr, S4: tl.constexpr, S5: tl.constexpr,
    TILE_ROWS: tl.constexpr, TILE_RUN: tl.constexpr, IN_REGISTERS: tl.constexpr,
    ALIGN: tl.constexpr, WORD: tl.constexpr, WORD_BYTES: tl.constexpr,
):  # fmt: skip
    """Rewrite every piece of every unit in place, from the wire order to the local order.

    Item = (member, outer index, unit, piece). Row ``r`` of a piece lands at ``r * RUN``
    and comes from ``_placed(r, D.., S..)``. A piece in registers is read whole,
    then (after a barrier, so no thread overwrites words another has yet to read) written
    back. A larger piece is copied to this program's scratch slot, then written back from
    it; the second barrier keeps the next item from refilling the slot too early.
    """
    program = tl.program_id(0)
    tile_rows = tl.arange(0, TILE_ROWS)
    tile_cols = tl.arange(0, TILE_RUN)
    for item in range(program, items, tl.num_programs(0)):
        piece = item % PIECES
        rest = item // PIECES
        unit = rest % units
        rest = rest // units
        outer = rest % outer_count
        member = rest // outer_count
        start = piece * (ROWS * RUN)
        if IN_REGISTERS:
            ok = tile_rows < ROWS
            mask = ok[:, None] & (tile_cols < RUN)[None, :]
            wire = start + _placed(tile_rows, D0, D1, D2, D3, D4, D5, S0, S1, S2, S3, S4, S5)
            source = _unit_rows(
                bases, outer_offsets, ids, member, outer, unit, wire, ok, block_stride,
                PARTS, REGION_WORDS, ALIGN, WORD, WORD_BYTES,
            )  # fmt: skip
            words = tl.load(source[:, None] + tile_cols[None, :], mask=mask)
            tl.debug_barrier()
            local = start + tile_rows * RUN
            target = _unit_rows(
                bases, outer_offsets, ids, member, outer, unit, local, ok, block_stride,
                PARTS, REGION_WORDS, ALIGN, WORD, WORD_BYTES,
            )  # fmt: skip
            tl.store(target[:, None] + tile_cols[None, :], words, mask=mask)
        else:
            slot = scratch + program.to(tl.int64) * (ROWS * RUN)
            for first in range(0, ROWS, TILE_ROWS):
                rows = first + tile_rows
                ok = rows < ROWS
                source = _unit_rows(
                    bases, outer_offsets, ids, member, outer, unit, start + rows * RUN, ok, block_stride,
                    PARTS, REGION_WORDS, ALIGN, WORD, WORD_BYTES,
                )  # fmt: skip
                for column in range(0, RUN, TILE_RUN):
                    cols = column + tile_cols
                    mask = ok[:, None] & (cols < RUN)[None, :]
                    words = tl.load(source[:, None] + cols[None, :], mask=mask)
                    tl.store(slot + (rows * RUN)[:, None] + cols[None, :], words, mask=mask)
            tl.debug_barrier()
            for first in range(0, ROWS, TILE_ROWS):
                rows = first + tile_rows
                ok = rows < ROWS
                wire = _placed(rows, D0, D1, D2, D3, D4, D5, S0, S1, S2, S3, S4, S5)
                target = _unit_rows(
                    bases, outer_offsets, ids, member, outer, unit, start + rows * RUN, ok, block_stride,
                    PARTS, REGION_WORDS, ALIGN, WORD, WORD_BYTES,
                )  # fmt: skip
                for column in range(0, RUN, TILE_RUN):
                    cols = column + tile_cols
                    mask = ok[:, None] & (cols < RUN)[None, :]
                    words = tl.load(slot + wire[:, None] + cols[None, :], mask=mask)
                    tl.store(target[:, None] + cols[None, :], words, mask=mask)
            tl.debug_barrier()


@triton.jit(do_not_specialize=["units", "out_first", "out_count", "out_slot", "in_first", "in_count", "in_slot"])
def receive_split_kernel(
    bases, outer_offsets, ids, scratch, units, outer_count, block_stride,
    out_first, out_count, out_slot, in_first, in_count, in_slot,
    PARTS: tl.constexpr, PIECES: tl.constexpr, REGION_WORDS: tl.constexpr, ROWS: tl.constexpr, RUN: tl.constexpr,
    D0: tl.constexpr, D1: tl.constexpr, D2: tl.constexpr, D3: tl.constexpr, D4: tl.constexpr, D5: tl.constexpr,
    S0: tl.constexpr, S1: tl.constexpr, S2: tl.constexpr, S3: tl.constexpr, S4: tl.constexpr, S5: tl.constexpr,
    TILE_ROWS: tl.constexpr, TILE_RUN: tl.constexpr, CHUNKS: tl.constexpr,
    ALIGN: tl.constexpr, WORD: tl.constexpr, WORD_BYTES: tl.constexpr,
):  # fmt: skip
    """One launch of a split receive (``launch.Round``): no barrier inside, every program shares every piece.

    Item = (piece of the round, chunk of ``TILE_ROWS`` rows). The first ``out_count x
    CHUNKS`` items write pieces ``out_first ..`` back into place from scratch slots
    ``out_slot ..`` (local row ``r`` from slot word ``_placed(r)``); the rest copy pieces
    ``in_first ..`` as they are into slots ``in_slot ..``. A piece's two halves are in
    different launches, so the kernel boundary orders them on every device; the two
    sets of one launch touch different pieces and different slots.
    """
    program = tl.program_id(0)
    tile_rows = tl.arange(0, TILE_ROWS)
    tile_cols = tl.arange(0, TILE_RUN)
    out_items = out_count * CHUNKS
    for item in range(program, out_items + in_count * CHUNKS, tl.num_programs(0)):
        writing = item < out_items
        step = tl.where(writing, item, item - out_items)
        k = step // CHUNKS
        job = tl.where(writing, out_first, in_first) + k
        slot = scratch + (tl.where(writing, out_slot, in_slot) + k).to(tl.int64) * (ROWS * RUN)
        piece = job % PIECES
        rest = job // PIECES
        unit = rest % units
        rest = rest // units
        outer = rest % outer_count
        member = rest // outer_count
        rows = (step % CHUNKS) * TILE_ROWS + tile_rows
        ok = rows < ROWS
        place = _unit_rows(
            bases, outer_offsets, ids, member, outer, unit, piece * (ROWS * RUN) + rows * RUN, ok, block_stride,
            PARTS, REGION_WORDS, ALIGN, WORD, WORD_BYTES,
        )  # fmt: skip
        if writing:
            wire = _placed(rows, D0, D1, D2, D3, D4, D5, S0, S1, S2, S3, S4, S5)
            for column in range(0, RUN, TILE_RUN):
                cols = column + tile_cols
                mask = ok[:, None] & (cols < RUN)[None, :]
                words = tl.load(slot + wire[:, None] + cols[None, :], mask=mask)
                tl.store(place[:, None] + cols[None, :], words, mask=mask)
        else:
            for column in range(0, RUN, TILE_RUN):
                cols = column + tile_cols
                mask = ok[:, None] & (cols < RUN)[None, :]
                words = tl.load(place[:, None] + cols[None, :], mask=mask)
                tl.store(slot + (rows * RUN)[:, None] + cols[None, :], words, mask=mask)


COPY_STRIDES = [f"{side}{i}" for side in "ST" for i in range(6)]


@triton.jit(do_not_specialize=["items", "blocks", *COPY_STRIDES])
def copy_kernel(
    src_bases, dst_bases, src_ids, dst_ids, items, blocks, src_block_stride, dst_block_stride,
    S0, S1, S2, S3, S4, S5, T0, T1, T2, T3, T4, T5,
    SRC_INDEXED: tl.constexpr, DST_INDEXED: tl.constexpr, ROWS: tl.constexpr, RUN: tl.constexpr,
    D0: tl.constexpr, D1: tl.constexpr, D2: tl.constexpr, D3: tl.constexpr, D4: tl.constexpr, D5: tl.constexpr,
    TILE_ROWS: tl.constexpr, TILE_RUN: tl.constexpr, ALIGN: tl.constexpr, WORD: tl.constexpr, WORD_BYTES: tl.constexpr,
):  # fmt: skip
    """Block ``dst_ids[i]`` of pair ``p`` receives block ``src_ids[i]`` of pair ``p``.

    Item = (pair, i). A side that is not indexed (a staging buffer) uses block ``i``.
    Row offsets are int64: outer strides of a large cache pass 2**31 words. Row strides
    (S on the source side, T on the destination) are run-time values.
    """
    program = tl.program_id(0)
    tile_rows = tl.arange(0, TILE_ROWS).to(tl.int64)
    tile_cols = tl.arange(0, TILE_RUN)
    for item in range(program, items, tl.num_programs(0)):
        i = item % blocks
        pair = item // blocks
        src_block = tl.load(src_ids + i) if SRC_INDEXED else i.to(tl.int64)
        dst_block = tl.load(dst_ids + i) if DST_INDEXED else i.to(tl.int64)
        source = tl.load(src_bases + pair) + src_block * src_block_stride
        target = tl.load(dst_bases + pair) + dst_block * dst_block_stride
        for first in range(0, ROWS, TILE_ROWS):
            rows = first + tile_rows
            ok = rows < ROWS
            src_words = _placed(rows, D0, D1, D2, D3, D4, D5, S0, S1, S2, S3, S4, S5)
            dst_words = _placed(rows, D0, D1, D2, D3, D4, D5, T0, T1, T2, T3, T4, T5)
            src_rows = _rows_at(source + src_words * WORD_BYTES, ALIGN, WORD)
            dst_rows = _rows_at(target + dst_words * WORD_BYTES, ALIGN, WORD)
            for column in range(0, RUN, TILE_RUN):
                cols = column + tile_cols
                mask = ok[:, None] & (cols < RUN)[None, :]
                words = tl.load(src_rows[:, None] + cols[None, :], mask=mask)
                tl.store(dst_rows[:, None] + cols[None, :], words, mask=mask)


@dataclass
class KernelCall:
    """One launch, fully decided: the kernel, its grid, arguments and compile-time constants."""

    kernel: Any
    grid: tuple[int]
    args: tuple[Any, ...]
    constants: dict[str, Any] = field(default_factory=dict)

    def launch(self) -> None:
        self.kernel[self.grid](*self.args, **self.constants)

    def compile(self) -> None:
        """Compile the kernel for this call and load it onto the current device, launching
        nothing (Triton's ``warmup``; a no-op in the interpreter): a kernel that does not
        compile, or needs more than the device has, fails here, before any byte moves."""
        compiled = self.kernel.warmup(*self.args, grid=self.grid, **self.constants)
        load = getattr(compiled, "_init_handles", None)  # where Triton checks shared memory and threads
        if load is not None:
            load()

    def compile_key(self) -> tuple[Any, ...]:
        """What this call's compiled kernel depends on, at least as finely as Triton's own
        key: the constants, each tensor's dtype and 16-byte alignment, each run-time count's
        width (``do_not_specialize``) and every other argument's value. Calls with equal keys
        launch the same compiled kernel."""
        unspecialized = set(getattr(self.kernel, "do_not_specialize", ()) or ())
        names = getattr(self.kernel, "arg_names", None) or [None] * len(self.args)
        arguments: list[Any] = []
        for name, arg in zip(names, self.args):  # the constants' names follow the arguments
            if isinstance(arg, torch.Tensor):
                arguments.append((arg.dtype, arg.data_ptr() % 16 == 0))
            elif name in unspecialized and type(arg) is int:
                arguments.append("i32" if -(1 << 31) <= arg < 1 << 31 else "u64" if arg >= 1 << 63 else "i64")
            else:
                arguments.append(arg)
        return (self.kernel, tuple(arguments), *self.constants.items())  # in the order made: one per call site


def receive_calls(
    launch: ReceiveLaunch,
    *,
    bases: torch.Tensor,
    outer_offsets: torch.Tensor,
    ids: torch.Tensor,
    scratch: torch.Tensor,
    units: int,
    block_stride: int,
) -> list[KernelCall]:
    """The receive's launches, in order, for tables already on the device (int64 addresses and block ids).

    One launch in registers or slots mode; split, one per round of ``launch.schedule``.
    """
    constants = dict(
        PARTS=launch.parts,
        PIECES=launch.pieces,
        REGION_WORDS=launch.region_words,
        **_each("S", launch.rows.src_strides),
        **_tiling(launch),
        # One stage: no load of a later step is hoisted above a barrier.
        num_stages=1,
    )
    tables = (bases, outer_offsets, ids, scratch)
    if launch.mode != "split":
        return [
            KernelCall(
                receive_kernel,
                (launch.programs,),
                (*tables, launch.items, units, outer_offsets.numel(), block_stride),
                dict(constants, IN_REGISTERS=launch.in_registers),
            )
        ]
    return [
        KernelCall(
            receive_split_kernel,
            (max(1, min(r.items(launch.chunks), launch.programs)),),
            (*tables, units, outer_offsets.numel(), block_stride, *astuple(r)),
            dict(constants, CHUNKS=launch.chunks),
        )
        for r in launch.schedule
    ]


def copy_call(
    launch: CopyLaunch,
    *,
    src_bases: torch.Tensor,
    dst_bases: torch.Tensor,
    src_ids: torch.Tensor | None,
    dst_ids: torch.Tensor | None,
    blocks: int,
    src_block_stride: int,
    dst_block_stride: int,
) -> KernelCall:
    """The copy launch; an id table that is None means block ``i`` on that side (a staging buffer)."""
    rows = launch.rows
    any_ids = src_ids if src_ids is not None else dst_ids if dst_ids is not None else src_bases
    return KernelCall(
        copy_kernel,
        (launch.programs,),
        (
            src_bases,
            dst_bases,
            src_ids if src_ids is not None else any_ids,
            dst_ids if dst_ids is not None else any_ids,
            launch.items,
            blocks,
            src_block_stride,
            dst_block_stride,
            *rows.src_strides,
            *rows.dst_strides,
        ),
        dict(SRC_INDEXED=src_ids is not None, DST_INDEXED=dst_ids is not None, **_tiling(launch)),
    )


def _tiling(launch: ReceiveLaunch | CopyLaunch) -> dict[str, Any]:
    """The constants both kernels take alike: the rows they move, their tile, word and warps."""
    return dict(
        ROWS=launch.rows.rows,
        RUN=launch.rows.run,
        **_each("D", launch.rows.dims),
        TILE_ROWS=launch.tile.rows,
        TILE_RUN=launch.tile.run,
        ALIGN=launch.align_bytes,
        WORD=TRITON_WORDS[launch.word_bytes],
        WORD_BYTES=launch.word_bytes,
        num_warps=launch.num_warps,
    )


@triton.jit
def _probe_kernel(out):
    tl.store(out, tl.load(out) + 1)


def probe(device: torch.device) -> None:
    """Compile a kernel of one load and store, build Triton's launcher for it and load it onto
    ``device`` (the current one), launching nothing: what every kernel here needs of the
    machine (a C compiler and Python's headers for the launcher, the driver's library, the
    device's compiler), tried by doing it before any real kernel is."""
    KernelCall(_probe_kernel, (1,), (torch.zeros(1, dtype=torch.int32, device=device),)).compile()


def _each(prefix: str, values: tuple[int, ...]) -> dict[str, int]:
    """A per-dim tuple as the kernels' scalar constants: D0..D5 and so on."""
    return {f"{prefix}{i}": value for i, value in enumerate(values)}


def too_old() -> str | None:
    """Why this Triton cannot compile the kernels, or None."""
    version = tuple(int(part) for part in triton.__version__.split(".")[:2])
    if version < OLDEST_TRITON:
        return f"triton {triton.__version__} is older than {'.'.join(map(str, OLDEST_TRITON))}"
    return None


def interpreted() -> bool:
    """True when these kernels run in Triton's interpreter (TRITON_INTERPRET=1 at import)."""
    return not isinstance(receive_kernel, triton.runtime.JITFunction)


def compiler_targets() -> list[str]:
    """The Triton compiler backends installed here (``nvidia``, ``amd``, ``intel``...)."""
    from triton.backends import backends

    return sorted(backends)
