"""The handshake between two engines: who the peer is, what it holds, and when it may let go.

The engine that reads (decode) listens; the engine that holds the blocks (prefill)
connects, and every message is one frame (``kvhost.nixl.framing``):

1. ``auth``: the connecting side proves a secret the listener gave it by a channel of its
   own (``prove``). Until a connection has proved it, it may send one frame of at most
   ``AUTH_FRAME_BYTES`` within ``AUTH_SECONDS``; anything else (garbage, silence, a wrong
   proof) drops it. ``accept_hello`` reads every pending connection at once, so no number
   of strays stalls the real peer.
2. ``hello``: the peer's block table, its NIXL agent metadata (the frame's blob) and the
   requests whose blocks it holds, as columns: names in JSON; numbers, token counts and
   the block ids of all of them back to back as arrays (``send_hello``, ``parse_hello``,
   which checks every field). An application may add fields of its own (``extra``) and
   read them back, with the same checks, from ``Hello.fields``.
3. ``done``: the reader has read every block; the holder may release its memory
   (``send_done``, ``wait_done``).

Every wait has a deadline, and everything a peer sends is bounded in size.
"""

from __future__ import annotations

import hmac
import selectors
import socket
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kvhost.nixl.errors import ProtocolError
from kvhost.nixl.fields import MAX_ARRAY_BYTES, Fields, check_seconds
from kvhost.nixl.framing import Message, read_arrived, receive, send
from kvhost.nixl.tables import RegionTable

AUTH, HELLO, DONE = "auth", "hello", "done"  # the message kinds, in the order they are sent
MAX_REQUESTS = 1 << 14  # requests one hello may announce
MAX_TOKENS = 1 << 24  # tokens of one request
SECRET_BYTES = 32  # exactly: the auth frame carries it as hex
# Before a connection proves who it is, it may send one frame of this many bytes, within
# this many seconds; others are dropped. At most this many such connections are held.
AUTH_FRAME_BYTES = 1024
AUTH_SECONDS = 5.0
MAX_PENDING_CONNECTIONS = 32


@dataclass(frozen=True)
class RemoteRequest:
    """A request whose blocks the peer holds: ``remote_ids`` are blocks of the peer's table."""

    name: str
    number: int
    tokens: int
    remote_ids: Sequence[int] | np.ndarray


@dataclass(frozen=True)
class Hello:
    """What the peer said first, every field checked. ``fields`` is the whole hello, for the
    fields an application adds (``Fields`` checks them as strictly)."""

    pid: int
    table: RegionTable
    requests: list[RemoteRequest]
    metadata: bytes
    fields: Fields = field(repr=False, compare=False)


def prove(sock: socket.socket, secret: bytes, *, timeout: float) -> None:
    """Send the ``auth`` frame that proves ``secret``: the first thing a connecting peer sends."""
    send(sock, AUTH, {"proof": _checked(secret).hex()}, timeout=timeout)


def hello_header(
    table: RegionTable, requests: Sequence[RemoteRequest], *, pid: int, extra: Mapping[str, Any] | None = None
) -> dict[str, Any]:
    """The JSON of a hello: the table, and the requests as columns (bulk integers as arrays)."""
    return {**(extra or {}), "pid": pid, "table": table.to_dict(), "requests": request_columns(requests, table)}


def request_columns(requests: Sequence[RemoteRequest], table: RegionTable) -> dict[str, Any]:
    """Requests whose blocks ``table`` holds, as columns: names (JSON); numbers, token counts
    and the block ids of all of them back to back (arrays)."""
    id_type = np.uint32 if table.num_blocks <= 1 << 32 else np.uint64
    block_ids = [np.asarray(r.remote_ids, dtype=id_type) for r in requests]
    return {
        "name": [r.name for r in requests],
        "number": np.array([r.number for r in requests], dtype=np.uint32),
        "tokens": np.array([r.tokens for r in requests], dtype=np.uint32),
        "block_ids": np.concatenate(block_ids) if block_ids else np.zeros(0, dtype=id_type),
    }


def send_hello(
    sock: socket.socket,
    table: RegionTable,
    requests: Sequence[RemoteRequest],
    metadata: bytes,
    *,
    pid: int,
    timeout: float,
    extra: Mapping[str, Any] | None = None,
) -> None:
    """Say hello: this side's table, its agent ``metadata`` and the requests it holds."""
    send(sock, HELLO, hello_header(table, requests, pid=pid, extra=extra), metadata, timeout=timeout)


def parse_hello(message: Message) -> Hello:
    """The peer's hello, every field checked: a malformed one is a ProtocolError.

    Requests come as columns: names (JSON), numbers, token counts and the block ids of all
    of them back to back (arrays); each request's ids are a view of the frame's bytes.
    """
    fields = message.fields(HELLO)
    table = RegionTable.from_dict(fields.fields("table").data, "hello.table", message.arrays)
    requests = parse_requests(fields.fields("requests"), table.block_size, table.num_blocks)
    if not requests:
        raise ProtocolError("hello.requests.name: empty")
    if not message.blob:
        raise ProtocolError("hello: no agent metadata")
    return Hello(fields.integer("pid", minimum=1, maximum=1 << 31), table, requests, message.blob, fields)


def parse_requests(columns: Fields, block_size: int, num_blocks: int) -> list[RemoteRequest]:
    """Requests sent as ``request_columns``, every field checked: each request's block ids (a
    view of the frame's bytes) must be as many as its tokens fill blocks of ``block_size``,
    each below ``num_blocks``. Names are distinct."""
    where = columns.where
    names = columns.texts("name", max_items=MAX_REQUESTS, max_length=64, distinct=True)
    numbers = columns.array("number", maximum=1 << 31, max_length=MAX_REQUESTS)
    tokens = columns.array("tokens", minimum=1, maximum=MAX_TOKENS, max_length=MAX_REQUESTS)
    for name, values in (("number", numbers), ("tokens", tokens)):
        if values.size != len(names):
            raise ProtocolError(f"{where}.{name}: {values.size} values for {len(names)} requests")
    ends = np.cumsum(-(-tokens.astype(np.int64) // block_size))
    ids = columns.array("block_ids", maximum=num_blocks - 1, max_length=MAX_ARRAY_BYTES)
    needed = int(ends[-1]) if ends.size else 0
    if ids.size != needed:
        raise ProtocolError(
            f"{where}.block_ids: {ids.size} block ids, but the requests' tokens need {needed} blocks of {block_size}"
        )
    starts = [0, *ends[:-1].tolist()]
    return [
        RemoteRequest(name, number, count, ids[start:end])
        for name, number, count, start, end in zip(names, numbers.tolist(), tokens.tolist(), starts, ends.tolist())
    ]


def send_done(sock: socket.socket, *, ok: bool, timeout: float) -> None:
    """Tell the peer every block has been read (``ok``: and all was well)."""
    send(sock, DONE, {"ok": ok}, timeout=timeout)


def wait_done(sock: socket.socket, *, timeout: float) -> Message:
    """Hold on until the peer says ``done``: registered memory must outlive its reads."""
    return receive(sock, timeout=timeout, expect=DONE, limit=AUTH_FRAME_BYTES)


@dataclass
class _Pending:
    """A connection that has not yet proved who it is: its deadline and the bytes so far."""

    deadline: float
    data: bytearray = field(default_factory=bytearray)


def accept_hello(
    listener: socket.socket,
    secret: bytes,
    timeout: float,
    *,
    watch: Callable[[], object] | None = None,
    peer: str = "the peer",
) -> tuple[socket.socket, Hello, int]:
    """Wait for the peer to connect, prove ``secret`` and say hello; returns the connection,
    the hello, and how many other connections were dropped.

    A connection is the peer once its first frame is an ``auth`` whose proof is ``secret``.
    ``watch`` is called between waits (every 50 ms): it raises to give up early (when the
    process that should connect has exited). No peer proving itself within ``timeout``
    seconds is a ProtocolError, as is a malformed hello; ``peer`` names it in messages.
    """
    deadline = time.monotonic() + check_seconds(timeout, "connect timeout")
    _checked(secret)
    pending: dict[socket.socket, _Pending] = {}
    dropped = 0
    chosen: socket.socket | None = None

    def drop(conn: socket.socket) -> None:
        nonlocal dropped
        selector.unregister(conn)
        del pending[conn]
        conn.close()
        dropped += 1

    listener.setblocking(False)
    with selectors.DefaultSelector() as selector:
        selector.register(listener, selectors.EVENT_READ)
        try:
            while chosen is None:
                if watch is not None:
                    watch()
                now = time.monotonic()
                if now > deadline:
                    others = f" ({dropped} other connection(s) dropped)" if dropped else ""
                    raise ProtocolError(f"{peer} did not connect and prove who it is within {timeout:g} s{others}")
                for conn in [c for c, p in pending.items() if now > p.deadline]:
                    drop(conn)
                for key, _ in selector.select(timeout=0.05):
                    if key.fileobj is listener:
                        for conn in _accept_all(listener):
                            if len(pending) >= MAX_PENDING_CONNECTIONS:
                                drop(next(iter(pending)))  # the oldest
                            conn.setblocking(False)
                            pending[conn] = _Pending(min(now + AUTH_SECONDS, deadline))
                            selector.register(conn, selectors.EVENT_READ)
                        continue
                    conn = key.fileobj  # type: ignore[assignment]
                    if conn not in pending:  # dropped as the oldest while this one was ready
                        continue
                    verdict = _read_auth(conn, pending[conn].data, secret)
                    if verdict is True:
                        chosen = conn
                        break
                    if verdict is False:
                        drop(conn)
            selector.unregister(chosen)
            del pending[chosen]
        except BaseException:
            if chosen is not None:
                chosen.close()
            raise
        finally:
            for conn in pending:
                conn.close()
            dropped += len(pending)
    try:
        chosen.setblocking(True)
        left = max(deadline - time.monotonic(), 1.0)
        return chosen, parse_hello(receive(chosen, timeout=left, expect=HELLO)), dropped
    except BaseException:
        chosen.close()
        raise


def _accept_all(listener: socket.socket) -> list[socket.socket]:
    accepted: list[socket.socket] = []
    while True:
        try:
            conn, _ = listener.accept()
        except (BlockingIOError, InterruptedError):
            return accepted
        except OSError:  # the peer gave up between the listen queue and accept
            return accepted
        accepted.append(conn)


def _read_auth(conn: socket.socket, data: bytearray, secret: bytes) -> bool | None:
    """Read what has arrived of a connection's first frame, never past it: True once it is
    an ``auth`` frame proving ``secret``, False when it cannot be one, None while incomplete."""
    try:
        message = read_arrived(conn, data, AUTH_FRAME_BYTES)
        if message is None:
            return None
        proof = message.fields().text("proof", max_length=2 * SECRET_BYTES) if message.kind == AUTH else ""
    except ProtocolError:
        return False
    return hmac.compare_digest(proof.encode(), secret.hex().encode())


def _checked(secret: bytes) -> bytes:
    if not isinstance(secret, bytes) or len(secret) != SECRET_BYTES:
        got = f"{len(secret)} bytes" if isinstance(secret, bytes) else type(secret).__name__
        raise ProtocolError(f"the shared secret must be {SECRET_BYTES} bytes, got {got}")
    return secret
