"""Framed messages on the control socket between two engines, and strict field checks.

Agent metadata and block tables travel beside NIXL, on a plain TCP socket. A frame is

    magic b"KVHM" | version (1 byte) | JSON length (4) | blob length (4) | array length (4)
    | CRC-32 (4) | JSON object (UTF-8) | blob (opaque bytes: a NIXL agent's metadata)
    | arrays (unsigned little-endian integers)

all header integers big-endian, the CRC covering JSON, blob and arrays. Bulk integers (block
ids, stream addresses) travel as arrays, not JSON: a JSON value stands for one with
``{"array": "<u4", "offset": 0, "count": 40}``, which ``Fields.array`` reads in place with
``numpy.frombuffer`` and checks in one vectorised pass. So a frame costs memory in
proportion to its size: its bytes once (the blob twice while it is copied out), plus what
the JSON parses into, which is bounded absolutely: at most ``MAX_JSON_BYTES`` and
``MAX_JSON_VALUES`` values, counted from its punctuation before it is parsed.

A peer's bytes are never trusted: lengths are capped before anything is allocated, the CRC
catches corruption, and ``Fields`` checks every value's type and range, so anything
malformed or truncated becomes a ``ProtocolError`` that names what was wrong, never a crash.
Every wait has a deadline (``check_seconds``).
"""

from __future__ import annotations

import json
import math
import numbers
import socket
import struct
import time
import zlib
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kvhost.errors import KVHostError

MAGIC = b"KVHM"
VERSION = 2
_HEADER = struct.Struct(">4sBIIII")
HEADER_BYTES = _HEADER.size
MAX_JSON_BYTES = 1 << 20
MAX_JSON_VALUES = 1 << 16
MAX_BLOB_BYTES = 16 << 20
MAX_ARRAY_BYTES = 64 << 20
U64_MAX = (1 << 64) - 1
# The integer types an array may be sent as, by their numpy names.
ARRAY_TYPES = {name: np.dtype(name) for name in ("u1", "<u2", "<u4", "<u8")}
# The longest any kvhost wait may be asked to last: a week. A deadline is always finite.
MAX_WAIT_SECONDS = 7 * 24 * 3600.0


class ProtocolError(KVHostError, ValueError):
    """A control message was malformed, truncated, unexpected, or did not arrive in time."""


class InvalidTimeoutError(KVHostError, ValueError):
    """A timeout that is not a finite number of seconds in range (NaN, infinite, negative, a bool)."""


def check_seconds(value: Any, where: str, *, positive: bool = False) -> float:
    """``value`` as seconds to wait: a finite real number in [0, MAX_WAIT_SECONDS] (above 0 if ``positive``)."""
    expected = f"{where}: expected a number of seconds in {'(' if positive else '['}0, {MAX_WAIT_SECONDS:g}]"
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Real):
        raise InvalidTimeoutError(f"{expected}, got {_show(value)}")
    seconds = float(value)
    if not math.isfinite(seconds) or seconds < 0 or (positive and seconds == 0) or seconds > MAX_WAIT_SECONDS:
        raise InvalidTimeoutError(f"{expected}, got {seconds}")
    return seconds


@dataclass(frozen=True)
class Message:
    """One frame: ``kind`` (from the JSON's ``kind``), the JSON object, the blob, and the
    array bytes its ``{"array": ...}`` values point into (read them with ``Fields``)."""

    kind: str
    header: dict[str, Any]
    blob: bytes = b""
    arrays: bytes | bytearray | memoryview = field(default=b"", repr=False)

    def fields(self, where: str | None = None) -> Fields:
        """The JSON object as ``Fields`` that can read this frame's arrays."""
        return Fields(self.header, where or self.kind, self.arrays)


def encode(kind: str, header: Mapping[str, Any], blob: bytes = b"") -> bytes:
    """The frame for a message; ``header`` must be JSON-serialisable and not name ``kind``.

    Flat unsigned numpy integer arrays anywhere in ``header`` travel as arrays.
    """
    parts: list[bytes] = []
    size = 0

    def pack(value: Any) -> Any:
        nonlocal size
        if isinstance(value, np.ndarray):
            if value.ndim != 1 or value.dtype.kind != "u":
                raise ProtocolError(f"message {kind!r}: arrays must be flat unsigned integers, got {value.dtype}")
            little = value.astype(value.dtype.newbyteorder("<"), copy=False)
            pad = -size % little.itemsize
            parts.append(bytes(pad) + little.tobytes())
            ref = {"array": little.dtype.str.replace("|", ""), "offset": size + pad, "count": int(little.size)}
            size += pad + little.nbytes
            return ref
        if isinstance(value, Mapping):
            return {key: pack(item) for key, item in value.items()}
        if isinstance(value, (list, tuple)):
            return [pack(item) for item in value]
        return value

    try:
        body = json.dumps({"kind": kind, **pack(header)}, separators=(",", ":"), allow_nan=False).encode()
    except (TypeError, ValueError) as err:
        raise ProtocolError(f"message {kind!r} cannot be sent as JSON: {err}") from None
    arrays = b"".join(parts)
    values = json_values(body)
    if (
        len(body) > MAX_JSON_BYTES
        or values > MAX_JSON_VALUES
        or len(blob) > MAX_BLOB_BYTES
        or len(arrays) > MAX_ARRAY_BYTES
    ):
        raise ProtocolError(
            f"message {kind!r} too large: {len(body)} JSON bytes ({values} values), {len(blob)} blob bytes, "
            f"{len(arrays)} array bytes"
        )
    crc = zlib.crc32(arrays, zlib.crc32(blob, zlib.crc32(body)))
    return _HEADER.pack(MAGIC, VERSION, len(body), len(blob), len(arrays), crc) + body + blob + arrays


def json_values(body: bytes | bytearray) -> int:
    """An upper bound on the values (and keys) a JSON text parses into, read from its punctuation."""
    return 1 + body.count(b",") + body.count(b":") + body.count(b"[") + body.count(b"{")


def parse_header(data: bytes | bytearray | memoryview) -> tuple[int, int, int, int]:
    """Check a frame's fixed header; returns (JSON length, blob length, array length, CRC)."""
    if len(data) < HEADER_BYTES:
        raise ProtocolError(f"truncated frame: {len(data)} of {HEADER_BYTES} header bytes")
    magic, version, json_len, blob_len, array_len, crc = _HEADER.unpack_from(data)
    if magic != MAGIC:
        raise ProtocolError(f"not a kvhost frame: magic {magic!r}, expected {MAGIC!r}")
    if version != VERSION:
        raise ProtocolError(f"protocol version {version} is not supported (this side speaks {VERSION})")
    for what, length, limit in (
        ("JSON", json_len, MAX_JSON_BYTES),
        ("blob", blob_len, MAX_BLOB_BYTES),
        ("array", array_len, MAX_ARRAY_BYTES),
    ):
        if length > limit:
            raise ProtocolError(f"{what} length {length} exceeds the limit of {limit} bytes")
    return json_len, blob_len, array_len, crc


def parse_body(body: bytes | bytearray, blob: bytes, crc: int, arrays: bytes | bytearray | memoryview = b"") -> Message:
    """Check the CRC, decode the JSON object and its ``kind``."""
    if zlib.crc32(arrays, zlib.crc32(blob, zlib.crc32(body))) != crc:
        raise ProtocolError("checksum mismatch: the message was corrupted")
    values = json_values(body)
    if values > MAX_JSON_VALUES:
        raise ProtocolError(f"message body may hold {values} JSON values, more than the limit of {MAX_JSON_VALUES}")
    try:
        header = json.loads(body.decode("utf-8"), parse_constant=_reject_constant)
    except ProtocolError:
        raise
    except (ValueError, RecursionError) as err:  # bad UTF-8 or JSON, an integer too long to parse
        raise ProtocolError(f"message body is not valid JSON: {err}") from None
    if not isinstance(header, dict):
        raise ProtocolError(f"message body must be a JSON object, got {type(header).__name__}")
    kind = header.pop("kind", None)
    if not isinstance(kind, str):
        raise ProtocolError(f"message has no string 'kind' (got {_show(kind)})")
    return Message(kind, header, blob, arrays)


def decode(data: bytes) -> Message:
    """One whole frame from bytes; trailing bytes are an error."""
    json_len, blob_len, array_len, crc = parse_header(data)
    total = HEADER_BYTES + json_len + blob_len + array_len
    if len(data) < total:
        raise ProtocolError(f"truncated frame: {len(data)} of {total} bytes")
    if len(data) > total:
        raise ProtocolError(f"{len(data) - total} unexpected bytes after the frame")
    view = memoryview(data)
    body_end = HEADER_BYTES + json_len
    blob_end = body_end + blob_len
    return parse_body(bytes(view[HEADER_BYTES:body_end]), bytes(view[body_end:blob_end]), crc, view[blob_end:total])


def send(sock: socket.socket, kind: str, header: Mapping[str, Any], blob: bytes = b"", *, timeout: float) -> None:
    """Send one message within ``timeout`` seconds; a closed, broken or stalled socket is a ProtocolError."""
    seconds = check_seconds(timeout, "send timeout")
    frame = encode(kind, header, blob)
    try:
        sock.settimeout(seconds)
        sock.sendall(frame)
    except TimeoutError:
        raise ProtocolError(f"could not send {kind!r} within {seconds:g} s: the peer does not read") from None
    except OSError as err:
        raise ProtocolError(f"could not send {kind!r}: {err}") from None


def receive(sock: socket.socket, *, timeout: float, expect: str | None = None, limit: int | None = None) -> Message:
    """Read one message within ``timeout`` seconds; ``expect`` names the only kind accepted.

    ``limit`` caps the frame's bytes below the protocol's own caps (for a peer that has not
    yet said who it is), checked from the header before anything else is read.
    """
    seconds = check_seconds(timeout, "receive timeout")
    deadline = time.monotonic() + seconds
    json_len, blob_len, array_len, crc = parse_header(_read(sock, HEADER_BYTES, deadline, "header"))
    if limit is not None and json_len + blob_len + array_len > limit:
        raise ProtocolError(
            f"frame of {json_len + blob_len + array_len} bytes exceeds the limit of {limit} bytes at this point"
        )
    body = _read(sock, json_len, deadline, "JSON body")
    blob = bytes(_read(sock, blob_len, deadline, "blob"))
    arrays = _read(sock, array_len, deadline, "arrays")
    message = parse_body(body, blob, crc, arrays)
    if expect is not None and message.kind != expect:
        raise ProtocolError(f"expected a {expect!r} message, got {_show(message.kind)}")
    return message


def _read(sock: socket.socket, count: int, deadline: float, what: str) -> bytearray:
    """Exactly ``count`` bytes into one buffer (no chunks to join: the bytes are held once)."""
    buffer = bytearray(count)
    view = memoryview(buffer)
    got = 0
    while got < count:
        left = deadline - time.monotonic()
        if left <= 0:
            raise ProtocolError(f"timed out waiting for the {what}: {got} of {count} bytes arrived")
        sock.settimeout(left)
        try:
            n = sock.recv_into(view[got:], min(count - got, 1 << 20))
        except TimeoutError:
            continue  # the deadline check above reports it
        except OSError as err:
            raise ProtocolError(f"connection failed while reading the {what}: {err}") from None
        if not n:
            raise ProtocolError(f"truncated message: connection closed after {got} of {count} {what} bytes")
        got += n
    return buffer


def _reject_constant(name: str) -> None:
    raise ProtocolError(f"message body holds {name}, which is not a number")


class Fields:
    """Typed access to one JSON object from a peer; ``where`` prefixes every error.

    Each getter raises ProtocolError naming the field's path and the bad value. ``arrays``
    are the frame's array bytes, which ``array`` values point into.
    """

    def __init__(self, value: Any, where: str, arrays: bytes | bytearray | memoryview = b"") -> None:
        if not isinstance(value, dict):
            raise ProtocolError(f"{where}: expected an object, got {_show(value)}")
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

    def items(self, name: str, *, max_length: int = 1 << 16) -> list[Any]:
        value = self._get(name)
        if not isinstance(value, list) or len(value) > max_length:
            raise ProtocolError(
                f"{self.where}.{name}: expected a list of at most {max_length} items, got {_show(value)}"
            )
        return value

    def texts(self, name: str, *, max_items: int = 1 << 16, max_length: int = 256) -> list[str]:
        where = f"{self.where}.{name}"
        return [
            check_text(v, f"{where}[{i}]", max_length=max_length)
            for i, v in enumerate(self.items(name, max_length=max_items))
        ]

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
        raise ProtocolError(f"{where}: expected an integer in [{minimum}, {maximum}], got {_show(value)}")
    return value


def check_text(value: Any, where: str, *, max_length: int = 256) -> str:
    if not isinstance(value, str) or not value or len(value) > max_length:
        raise ProtocolError(f"{where}: expected a string of 1 to {max_length} characters, got {_show(value)}")
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
            raise ProtocolError(f"{where}: expected an integer array {{array, offset, count}}, got {_show(value)}")
        dtype = ARRAY_TYPES.get(value["array"]) if isinstance(value["array"], str) else None
        if dtype is None:
            raise ProtocolError(f"{where}.array: {_show(value['array'])} is not one of {sorted(ARRAY_TYPES)}")
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
            bad = int(np.flatnonzero(array == (low if low < minimum else high))[0])
            raise ProtocolError(f"{where}[{bad}]: expected an integer in [{minimum}, {maximum}], got {int(array[bad])}")
    view = array.view()
    view.flags.writeable = False
    return view


def _show(value: Any) -> str:
    text = repr(value)
    if isinstance(value, float) and not math.isfinite(value):
        text = str(value)
    return text if len(text) <= 60 else text[:57] + "..."
