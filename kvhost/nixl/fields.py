"""Strict checks of the values a peer sends, and of every number of seconds kvhost waits.

A peer's values are never trusted. ``Fields`` gives typed access to one JSON object from a
control message (``kvhost.nixl.framing``): each getter checks the value's type and range
and raises a ``ProtocolError`` that names the field's path and the bad value, never
another exception. Bulk integers travel as arrays beside the JSON: a JSON value stands for
one with ``{"array": "<u4", "offset": 0, "count": 40}``, which ``check_array`` reads in
place with ``numpy.frombuffer`` and checks in one vectorised pass.

``check_seconds`` is the one check of a wait: every deadline is finite.
"""

from __future__ import annotations

import math
import numbers
from typing import Any

import numpy as np

from kvhost.errors import ArgumentError, shown
from kvhost.nixl.errors import InvalidTimeoutError, ProtocolError

U64_MAX = (1 << 64) - 1
# The integer types an array may be sent as, by their numpy names.
ARRAY_TYPES = {name: np.dtype(name) for name in ("u1", "<u2", "<u4", "<u8")}
# The array bytes one frame may carry: the most any array read from it can hold.
MAX_ARRAY_BYTES = 64 << 20
# The longest any kvhost wait may be asked to last: a week. A deadline is always finite.
MAX_WAIT_SECONDS = 7 * 24 * 3600.0


def check_seconds(value: Any, where: str, *, positive: bool = False) -> float:
    """``value`` as seconds to wait: a finite real number in [0, MAX_WAIT_SECONDS] (above 0 if ``positive``)."""
    expected = f"{where}: expected a number of seconds in {'(' if positive else '['}0, {MAX_WAIT_SECONDS:g}]"
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Real):
        raise InvalidTimeoutError(f"{expected}, got {show(value)}")
    try:
        seconds = float(value)
    except OverflowError:  # an integer too large for a float
        raise InvalidTimeoutError(f"{expected}, got {show(value)}") from None
    if not math.isfinite(seconds) or seconds < 0 or (positive and seconds == 0) or seconds > MAX_WAIT_SECONDS:
        raise InvalidTimeoutError(f"{expected}, got {seconds}")
    return seconds


class Fields:
    """Typed access to one JSON object from a peer; ``where`` prefixes every error.

    Each getter raises ProtocolError naming the field's path and the bad value. ``arrays``
    are the frame's array bytes, which ``array`` values point into.
    """

    def __init__(self, value: Any, where: str, arrays: bytes | bytearray | memoryview = b"") -> None:
        if not isinstance(value, dict):
            raise ProtocolError(f"{where}: expected an object, got {show(value)}")
        self.data: dict[str, Any] = value
        self.where = where
        self.arrays = arrays

    def _get(self, name: str) -> Any:
        if name not in self.data:
            raise ProtocolError(f"{self.where}.{name}: missing")
        return self.data[name]

    def integer(self, name: str, *, minimum: int = 0, maximum: int = U64_MAX) -> int:
        return check_int(self._get(name), f"{self.where}.{name}", minimum=minimum, maximum=maximum)

    def text(self, name: str, *, max_length: int = 256) -> str:
        return check_text(self._get(name), f"{self.where}.{name}", max_length=max_length)

    def seconds(self, name: str, *, default: float | None = None) -> float:
        """A number of seconds (``check_seconds``); ``default`` when the field is absent, if given."""
        value = self.data.get(name, default) if default is not None else self._get(name)
        try:
            return check_seconds(value, f"{self.where}.{name}")
        except InvalidTimeoutError as err:
            raise ProtocolError(str(err)) from None

    def items(self, name: str, *, max_length: int = 1 << 16) -> list[Any]:
        value = self._get(name)
        if not isinstance(value, list) or len(value) > max_length:
            raise ProtocolError(
                f"{self.where}.{name}: expected a list of at most {max_length} items, got {show(value)}"
            )
        return value

    def texts(self, name: str, *, max_items: int = 1 << 16, max_length: int = 256, distinct: bool = False) -> list[str]:
        """A list of strings; ``distinct``: no string twice (the first repeat is named)."""
        where = f"{self.where}.{name}"
        values = [
            check_text(v, f"{where}[{i}]", max_length=max_length)
            for i, v in enumerate(self.items(name, max_length=max_items))
        ]
        if distinct:
            seen: set[str] = set()
            for i, value in enumerate(values):
                if value in seen:
                    raise ProtocolError(f"{where}[{i}]: {value!r} appears twice")
                seen.add(value)
        return values

    def fields(self, name: str) -> Fields:
        return Fields(self._get(name), f"{self.where}.{name}", self.arrays)

    def array(
        self, name: str, *, minimum: int = 0, maximum: int = U64_MAX, max_length: int = MAX_ARRAY_BYTES
    ) -> np.ndarray:
        """An integer array (read-only, read in place), every value in [minimum, maximum]."""
        return check_array(
            self._get(name),
            f"{self.where}.{name}",
            self.arrays,
            minimum=minimum,
            maximum=maximum,
            max_length=max_length,
        )


def check_int(value: Any, where: str, *, minimum: int = 0, maximum: int = U64_MAX) -> int:
    """``value`` as an int in [minimum, maximum]; booleans and floats are rejected."""
    if isinstance(value, bool) or not isinstance(value, int) or not minimum <= value <= maximum:
        raise ProtocolError(f"{where}: expected an integer in [{minimum}, {maximum}], got {show(value)}")
    return value


def check_text(value: Any, where: str, *, max_length: int = 256) -> str:
    """A string of 1 to ``max_length`` printable characters. A peer's text reaches logs,
    messages and digests: JSON's escapes can spell control characters (a forged log line)
    and lone surrogates (which no encoder takes)."""
    if not isinstance(value, str) or not value or len(value) > max_length:
        raise ProtocolError(f"{where}: expected a string of 1 to {max_length} characters, got {show(value)}")
    if not value.isprintable():
        raise ProtocolError(f"{where}: expected printable text, got {show(value)}")
    return value


def check_array(
    value: Any,
    where: str,
    arrays: bytes | bytearray | memoryview,
    *,
    minimum: int = 0,
    maximum: int = U64_MAX,
    max_length: int = MAX_ARRAY_BYTES,
) -> np.ndarray:
    """An ``{"array": type, "offset": o, "count": n}`` value read from ``arrays`` (or, in
    process, a flat unsigned numpy array), with at most ``max_length`` values, every one in
    [minimum, maximum]. Nothing is copied: min and max are read in one pass each."""
    if isinstance(value, np.ndarray):  # in process: the array itself, before it was sent
        if value.ndim != 1 or value.dtype.kind != "u":
            raise ProtocolError(f"{where}: expected a flat unsigned integer array, got {value.dtype} {value.shape}")
        array = value
    else:
        if not isinstance(value, dict) or set(value) != {"array", "offset", "count"}:
            raise ProtocolError(f"{where}: expected an integer array {{array, offset, count}}, got {show(value)}")
        dtype = ARRAY_TYPES.get(value["array"]) if isinstance(value["array"], str) else None
        if dtype is None:
            raise ProtocolError(f"{where}.array: {show(value['array'])} is not one of {sorted(ARRAY_TYPES)}")
        offset = check_int(value["offset"], f"{where}.offset", maximum=len(arrays))
        count = check_int(value["count"], f"{where}.count", maximum=max_length)
        if offset % dtype.itemsize:
            raise ProtocolError(f"{where}.offset: {offset} is not a multiple of the item size {dtype.itemsize}")
        if offset + count * dtype.itemsize > len(arrays):
            raise ProtocolError(
                f"{where}: {count} items of {dtype.itemsize} bytes from offset {offset} run past the "
                f"{len(arrays)} array bytes"
            )
        array = np.frombuffer(arrays, dtype, count, offset)
    if array.size > max_length:
        raise ProtocolError(f"{where}: {array.size} values, more than the limit of {max_length}")
    if array.size:
        low, high = int(array.min()), int(array.max())
        if low < minimum or high > maximum:
            # The first value out of range: a mask of a byte a value, never an index of each
            # (8 bytes a value: a 64 MiB frame of one-byte ids would cost half a GiB to refuse).
            bad = int(np.argmax(array < minimum if low < minimum else array > maximum))
            raise ProtocolError(f"{where}[{bad}]: expected an integer in [{minimum}, {maximum}], got {int(array[bad])}")
    view = array.view()
    view.flags.writeable = False
    return view


def check_flag(value: object, name: str) -> None:
    """Refuse a flag that is not a bool: "no" or 0.0 would be read as yes or no unsaid."""
    if not isinstance(value, bool):
        raise ArgumentError(f"{name} must be True or False, got {show(value)}")


def show(value: Any) -> str:
    """A value for a message: its repr (``nan``, ``inf`` as written), cut to 60 characters."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    return shown(value)
