"""Framed messages on the control socket between two engines, and strict field checks.

Agent metadata and block tables travel beside NIXL, on a plain TCP socket. A frame is

    magic b"KVHM" | version (1 byte) | JSON length (4) | blob length (4) | CRC-32 (4)
    | JSON object (UTF-8) | blob (opaque bytes: a NIXL agent's metadata)

all integers big-endian, the CRC covering JSON and blob. A peer's bytes are never trusted:
lengths are capped before anything is allocated, the CRC catches corruption, and
``Fields`` checks every value's type and range, so anything malformed or truncated
becomes a ``ProtocolError`` that names what was wrong, never a crash. Every wait has a
deadline (``check_seconds``).
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
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvhost.errors import KVHostError

MAGIC = b"KVHM"
VERSION = 1
_HEADER = struct.Struct(">4sBIII")
HEADER_BYTES = _HEADER.size
MAX_JSON_BYTES = 64 << 20
MAX_BLOB_BYTES = 16 << 20
U64_MAX = (1 << 64) - 1
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
    """One frame: ``kind`` (from the JSON's ``kind``), the JSON object, and the blob."""

    kind: str
    header: dict[str, Any]
    blob: bytes = b""


def encode(kind: str, header: Mapping[str, Any], blob: bytes = b"") -> bytes:
    """The frame for a message; ``header`` must be JSON-serialisable and not name ``kind``."""
    try:
        body = json.dumps({"kind": kind, **header}, separators=(",", ":"), allow_nan=False).encode()
    except (TypeError, ValueError) as err:
        raise ProtocolError(f"message {kind!r} cannot be sent as JSON: {err}") from None
    if len(body) > MAX_JSON_BYTES or len(blob) > MAX_BLOB_BYTES:
        raise ProtocolError(f"message {kind!r} too large: {len(body)} JSON bytes, {len(blob)} blob bytes")
    crc = zlib.crc32(blob, zlib.crc32(body))
    return _HEADER.pack(MAGIC, VERSION, len(body), len(blob), crc) + body + blob


def parse_header(data: bytes) -> tuple[int, int, int]:
    """Check a frame's fixed header; returns (JSON length, blob length, CRC)."""
    if len(data) < HEADER_BYTES:
        raise ProtocolError(f"truncated frame: {len(data)} of {HEADER_BYTES} header bytes")
    magic, version, json_len, blob_len, crc = _HEADER.unpack_from(data)
    if magic != MAGIC:
        raise ProtocolError(f"not a kvhost frame: magic {magic!r}, expected {MAGIC!r}")
    if version != VERSION:
        raise ProtocolError(f"protocol version {version} is not supported (this side speaks {VERSION})")
    if json_len > MAX_JSON_BYTES:
        raise ProtocolError(f"JSON length {json_len} exceeds the limit of {MAX_JSON_BYTES} bytes")
    if blob_len > MAX_BLOB_BYTES:
        raise ProtocolError(f"blob length {blob_len} exceeds the limit of {MAX_BLOB_BYTES} bytes")
    return json_len, blob_len, crc


def parse_body(body: bytes, blob: bytes, crc: int) -> Message:
    """Check the CRC, decode the JSON object and its ``kind``."""
    if zlib.crc32(blob, zlib.crc32(body)) != crc:
        raise ProtocolError("checksum mismatch: the message was corrupted")
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
        raise ProtocolError(f"message has no string 'kind' (got {kind!r})")
    return Message(kind, header, blob)


def decode(data: bytes) -> Message:
    """One whole frame from bytes; trailing bytes are an error."""
    json_len, blob_len, crc = parse_header(data)
    total = HEADER_BYTES + json_len + blob_len
    if len(data) < total:
        raise ProtocolError(f"truncated frame: {len(data)} of {total} bytes")
    if len(data) > total:
        raise ProtocolError(f"{len(data) - total} unexpected bytes after the frame")
    body = data[HEADER_BYTES : HEADER_BYTES + json_len]
    return parse_body(body, data[HEADER_BYTES + json_len : total], crc)


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


def receive(sock: socket.socket, *, timeout: float, expect: str | None = None) -> Message:
    """Read one message within ``timeout`` seconds; ``expect`` names the only kind accepted."""
    seconds = check_seconds(timeout, "receive timeout")
    deadline = time.monotonic() + seconds
    json_len, blob_len, crc = parse_header(_read_exactly(sock, HEADER_BYTES, deadline, "header"))
    body = _read_exactly(sock, json_len, deadline, "JSON body")
    blob = _read_exactly(sock, blob_len, deadline, "blob")
    message = parse_body(body, blob, crc)
    if expect is not None and message.kind != expect:
        raise ProtocolError(f"expected a {expect!r} message, got {message.kind!r}")
    return message


def _read_exactly(sock: socket.socket, count: int, deadline: float, what: str) -> bytes:
    chunks, got = [], 0
    while got < count:
        left = deadline - time.monotonic()
        if left <= 0:
            raise ProtocolError(f"timed out waiting for the {what}: {got} of {count} bytes arrived")
        sock.settimeout(left)
        try:
            chunk = sock.recv(min(count - got, 1 << 20))
        except TimeoutError:
            continue  # the deadline check above reports it
        except OSError as err:
            raise ProtocolError(f"connection failed while reading the {what}: {err}") from None
        if not chunk:
            raise ProtocolError(f"truncated message: connection closed after {got} of {count} {what} bytes")
        chunks.append(chunk)
        got += len(chunk)
    return b"".join(chunks)


def _reject_constant(name: str) -> None:
    raise ProtocolError(f"message body holds {name}, which is not a number")


class Fields:
    """Typed access to one JSON object from a peer; ``where`` prefixes every error.

    Each getter raises ProtocolError naming the field's path and the bad value.
    """

    def __init__(self, value: Any, where: str) -> None:
        if not isinstance(value, dict):
            raise ProtocolError(f"{where}: expected an object, got {_show(value)}")
        self.data: dict[str, Any] = value
        self.where = where

    def _get(self, name: str) -> Any:
        if name not in self.data:
            raise ProtocolError(f"{self.where}.{name}: missing")
        return self.data[name]

    def integer(self, name: str, *, minimum: int = 0, maximum: int = U64_MAX) -> int:
        return check_int(self._get(name), f"{self.where}.{name}", minimum=minimum, maximum=maximum)

    def text(self, name: str, *, max_length: int = 256) -> str:
        value = self._get(name)
        if not isinstance(value, str) or not value or len(value) > max_length:
            raise ProtocolError(
                f"{self.where}.{name}: expected a string of 1 to {max_length} characters, got {_show(value)}"
            )
        return value

    def items(self, name: str, *, max_length: int = 1 << 24) -> list[Any]:
        value = self._get(name)
        if not isinstance(value, list) or len(value) > max_length:
            raise ProtocolError(
                f"{self.where}.{name}: expected a list of at most {max_length} items, got {_show(value)}"
            )
        return value

    def fields(self, name: str) -> Fields:
        return Fields(self._get(name), f"{self.where}.{name}")

    def integers(self, name: str, *, minimum: int = 0, maximum: int = U64_MAX) -> list[int]:
        where = f"{self.where}.{name}"
        return [check_int(v, f"{where}[{i}]", minimum=minimum, maximum=maximum) for i, v in enumerate(self.items(name))]


def check_int(value: Any, where: str, *, minimum: int = 0, maximum: int = U64_MAX) -> int:
    """``value`` as an int in [minimum, maximum]; booleans and floats are rejected."""
    if isinstance(value, bool) or not isinstance(value, int) or not minimum <= value <= maximum:
        raise ProtocolError(f"{where}: expected an integer in [{minimum}, {maximum}], got {_show(value)}")
    return value


def _show(value: Any) -> str:
    text = repr(value)
    if isinstance(value, float) and not math.isfinite(value):
        text = str(value)
    return text if len(text) <= 60 else text[:57] + "..."
