"""The prefill side of ``kvhost.nixl.peers``: one loop that serves many decode engines at once.

``Server.serve`` accepts connections on a listening socket and walks each through the
handshake (knock, challenge, engine, offer) to a *hold*: the peer reads the blocks it was
offered with NIXL while the server waits for its ``done``. A hold ends when the peer says
``done``, closes its socket (its process ended), or stops beating for ``peer_timeout``
seconds (its host or the link went down: no socket ever closes then); ``release`` is
called at once, so the application lets go of what it held for that peer.

Nothing a peer does is trusted: before it proves the secret a connection may send one
frame of at most ``AUTH_FRAME_BYTES`` (its engine message at most ``ENGINE_FRAME_BYTES``)
within ``auth_timeout`` seconds; at most ``MAX_CONNECTIONS`` connections are held, an
unproven one dropped for a new one (one of the address holding the most unproven ones, so
that a flood from one host churns its own; of those the oldest not yet challenged, which
``connect`` tries again, else the oldest); frames are read only up to their
end, and a held peer may send only small frames. Only proven peers keep the server from
its idle stop, and a peer the application's ``offer`` fails for is refused alone.
Everything runs on the calling thread and nothing blocks it: an offer (megabytes of agent
metadata) goes out as its peer reads it, within ``send_timeout`` (the time the loop spends
in the application's steps not counted), while the others are served; a process out of file
descriptors pauses accepting instead of spinning.
"""

from __future__ import annotations

import contextlib
import errno
import os
import selectors
import socket
import time
from collections import Counter, deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from kvhost.errors import ArgumentError
from kvhost.nixl.engine import EngineSpec, check_compatible
from kvhost.nixl.errors import InvalidTimeoutError, PeerClosedError, ProtocolError
from kvhost.nixl.fields import Fields, check_seconds, show
from kvhost.nixl.framing import Message, encode, read_arrived, send
from kvhost.nixl.handshake import AUTH_FRAME_BYTES, AUTH_SECONDS
from kvhost.nixl.peers import (
    BEAT,
    CHALLENGE,
    DONE,
    ENGINE,
    ENGINE_FRAME_BYTES,
    HELD,
    KNOCK,
    MAX_BEAT_SECONDS,
    MAX_REASON_CHARACTERS,
    MIN_BEAT_SECONDS,
    NONCE_BYTES,
    OFFER,
    REFUSE,
    Offer,
    check_secret,
    nonce_of,
    printable_reason,
    proof,
    proves,
)

MAX_CONNECTIONS = 64  # proven or not, held at once
ACCEPT_PAUSE = 0.1  # seconds the listener waits when the process is out of file descriptors
MAX_RECORDS = 1024  # the latest proven peers' records kept (a server may run for months); counts keep all


@dataclass(frozen=True)
class PeerHello:
    """A decode engine that proved the secret: where from, its spec, and all it said."""

    address: str
    spec: EngineSpec
    fields: Fields = field(repr=False)


@dataclass
class PeerRecord:
    """What became of one decode engine that was offered blocks (or refused).

    ``outcome``: ``done`` (it said so), ``closed`` (its socket closed first), ``silent`` (no
    beat for ``peer_timeout`` seconds), ``refused`` (the engines cannot work together, or the
    application's ``offer`` refused it; by either side), ``failed`` (the offer could not be
    sent, or the peer sent what a held peer may not). ``requests``: how many it was offered.
    """

    address: str
    outcome: str = ""
    detail: str = ""
    requests: int = 0
    held_seconds: float = 0.0
    ok: bool | None = None  # what ``done`` said


@dataclass(eq=False)
class _Connection:
    sock: socket.socket
    address: str
    host: str  # the address without its port: connections are weighed by the host they come from
    deadline: float
    # What it must send next: knock, engine, nothing while its offer goes out (offer), beats and done.
    stage: str = KNOCK
    data: bytearray = field(default_factory=bytearray)
    outbox: memoryview = field(default_factory=lambda: memoryview(b""))  # what is left to send of its offer
    nonces: tuple[bytes, bytes] = (b"", b"")
    record: PeerRecord | None = None  # set once it proves the secret; an unproven one is only closed
    held_since: float = 0.0
    offered: bool = False  # the application's ``offer`` returned: it holds something until ``release``
    away_at_offer: float = 0.0  # the server's ``away`` when its offer began to go out
    away_at_accept: float = 0.0  # the server's ``away`` when it was accepted


class Server:
    """Serves ``spec``'s blocks to decode engines that prove ``secret``.

    ``offer(peer)`` says what a peer that proved itself and can be served gets (it may
    raise ProtocolError to refuse it, with its message, whose unprintable characters decode
    hears escaped; any other exception refuses that peer too, naming the exception);
    ``release(record)`` is called when a hold ends, however it ends (what it raises is
    logged: the other peers are still served). ``log`` receives one line per event worth telling.
    """

    def __init__(
        self,
        listener: socket.socket,
        secret: bytes,
        spec: EngineSpec,
        offer: Callable[[PeerHello], Offer],
        *,
        release: Callable[[PeerRecord], None] | None = None,
        peer_timeout: float = 5.0,
        auth_timeout: float = AUTH_SECONDS,
        send_timeout: float = 10.0,
        log: Callable[[str], None] | None = None,
    ) -> None:
        if not isinstance(listener, socket.socket):
            raise ArgumentError(f"listener must be a listening socket, got {type(listener).__name__}")
        if not isinstance(spec, EngineSpec):
            raise ArgumentError(f"spec must be an EngineSpec, got {type(spec).__name__}")
        if not callable(offer) or any(f is not None and not callable(f) for f in (release, log)):
            raise ArgumentError("offer (and release and log, where given) must be callables")
        self.listener = listener
        self.secret = check_secret(secret)
        self.spec = spec
        self.offer = offer
        self.release = release
        self.peer_timeout = check_seconds(peer_timeout, "peer timeout", positive=True)
        if self.peer_timeout < 4 * MIN_BEAT_SECONDS:
            raise InvalidTimeoutError(
                f"peer timeout {peer_timeout!r}: at least {4 * MIN_BEAT_SECONDS:g} s, four of the shortest beats "
                f"({MIN_BEAT_SECONDS:g} s) a decode is told to send"
            )
        self.auth_timeout = check_seconds(auth_timeout, "auth timeout", positive=True)
        self.send_timeout = check_seconds(send_timeout, "send timeout", positive=True)
        self._log = log or _say_nothing
        self.records: deque[PeerRecord] = deque(maxlen=MAX_RECORDS)  # the latest, held ones included
        self.proven = 0  # connections that proved the secret: peers
        self.ended: Counter[str] = Counter()  # peers whose holds ended, by outcome
        self.done_ok = 0  # peers that said done, and that all went well
        self.dropped = 0  # connections that never proved the secret
        self._connections: dict[socket.socket, _Connection] = {}
        self._accept_paused_until = 0.0  # out of file descriptors: the listener waits until then
        self._short_of_descriptors = False  # told once an episode, not every pause
        self._drain_until: float | None = None  # draining (``drain``): serve returns by then at the latest
        # Seconds this loop spent in the application's steps (an offer, a release, a log line):
        # an offer being sent meanwhile was not written, and its send deadline does not count them.
        self._away = 0.0

    @property
    def served(self) -> int:
        """Peers offered blocks so far (proven and not refused), held ones included."""
        return self.proven - self.ended["refused"]

    @property
    def beat_seconds(self) -> float:
        """How often peers are told to beat: four beats fit in ``peer_timeout``."""
        return min(max(self.peer_timeout / 4, MIN_BEAT_SECONDS), MAX_BEAT_SECONDS)

    def drain(self, seconds: float) -> None:
        """Stop serving gently (a rolling restart): ``serve`` takes no new peer, ends those it
        has not offered blocks yet, and returns once every hold has ended (its decode read
        and said done) or after ``seconds`` (counted from this call, whatever an earlier one
        said). A signal handler may call it while ``serve`` runs."""
        self._drain_until = time.monotonic() + check_seconds(seconds, "drain timeout")

    @property
    def draining(self) -> bool:
        return self._drain_until is not None

    def serve(self, *, peers: int | None, idle_timeout: float, stop: Callable[[], bool] | None = None) -> None:
        """Serve until ``peers`` holds have ended (None: until ``stop`` says so, or a ``drain``
        ends), or until no proven peer has been held for ``idle_timeout`` seconds. Every
        connection still open when it returns is closed (and a hold released)."""
        idle = check_seconds(idle_timeout, "idle timeout", positive=True)
        if peers is not None and (type(peers) is not int or peers < 1):  # a bool, 2.5 or NaN is no count of peers
            raise ArgumentError(f"peers: expected None or an int of at least 1, got {show(peers)}")
        if stop is not None and not callable(stop):  # stop=False would be read as "never", True as an error later
            raise ArgumentError(f"stop: expected None or a callable, got {show(stop)}")
        self.listener.setblocking(False)
        self._accept_paused_until = 0.0  # a pause of an earlier serve ended with its selector
        quiet_since = time.monotonic()
        with selectors.DefaultSelector() as selector:
            selector.register(self.listener, selectors.EVENT_READ)
            try:
                while True:
                    if (peers is not None and self.served >= peers and not self._holding()) or (stop and stop()):
                        return
                    now = time.monotonic()
                    if self._drain_until is not None and self._drained(selector, self._drain_until, now):
                        return
                    if any(c.record is not None for c in self._connections.values()):
                        quiet_since = now  # strays that never prove the secret do not keep the cache served
                    elif now - quiet_since > idle:
                        self._tell(f"no decode engine for {idle:g} s: stopping")
                        return
                    if self._accept_paused_until and now >= self._accept_paused_until and not self.draining:
                        self._accept_paused_until = 0.0
                        selector.register(self.listener, selectors.EVENT_READ)
                    for key, events in selector.select(timeout=0.05):
                        if key.fileobj is self.listener:
                            self._accept(selector)
                            continue
                        if events & selectors.EVENT_WRITE and key.fileobj in self._connections:
                            self._write(selector, self._connections[key.fileobj])
                        if events & selectors.EVENT_READ and key.fileobj in self._connections:
                            self._read(selector, self._connections[key.fileobj])
                    # Deadlines only after what had arrived was read: a step that took long here
                    # (the application's offer, a release) must not end peers whose beats wait unread.
                    self._expire(selector, time.monotonic())
            finally:
                for conn in list(self._connections.values()):
                    self._end(selector, conn, "closed", "the server stopped")

    def _drained(self, selector: selectors.BaseSelector, until: float, now: float) -> bool:
        """While draining (until ``until``): no new peer, none but those held; True once none
        is held or the drain's time is up."""
        held = sum(c.offered for c in self._connections.values())
        if self.listener in selector.get_map():
            selector.unregister(self.listener)
            self._tell(f"draining: no new decode engine; {held} held finish their reads, {until - now:.3g} s at most")
        for conn in [c for c in self._connections.values() if not c.offered]:
            self._end(selector, conn, "closed", "the server is stopping")
        if held and now <= until:
            return False
        self._tell(f"drained: {f'{held} hold(s) still open at the drain timeout' if held else 'every hold ended'}")
        return True

    def _tell(self, line: str) -> None:
        """``log``'s line; a log that fails (stdout's reader gone) must not end the serving."""
        with contextlib.suppress(Exception), self._application_step():
            self._log(line)

    @contextlib.contextmanager
    def _application_step(self) -> Iterator[None]:
        started = time.monotonic()
        try:
            yield
        finally:
            self._away += time.monotonic() - started

    def _holding(self) -> bool:
        return any(c.offered for c in self._connections.values())

    def _expire(self, selector: selectors.BaseSelector, now: float) -> None:
        for conn in [c for c in self._connections.values() if now > c.deadline]:
            if conn.stage == OFFER:
                # Its offer is written only while this loop waits in select: the time the loop
                # spent in the application's steps meanwhile (another peer's offer) is not the
                # peer's to answer for.
                if time.monotonic() <= conn.deadline + (self._away - conn.away_at_offer):
                    continue
                detail = f"could not send 'offer' within {self.send_timeout:g} s: the peer does not read"
                self._end(selector, conn, "failed", detail)
                continue
            # What arrived while a long step held this loop (an application's offer, a release)
            # is read before its deadline is judged: the select batch that step ran in was taken
            # before it.
            self._read(selector, conn)
            # One still proving the secret is not charged for the application's steps either:
            # a knock read late was challenged just now, and its answer cannot be in yet.
            grace = self._away - conn.away_at_accept if conn.record is None else 0.0
            if conn.sock in self._connections and time.monotonic() > conn.deadline + grace:
                # a held peer that stopped beating, or one that did not prove the secret in time
                self._end(selector, conn, "silent", f"no beat for {self.peer_timeout:g} s")

    def _accept(self, selector: selectors.BaseSelector) -> None:
        while True:
            try:
                sock, address = self.listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as err:
                if err.errno in (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM):
                    # The connection stays queued and the listener readable: accepting again at
                    # once would spin. Served peers go on; the listener waits a while.
                    if not self._short_of_descriptors:
                        self._tell(f"cannot accept a connection ({err.strerror}): pausing {ACCEPT_PAUSE:g} s at a time")
                    self._short_of_descriptors = True
                    selector.unregister(self.listener)
                    self._accept_paused_until = time.monotonic() + ACCEPT_PAUSE
                return  # otherwise the peer gave up between the listen queue and accept
            self._short_of_descriptors = False
            if len(self._connections) >= MAX_CONNECTIONS:
                unproven = [c for c in self._connections.values() if c.record is None]
                if not unproven:
                    sock.close()
                    self.dropped += 1
                    continue
                # One of the host that holds the most (a flood from one address churns its own
                # connections, not a decode's from elsewhere); of its, the oldest not yet
                # challenged (``connect`` tries again), else the oldest.
                held = Counter(c.host for c in unproven)
                busiest = max(held, key=held.__getitem__)  # of a tie, the host seen first
                theirs = [c for c in unproven if c.host == busiest]
                self._end(selector, min(theirs, key=lambda c: c.stage != KNOCK), "", "")
            sock.setblocking(False)
            conn = _Connection(sock, f"{address[0]}:{address[1]}", address[0], time.monotonic() + self.auth_timeout)
            conn.away_at_accept = self._away
            self._connections[sock] = conn
            selector.register(sock, selectors.EVENT_READ)

    def _read(self, selector: selectors.BaseSelector, conn: _Connection) -> None:
        limit = ENGINE_FRAME_BYTES if conn.stage == ENGINE else AUTH_FRAME_BYTES
        try:
            message = read_arrived(conn.sock, conn.data, limit)
        except PeerClosedError as err:
            self._end(selector, conn, "closed", str(err))
            return
        except ProtocolError as err:
            self._end(selector, conn, "failed", str(err))
            return
        if message is None:
            return
        try:
            if conn.stage == KNOCK and message.kind == KNOCK:
                self._challenge(conn, message)
            elif conn.stage == ENGINE and message.kind == ENGINE:
                self._answer(selector, conn, message)
            elif conn.stage == BEAT and message.kind == BEAT:
                conn.deadline = time.monotonic() + self.peer_timeout
                # Held still: say so, so that decode may trust the reads it ended before this beat.
                self._say_held(selector, conn, {"n": message.fields().integer("n", maximum=1 << 62)})
            elif conn.stage == BEAT and message.kind == DONE:
                assert conn.record is not None
                conn.record.ok = message.fields().data.get("ok") is True
                # It read everything while held: say so before letting go (a decode that
                # hears nothing cannot trust its bytes). A peer gone meanwhile changes nothing.
                self._say_held(selector, conn, {"done": True})
                if conn.sock in self._connections:
                    self._end(selector, conn, "done", "")
            elif conn.stage == BEAT and message.kind == REFUSE:
                self._end(selector, conn, "refused", message.fields().text("reason", max_length=MAX_REASON_CHARACTERS))
            else:
                raise ProtocolError(f"unexpected {message.kind!r:.40} message")
        except ProtocolError as err:
            self._end(selector, conn, "failed", str(err))

    def _say_held(self, selector: selectors.BaseSelector, conn: _Connection, header: dict[str, object]) -> None:
        """``held``, sent whole at once or not at all: a peer that does not read these few
        bytes (the socket's buffer full of them) is ended, never waited for."""
        frame = encode(HELD, header)
        try:
            sent = conn.sock.send(frame)
        except (BlockingIOError, InterruptedError):
            sent = 0
        except OSError:  # gone: its socket's own end says so next
            return
        if sent != len(frame):
            self._end(selector, conn, "failed", "it does not read prefill's answers to its beats")

    def _challenge(self, conn: _Connection, message: Message) -> None:
        mine = os.urandom(NONCE_BYTES)
        conn.nonces = (nonce_of(message.fields()), mine)
        _send(conn.sock, CHALLENGE, {"nonce": mine.hex(), "proof": proof(self.secret, "prefill", conn.nonces)}, 1.0)
        conn.stage = ENGINE

    def _answer(self, selector: selectors.BaseSelector, conn: _Connection, message: Message) -> None:
        fields = message.fields()
        if not proves(self.secret, "decode", conn.nonces, fields.text("proof", max_length=64)):
            raise ProtocolError("wrong proof of the secret")
        record = conn.record = PeerRecord(conn.address)
        self.records.append(record)  # proven: from here on it is a peer, and what happens to it is recorded
        self.proven += 1
        conn.held_since = time.monotonic()
        try:
            spec = EngineSpec.from_dict(fields.fields("engine").data, "engine.engine")
            check_compatible(spec, self.spec, local_name="decode", remote_name="prefill")  # a ProtocolError
            with self._application_step():
                offer = self.offer(PeerHello(conn.address, spec, fields))
                conn.offered = True
                record.requests = len(offer.requests)
                offer = Offer(offer.spec, offer.tables, offer.metadata, offer.requests, self.beat_seconds, offer.extra)
                conn.outbox = memoryview(encode(OFFER, offer.header(), b"".join(offer.metadata)))
        except Exception as err:  # the application's offer failed for this peer, or is not one: refused alone
            reason = str(err) if isinstance(err, ProtocolError) else f"the offer failed: {type(err).__name__}: {err}"
            with contextlib.suppress(ProtocolError):
                _send(conn.sock, REFUSE, {"reason": printable_reason(reason)}, self.send_timeout)
            self._end(selector, conn, "refused", reason)
            return
        conn.stage, conn.deadline, conn.away_at_offer = OFFER, time.monotonic() + self.send_timeout, self._away
        selector.modify(conn.sock, selectors.EVENT_READ | selectors.EVENT_WRITE)

    def _write(self, selector: selectors.BaseSelector, conn: _Connection) -> None:
        """Send what the socket takes of a peer's offer; once all is sent, the hold begins."""
        try:
            sent = conn.sock.send(conn.outbox)
        except (BlockingIOError, InterruptedError):
            return
        except OSError as err:
            self._end(selector, conn, "failed", f"could not send 'offer': {err}")
            return
        conn.outbox = conn.outbox[sent:]
        if conn.outbox:
            return
        selector.modify(conn.sock, selectors.EVENT_READ)
        conn.stage, conn.deadline = BEAT, time.monotonic() + self.peer_timeout
        assert conn.record is not None
        self._tell(f"offered {conn.record.requests} requests to decode at {conn.address}")

    def _end(self, selector: selectors.BaseSelector, conn: _Connection, outcome: str, detail: str) -> None:
        """Close a connection; a proven one's record says how it ended (``outcome``, ``detail``),
        and ``release`` is told if the application made it an offer, whoever ended the hold."""
        selector.unregister(conn.sock)
        del self._connections[conn.sock]
        try:
            conn.sock.close()
        except OSError as err:  # close(2) lets go of the descriptor even when it reports an error: the hold ends
            self._tell(f"closing decode at {conn.address} failed: {type(err).__name__}: {err}")
        if conn.record is None:
            self.dropped += 1
            return
        conn.record.outcome, conn.record.detail = outcome, detail
        conn.record.held_seconds = time.monotonic() - conn.held_since
        self.ended[outcome] += 1
        self.done_ok += outcome == "done" and conn.record.ok is True
        failed = None
        if self.release is not None and conn.offered:
            try:
                with self._application_step():
                    self.release(conn.record)
            except Exception as err:  # logged: the other peers, and the connections still to close, come first
                failed = f"release for decode at {conn.address} failed: {type(err).__name__}: {err}"
        self._tell(f"decode at {conn.address}: {conn.record.outcome}" + (f": {detail}" if detail else ""))
        if failed:
            self._tell(failed)


def _say_nothing(line: str) -> None:
    pass


def _send(sock: socket.socket, kind: str, header: dict[str, object], timeout: float, *, blob: bytes = b"") -> None:
    """``framing.send`` on one of the server's sockets, left non-blocking after it as the
    server keeps them; with no time left nothing is offered (half a frame is worse than none)."""
    try:
        if timeout <= 0:
            raise ProtocolError(f"could not send {kind!r} within {timeout:g} s: the peer does not read")
        send(sock, kind, header, blob, timeout=timeout)
    finally:
        with contextlib.suppress(OSError):
            sock.setblocking(False)
