"""Engines on different hosts: the messages between a prefill engine and the decode engines it serves.

The engine that holds the blocks (prefill) listens (``kvhost.nixl.server``); each engine
that reads them (decode) connects to it (``connect``). Both know a shared secret, given
to each by a channel of its own (a file); it never crosses the wire. Every message is one
frame (``kvhost.nixl.framing``):

1. ``knock`` (decode): a fresh nonce.
2. ``challenge`` (prefill): a fresh nonce of its own, and its proof of the secret:
   HMAC-SHA256(secret, "prefill" + both nonces). Decode refuses a prefill that cannot prove it.
3. ``engine`` (decode): its proof, HMAC-SHA256(secret, "decode" + both nonces), its
   ``EngineSpec`` and fields of the application's own (which requests it wants).
4. ``offer`` (prefill): its ``EngineSpec``, one block table and NIXL agent metadata per
   tensor-parallel rank, the requests it holds for this peer, and how often to beat; or
   ``refuse``: one line naming the field the engines disagree on and both values
   (``kvhost.nixl.engine.refusal``). Decode checks the offer the same way, and every
   table against the spec, before it reads a byte.
5. ``beat`` (decode), every ``beat_seconds`` while it reads, and at once when a read has
   ended: a prefill that hears nothing for a few beats knows decode is gone (a host down,
   a link cut: no socket ever closes) and lets go of what it held for it. ``held``
   (prefill) answers each beat it hears while it still holds the blocks.
6. ``done`` (decode): every block read; prefill may let go. ``held`` (prefill): it held
   them until then. A read that no ``held`` followed (prefill heard no beat for its peer
   timeout while decode was frozen, and may have given the blocks to others) is not trusted.

Fresh nonces on both sides make a recorded handshake useless; proofs are compared in
constant time. The channel authenticates the peers, not the bytes after (nor does UCX
its own traffic): across hosts, run it on a network you trust, or under a tunnel.
Every wait has a deadline, and everything a peer sends is bounded in size.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import math
import os
import select
import socket
import stat
import sys
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kvhost.errors import ArgumentError, shown
from kvhost.nixl.engine import (
    EngineSpec,
    IncompatibleEngineError,
    check_compatible,
    table_refusal,
    table_shape_refusal,
)
from kvhost.nixl.errors import HoldLostError, PeerClosedError, ProtocolError
from kvhost.nixl.fields import Fields, check_flag, check_seconds, show
from kvhost.nixl.framing import MAX_BLOB_BYTES, Message, encode, read_arrived, receive, send
from kvhost.nixl.handshake import AUTH_FRAME_BYTES, RemoteRequest, parse_requests, request_columns
from kvhost.nixl.tables import MAX_STREAMS, RegionTable

KNOCK, CHALLENGE, ENGINE, OFFER, REFUSE, BEAT, DONE = "knock", "challenge", "engine", "offer", "refuse", "beat", "done"
HELD = "held"
NONCE_BYTES = 16
SECRET_BYTES = 32  # at least; a secret file holds it as hex
MAX_SECRET_DIGITS = 4096  # hex digits a secret may have: a longer one is refused, not cut
RETRY_SECONDS = 0.2  # between tries to connect, or to shake hands again
ENGINE_FRAME_BYTES = 64 << 10  # an engine message: a spec and the application's few fields
# How often decode must beat, as the prefill tells it: between these (a quarter of the
# prefill's peer timeout, so its shortest timeout is four of the shortest beats).
MIN_BEAT_SECONDS, MAX_BEAT_SECONDS = 0.05, 60.0
# Prefill's answers read at one go: it sends one per beat, so a few at most; one that floods
# them must not keep the reader (and the socket's lock, which ``done`` waits for) past its deadline.
MAX_ANSWERS_AT_ONCE = 64
MAX_REASON_CHARACTERS = 400  # of a refusal: what the other side reads of one


def printable_reason(reason: str) -> str:
    """A refusal's reason as the other side reads one: printable (a line end or an escape
    is refused there as a bad frame, and it would not hear why), so each character that
    is not goes as its escape (``\\n``); at most ``MAX_REASON_CHARACTERS``, never empty.
    Both sides refuse so: prefill's application, and decode refusing an offer."""
    shortened = reason[:MAX_REASON_CHARACTERS]  # before escaping: an exception's message may be huge
    text = "".join(c if c.isprintable() else ascii(c)[1:-1] for c in shortened)
    return text[:MAX_REASON_CHARACTERS] or "no reason given"


def proof(secret: bytes, role: str, nonces: tuple[bytes, bytes]) -> str:
    """What ``role`` sends to prove the secret for this pair of nonces (decode's, prefill's)."""
    return hmac.new(secret, role.encode() + nonces[0] + nonces[1], hashlib.sha256).hexdigest()


def proves(secret: bytes, role: str, nonces: tuple[bytes, bytes], claimed: str) -> bool:
    return hmac.compare_digest(proof(secret, role, nonces).encode(), claimed.encode())


def nonce_of(fields: Fields) -> bytes:
    text = fields.text("nonce", max_length=2 * NONCE_BYTES)
    try:
        value = bytes.fromhex(text)
    except ValueError:
        value = b""
    if len(value) != NONCE_BYTES:
        raise ProtocolError(f"{fields.where}.nonce: expected {NONCE_BYTES} bytes in hex")
    return value


def check_secret(secret: Any) -> bytes:
    """A shared secret as the handshake takes it: bytes, at least ``SECRET_BYTES`` of them
    (an empty key would let anyone prove it)."""
    if not isinstance(secret, bytes) or len(secret) < SECRET_BYTES:
        got = f"{len(secret)} bytes" if isinstance(secret, bytes) else type(secret).__name__
        raise ProtocolError(f"the shared secret must be at least {SECRET_BYTES} bytes, got {got}")
    return secret


def read_secret_file(path: str, *, timeout: float = 10.0) -> bytes:
    """The shared secret from a file of hex digits (at least ``SECRET_BYTES`` bytes' worth).

    ``-`` reads one line from standard input, within ``timeout`` seconds (not argv, not the
    environment: any local user can read a process's command line). A file others may
    read is refused: the secret is what keeps strangers from reading the cache; so is
    anything but a regular file (a FIFO with no writer would block its open forever).
    """
    most = MAX_SECRET_DIGITS + 2  # and a line end
    seconds = check_seconds(timeout, "secret timeout")  # checked whatever the path: not only for standard input
    if not isinstance(path, (str, os.PathLike)):
        raise ArgumentError(f"a secret file is a path, got {type(path).__name__}")
    if path == "-":
        where = "standard input"
        data = _read_line(sys.stdin.fileno(), seconds, most, where)
        data = data.split(b"\n", 1)[0]  # what followed the line is not ours
    else:
        where = f"secret file {path}"
        try:
            descriptor = os.open(path, os.O_RDONLY | os.O_NONBLOCK)  # a FIFO opens at once, and is refused below
        except OSError as err:
            raise ProtocolError(f"{where}: {err.strerror}") from None
        except ValueError as err:  # a NUL in the path
            raise ArgumentError(f"{where}: {err}") from None
        try:
            mode = os.fstat(descriptor).st_mode
            if not stat.S_ISREG(mode):
                raise ProtocolError(f"{where}: not a regular file")
            if mode & 0o077:
                raise ProtocolError(f"{where}: readable by others (mode {mode & 0o777:o}); chmod 600 it")
            data = os.read(descriptor, most)
        except OSError as err:
            raise ProtocolError(f"{where}: {err.strerror}") from None
        finally:
            os.close(descriptor)
    try:
        digits = data.decode("ascii").strip()
    except UnicodeDecodeError:
        raise ProtocolError(f"{where}: expected hex digits, got bytes that are not ASCII") from None
    if len(digits) > MAX_SECRET_DIGITS:
        raise ProtocolError(f"{where}: more than {MAX_SECRET_DIGITS} hex digits")
    try:
        secret = bytes.fromhex(digits)
    except ValueError:
        secret = b""
    if len(secret) < SECRET_BYTES:
        raise ProtocolError(f"{where}: expected a secret of at least {SECRET_BYTES} bytes as hex digits")
    return secret


def _read_line(descriptor: int, seconds: float, most: int, where: str) -> bytes:
    """The bytes of ``descriptor`` up to a line end or its end, at most ``most``, within
    ``seconds``: a writer that never ends its line is a ProtocolError at the deadline.
    Read from the descriptor itself (``sys.stdin``'s buffer is bypassed): what follows the
    line in the same read is not left for another reader."""
    deadline = time.monotonic() + seconds
    data = bytearray()
    while b"\n" not in data and len(data) < most:
        left = deadline - time.monotonic()
        if left <= 0 or not select.select([descriptor], [], [], left)[0]:
            raise ProtocolError(f"{where}: no line within {seconds:g} s")
        try:
            chunk = os.read(descriptor, most - len(data))
        except OSError as err:
            raise ProtocolError(f"{where}: {err.strerror}") from None
        if not chunk:  # its end: what came is the line
            break
        data += chunk
    return bytes(data)


def write_secret_file(path: str) -> bytes:
    """A new random secret in a new file only its owner can read (never over an existing one)."""
    secret = os.urandom(SECRET_BYTES)
    try:
        descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except OSError as err:
        raise ProtocolError(f"secret file {path}: {err.strerror}") from None
    with os.fdopen(descriptor, "w") as out:
        out.write(secret.hex() + "\n")
    return secret


@dataclass(frozen=True)
class Offer:
    """What a prefill engine offers one decode engine: per rank its table and agent metadata,
    the requests whose blocks it holds for that peer, and fields of the application's own."""

    spec: EngineSpec
    tables: Sequence[RegionTable]
    metadata: Sequence[bytes]
    requests: Sequence[RemoteRequest]
    beat_seconds: float = 1.0
    extra: Mapping[str, Any] = field(default_factory=dict)
    fields: Fields | None = field(default=None, repr=False, compare=False)

    def header(self) -> dict[str, Any]:
        """The offer's JSON (bulk integers as arrays); its metadata travels as the blob."""
        _check_extra(self.extra, ("engine", "tables", "metadata_bytes", "requests", "beat_seconds"), "offer")
        self._check_sendable()
        return {
            **self.extra,
            "engine": self.spec.to_dict(),
            "tables": [table.to_dict() for table in self.tables],
            "metadata_bytes": np.array([len(m) for m in self.metadata], dtype=np.uint32),
            "requests": request_columns(
                self.requests, min(self.tables, key=lambda t: t.num_blocks), self.spec.block_size
            ),
            "beat_seconds": self.beat_seconds,
        }

    def _check_sendable(self) -> None:
        """What decode would refuse of an offer, said here as the application's mistake
        (decode would name it a ProtocolError of prefill's, or the blob would not join)."""
        if not isinstance(self.spec, EngineSpec):
            raise ArgumentError(f"an offer's spec must be an EngineSpec, got {show(self.spec)}")
        ranks = self.spec.tp_size
        for name in ("tables", "metadata"):
            items = getattr(self, name)
            if not isinstance(items, Sequence) or len(items) != ranks:
                expected = f"a sequence of {ranks} (a rank's each)"
                raise ArgumentError(f"an offer's {name} must be {expected}, got {show(items)}")
        for rank, (table, metadata) in enumerate(zip(self.tables, self.metadata)):
            if not isinstance(table, RegionTable):
                raise ArgumentError(f"an offer's tables[{rank}] must be a RegionTable, got {show(table)}")
            if type(metadata) is not bytes or not 1 <= len(metadata) <= MAX_BLOB_BYTES:
                raise ArgumentError(
                    f"an offer's metadata[{rank}] must be an agent's metadata (1 to {MAX_BLOB_BYTES} bytes), "
                    f"got {show(metadata)}"
                )
        _check_beat(
            check_seconds(self.beat_seconds, "an offer's beat_seconds"), "an offer's beat_seconds", ArgumentError
        )


def _check_beat(beat: float, what: str, error: type[Exception]) -> None:
    """A beat interval decode can keep and prefill can watch; ``error`` says whose mistake."""
    if not MIN_BEAT_SECONDS <= beat <= MAX_BEAT_SECONDS:
        raise error(f"{what} {beat:g} is not in [{MIN_BEAT_SECONDS}, {MAX_BEAT_SECONDS}]")


def _check_extra(extra: Mapping[str, Any], reserved: Sequence[str], what: str) -> None:
    """The application's own fields of a message: named by strings, none of the protocol's
    own (which would overwrite them, unsaid)."""
    if not isinstance(extra, Mapping):
        raise ArgumentError(f"{what}'s extra fields must be a mapping, got {type(extra).__name__}")
    for key in extra:
        if not isinstance(key, str):
            raise ArgumentError(f"{what}'s extra fields must be named by strings, got {shown(key, 40)}")
        if key in reserved:
            raise ArgumentError(f"{what}'s extra field {key!r} is the protocol's own: name it otherwise")


def _refuse_table(problem: str | None) -> None:
    if problem is not None:
        raise IncompatibleEngineError(f"prefill {problem}")


def parse_offer(message: Message, local: EngineSpec) -> Offer:
    """A prefill's offer, every field checked; its engine against ``local`` (a refusal is an
    IncompatibleEngineError naming the field and both values) and each table against its spec."""
    fields = message.fields(OFFER)
    spec = EngineSpec.from_dict(fields.fields("engine").data, "offer.engine")
    check_compatible(local, spec, local_name="decode", remote_name="prefill")
    items = fields.items("tables", max_length=spec.tp_size + 1)
    if len(items) != spec.tp_size:
        raise ProtocolError(f"offer.tables: {len(items)} tables for TP {spec.tp_size}")
    tables: list[RegionTable] = []
    streams_left = MAX_STREAMS  # for the whole offer, not each table: their arrays may share bytes
    for rank, data in enumerate(items):

        def shape(shell: RegionTable, rank: int = rank) -> None:  # before its streams: its sizes bound them
            _refuse_table(table_shape_refusal(spec, rank, shell))

        where = f"offer.tables[{rank}]"
        table = RegionTable.from_dict(data, where, message.arrays, max_streams=streams_left, check=shape)
        streams_left -= len(table.streams)
        _refuse_table(table_refusal(spec, rank, table))
        if tables and (table.order, table.sizes) != (tables[0].order, tables[0].sizes):  # what plan_ranks reads
            _refuse_table(
                f"rank {rank} table: region order {table.order!r} and sizes {table.sizes} differ from rank 0's "
                f"{tables[0].order!r} and {tables[0].sizes}"
            )
        tables.append(table)
    lengths = fields.array("metadata_bytes", minimum=1, maximum=MAX_BLOB_BYTES, max_length=spec.tp_size)
    if lengths.size != spec.tp_size or int(lengths.sum()) != len(message.blob):
        raise ProtocolError(
            f"offer.metadata_bytes: {lengths.tolist()} for {spec.tp_size} ranks and {len(message.blob)} blob bytes"
        )
    ends = np.cumsum(lengths).tolist()
    metadata = [message.blob[start:end] for start, end in zip([0, *ends[:-1]], ends)]
    requests = parse_requests(fields.fields("requests"), spec.block_size, min(t.num_blocks for t in tables))
    beat = fields.seconds("beat_seconds")
    _check_beat(beat, "offer.beat_seconds:", ProtocolError)
    return Offer(spec, tables, metadata, requests, beat, fields=fields)


class Session:
    """One decode engine's connection to one prefill engine: its offer, the beats, ``done``.

    ``start_beats`` sends a beat every ``offer.beat_seconds`` from a thread until ``done``
    or ``close``, and one at once whenever ``ask`` is called; a send that fails ends the
    beats (``beat_error`` says why). Prefill answers each beat with ``held`` while it still
    holds the blocks, and ``done`` the same way.

    A read is good only if prefill held its blocks until it ended: a prefill that heard no
    beat for its peer timeout (this process frozen, the link down) lets go and may give
    them to others. So: ``mark = ask()`` once a read has ended; the read is confirmed once
    ``confirmed(mark)`` (prefill answered a beat sent after it), or once ``done`` returns.
    """

    def __init__(self, sock: socket.socket, address: str, offer: Offer) -> None:
        self.sock = sock
        self.address = address
        self.offer = offer
        self.beat_error: str | None = None
        self.held_through = 0  # the last beat prefill answered with ``held``
        self._held_at_done = False
        self._sent = 0  # beats sent
        self._answers = bytearray()  # what has arrived of prefill's next answer
        self._lock = threading.Lock()  # the socket: one thread sends or reads at a time
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._wake, self._waker = socket.socketpair()  # ``ask`` wakes the beat thread
        self._waker.setblocking(False)

    def start_beats(self) -> None:
        with self._lock:  # one beat thread, whoever calls
            if self._thread is None:
                self._thread = threading.Thread(target=self._beat, name=f"beats to {self.address}", daemon=True)
                self._thread.start()

    def ask(self) -> int:
        """The beat whose ``held`` answer confirms every read ended by now; the beat thread
        sends one at once."""
        mark = self._sent + 1  # sent after this line, whatever the beat thread is doing
        with contextlib.suppress(OSError):  # full or closed: woken already, or gone
            self._waker.send(b"!")
        return mark

    def confirmed(self, mark: int) -> bool:
        """Whether prefill held the blocks past beat ``mark`` (``ask``'s), or until ``done``."""
        return self._held_at_done or self.held_through >= mark

    def _beat(self) -> None:
        interval = self.offer.beat_seconds
        due = time.monotonic() + interval
        while not self._stop.is_set():
            # A socket closed under it (-1) is never ready: the beat's send then says so.
            ready = _readable([self.sock, self._wake], due - time.monotonic())
            with self._lock:
                if self._stop.is_set():  # done was sent while this beat waited for the lock
                    return
                try:
                    if self.sock in ready:
                        self._take_answers()
                    asked = self._wake in ready
                    if asked:
                        with contextlib.suppress(OSError):
                            self._wake.recv(4096)  # every ask so far: one beat answers them all
                    if asked or time.monotonic() >= due:
                        self._sent += 1
                        send(self.sock, BEAT, {"n": self._sent}, timeout=interval)
                        due = time.monotonic() + interval
                except ProtocolError as err:
                    self.beat_error = str(err)
                    return

    def _take_answers(self) -> None:
        """Read prefill's answers that have arrived, at most ``MAX_ANSWERS_AT_ONCE`` of them,
        without waiting for more: the caller checks its deadline between calls."""
        self.sock.setblocking(False)  # ``send`` and ``receive`` set their own timeouts
        for _ in range(MAX_ANSWERS_AT_ONCE):
            message = read_arrived(self.sock, self._answers, AUTH_FRAME_BYTES)
            if message is None:
                return
            if message.kind != HELD:
                raise ProtocolError(f"prefill sent {show(message.kind)} while it held the blocks")
            fields = message.fields()
            if fields.data.get("done") is True:
                self._held_at_done = True
                return  # its last word: the connection's end follows
            self.held_through = max(self.held_through, fields.integer("n", maximum=self._sent))

    def done(self, *, ok: bool, timeout: float) -> None:
        """Tell prefill every block has been read (``ok``: and all was well) and wait, up to
        ``timeout`` seconds in all (above 0), for its word that it held them until then; ends
        the beats.

        A HoldLostError where that word does not come: prefill let go first (no beat reached
        it for its peer timeout, while this process was frozen or the link down) and may have
        reused the blocks, so what was read from it is not to be trusted, but for reads
        ``confirmed`` before.
        """
        # Not 0: no answer can come in no time, so done(timeout=0) could only ever fail, and
        # its send would stop half-way through the frame; refused as the mistake it is.
        seconds = check_seconds(timeout, "done timeout", positive=True)
        check_flag(ok, "ok")  # sent to prefill as given: "no" would be read as a word, not as False
        deadline = time.monotonic() + seconds
        self._stop.set()
        # The beat thread may hold the socket through a beat's send (up to a beat's interval,
        # to a prefill that does not read): waited for no longer than the timeout.
        locked = self._lock.acquire(timeout=seconds)
        try:
            left = deadline - time.monotonic()
            if not locked or left <= 0:
                raise ProtocolError(f"could not send 'done' within {seconds:g} s: a beat being sent held the socket")
            send(self.sock, DONE, {"ok": ok}, timeout=left)
            while not self._held_at_done:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise ProtocolError(f"no answer to 'done' within {seconds:g} s")
                if _readable([self.sock], left):
                    self._take_answers()
        except ProtocolError as err:
            lost = f" (a beat had failed: {self.beat_error})" if self.beat_error else ""
            raise HoldLostError(
                f"prefill at {self.address} did not confirm it held the blocks until 'done'{lost}: {err}; "
                "what was read from it may have been reused"
            ) from None
        finally:
            if locked:
                self._lock.release()

    def close(self) -> None:
        self._stop.set()
        with contextlib.suppress(OSError):
            self._waker.send(b"!")
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=5)  # a beat blocked on a dead link ends within its own timeout
        for sock in (self.sock, self._wake, self._waker):
            with contextlib.suppress(OSError):
                sock.close()


def _readable(socks: Sequence[socket.socket], seconds: float) -> list[socket.socket]:
    """Those of ``socks`` with bytes, or their end, to read within ``seconds``. ``poll``, not
    ``select``: a serving process's descriptors run past select's 1024."""
    poller = select.poll()
    for sock in socks:
        if sock.fileno() < 0:  # closed here (``close`` on another thread): nothing more will come
            raise PeerClosedError("the connection was closed on this side")
        poller.register(sock, select.POLLIN)
    ready = {descriptor for descriptor, _ in poller.poll(math.ceil(max(seconds, 0.0) * 1000))}
    return [sock for sock in socks if sock.fileno() in ready]


def parse_address(text: str, default_host: str = "127.0.0.1") -> tuple[str, int]:
    """``HOST:PORT`` (``[V6]:PORT``, or ``PORT`` alone on ``default_host``) as a pair; a bad one
    is an ArgumentError (a ValueError, as argparse expects of a type)."""
    if not isinstance(text, str):
        raise ArgumentError(f"an address must be a str, HOST:PORT, got {type(text).__name__}")
    if text.startswith("["):  # [V6]:PORT
        host, sep, port = text[1:].partition("]:")
        if not sep or "[" in host or "]" in host:
            raise ArgumentError(f"{text!r} is not [ADDRESS]:PORT")
    else:
        host, sep, port = text.rpartition(":")
        if not sep:
            host, port = default_host, text
        elif ":" in host or "[" in host or "]" in host:  # split at its last colon, an IPv6 address loses a part
            raise ArgumentError(f"{text!r}: an IPv6 address goes in brackets, as [ADDRESS]:PORT")
        host = host or default_host
    if not port.isascii() or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise ArgumentError(f"{text!r} is not HOST:PORT with a port in [0, 65535]")
    _check_host(host, repr(text))
    try:
        host.encode("idna")  # what the resolver is given: an empty label (a..b) or one too long fails
    except UnicodeError as err:
        raise ArgumentError(f"{text!r}: {host!r} is not a host name ({err})") from None
    return host, int(port)


def _check_address(address: object) -> None:
    """A (host, port) pair as given, never coerced: the resolver would take port 65536 + p as
    p, and a host name up to a NUL as the part before it."""
    if not isinstance(address, tuple) or len(address) != 2:
        raise ArgumentError(f"an address must be a (host, port) pair, got {address!r:.80}")
    host, port = address
    if type(port) is not int or not 1 <= port <= 65535:  # 0 is a listener's "any", no one's address
        raise ArgumentError(f"{address!r:.80}: the port must be an int in [1, 65535]")
    _check_host(host, repr(address))


def _check_host(host: object, what: str) -> None:
    if not isinstance(host, str) or not host or not host.isprintable() or " " in host:
        raise ArgumentError(f"{what:.80}: {host!r:.80} is not a host name or address")


def connect(
    address: tuple[str, int],
    secret: bytes,
    spec: EngineSpec,
    *,
    timeout: float,
    extra: Mapping[str, Any] | None = None,
) -> Session:
    """Connect to a prefill engine, prove the secret both ways, and take its offer.

    Connecting is retried until ``timeout`` seconds have passed (the prefill may still be
    starting), and so is the handshake where the prefill closes the connection before it
    challenged this one (a prefill holding as many connections as it may drops one that
    has not been challenged for a new one); every later step has what is left of them. A
    prefill that cannot prove the secret, or says something malformed, is a ProtocolError;
    one whose engine cannot be served is an IncompatibleEngineError (it refused, or decode
    does, naming the field). A host name no resolver could take (an empty label, one too
    long) is a ProtocolError at once; one that does not resolve is tried again until the
    timeout, as a name whose record is still on its way may.
    """
    seconds = check_seconds(timeout, "connect timeout")
    check_secret(secret)
    _check_address(address)
    if not isinstance(spec, EngineSpec):
        raise ArgumentError(f"spec must be an EngineSpec, got {type(spec).__name__}")
    _check_extra({} if extra is None else extra, ("proof", "engine"), "the engine message")
    # Its size as sent (the proof is 64 hex digits whatever the nonces): prefill would drop a
    # larger one unread, and this side would hear only that the connection was reset.
    size = len(encode(ENGINE, {**(extra or {}), "proof": "0" * 64, "engine": spec.to_dict()}))
    if size > ENGINE_FRAME_BYTES:
        raise ArgumentError(
            f"the engine message with these extra fields is {size} bytes; prefill reads at most {ENGINE_FRAME_BYTES}"
        )
    deadline = time.monotonic() + seconds
    name = f"prefill at {address[0]}:{address[1]}"
    while True:  # a try that may be made again: until one more could not end before the deadline
        try:
            sock = _connect(address, deadline, name)
        except OSError as err:
            failed: ProtocolError = ProtocolError(
                f"could not connect to {name} before the connect timeout: {err.strerror or err}"
            )
        else:
            try:
                return _handshake(sock, secret, spec, deadline, name, address, extra)
            except _Unchallenged as err:
                failed = PeerClosedError(f"{name} closed the connection before its challenge: {err}")
        if time.monotonic() + RETRY_SECONDS > deadline:
            raise failed
        time.sleep(RETRY_SECONDS)


class _Unchallenged(PeerClosedError):
    """The prefill closed the connection before it challenged us: nothing was said yet."""


def _handshake(
    sock: socket.socket,
    secret: bytes,
    spec: EngineSpec,
    deadline: float,
    name: str,
    address: tuple[str, int],
    extra: Mapping[str, Any] | None,
) -> Session:
    try:
        mine = os.urandom(NONCE_BYTES)
        with _naming(name, "its challenge"):
            try:
                send(sock, KNOCK, {"nonce": mine.hex()}, timeout=_left(deadline))
                challenge = receive(sock, timeout=_left(deadline), expect=CHALLENGE, limit=AUTH_FRAME_BYTES)
            except PeerClosedError as err:
                raise _Unchallenged(str(err)) from None
            fields = challenge.fields()
            nonces = (mine, nonce_of(fields))
            claimed = fields.text("proof", max_length=64)
        if not proves(secret, "prefill", nonces, claimed):
            raise ProtocolError(f"{name} did not prove the shared secret")
        header = {**(extra or {}), "proof": proof(secret, "decode", nonces), "engine": spec.to_dict()}
        with _naming(name, "its offer"):
            send(sock, ENGINE, header, timeout=_left(deadline))
            answer = receive(sock, timeout=_left(deadline))
            why = answer.fields().text("reason", max_length=MAX_REASON_CHARACTERS) if answer.kind == REFUSE else None
        if why is not None:
            raise IncompatibleEngineError(f"{name} refused: {why}")
        if answer.kind != OFFER:
            raise ProtocolError(f"{name}: expected an offer, got {answer.kind!r:.40}")
        try:
            with _naming(name, "its offer"):
                offer = parse_offer(answer, spec)
        except IncompatibleEngineError as err:
            with contextlib.suppress(ProtocolError):
                send(sock, REFUSE, {"reason": printable_reason(str(err))}, timeout=1.0)
            raise IncompatibleEngineError(f"{name}: {err}") from None
        return Session(sock, f"{address[0]}:{address[1]}", offer)
    except BaseException:
        sock.close()
        raise


@contextlib.contextmanager
def _naming(name: str, step: str) -> Iterator[None]:
    """A protocol error in ``step`` of the handshake names the prefill and the step: a decode
    of several prefill engines must say which failed, and at what (a timeout waiting for an
    offer is not one waiting to connect)."""
    try:
        yield
    except (_Unchallenged, IncompatibleEngineError):
        raise  # named by the caller, or not a fault of the protocol
    except ProtocolError as err:
        raise type(err)(f"{name}, at {step}: {err}") from None


def _left(deadline: float) -> float:
    return max(deadline - time.monotonic(), 0.1)


def _connect(address: tuple[str, int], deadline: float, name: str) -> socket.socket:
    """One try to connect (an OSError may be tried again); a host name no resolver takes is
    a ProtocolError: trying again changes nothing."""
    try:
        candidates = _resolve(address, deadline)
    except UnicodeError as err:
        raise ProtocolError(f"cannot connect to {name}: not a host name ({err})") from None
    failed: OSError = OSError(f"{address[0]!r} resolved to no address")
    for position, (family, kind, protocol, _, sockaddr) in enumerate(candidates):  # in the resolver's order
        sock = None
        try:
            sock = socket.socket(family, kind, protocol)  # a family this host has not (IPv6 off): the next
            # An address that drops what we send must leave time for the others.
            sock.settimeout(max(_left(deadline) / (len(candidates) - position), 0.1))
            sock.connect(sockaddr)
        except OSError as err:
            if sock is not None:
                sock.close()
            failed = err
            continue
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return sock
    raise failed


MAX_LOOKUPS = 8  # host names being resolved at once, across all connects of this process
_lookups = threading.BoundedSemaphore(MAX_LOOKUPS)


def _free_lookups() -> None:
    """In a forked child: the lookups running in the parent are not running here (their
    threads were not copied), so none holds a slot."""
    global _lookups
    _lookups = threading.BoundedSemaphore(MAX_LOOKUPS)


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_free_lookups)

_AddressInfo = tuple[socket.AddressFamily, socket.SocketKind, int, str, Any]


def _resolve(address: tuple[str, int], deadline: float) -> Sequence[_AddressInfo]:
    """The addresses of ``address``'s host, by its deadline. An address written as numbers
    needs no resolver; a name is looked up on a thread of its own, because ``getaddrinfo``
    has no timeout (a resolver that does not answer holds it for tens of seconds). A lookup
    still running at the deadline is left to finish on its thread, and no more than
    ``MAX_LOOKUPS`` run at once: a connect retried against a dead resolver cannot pile up
    threads."""
    host, port = address
    try:
        return socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_NUMERICHOST)
    except socket.gaierror:
        pass  # a name, not numbers
    answer: list[Sequence[_AddressInfo] | BaseException] = []
    finished = threading.Event()
    held = [True]  # the slot, given back once by whichever of the thread and this call gets there first
    holding = threading.Lock()

    def give_back() -> None:
        with holding:
            if held:
                held.clear()
                _lookups.release()

    def look_up() -> None:
        try:
            answer.append(socket.getaddrinfo(host, port, type=socket.SOCK_STREAM))
        except BaseException as err:  # handed to the caller, which raises it
            answer.append(err)
        finally:
            give_back()
            finished.set()

    if not _lookups.acquire(timeout=max(deadline - time.monotonic(), 0.0)):
        raise TimeoutError(f"{MAX_LOOKUPS} host name lookups were still running at the connect timeout")
    try:  # straight after the acquire: an interrupt between the two would lose the slot
        threading.Thread(target=look_up, name=f"kvhost-resolve-{host:.40}", daemon=True).start()
    except BaseException as err:
        # No thread to be had (a process at its limit), or an interrupt (Ctrl-C) inside
        # start(): the slot is given back now, not lost. Had the thread started after all,
        # one lookup runs beyond the bound until it ends, and its own give_back does nothing.
        give_back()
        if isinstance(err, RuntimeError):
            raise OSError(f"could not start a thread to look up host name {host!r:.80}: {err}") from None
        raise
    if not finished.wait(max(deadline - time.monotonic(), 0.0)):
        raise TimeoutError(f"the lookup of host name {host!r:.80} did not finish before the connect timeout")
    result = answer[0]
    if isinstance(result, BaseException):
        raise result
    return result
