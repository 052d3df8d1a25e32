"""Block ids: the checks every id list goes through, and runs of consecutive ids.

kvhost/ids.py at its edges: ids given as an integer tensor, the default that ids be
unique, an empty list, runs found in one list or in two, values too long to quote whole
in a message. Found by mutation testing (ci/mutation.py).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import kvhost
from kvhost.ids import IdBatch, checked_ids, find_runs, find_runs_list
from kvhost.testing import ReceiveCase, make_cache

SIZES = dict(K=2, B=8, N=8, H=2, C=4)


def test_ids_as_integer_tensors_and_arrays_are_accepted():
    caches = {"l": make_cache("KBNHC", "KBNHC", SIZES)}
    case = ReceiveCase(caches, "KBNHC", seed=5)
    case.send("t", [3, 1], "HNC", 4)
    case.send("a", [6], "HNC", 4)
    requests = {"t": torch.tensor([3, 1], dtype=torch.int32), "a": np.array([6], dtype=np.uint8)}
    stats = kvhost.receive(caches, requests, axes="KBNHC", remote_order="HNC", remote_block_size=4)
    assert stats.blocks == 3
    case.check()


def test_subclasses_of_lists_tuples_and_ranges_are_id_lists_too():
    # Plain lists take a fast path; a subclass (a named tuple, a list an engine extends)
    # is still a list of ids, and a subclass of str is still not one.
    from typing import NamedTuple

    class Blocks(list):  # type: ignore[type-arg]
        pass

    class Pair(NamedTuple):
        first: int
        second: int

    batch = IdBatch(8)
    batch.add("list", Blocks([4, 5]))
    batch.add("tuple", Pair(1, 2))
    batch.check()
    assert batch.array().tolist() == [4, 5, 1, 2] and batch.lengths == [2, 2]

    class Name(str):
        pass

    with pytest.raises(kvhost.RequestError, match="ids: block ids must be a"):
        IdBatch(8).add("ids", Name("12"))


def test_numpy_integers_in_a_list_are_ids():
    batch = IdBatch(8)
    batch.add("ids", [np.int64(3), 4, np.uint8(5)])
    batch.check()
    assert batch.array().tolist() == [3, 4, 5]
    with pytest.raises(kvhost.RequestError, match=r"ids: block ids must be integers, got np\.True_ at position 1"):
        bad = IdBatch(8)
        bad.add("ids", [np.int64(3), np.True_])
        bad.check()


class Liar(int):
    """An int whose comparisons, hash and ``__int__`` say nothing of its value."""

    def __lt__(self, other):
        return False

    __gt__ = __ge__ = __le__ = __lt__

    def __eq__(self, other):
        return False

    def __hash__(self):
        return id(self)

    def __int__(self):
        return 0

    def __index__(self):
        return 0


def test_an_int_subclass_is_checked_by_its_own_value_not_its_comparisons():
    """Its value is what the kernels get: a range check by its comparisons let 2**40 through
    to a kernel (a segmentation fault on the CPU backend)."""
    with pytest.raises(kvhost.RequestError, match=r"a: block id 1099511627776 at position 0 is out of range \[0, 8\)"):
        checked_ids([Liar(1 << 40)], "a", 8)
    with pytest.raises(kvhost.RequestError, match="block id 3 is claimed by mine and yours"):
        batch = IdBatch(8)
        batch.add("mine", [Liar(3)])
        batch.add("yours", [Liar(3)])
        batch.check()
    assert checked_ids([Liar(5), 2], "a", 8).tolist() == [5, 2]
    caches = {"l": make_cache("KBNHC", "KBNHC", dict(K=2, B=8, N=4, H=2, C=4)).fill_(3)}
    before = caches["l"].clone()
    for call in (
        lambda: kvhost.receive(caches, {"a": [Liar(1 << 40)]}, axes="KBNHC", remote_order="HNC"),
        lambda: kvhost.copy_blocks(caches, caches, [0], [Liar(1 << 40)], axes="KBNHC"),
    ):
        with pytest.raises(kvhost.RequestError, match="1099511627776 at position 0 is out of range"):
            call()
    assert torch.equal(caches["l"], before)
    for option in ("remote_block_size", "tokens"):
        request = kvhost.Incoming([1], tokens=Liar(0)) if option == "tokens" else [1]
        extra = {"remote_block_size": Liar(0)} if option == "remote_block_size" else {}
        with pytest.raises(kvhost.RequestError, match="must be a positive integer"):
            kvhost.receive(caches, {"a": request}, axes="KBNHC", remote_order="HNC", **extra)


class PosingId(np.int64):
    """A numpy integer whose ``__index__``, ``__int__`` and ``item`` say another number."""

    def __index__(self):
        return 1

    def __int__(self):
        return 2

    def item(self):
        return 3


def test_a_numpy_integer_subclass_is_read_by_its_stored_value():
    """numpy builds an int64 array of it through ``__int__`` and ``operator.index`` asks
    ``__index__``: neither is the number it holds, which is what is checked and copied."""
    from kvhost.ids import integer_value

    assert integer_value(PosingId(7)) == 7 and type(integer_value(PosingId(7))) is int
    assert checked_ids([PosingId(7), np.int64(2)], "a", 8).tolist() == [7, 2]
    with pytest.raises(kvhost.RequestError, match="a: block id 9 at position 0 is out of range"):
        checked_ids([PosingId(9)], "a", 8)
    src = {"l": torch.arange(2 * 8 * 4 * 2 * 4, dtype=torch.float32).reshape(2, 8, 4, 2, 4)}
    dst = {"l": torch.zeros(2, 8, 4, 2, 4)}
    kvhost.copy_blocks(src, dst, [PosingId(7)], [0], axes="KBNHC")
    assert torch.equal(dst["l"][:, 0], src["l"][:, 7])


def test_ids_must_be_unique_unless_told_otherwise():
    for unique in (True, False):
        batch = IdBatch(4, unique=unique)
        batch.add("mine", [1, 2])
        batch.add("yours", [2])
        if unique:
            with pytest.raises(kvhost.RequestError, match="block id 2 is claimed by mine and yours"):
                batch.check()
        else:
            batch.check()


def test_checked_ids_is_one_checked_list():
    assert checked_ids([3, 1, 2], "ids", 4).tolist() == [3, 1, 2]
    assert checked_ids([], "ids", 4).tolist() == []
    with pytest.raises(kvhost.RequestError, match=r"ids: empty \(no block ids\)"):
        checked_ids([], "ids", 4, allow_empty=False)
    with pytest.raises(kvhost.RequestError, match="ids: block id 4 at position 1 is out of range"):
        checked_ids([3, 4], "ids", 4)
    with pytest.raises(kvhost.RequestError, match="ids: block id 3 appears twice"):
        checked_ids([3, 3], "ids", 4)
    with pytest.raises(kvhost.RequestError, match="ids: block ids must be a"):
        checked_ids({3}, "ids", 4)


@pytest.fixture(params=["loop", "numpy"])
def runs_path(request, monkeypatch):  # type: ignore[no-untyped-def]
    """find_runs through its Python loop (short lists) or its numpy calls (long ones)."""
    import kvhost.ids

    monkeypatch.setattr(kvhost.ids, "SHORT_IDS", 1 << 30 if request.param == "loop" else 0)
    return request.param


def test_runs_of_ids_consecutive_in_both_lists(runs_path):
    src = np.array([0, 1, 2, 5, 6, 9])
    dst = np.array([3, 4, 5, 9, 11, 12])
    assert find_runs(src, dst).tolist() == [[0, 3, 3], [5, 9, 1], [6, 11, 1], [9, 12, 1]]
    assert find_runs(src).tolist() == [[0, 0, 3], [5, 5, 2], [9, 9, 1]]  # one list
    assert find_runs(np.array([7, 7, 8])).tolist() == [[7, 7, 1], [7, 7, 2]]  # a repeat breaks a run
    empty = find_runs(np.zeros(0, dtype=np.int64))
    assert empty.shape == (0, 3) and empty.dtype == np.int64
    assert find_runs(np.array([4]), np.array([2])).tolist() == [[4, 2, 1]]
    assert find_runs_list(src, dst) == [[0, 3, 3], [5, 9, 1], [6, 11, 1], [9, 12, 1]]  # as Python rows
    assert find_runs_list(src) == [[0, 0, 3], [5, 5, 2], [9, 9, 1]]
    assert find_runs_list(np.array([7, 7, 8])) == [[7, 7, 1], [7, 7, 2]]
    assert find_runs_list(np.zeros(0, dtype=np.int64)) == []


def test_short_and_long_id_lists_find_the_same_runs():
    import kvhost.ids

    rng = np.random.default_rng(5)
    for length in range(0, 80, 3):
        src = np.cumsum(rng.choice([1, 1, 1, 2, -3], size=length)) + 50
        dst = np.cumsum(rng.choice([1, 1, 1, 7], size=length))
        short = kvhost.ids._short_runs(src.tolist(), dst.tolist())
        found = find_runs(src, dst)
        assert found.dtype == np.int64 and found.shape == (len(short), 3)
        assert found.tolist() == short
        assert found[:, 2].sum() == length
        assert find_runs_list(src, dst) == short
        assert find_runs_list(src) == find_runs(src).tolist() == kvhost.ids._short_runs(src.tolist(), src.tolist())


@pytest.mark.parametrize(
    ("ids", "accepted"),
    [
        (range(3, 4), [3]),  # one id: its first is its last
        (range(7, -1, -1), [7, 6, 5, 4, 3, 2, 1, 0]),  # every id, down to 0
        (range(0, 8, 3), [0, 3, 6]),
        (range(5, 5), []),
    ],
)
def test_ranges_in_bounds_are_ids(ids, accepted):
    assert checked_ids(ids, "ids", 8).tolist() == accepted


@pytest.mark.parametrize(
    ("ids", "value", "position"),
    [
        (range(8, 9), 8, 0),
        (range(-(2**64), 5), -(2**64), 0),  # more ids than len() can count, its last in bounds
        (range(2, 2**64), 8, 6),  # ... its first in bounds
        (range(7, -(10**12), -1), -1, 8),
    ],
)
def test_a_range_is_refused_from_its_ends_naming_its_first_id_out_of_bounds(ids, value, position):
    """Checked without making its ids: the first out of bounds lies within limit + 1."""
    with pytest.raises(
        kvhost.RequestError, match=rf"^ids: block id {value} at position {position} is out of range \[0, 8\)$"
    ):
        checked_ids(ids, "ids", 8)


def test_long_values_are_cut_short_in_messages():
    def message(value: object) -> str:
        with pytest.raises(kvhost.RequestError) as raised:
            IdBatch(8).add("ids", value)
        return str(raised.value).split(", got ", 1)[1]

    assert message(b"x" * 37) == "bytes b'" + "x" * 37 + "'"  # 40 characters: quoted whole
    assert message(b"x" * 38) == "bytes b'" + "x" * 35 + "..."  # 41: the first 37 and an ellipsis


@pytest.mark.parametrize("bits", [8, 16, 32, 64])
@pytest.mark.parametrize("sign", ["", "u"])
def test_ids_as_tensors_of_every_whole_byte_integer_type_are_accepted(sign, bits):
    dtype = getattr(torch, f"{sign}int{bits}")
    batch = IdBatch(8)
    batch.add("ids", torch.tensor([5, 2], dtype=dtype))
    batch.check()
    assert batch.array().tolist() == [5, 2]
