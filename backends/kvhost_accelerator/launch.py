"""Launch plans for the Triton kernels, worked out on the host from a transform or a copy plan.

Pure arithmetic on shapes and strides (no device, no triton), so it is tested anywhere.
The kernels move *words*: the widest of 1, 2, 4 or 8 bytes that divides every address,
stride and run they touch, so one load moves as much as the layout allows whatever the
dtype. Work is cut into *rows*: a row is ``run`` words that are consecutive on both
sides; row ``r``'s place on the gathered side is its row-major index over ``dims``
dotted with per-dim strides (in words). A program moves a tile of ``tile.rows x
tile.run`` words per step, and loops over work *items* (persistent programs), so a
launch needs only as many programs as the device runs at once.

Receive, per item (one piece of one unit of one outer index of one member tensor), one
of three modes, chosen from the transform and the device alone (never from the batch, so
a batch size never compiles a new kernel):

- *registers*: the whole piece fits in one tile that a thread's registers can hold (read
  it all, barrier, write it back rearranged: one read and one write of every byte);
- *slots*: the piece goes through a per-program scratch slot in device memory (copy in,
  barrier, copy out rearranged): one scratch pass that stays in the device's cache, since
  only ``programs`` slots exist. Used when the scratch budget holds a slot for each of the
  device's multiprocessors; the launch then has as many programs as slots, up to
  ``programs`` (on an H200, 128 KiB pieces ran at 0.52 of memcpy in one launch of 264
  programs, against 0.33 split into 129 launches, each one's host-side launch cost
  longer than its work). Where the budget is too small for that, the scratch may grow
  to ``Limits.scratch_most_bytes``, beyond the cache: on the H200, 512 KiB pieces ran at
  0.41 of memcpy with 256 MiB of slots in one launch, against 0.16 split into 513;
- *split*: pieces too large even for that are cut into chunks of rows that every program
  shares, and the barrier between copying a piece in and writing it back is a kernel
  boundary: launch ``k`` writes back round ``k - 1`` from its half of the scratch and
  copies round ``k`` into the other half. A launch has a program for every chunk of its
  round, up to the device's programs, whatever the piece size: a round is up to half the
  scratch budget, so a batch of a few pieces fills the device too. Also the mode of every
  piece where the in-kernel barrier does not order global memory between a program's
  threads (``Limits.barrier``).

Registers are counted, not bytes: a thread holds its share of a tile's words plus one
64-bit address per access, and with narrow words (a misaligned cache, a last axis that
is not the channels) every word is an access of its own. Tiles are sized so that this
estimate stays within ``Limits.thread_registers``; the compiled code's register count and
spills are pinned by ``tests/test_triton_compile.py``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import lru_cache
from math import ceil, prod

from kvhost.backend import next_power_of_two
from kvhost.errors import BackendError
from kvhost.layout import contiguous_strides
from kvhost.transform import MAX_LOOP_DIMS, CopyPlan, Rearrangement

WORD_TYPES = {1: "int8", 2: "int16", 4: "int32", 8: "int64"}
MAX_UNIT_WORDS = (1 << 31) - 1  # a word's place in its unit is an int32 in the kernels


def widest_word(*quantities: int, most: int = 8) -> int:
    """The widest power of two, at most ``most``, dividing every quantity (bytes)."""
    bits = 0
    for quantity in quantities:
        bits |= quantity
    return min(most, bits & -bits) if bits else most


@dataclass(frozen=True)
class Limits:
    """What one program may hold, in bytes, and how many programs a launch may have.

    ``register_bytes``: the largest receive piece kept in registers; ``tile_bytes``: a
    step of the tiled loops (a power of two); ``programs``: the persistent grid's cap
    (a few per multiprocessor on a GPU; the interpreter runs programs one by one);
    ``scratch_bytes``: all scratch slots together, so they stay in the device's cache;
    ``thread_registers``: the estimated registers one thread may hold for its share of
    a tile (``register_cost``); ``barrier``: whether the kernels' in-kernel barrier orders
    global memory between a program's threads (when not, every receive is split);
    ``processors``: the device's multiprocessors, the fewest slots a slots-mode launch may
    have (0: a slot for each of ``programs``); ``scratch_most_bytes``: what the slots may
    take, beyond the cache, where ``scratch_bytes`` holds too few (0: never more).
    """

    register_bytes: int = 32 << 10
    tile_bytes: int = 16 << 10
    programs: int = 1024
    scratch_bytes: int = 32 << 20  # within L2 (40 MB on A100, 50-60 MB on H100/H200)
    thread_registers: int = 64
    barrier: bool = True
    processors: int = 0
    scratch_most_bytes: int = 0

    def __post_init__(self) -> None:
        # A tile's sides are powers of two (Triton's aranges); a tile of any other byte
        # count would give a side that is not one, which no kernel compiles.
        if self.tile_bytes < 1 or self.tile_bytes & (self.tile_bytes - 1):
            raise BackendError(f"Limits.tile_bytes {self.tile_bytes} must be a positive power of two")
        if self.programs < 1:
            raise BackendError(f"Limits.programs {self.programs} must be at least 1")
        if self.processors < 0:
            raise BackendError(f"Limits.processors {self.processors} must be at least 0 (0: unknown)")

    @property
    def fewest_slots(self) -> int:
        """Slots a slots-mode launch needs: one per multiprocessor (each runs a program), at most ``programs``."""
        return min(self.processors or self.programs, self.programs)


@dataclass(frozen=True)
class Tile:
    rows: int
    run: int

    @property
    def words(self) -> int:
        return self.rows * self.run


@dataclass(frozen=True)
class Rows:
    """``rows`` rows of ``run`` words; row ``r`` sits at index ``r`` over ``dims``.

    ``src_strides``/``dst_strides`` (words) place a row on each side; a side whose rows
    are consecutive (``r * run``) has strides that say so.
    """

    dims: tuple[int, ...]  # always MAX_LOOP_DIMS long, padded in front with 1
    src_strides: tuple[int, ...]
    dst_strides: tuple[int, ...]
    run: int

    @property
    def rows(self) -> int:
        return prod(self.dims)

    @property
    def words(self) -> int:
        return self.rows * self.run

    def offsets(self, row: int) -> tuple[int, int]:
        """(source, destination) word offset of row ``row`` (the kernels' index arithmetic)."""
        src = dst = 0
        for size, s, d in zip(reversed(self.dims), reversed(self.src_strides), reversed(self.dst_strides)):
            index = row % size
            row //= size
            src += index * s
            dst += index * d
        return src, dst


def _rows(dims: list[int], src: list[int], dst: list[int], run: int) -> Rows:
    if len(dims) > MAX_LOOP_DIMS:
        raise BackendError(f"the Triton kernels take at most {MAX_LOOP_DIMS} row dims, this transform needs {dims}")
    pad = MAX_LOOP_DIMS - len(dims)
    return Rows((1,) * pad + tuple(dims), (0,) * pad + tuple(src), (0,) * pad + tuple(dst), run)


WARP = 32  # threads per warp on NVIDIA; AMD's 64-wide wavefronts halve a thread's share


def _warps(tile: Tile, word: int) -> int:
    return 8 if tile.words * word > (8 << 10) else 4


def register_cost(tile: Tile, word: int, align: int) -> int:
    """Estimated registers a thread holds for its share of ``tile``: words plus addresses.

    Each access moves ``vector`` consecutive words (up to 16 bytes, as far as rows are
    aligned) and needs its own 64-bit address (two registers); words narrower than a
    register take a register each unless they share a vector. With 2-byte words and
    rows of one word, that is three registers per two bytes moved.
    """
    vector = max(1, min(tile.run, align // word))
    threads = _warps(tile, word) * WARP
    accesses = ceil(tile.words / vector / threads)
    return accesses * (max(1, vector * word // 4) + 2)


def _tile(rows: Rows, word: int, align: int, limits: Limits) -> Tile:
    """The largest tile of at most ``tile_bytes`` whose register cost fits ``thread_registers``."""
    words = max(1, limits.tile_bytes // word)
    run = min(next_power_of_two(rows.run), words)
    tile = Tile(min(next_power_of_two(rows.rows), max(1, words // run)), run)
    while tile.words > 1 and register_cost(tile, word, align) > limits.thread_registers:
        tile = Tile(tile.rows // 2, tile.run) if tile.rows > 1 else Tile(1, tile.run // 2)
    return tile


def _items(count: int, limits: Limits) -> int:
    """Work items are counted in int32 by the kernels, each program stepping by the grid's
    size: the last step past the count (up to ``limits.programs`` past it) must not wrap."""
    if count > (1 << 31) - 1 - limits.programs:
        raise BackendError(
            f"{count} work items in one launch; the kernels count items in int32, up to "
            f"{(1 << 31) - 1 - limits.programs} with {limits.programs} programs (split the call)"
        )
    return count


def _piece_rows(shape: list[int], perm: tuple[int, ...], cut: int, keeps_run: bool) -> Rows:
    """Rows of one piece when the unit is cut into pieces along its first ``cut`` (shared) dims."""
    sizes = shape[cut:]
    order = [p - cut for p in perm[cut:]]
    gathered = contiguous_strides(tuple(sizes))
    dims = [sizes[p] for p in order]
    src = [gathered[p] for p in order]
    run = 1
    if keeps_run:
        run = dims.pop()
        src.pop()
    dst = contiguous_strides(tuple(dims))
    return _rows(dims, src, [d * run for d in dst], run)


@dataclass(frozen=True)
class Round:
    """One launch of a split receive: two independent sets of work, no barrier between them.

    Write back pieces ``out_first .. out_first + out_count - 1`` (items in the kernels'
    order) from scratch slots ``out_slot ..``, and copy pieces ``in_first ..`` into slots
    ``in_slot ..``. A slot is one piece of scratch; the kernel boundary before the next
    launch is the barrier between a piece's copy in and its write back.
    """

    out_first: int
    out_count: int
    out_slot: int
    in_first: int
    in_count: int
    in_slot: int

    def items(self, chunks: int) -> int:
        return (self.out_count + self.in_count) * chunks


def _schedule(items: int, round_pieces: int, halves: int) -> tuple[Round, ...]:
    """Launches that copy every piece in and write it back, ``round_pieces`` pieces a round.

    Two halves of scratch: launch ``k`` writes back round ``k - 1`` from one half while it
    copies round ``k`` into the other (rounds + 1 launches). One half (a piece larger than
    half the budget): copy in, then write back, round by round (2 x rounds launches).
    """
    spans = [(first, min(round_pieces, items - first)) for first in range(0, items, round_pieces)]
    if halves == 1:
        out: list[Round] = []
        for first, count in spans:
            out += [Round(0, 0, 0, first, count, 0), Round(first, count, 0, 0, 0, 0)]
        return tuple(out)
    none = (0, 0)
    return tuple(
        Round(
            *(spans[k - 1] if k > 0 else none),
            (k - 1) % 2 * round_pieces,
            *(spans[k] if k < len(spans) else none),
            k % 2 * round_pieces,
        )
        for k in range(len(spans) + 1)
    )


@dataclass(frozen=True)
class ReceiveLaunch:
    """Every piece of every unit, outer index and member tensor of a job: one launch or, split, several.

    Offsets are words into a unit's regions back to back (region ``k`` of a unit is its
    ``k``-th block); a piece is ``rows.words`` consecutive words of it, moved in place
    from the wire order to the local order. Row ``r`` of a piece is written at
    ``r * run`` and read from ``rows.offsets(r)[0]``. ``mode`` is "registers", "slots"
    or "split" (module docstring). Split: a chunk is ``tile.rows`` rows of a piece (``chunks`` per
    piece), a round ``round_pieces`` pieces, ``schedule`` the launches, each of at most
    ``programs`` programs.
    """

    word_bytes: int
    align_bytes: int  # every row starts at a multiple of this (up to 16): lets loads widen
    parts: int
    region_words: int
    pieces: int
    rows: Rows
    tile: Tile
    mode: str
    items: int
    programs: int
    num_warps: int
    chunks: int
    round_pieces: int
    halves: int
    schedule: tuple[Round, ...] = field(repr=False)

    @property
    def in_registers(self) -> bool:
        return self.mode == "registers"

    @property
    def piece_words(self) -> int:
        return self.rows.words

    @property
    def scratch_words(self) -> int:
        if self.mode == "registers":
            return 0
        if self.mode == "slots":
            return self.programs * self.piece_words
        halves = min(self.halves, sum(1 for r in self.schedule if r.in_count))
        return halves * self.round_pieces * self.piece_words

    @property
    def launches(self) -> int:
        return len(self.schedule) if self.mode == "split" else 1


@dataclass(frozen=True)
class _Pieces:
    """What a receive launch takes from the transform and the device alone (``_pieces``)."""

    word: int
    align: int
    count: int  # pieces per unit
    rows: Rows
    tile: Tile
    mode: str
    slots: int = 0  # slots mode: the scratch slots, one program each (the launch's most programs)
    chunks: int = 1
    round_pieces: int = 0
    halves: int = 0


def plan_receive_launch(
    plan: Rearrangement, *, members: int, outer: int, units: int, alignment: int, limits: Limits
) -> ReceiveLaunch:
    """The launches that apply ``plan`` to ``units`` units of ``outer x members`` regions each.

    ``alignment`` is the OR of every base address, outer offset and block stride (bytes):
    the word may not be wider than its lowest set bit.
    """
    pieces = _pieces(plan, alignment, limits)
    items = _items(members * outer * units * pieces.count, limits)
    if pieces.mode == "split":
        schedule = _schedule(items, pieces.round_pieces, pieces.halves)
        programs = limits.programs  # each launch: as many as its round's chunks, up to this
    else:
        schedule = ()
        programs = min(items, limits.programs, pieces.slots if pieces.mode == "slots" else items)
    return ReceiveLaunch(
        word_bytes=pieces.word,
        align_bytes=pieces.align,
        parts=plan.parts,
        region_words=plan.region_bytes // pieces.word,
        pieces=pieces.count,
        rows=pieces.rows,
        tile=pieces.tile,
        mode=pieces.mode,
        items=items,
        programs=max(1, programs),
        num_warps=_warps(pieces.tile, pieces.word),
        chunks=pieces.chunks,
        round_pieces=pieces.round_pieces,
        halves=pieces.halves,
        schedule=schedule,
    )


@lru_cache(maxsize=256)
def _pieces(plan: Rearrangement, alignment: int, limits: Limits) -> _Pieces:
    """Words, pieces, tile and mode: worked out once per transform, alignment and device (tens of us)."""
    shape, perm = list(plan.src_shape), plan.perm
    keeps_run = perm[-1] == len(shape) - 1  # the last dim is contiguous on both sides
    if not keeps_run and widest_word(alignment, plan.itemsize) < plan.itemsize:
        # Items at addresses their size does not divide (imported memory) move as narrower
        # words: each item is then a last dim of its own, kept on both sides.
        shape, perm, keeps_run = [*shape, 1], (*perm, len(perm)), True
    run_bytes = shape[-1] * plan.itemsize if keeps_run else plan.itemsize
    word = widest_word(alignment, run_bytes, plan.region_bytes)
    if plan.unit_bytes // word > MAX_UNIT_WORDS:
        raise BackendError(
            f"a receive unit of {plan.unit_bytes} bytes is {plan.unit_bytes // word} words of {word} bytes: "
            f"the kernels index within a unit in 32 bits (at most {MAX_UNIT_WORDS} words)"
        )
    if keeps_run:
        shape[-1] = run_bytes // word
    common = 0
    while common < len(shape) - 1 and perm[common] == common:  # shared leading dims: independent pieces
        common += 1
    # Fewest pieces whose piece fits in registers; failing that, the smallest pieces (least scratch).
    for cut in range(common + 1):
        rows = _piece_rows(shape, perm, cut, keeps_run)
        # Rows start at multiples of the run (row strides are), so alignment is shared.
        align = widest_word(alignment, rows.run * word, plan.region_bytes, most=16)
        whole = Tile(next_power_of_two(rows.rows), next_power_of_two(rows.run))
        in_registers = whole.words * word <= limits.register_bytes
        in_registers = in_registers and register_cost(whole, word, align) <= limits.thread_registers
        if in_registers:
            break
    count = prod(shape[:cut])
    # The kernel trusts these: a row read past its piece would touch another block.
    reach = sum((d - 1) * s for d, s in zip(rows.dims, rows.src_strides)) + rows.run
    if rows.words * word * count != plan.unit_bytes or reach > rows.words:
        raise BackendError(f"receive launch does not tile its unit: {plan}, {rows}, {count} pieces of {word} B words")
    piece_bytes = rows.words * word
    slots = limits.scratch_bytes // piece_bytes
    if slots < limits.fewest_slots:  # a slot per multiprocessor beats split launches even beyond the cache
        slots = max(slots, limits.scratch_most_bytes // piece_bytes)
    if in_registers and limits.barrier:
        return _Pieces(word, align, count, rows, whole, "registers")
    tile = _tile(rows, word, align, limits)
    if limits.barrier and slots >= limits.fewest_slots:
        return _Pieces(word, align, count, rows, tile, "slots", slots)
    # A piece beyond the budget still needs all of its scratch: one piece a round.
    round_pieces = max(1, limits.scratch_bytes // (2 * piece_bytes))
    halves = 2 if 2 * round_pieces * piece_bytes <= limits.scratch_bytes else 1
    return _Pieces(
        word,
        align,
        count,
        rows,
        tile,
        "split",
        chunks=ceil(rows.rows / tile.rows),
        round_pieces=round_pieces,
        halves=halves,
    )


@dataclass(frozen=True)
class CopyLaunch:
    """One copy launch: block ``dst_ids[i]`` of pair ``p`` gets block ``src_ids[i]`` of pair ``p``.

    A block is ``rows`` rows placed by ``rows.src_strides``/``rows.dst_strides`` from the
    block's address on each side; block addresses are ``base + id * block stride``.
    """

    word_bytes: int
    align_bytes: int
    rows: Rows
    tile: Tile
    items: int
    programs: int
    num_warps: int


def plan_copy_launch(plan: CopyPlan, *, pairs: int, blocks: int, alignment: int, limits: Limits) -> CopyLaunch:
    """The launch that copies ``blocks`` blocks for each of ``pairs`` tensor pairs through ``plan``."""
    loops = plan.loops
    strides = (plan.src_block_stride, plan.dst_block_stride, *loops.src_strides, *loops.dst_strides)
    word = widest_word(alignment, loops.run_bytes, *strides)
    rows = _rows(
        list(loops.shape),
        [s // word for s in loops.src_strides],
        [d // word for d in loops.dst_strides],
        loops.run_bytes // word,
    )
    align = widest_word(alignment, *strides, most=16)
    tile = _tile(rows, word, align, limits)
    items = _items(pairs * blocks, limits)
    return CopyLaunch(
        word_bytes=word,
        align_bytes=align,
        rows=rows,
        tile=tile,
        items=items,
        programs=max(1, min(items, limits.programs)),
        num_warps=_warps(tile, word),
    )
