"""Layouts: a KV tensor's dims named by axis letters, with the physical order read from strides.

Letters (docs/design.md, "Words"): ``L`` layers, ``K`` the key/value pair, ``B`` blocks, ``N``
tokens in a block, ``H`` KV heads, ``C`` channels. ``axes`` names a tensor's dims in shape
order; the physical order is the order of decreasing stride. The axes physically after
``B`` form a block's *region*, which must be one contiguous run of bytes; the axes
physically before ``B`` are *outer*: every outer index has its own region per block.

A Layout holds only shape, strides and item size, never data, so it can key plan caches.
"""

from __future__ import annotations

import itertools
from dataclasses import InitVar, dataclass
from functools import cached_property

import numpy as np
import torch

from kvhost.errors import LayoutError, shown
from kvhost.lru import LRU
from kvhost.memory import Lane, find_overlap, strided_extent

AXIS_LETTERS = "LKBNHC"
REQUIRED_LETTERS = "BNC"
ITEM_SIZES = (1, 2, 4, 8)  # bytes an element may take: the kernels move 1-, 2-, 4- and 8-byte words


def checked_letters(letters: object, *, what: str, error: type[Exception] = LayoutError) -> str:
    """``letters`` as a plain string of known, distinct letters, or an error; ``what`` says
    where they came from. A str subclass is read by its characters (``str.__str__``), not
    by its methods, which may say anything (its hash and ``==`` key plan caches)."""
    if type(letters) is str and letters in _good_letters:  # a set lookup: this runs on every receive
        return letters
    plain = str.__str__(letters) if isinstance(letters, str) else None  # its own characters
    if not plain:
        raise error(f"{what} must be a non-empty string of axis letters from {AXIS_LETTERS!r}, got {shown(letters)}")
    unknown = sorted(set(plain) - set(AXIS_LETTERS))
    if unknown:
        # vLLM's names for the layouts spell the head dim D: HND is HNC here.
        named = f" (the head dim is C here: {plain.replace('D', 'C')!r})" if unknown == ["D"] else ""
        raise error(
            f"{what} {shown(plain)} has unknown letter(s) {shown(''.join(unknown))}; known letters are "
            f"{AXIS_LETTERS!r}{named}"
        )
    repeated = sorted({a for a in plain if plain.count(a) > 1})
    if repeated:
        raise error(f"{what} {shown(plain)} repeats letter(s) {''.join(repeated)!r}")
    _good_letters.add(plain)
    return plain


# Letter strings that passed: bounded without an eviction rule, since each is an ordered
# pick of distinct letters from AXIS_LETTERS (1,956 strings at most).
_good_letters: set[str] = set()


# Validated layouts by (axes, shape, strides, item size): a miss validates again.
_known: LRU[tuple[str, tuple[int, ...], tuple[int, ...], int], Layout] = LRU(1024)


@dataclass(frozen=True)
class Layout:
    """Shape, strides (in elements) and item size of one KV tensor, its dims named by letters."""

    axes: str
    shape: tuple[int, ...]
    strides: tuple[int, ...]
    itemsize: int
    # What messages call the tensor, and whether its block regions are held to be contiguous
    # (False only for a sender's view read as it is: kvhost.testing's connectors). Not fields:
    # two layouts of one geometry are equal.
    name: InitVar[str] = "layout"
    regions_checked: InitVar[bool] = True

    def __post_init__(self, name: str, regions_checked: bool) -> None:
        # Plans and kernels trust a layout's numbers as addresses: one made by hand is held
        # to what ``of`` reads from a tensor, and validated the same way.
        checked_letters(self.axes, what=f"{name}: axes")
        for field in ("shape", "strides"):
            values = getattr(self, field)
            if not isinstance(values, tuple) or not all(type(v) is int for v in values):
                raise LayoutError(f"{name}: {field} must be a tuple of ints, got {shown(values)}")
            object.__setattr__(self, field, tuple(values))  # a torch.Size is kept as the tuple it is
        if type(self.itemsize) is not int or self.itemsize not in ITEM_SIZES:
            raise LayoutError(f"{name}: item size {shown(self.itemsize)} is not 1, 2, 4 or 8 bytes")
        missing = [a for a in REQUIRED_LETTERS if a not in self.axes]
        if missing:
            raise LayoutError(f"{name}: axes {self.axes!r} lack required letter(s) {''.join(missing)!r}")
        if len(self.shape) != len(self.axes):
            raise LayoutError(
                f"{name}: axes {self.axes!r} name {len(self.axes)} dims but the tensor has {len(self.shape)} "
                f"(shape {self.shape})"
            )
        if len(self.strides) != len(self.shape):
            raise LayoutError(f"{name}: shape {self.shape} has {len(self.shape)} dims but strides {self.strides}")
        if regions_checked:
            self.validate(name)

    def __hash__(self) -> int:
        # Layouts key every plan cache; hash the fields once, not on every lookup.
        return self._hash

    @cached_property
    def _hash(self) -> int:
        return hash((self.axes, self.shape, self.strides, self.itemsize))

    @classmethod
    def of(cls, tensor: torch.Tensor, axes: str, *, name: str = "tensor") -> Layout:
        """The layout of ``tensor`` whose dims, in shape order, are named by ``axes``."""
        if not isinstance(tensor, torch.Tensor):
            raise LayoutError(f"{name}: expected a torch.Tensor, got {type(tensor).__name__}")
        problem = not_plain(tensor)
        if problem is not None:
            raise LayoutError(f"{name}: {problem}")
        if tensor.element_size() not in ITEM_SIZES:
            raise LayoutError(f"{name}: item size {tensor.element_size()} of {tensor.dtype} is not 1, 2, 4 or 8 bytes")
        axes = checked_letters(axes, what=f"{name}: axes")
        key = _key(tensor, axes)
        layout = _known.get(key)
        if layout is None:
            layout = cls(*key, name=name)
            _known.put(key, layout)  # only valid layouts are remembered
        return layout

    @staticmethod
    def known(tensor: torch.Tensor, axes: str) -> Layout | None:
        """The layout already validated for a tensor of this shape and strides, if any.

        Only for a tensor whose own facts ``of`` checks hold (a strided tensor whose bytes
        are its values): the cache is keyed by shape and strides alone.
        """
        if not_plain(tensor) is not None:
            return None
        return _known.get(_key(tensor, axes))

    def describes(self, tensor: torch.Tensor, axes: str) -> bool:
        """Whether this (validated) layout is ``tensor``'s, its dims named by ``axes``: the
        same shape, strides and item size, and a tensor whose bytes are its values."""
        return (
            self.axes == axes
            and tensor.shape == self.shape
            and tensor.stride() == self.strides
            and tensor.element_size() == self.itemsize
            and not_plain(tensor) is None
        )

    # --- derived facts ---------------------------------------------------------------

    def size(self, letter: str) -> int:
        return self.shape[self.axes.index(letter)] if letter in self.axes else 1

    def stride(self, letter: str) -> int:
        return self.strides[self.axes.index(letter)]

    @cached_property
    def physical(self) -> str:
        """Letters in memory order, largest stride first.

        A size-1 dim has no meaningful stride; on a tie it goes inside its partner. Tokens
        and channels must lie in the block region: one of size 1 whose stride puts it before
        ``B`` (a permuted or ``as_strided`` view) goes just inside ``B`` instead. A single
        block (``B`` of size 1) whose stride puts it inside sized tokens or channels (numpy's
        ``newaxis`` gives it stride 0) is read as ``unsqueeze`` at its place in the shape
        would have made it.
        """
        letters = self._by_stride(self.strides)
        b = letters.index("B")
        if self.size("B") == 1 and any(self.size(a) > 1 for a in letters[:b] if a in "NC"):
            i = self.axes.index("B")
            unsqueezed = self.strides[i + 1] * self.shape[i + 1] if i + 1 < len(self.axes) else 1
            letters = self._by_stride((*self.strides[:i], unsqueezed, *self.strides[i + 1 :]))
            b = letters.index("B")
        stray = "".join(a for a in letters[:b] if a in "NC" and self.size(a) == 1)
        if not stray:
            return letters
        outer = "".join(a for a in letters[:b] if a not in stray)
        return outer + "B" + stray + letters[b + 1 :]

    def _by_stride(self, strides: tuple[int, ...]) -> str:
        order = sorted(range(len(self.axes)), key=lambda i: (-strides[i], self.shape[i] == 1, i))
        return "".join(self.axes[i] for i in order)

    @cached_property
    def physical_dims(self) -> tuple[int, ...]:
        """The dims of ``axes`` in memory order (``physical``)."""
        return tuple(self.axes.index(a) for a in self.physical)

    def physical_view(self, tensor: torch.Tensor) -> torch.Tensor:
        """``tensor`` (of this layout, or its bytes) with its dims in memory order: outer
        letters, then ``B``, then the region."""
        return tensor.permute(self.physical_dims)

    @cached_property
    def outer(self) -> str:
        """Letters physically before ``B``: each index of them has its own region per block."""
        return self.physical[: self.physical.index("B")]

    @cached_property
    def region(self) -> str:
        """Letters physically after ``B``, in memory order: one block's contiguous region."""
        return self.physical[self.physical.index("B") + 1 :]

    @property
    def num_blocks(self) -> int:
        return self.size("B")

    @property
    def block_size(self) -> int:
        return self.size("N")

    @cached_property
    def region_numel(self) -> int:
        return int(np.prod([self.size(a) for a in self.region], dtype=np.int64))

    @property
    def region_bytes(self) -> int:
        return self.region_numel * self.itemsize

    @property
    def block_stride_bytes(self) -> int:
        return self.stride("B") * self.itemsize

    @cached_property
    def outer_count(self) -> int:
        return int(np.prod([self.size(a) for a in self.outer], dtype=np.int64))

    @cached_property
    def outer_offsets_bytes(self) -> np.ndarray:
        """Byte offset of every outer index's block-0 region, in row-major outer order."""
        offsets = np.zeros(1, dtype=np.int64)
        for letter in self.outer:
            steps = np.arange(self.size(letter), dtype=np.int64) * self.stride(letter) * self.itemsize
            offsets = (offsets[:, None] + steps[None, :]).reshape(-1)
        return offsets

    @cached_property
    def extent_bytes(self) -> int:
        """Bytes from the first element to the end of the last: what the tensor spans."""
        return strided_extent(self.shape, self.strides, self.itemsize)

    def lanes(self, address: int, owner: str) -> list[Lane]:
        """The tensor's block regions at ``address``: one lane per outer index (kvhost.memory)."""
        offsets = self.outer_offsets_bytes.tolist()
        return [
            Lane(address + offset, self.block_stride_bytes, self.num_blocks, self.region_bytes, self._owner(owner, i))
            for i, offset in enumerate(offsets)
        ]

    def _owner(self, owner: str, outer_index: int) -> str:
        """``owner`` with the letters and values of one outer index, e.g. ``layer 'l0'[K=1]``."""
        if not self.outer:
            return owner
        values = []
        for letter in reversed(self.outer):
            outer_index, value = divmod(outer_index, self.size(letter))
            values.append(f"{letter}={value}")
        return f"{owner}[{','.join(reversed(values))}]"

    def logical_sizes(self) -> dict[str, int]:
        """Size of every letter but ``B``: what one block holds, layout aside."""
        return {a: self.size(a) for a in self.axes if a != "B"}

    # --- validation ------------------------------------------------------------------

    def validate(self, name: str) -> None:
        """Raise LayoutError unless every block's region is one contiguous run of bytes."""
        empty = [f"{a}={n}" for a, n in zip(self.axes, self.shape) if n < 1]
        if empty:
            raise LayoutError(f"{name}: axes {', '.join(empty)} are empty (shape {self.shape}): a cache holds no bytes")
        sized = [(self.strides[i], a) for i, a in enumerate(self.axes) if self.shape[i] > 1]
        for stride, letter in sized:
            if stride == 0:
                raise LayoutError(f"{name}: axis {letter} has stride 0 (a broadcast view): memory overlaps")
        for (s1, a1), (s2, a2) in itertools.combinations(sized, 2):
            if s1 == s2:
                raise LayoutError(f"{name}: axes {a1} and {a2} share stride {s1}: memory overlaps")
        if "N" in self.outer:
            raise LayoutError(
                f"{name}: tokens (N) must lie inside the block region, but physical order "
                f"{self.physical!r} puts N before B (strides {self.strides})"
            )
        if "C" in self.outer:
            raise LayoutError(
                f"{name}: channels (C) must lie inside the block region, but physical order "
                f"{self.physical!r} puts C before B (strides {self.strides})"
            )
        dense = 1
        for letter in reversed(self.region):
            if self.size(letter) == 1:
                continue
            if self.stride(letter) != dense:
                # Tokens apart from one another (a host buffer whose token index comes before
                # its layer, say) still make blocks of one token each.
                tokens = " (tokens that lie apart can be blocks of one token: N of 1, an id per token)"
                inner = [a for a in self.region[self.region.index(letter) + 1 :] if self.size(a) > 1]
                between = (
                    f"; {', '.join(inner)} inside it fill {dense} of those {self.stride(letter)} elements: other "
                    "data lies between (another layer's, or heads of another rank sliced off)"
                    if inner and self.stride(letter) > dense
                    else ""
                )
                raise LayoutError(
                    f"{name}: block region {self.region!r} is not contiguous: axis {letter} "
                    f"has stride {self.stride(letter)}, a dense region needs {dense} "
                    f"(shape {self.shape}, strides {self.strides}){between}" + (tokens if letter == "N" else "")
                )
            dense *= self.size(letter)
        if self.num_blocks > 1 and self.stride("B") < dense:
            raise LayoutError(
                f"{name}: block stride {self.stride('B')} is smaller than the region "
                f"({dense} elements): blocks would overlap"
            )
        overlap = find_overlap(self.lanes(0, "region"))
        if overlap is not None:
            raise LayoutError(
                f"{name}: strides {self.strides} (shape {self.shape}) make two block regions share memory: "
                f"{overlap.describe()}"
            )


def view_as_letters(tensor: torch.Tensor, axes: str, letters: str) -> torch.Tensor:
    """``tensor``, whose dims are ``axes``, as a view whose dims are ``letters`` in that order.

    The two may differ by letters of size 1 (a head dim of one head, a K of one member): such
    a letter moves no byte, so one ``axes`` has and ``letters`` lacks is indexed away, and
    one ``letters`` has and ``axes`` lacks becomes a dim of size 1.
    """
    picked = tensor[tuple(slice(None) if a in letters else 0 for a in axes)]
    kept = [a for a in axes if a in letters]
    view = picked.permute([kept.index(a) for a in letters if a in kept])
    for dim, letter in enumerate(letters):
        if letter not in kept:
            view = view.unsqueeze(dim)
    return view


def contiguous_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    """Row-major strides, in elements, of a dense array of ``shape``."""
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= max(size, 1)
    return tuple(reversed(strides))


def not_plain(tensor: torch.Tensor) -> str | None:
    """Why ``tensor``'s blocks cannot be found by strides and moved as bytes, or None."""
    if tensor.is_nested:  # its layout says strided, its shape is refused by torch
        return "a nested tensor has no one shape and strides to address blocks by"
    if tensor.layout != torch.strided:
        return f"a {tensor.layout} tensor has no strides to address blocks by"
    if tensor.is_quantized:  # torch's own ops on its views crash the process
        return f"a quantized tensor ({tensor.dtype}) keeps its scale apart from its bytes"
    if tensor.is_conj() or tensor.is_neg():
        return "a lazily conjugated or negated view's bytes are not its values"
    if tensor.device.type in _ADDRESSED_DEVICES and tensor.numel() and not _address_of(tensor) and _claims(tensor):
        # A fake, functional or wrapper subclass tensor: the kernels would work at address 0.
        # (A storage freed to no bytes is refused as such where a member's storage is checked.)
        return f"a {type(tensor).__name__} with no memory of its own has no address to move its blocks at"
    return None


_ADDRESSED_DEVICES = frozenset({"cpu", "cuda", "xpu"})  # whose backends' kernels take data addresses


def _address_of(tensor: torch.Tensor) -> int:
    try:
        return tensor.data_ptr()
    except RuntimeError:
        return 0


def _claims(tensor: torch.Tensor) -> bool:
    """Whether the tensor's storage says it holds bytes (one with no address to them cannot)."""
    try:
        return tensor.untyped_storage().nbytes() > 0
    except RuntimeError:
        return True


def _key(tensor: torch.Tensor, axes: str) -> tuple[str, tuple[int, ...], tuple[int, ...], int]:
    shape = tuple(tensor.shape)
    strides = tuple(tensor.stride())  # devices without strides (XLA) report them dense in shape order
    return (axes, shape, strides, tensor.element_size())
