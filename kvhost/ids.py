"""Block ids from callers and peers: checked once, named by who sent them, never coerced.

Every id list kvhost accepts (a request's blocks, a copy's two lists, a connector's batch,
a transfer's local and remote blocks) goes through ``IdBatch``: the lists are gathered
into one flat Python list and checked with builtins, with no numpy call per list (a numpy
call costs 10-30 us with cold caches), and converted to one int64 array only when there is
work. Accepted: lists, tuples, ranges, 1-D integer numpy arrays and tensors, of ints (a
bool is not an id); sets and dict keys (no order), bytes and strings (not ids) and
iterators (used up by reading) are refused with the value named.
"""

from __future__ import annotations

import bisect
import itertools
import operator
from collections.abc import Sequence
from typing import Any, TypeGuard

import numpy as np
import torch

from kvhost.errors import RequestError, shown

Ids = Sequence[int] | np.ndarray | torch.Tensor
ID_KINDS = "list, tuple, range, 1-D numpy array or 1-D tensor of integers"


class IdBatch:
    """Named id lists gathered into one flat list; ``check`` validates them all at once:
    each an integer in ``[0, limit)`` (``what`` names one in messages), and unique if asked."""

    def __init__(self, limit: int, *, what: str = "block id", unique: bool = True) -> None:
        self.limit, self.what, self.unique = limit, what, unique
        self.subjects: list[str] = []  # "request 'a'", or an argument's name
        self.lengths: list[int] = []
        self.flat: list[Any] = []

    def add(self, subject: str, ids: Any) -> None:
        if type(ids) in _PLAIN:  # the common case first: no look-up of numpy's and torch's types
            if type(ids) is range:
                self._check_range(subject, ids)
        elif isinstance(ids, (np.ndarray, torch.Tensor)):
            if isinstance(ids, torch.Tensor) and (ids.is_nested or ids.layout != torch.strided):
                # before the shape: a nested tensor says strided, and has no sizes to show
                kind = "nested" if ids.is_nested else ids.layout
                raise RequestError(f"{subject}: block ids must be a dense tensor, got a {kind} tensor")
            if ids.ndim != 1:
                raise RequestError(f"{subject}: block ids must be a flat sequence, got shape {tuple(ids.shape)}")
            if not _integer_dtype(ids.dtype):
                raise RequestError(f"{subject}: block ids must be integers, got an array of {ids.dtype}")
            if isinstance(ids, torch.Tensor) and ids.device.type == "meta":
                raise RequestError(f"{subject}: block ids on the meta device have no values")
            ids = ids.tolist()
        elif not isinstance(ids, (list, tuple, range)):
            raise RequestError(f"{subject}: block ids must be a {ID_KINDS}, got {type(ids).__name__} {shown(ids, 40)}")
        flat = self.flat
        before = len(flat)
        flat.extend(ids)
        self.subjects.append(subject)
        self.lengths.append(len(flat) - before)  # what was taken, whatever a subclass's len() says

    def _check_range(self, subject: str, ids: range) -> None:
        """A range's ids are distinct and run one way: all lie in ``[0, limit)`` if both ends
        do. Otherwise the first outside is within ``limit + 1`` of the start, so a range
        of a billion ids (or more than ``len`` can count) is refused without making them."""
        limit = self.limit
        if ids and not (0 <= ids[0] < limit and 0 <= ids[-1] < limit):
            position, value = next((i, x) for i, x in enumerate(ids) if not 0 <= x < limit)
            raise RequestError(f"{subject}: {self.what} {value} at position {position} is out of range [0, {limit})")

    def check(self) -> None:
        """Raise unless every id is an integer in ``[0, limit)`` (and unique, if asked)."""
        flat, limit, what = self.flat, self.limit, self.what
        if not flat:
            return
        kinds = set(map(type, flat))
        if kinds != _INT:
            if not all(_integer_type(kind) for kind in kinds):
                position = next(i for i, x in enumerate(flat) if not _integer_type(type(x)))
                subject, at = self._where(position)
                got = shown(flat[position])
                raise RequestError(f"{subject}: block ids must be integers, got {got} at position {at}")
            # Their own values, which the int64 array is then made of: an int subclass's
            # comparisons or hash, or a numpy integer subclass's ``__index__`` and
            # ``__int__``, may say otherwise, and the range is checked on these.
            flat[:] = map(_own_value, flat)
        if min(flat) < 0 or max(flat) >= limit:
            position = next(i for i, x in enumerate(flat) if not 0 <= x < limit)
            subject, at = self._where(position)
            raise RequestError(f"{subject}: {what} {flat[position]} at position {at} is out of range [0, {limit})")
        if self.unique and len(set(flat)) != len(flat):
            first_seen: dict[int, int] = {}
            for position, block in enumerate(flat):
                earlier = first_seen.setdefault(block, position)
                if earlier != position:
                    a, b = self._owner(earlier), self._owner(position)
                    if a == b:
                        raise RequestError(f"{self.subjects[a]}: block id {block} appears twice")
                    raise RequestError(f"block id {block} is claimed by {self.subjects[a]} and {self.subjects[b]}")

    def array(self) -> np.ndarray:
        """Every id, in order, as one int64 array (the batch's only numpy conversion)."""
        return np.array(self.flat, dtype=np.int64) if self.flat else np.zeros(0, dtype=np.int64)

    def _owner(self, position: int) -> int:
        return bisect.bisect_right(list(itertools.accumulate(self.lengths)), position)

    def _where(self, position: int) -> tuple[str, int]:
        """Who holds flat ``position``, and where in its own list."""
        owner = self._owner(position)
        return self.subjects[owner], position - sum(self.lengths[:owner])


def checked_ids(ids: Any, subject: str, limit: int, *, allow_empty: bool = True) -> np.ndarray:
    """One id list of unique ids, checked as an ``IdBatch`` of one, as an int64 array."""
    batch = IdBatch(limit)
    batch.add(subject, ids)
    if not batch.flat and not allow_empty:
        raise RequestError(f"{subject}: empty (no block ids)")
    batch.check()
    return batch.array()


def find_runs(src_ids: np.ndarray, dst_ids: np.ndarray | None = None) -> np.ndarray:
    """Runs of ids consecutive in both lists (in ``src_ids`` alone when ``dst_ids`` is None):
    ``[n, 3]`` rows of source start, destination start, count."""
    if src_ids.size <= SHORT_IDS:
        return np.array(find_runs_list(src_ids, dst_ids), dtype=np.int64).reshape(-1, 3)
    dst = src_ids if dst_ids is None else dst_ids
    breaks = np.flatnonzero((np.diff(src_ids) != 1) | (np.diff(dst) != 1)) + 1
    starts = np.concatenate(([0], breaks))
    counts = np.diff(np.concatenate((starts, [src_ids.size])))
    return np.stack([src_ids[starts], dst[starts], counts], axis=1)


def find_runs_list(src_ids: np.ndarray, dst_ids: np.ndarray | None = None) -> list[list[int]]:
    """``find_runs`` as Python rows: a short list never makes a numpy array (``find_runs``
    takes its own short lists from here)."""
    if src_ids.size <= SHORT_IDS:
        ids = src_ids.tolist()
        return _short_runs(ids, ids if dst_ids is None else dst_ids.tolist())
    return find_runs(src_ids, dst_ids).tolist()  # type: ignore[no-any-return]


# Up to this many ids, runs are found in a Python loop: a dozen numpy calls cost more
# (10-20 us each with cold caches) than a loop over a request's few ids.
SHORT_IDS = 32


def _short_runs(src: list[int], dst: list[int]) -> list[list[int]]:
    rows: list[list[int]] = []
    for s, d in zip(src, dst):
        if rows and s == rows[-1][0] + rows[-1][2] and d == rows[-1][1] + rows[-1][2]:
            rows[-1][2] += 1
        else:
            rows.append([s, d, 1])
    return rows


_PLAIN = {list, tuple, range}
# Not quantized, bit or sub-byte types, whose elements ``tolist`` cannot read.
_TORCH_INTEGERS = {getattr(torch, f"{sign}int{bits}") for sign in ("", "u") for bits in (8, 16, 32, 64)}
_INT = {int}


def _integer_type(kind: type) -> bool:
    # numpy's timedelta64 is one of its signed integers, and Python's bool one of its ints.
    return issubclass(kind, (int, np.integer)) and not issubclass(kind, (bool, np.timedelta64))


def is_integer(value: object) -> TypeGuard[int | np.integer[Any]]:
    """An integer as given, never coerced: Python's or numpy's; not a bool, a float or a timedelta."""
    return _integer_type(type(value))


def integer_value(value: object) -> int | None:
    """An integer's own value as a plain int, or None where ``value`` is no integer
    (``is_integer``). Compare this, not ``value``: an int subclass's comparisons and
    ``__int__`` may say anything, ``_own_value`` reads the number itself."""
    return _own_value(value) if is_integer(value) else None


def _own_value(value: int | np.integer[Any]) -> int:
    """The number an integer holds, as a plain int: a numpy scalar's stored value (its
    type's ``item``, not a subclass's), a Python int's by ``operator.index``."""
    if type(value) in _NUMPY_INTEGERS or not isinstance(value, np.generic):
        return operator.index(value)  # numpy's own types read their stored value here
    return np.generic.item(value)


# numpy's integer types themselves (their subclasses are read by ``np.generic.item``, 10 times slower).
_NUMPY_INTEGERS = frozenset(np.dtype(code).type for code in "bBhHiIlLqQ")


def _integer_dtype(dtype: np.dtype[Any] | torch.dtype) -> bool:
    if isinstance(dtype, torch.dtype):
        return dtype in _TORCH_INTEGERS
    return dtype.kind in "iu"
