"""Framed, checksummed messages on the control socket between two engines.

Agent metadata and block tables travel beside NIXL, on a plain TCP socket. A frame is

    magic b"KVHM" | version (1 byte) | JSON length (4) | blob length (4) | array length (4)
    | CRC-32 (4) | JSON object (UTF-8) | blob (opaque bytes: a NIXL agent's metadata)
    | arrays (unsigned little-endian integers)

all header integers big-endian, the CRC covering JSON, blob and arrays. Bulk integers (block
ids, stream addresses) travel as arrays, not JSON, read in place by ``Fields.array``
(``kvhost.nixl.fields``). So a frame costs memory in proportion to its size: its bytes
once (the blob twice while it is copied out), plus what the JSON parses into, which is
bounded absolutely: at most ``MAX_JSON_BYTES`` and ``MAX_JSON_VALUES`` values, counted
from its punctuation before it is parsed.

Lengths are capped before anything is allocated and the CRC catches corruption, so a
malformed or truncated frame is a ``ProtocolError`` that names what was wrong. Every send
and receive has a deadline (``check_seconds``).
"""

from __future__ import annotations

import json
import socket
import struct
import time
import zlib
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kvhost.backend import check_sizes
from kvhost.errors import ArgumentError
from kvhost.ids import integer_value
from kvhost.nixl.errors import PeerClosedError, ProtocolError
from kvhost.nixl.fields import MAX_ARRAY_BYTES, Fields, check_seconds, show

MAGIC = b"KVHM"
VERSION = 2
_HEADER = struct.Struct(">4sBIIII")
HEADER_BYTES = _HEADER.size
MAX_JSON_BYTES = 1 << 20
MAX_JSON_VALUES = 1 << 16
MAX_BLOB_BYTES = 16 << 20


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
    if not isinstance(kind, str) or not isinstance(header, Mapping):
        raise ProtocolError(f"a message is a kind (a str) and a header (a mapping), got {show(kind)}, {show(header)}")
    if not isinstance(blob, (bytes, bytearray)):
        raise ProtocolError(f"message {kind!r}: its blob must be bytes, got {type(blob).__name__}")
    if "kind" in header:  # it would replace the message's own kind
        raise ProtocolError(f"message {kind!r}: its header must not name 'kind'")
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
        if isinstance(value, np.integer):  # a count read from an array: the same number in JSON
            return integer_value(value)
        return value

    try:
        body = json.dumps({"kind": kind, **pack(header)}, separators=(",", ":"), allow_nan=False).encode()
    except (TypeError, ValueError, RecursionError) as err:  # RecursionError: a header that holds itself
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
        raise ProtocolError(f"message has no string 'kind' (got {show(kind)})")
    return Message(kind, header, blob, arrays)


def decode(data: bytes) -> Message:
    """One whole frame from bytes; trailing bytes are an error."""
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise ProtocolError(f"a frame is bytes, got {type(data).__name__}")
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
    """Send one message within ``timeout`` seconds (above 0); a closed, broken or stalled socket is a ProtocolError."""
    # Not 0: a socket given no time is non-blocking, and its send stops wherever the buffer
    # fills, half a frame on the wire.
    seconds = check_seconds(timeout, "send timeout", positive=True)
    frame = encode(kind, header, blob)
    try:
        sock.settimeout(seconds)
        sock.sendall(frame)
    except TimeoutError:
        raise ProtocolError(f"could not send {kind!r} within {seconds:g} s: the peer does not read") from None
    except OSError as err:  # reset or broken: the peer closed it
        raise PeerClosedError(f"could not send {kind!r}: {err}") from None


def receive(sock: socket.socket, *, timeout: float, expect: str | None = None, limit: int | None = None) -> Message:
    """Read one message within ``timeout`` seconds; ``expect`` names the only kind accepted.

    ``limit`` caps the frame's bytes below the protocol's own caps (for a peer that has not
    yet said who it is), checked from the header before anything else is read.
    """
    seconds = check_seconds(timeout, "receive timeout")
    if expect is not None and type(expect) is not str:  # the caller's mistake, not the peer's
        raise ArgumentError(f"expect names a message kind (a str), got {show(expect)}")
    if limit is not None:
        check_sizes(limit=limit)  # NaN would bound nothing
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
        raise ProtocolError(f"expected a {expect!r} message, got {show(message.kind)}")
    return message


def read_arrived(sock: socket.socket, data: bytearray, limit: int) -> Message | None:
    """Read what has arrived of the next frame on a non-blocking socket into ``data`` (kept
    between calls), never past the frame's end: the message once whole (``data`` emptied),
    None while part of it is still to come.

    A header declaring more than ``limit`` bytes in all is refused as soon as it is in:
    the body is neither waited for nor given room. A socket that closes or fails is a
    PeerClosedError; anything else wrong, a ProtocolError.
    """
    while True:
        need = HEADER_BYTES
        if len(data) >= HEADER_BYTES:
            json_len, blob_len, array_len, _ = parse_header(data)
            need = HEADER_BYTES + json_len + blob_len + array_len
            if need > limit:
                raise ProtocolError(f"a frame of {need} bytes, more than the {limit} allowed here")
            if len(data) == need:
                message = decode(bytes(data))
                data.clear()
                return message
        try:
            chunk = sock.recv(need - len(data))
        except (BlockingIOError, InterruptedError):
            return None
        except OSError as err:
            raise PeerClosedError(f"the connection failed: {err}") from None
        if not chunk:
            raise PeerClosedError(
                "the peer closed the connection" + (f" {len(data)} bytes into a frame" if data else "")
            )
        data += chunk  # and round again: a header just completed is checked at once


def _read(sock: socket.socket, count: int, deadline: float, what: str) -> bytearray:
    """Exactly ``count`` bytes in one buffer that grows as they arrive, never ahead of them:
    a header declaring 64 MiB that no byte follows must not hold 64 MiB until the deadline."""
    buffer = bytearray()
    while len(buffer) < count:
        left = deadline - time.monotonic()
        if left <= 0:
            raise ProtocolError(f"timed out waiting for the {what}: {len(buffer)} of {count} bytes arrived")
        sock.settimeout(left)
        try:
            # A read's room grows with what has come (64 KiB, up to 1 MiB): so does its memory.
            chunk = sock.recv(min(count - len(buffer), max(len(buffer), 64 << 10), 1 << 20))
        except TimeoutError:
            continue  # the deadline check above reports it
        except OSError as err:
            raise PeerClosedError(f"connection failed while reading the {what}: {err}") from None
        if not chunk:
            raise PeerClosedError(f"truncated message: connection closed after {len(buffer)} of {count} {what} bytes")
        buffer += chunk
    return buffer


def _reject_constant(name: str) -> None:
    raise ProtocolError(f"message body holds {name}, which is not a number")
