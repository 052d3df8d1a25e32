"""Engines on different hosts (kvhost.nixl.peers, kvhost.nixl.server): the handshake, refusals, and letting go.

A ``Server`` runs on a thread with a real listening socket; decode engines are ``connect``
calls (or raw sockets misbehaving). No NIXL: offers carry real tables and stand-in
metadata. Pinned here:

- the secret is proved both ways and never sent; strays and impostors are dropped and do
  not stall a real peer;
- engines that cannot work together are refused at the handshake, in one line naming the
  field and both values, on both sides; pairs that differ only in block size, layout or TP
  are accepted;
- a hold ends, and ``release`` is told, when the peer says done, closes its socket, or
  stops beating (a host or link gone: no socket closes), each within its bound.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import os
import select
import selectors
import socket
import struct
import subprocess
import sys
import threading
import time
from typing import ClassVar
from unittest.mock import patch

import numpy as np
import pytest
import torch
from test_peer_limits import _closed_by_listener

from kvhost.errors import ArgumentError, KVHostError
from kvhost.nixl import (
    EngineSpec,
    HoldLostError,
    IncompatibleEngineError,
    InvalidTimeoutError,
    PeerClosedError,
    ProtocolError,
    RemoteRequest,
    TransferError,
    region_table,
)
from kvhost.nixl import peers as peers_module
from kvhost.nixl import server as server_module
from kvhost.nixl.engine import refusal, table_refusal
from kvhost.nixl.fields import Fields, check_text
from kvhost.nixl.framing import decode, encode, receive, send
from kvhost.nixl.peers import (
    BEAT,
    CHALLENGE,
    DONE,
    ENGINE,
    HELD,
    KNOCK,
    OFFER,
    REFUSE,
    Offer,
    Session,
    connect,
    parse_address,
    parse_offer,
    proof,
    read_secret_file,
    write_secret_file,
)
from kvhost.nixl.server import MAX_CONNECTIONS, PeerHello, Server
from kvhost.testing import make_cache

SECRET = bytes(range(32))
PREFILL = EngineSpec("mha", 2, 4, 8, "bfloat16", 16, "HNC", 2)
DECODE = EngineSpec("mha", 2, 4, 8, "bfloat16", 64, "NHC", 1)


def rank_table(spec, blocks=8):
    sizes = dict(K=2, B=blocks, N=spec.block_size, H=spec.heads_per_rank, C=spec.head_dim)
    memory = "KB" + spec.layout
    caches = {f"layer{i}": make_cache("KBNHC", memory, sizes, torch.bfloat16) for i in range(spec.layers)}
    return caches, region_table(caches, "KBNHC")


class Running:
    """A server on a thread; ``records`` and ``released`` once it returns. Its offer holds
    tables of ``table_spec`` (``spec`` unless told), or refuses every peer with ``refuse``.
    It listens on ``listener`` if given (bound and listening)."""

    def __init__(
        self,
        spec=PREFILL,
        peers=1,
        idle=20.0,
        stop=None,
        table_spec=None,
        refuse=None,
        metadata=None,
        delays=(),
        log=None,
        listener=None,
        **options,
    ):
        self.listener = listener or socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.keep = [rank_table(table_spec or spec) for _ in range(spec.tp_size)]  # the tables' memory stays alive
        self.released = []
        self.lines = []
        self.asked = []

        def offer(peer: PeerHello) -> Offer:
            self.asked.append(peer)
            if len(self.asked) <= len(delays):
                time.sleep(delays[len(self.asked) - 1])  # an application's offer that takes long
            if refuse is not None:
                raise ProtocolError(refuse)
            requests = [RemoteRequest("req-0", 0, 40, [1, 4, 2]), RemoteRequest("req-1", 1, 5, [7])]
            metas = metadata or [b"meta0", b"meta1"][: spec.tp_size]
            return Offer(spec, [t for _, t in self.keep], metas, requests)

        self.server = Server(
            self.listener, SECRET, spec, offer, release=self.released.append, log=log or self.lines.append, **options
        )
        self.thread = threading.Thread(target=self.server.serve, kwargs=dict(peers=peers, idle_timeout=idle, stop=stop))
        self.thread.start()

    def finish(self, within=15.0):
        self.thread.join(within)
        assert not self.thread.is_alive(), "the server did not return"
        self.listener.close()
        return list(self.server.records)


def test_a_decode_engine_takes_the_offer_beats_and_says_done():
    running = Running(peer_timeout=1.0)
    session = connect(("127.0.0.1", running.port), SECRET, DECODE, timeout=10, extra={"want": "all"})
    try:
        offer = session.offer
        assert offer.spec == PREFILL and len(offer.tables) == 2 and offer.metadata == [b"meta0", b"meta1"]
        assert [(r.name, r.tokens, list(r.remote_ids)) for r in offer.requests] == [
            ("req-0", 40, [1, 4, 2]),
            ("req-1", 5, [7]),
        ]
        assert offer.beat_seconds == 0.25
        assert running.asked[0].spec == DECODE and running.asked[0].fields.text("want") == "all"
        assert "fields" not in repr(running.asked[0])  # a log line names the peer, not all 64 KiB it may send
        with pytest.raises(dataclasses.FrozenInstanceError):  # what a peer said is not the application's to change
            running.asked[0].spec = PREFILL  # type: ignore[misc]
        session.start_beats()
        time.sleep(2.0)  # longer than peer_timeout: only the beats keep the hold
        assert not running.released
        session.done(ok=True, timeout=5)
    finally:
        session.close()
    [record] = running.finish()
    assert (record.outcome, record.ok, record.requests) == ("done", True, 2)
    assert running.released == [record] and 2.0 <= record.held_seconds < 10.0
    assert running.lines == [f"offered 2 requests to decode at {record.address}", f"decode at {record.address}: done"]


@pytest.mark.parametrize(
    ("change", "line"),
    [
        (dict(dtype="float16"), "dtype: decode float16, prefill bfloat16 (must agree)"),
        (dict(layers=3), "layers: decode 3, prefill 2 (must agree)"),
        (dict(head_dim=16), "head_dim: decode 16, prefill 8 (must agree)"),
        (
            dict(kv_heads=8),
            "kv_heads: decode 8 (8 per rank x 1), prefill 4 (2 per rank x 2) (the model's KV heads must agree)",
        ),
        (dict(block_size=24), "block_size: decode 24, prefill 16 (neither divides the other)"),
        (dict(kind="mla", kv_heads=1, layout="NC"), "kind: decode mla, prefill mha (must agree)"),
        (dict(layout="LHNC"), "layout: decode LHNC, prefill HNC (blocks that hold different letters)"),
    ],
)
def test_engines_that_cannot_work_together_are_refused_at_the_handshake(change, line):
    running = Running(peers=None, idle=3.0)
    decode = EngineSpec(**{**DECODE.to_dict(), **change})
    started = time.monotonic()
    with pytest.raises(IncompatibleEngineError) as refused:
        connect(("127.0.0.1", running.port), SECRET, decode, timeout=10)
    assert time.monotonic() - started < 5
    assert str(refused.value) == f"prefill at 127.0.0.1:{running.port} refused: {line}"
    assert "\n" not in str(refused.value)
    [record] = running.finish()
    assert (record.outcome, record.detail, record.requests, record.ok) == ("refused", line, 0, None)
    assert not running.released


SPEC_PROBLEMS = [
    (dict(kind="gqa"), "kind: 'gqa' is not one of ('mha', 'mla')"),
    (dict(dtype="float64"), "dtype: 'float64' is not one of ['bfloat16', 'float16', 'float32', 'float8_e4m3fn',"),
    (dict(layers=0), "layers: expected an integer in [1, 32768], got 0"),
    (dict(layers=32769), "layers: expected an integer in [1, 32768], got 32769"),
    (dict(layers=True), "layers: expected an integer in [1, 32768], got True"),
    (dict(layers=2.0), "layers: expected an integer in [1, 32768], got 2.0"),
    (dict(kv_heads=65537, tp_size=1), "kv_heads: expected an integer in [1, 65536], got 65537"),
    (dict(head_dim=(1 << 24) + 1), "head_dim: expected an integer in [1, 16777216], got 16777217"),
    (dict(block_size=0), "block_size: expected an integer in [1, 16777216], got 0"),
    (dict(block_size=(1 << 24) + 1), "block_size: expected an integer in [1, 16777216], got 16777217"),
    (dict(tp_size=1025), "tp_size: expected an integer in [1, 1024], got 1025"),
    (dict(layout="HHC"), "layout: 'HHC' must be distinct letters of 'LKHNC'"),
    (dict(layout="HNX"), "layout: 'HNX' must be distinct letters of 'LKHNC'"),
    (dict(layout="HN"), "layout: 'HN' lacks N or C"),
    (dict(layout="HC"), "layout: 'HC' lacks N or C"),
    (
        dict(kind="mla", kv_heads=1, layout="HNC"),
        "kind: an mla cache has one latent per token (kv_heads 1, no K or H), got 1",
    ),
    (
        dict(kind="mla", kv_heads=1, layout="KNC"),
        "kind: an mla cache has one latent per token (kv_heads 1, no K or H), got 1",
    ),
    (dict(kind="mla", kv_heads=2, layout="NC", tp_size=1), "kind: an mla cache has one latent per token (kv_heads 1"),
    (dict(kv_heads=4, tp_size=3), "kv_heads: 4 cannot be shared evenly by tp_size 3 ranks"),
]


def test_a_dtype_that_is_not_a_name_is_refused_as_such():
    """Built here (a peer's dtype is read as text of 32 characters at most first)."""
    with pytest.raises(ArgumentError, match=r"^dtype: \['bfloat16'\] is not one of \['bfloat16'"):
        EngineSpec(**{**PREFILL.to_dict(), "dtype": ["bfloat16"]})


@pytest.mark.parametrize(("change", "message"), SPEC_PROBLEMS)
def test_a_spec_no_engine_can_have_is_refused_naming_the_field(change, message):
    """Built here it is an ArgumentError; sent by a peer, a ProtocolError that says where."""
    fields = {**PREFILL.to_dict(), **change}
    with pytest.raises(ArgumentError) as built:
        EngineSpec(**fields)
    assert str(built.value).startswith(message)
    with pytest.raises(ProtocolError) as sent:
        EngineSpec.from_dict(fields, "hello.engine")
    # from_dict's own field checks word bad numbers as the spec's check does; either way
    # the message says where the field was found.
    assert str(sent.value).startswith(f"hello.engine.{message}")
    assert not isinstance(sent.value, ArgumentError) and isinstance(sent.value, KVHostError)


@pytest.mark.parametrize("name", ["layers", "kv_heads", "head_dim", "block_size", "tp_size"])
def test_a_peers_numbers_are_checked_as_they_are_read_before_the_spec_is_judged(name):
    """A field that is not a number in range is named before what the spec as a whole
    gets wrong (here an unknown kind)."""
    with pytest.raises(ProtocolError) as refused:
        EngineSpec.from_dict({**PREFILL.to_dict(), "kind": "gqa", name: 0}, "hello.engine")
    assert str(refused.value).startswith(f"hello.engine.{name}: expected an integer in [1, ")


@pytest.mark.parametrize(("name", "most"), [("kind", 8), ("dtype", 32), ("layout", 8)])
def test_a_peers_spec_names_are_bounded_before_they_are_looked_up(name, most):
    """At the bound a name is looked up (and is not one of those known); one character more
    is refused as too long, before any lookup."""
    fields = PREFILL.to_dict()
    with pytest.raises(ProtocolError) as at_most:
        EngineSpec.from_dict({**fields, name: "Z" * most}, "hello.engine")
    assert str(at_most.value).startswith(f"hello.engine.{name}: {'Z' * most!r} ")
    with pytest.raises(ProtocolError) as over:
        EngineSpec.from_dict({**fields, name: "Z" * (most + 1)}, "hello.engine")
    assert str(over.value).startswith(f"hello.engine.{name}: expected a string of 1 to {most} characters")


def test_the_specs_that_are_served_at_the_edges_of_every_bound():
    for change in (
        dict(layers=1),
        dict(layers=32768),
        dict(head_dim=1, block_size=1),
        dict(kv_heads=65536, tp_size=1),
        dict(head_dim=1 << 24),
        dict(block_size=1 << 24, layout="NHC"),
        dict(tp_size=4, kv_heads=4),
        dict(kind="mla", kv_heads=1, layout="NC", tp_size=1024),
        dict(layout="LKHNC"),
        dict(dtype="float8_e5m2"),
    ):
        spec = EngineSpec(**{**PREFILL.to_dict(), **change})
        assert EngineSpec.from_dict(spec.to_dict()) == spec and spec.problem() is None


def test_what_a_spec_says_of_itself():
    assert PREFILL.heads_per_rank == 2 and PREFILL.itemsize == 2
    assert PREFILL.describe() == "mha 2 layers x 4 KV heads x 8 bfloat16, HNC blocks of 16, TP 2"
    assert DECODE.describe() == "mha 2 layers x 4 KV heads x 8 bfloat16, NHC blocks of 64"
    latent = EngineSpec("mla", 3, 1, 576, "float8_e4m3fn", 64, "NC", 4)
    assert latent.heads_per_rank == 1 and latent.itemsize == 1  # every rank holds the latent whole
    assert latent.describe() == "mla 3 layers x latent 576 float8_e4m3fn, NC blocks of 64, TP 4"


@pytest.mark.parametrize(
    "change", [dict(block_size=16), dict(block_size=128), dict(layout="HNC"), dict(tp_size=4), dict(tp_size=2)]
)
def test_block_sizes_layouts_and_tp_that_differ_are_served(change):
    assert refusal(EngineSpec(**{**DECODE.to_dict(), **change}), PREFILL) is None


def test_cross_layer_engines_are_served_together_and_refused_with_per_layer_ones():
    """A cross-layer cache's block holds every layer (region ``LK...``): it is served by
    another cross-layer engine of any major order and block size, not by a per-layer one."""
    crossed = EngineSpec(**{**PREFILL.to_dict(), "layout": "LKHNC"})
    assert refusal(EngineSpec(**{**DECODE.to_dict(), "layout": "LKNHC"}), crossed) is None
    assert refusal(DECODE, crossed) == "layout: local NHC, remote LKHNC (blocks that hold different letters)"


def test_a_table_is_checked_against_its_engines_heads_and_kind():
    """An mha table holds the rank's share of the heads; an mla table holds no heads at all
    (its latent is whole on every rank)."""
    _, table = rank_table(EngineSpec("mha", 2, 4, 8, "bfloat16", 16, "HNC", 1))  # all 4 heads
    assert table_refusal(PREFILL, 0, table) == "rank 0 table: H is 4, the engine says 2"
    assert table_refusal(EngineSpec("mha", 2, 4, 8, "bfloat16", 16, "HNC", 1), 0, table) is None
    latent = EngineSpec("mla", 2, 1, 8, "bfloat16", 16, "NC", 2)
    caches = {f"layer{i}": make_cache("BNC", "BNC", dict(B=8, N=16, C=8), torch.bfloat16) for i in range(2)}
    assert table_refusal(latent, 1, region_table(caches, "BNC")) is None
    _, headed = rank_table(EngineSpec("mha", 2, 2, 8, "bfloat16", 16, "HNC", 1))
    assert table_refusal(latent, 0, headed) == "rank 0 table: an mla cache has no heads, the table has H 2"
    for k, said in ((1, None), (2, "rank 0 table: K is 2, an mla cache has one latent: no K")):
        keyed = {f"layer{i}": make_cache("KBNC", "KBNC", dict(K=k, B=8, N=16, C=8), torch.bfloat16) for i in range(2)}
        assert table_refusal(latent, 0, region_table(keyed, "KBNC")) == said
    sizes = dict(K=2, B=8, N=16, H=2, C=8)
    wide = {f"layer{i}": make_cache("KBNHC", "KBHNC", sizes, torch.float32) for i in range(2)}
    assert table_refusal(PREFILL, 0, region_table(wide, "KBNHC")) == (
        "rank 0 table: item size 4, the engine's bfloat16 has 2"
    )


def test_a_table_that_is_not_what_the_engine_says_is_refused_by_decode():
    _, table = rank_table(EngineSpec("mha", 2, 4, 8, "bfloat16", 32, "HNC", 2))  # blocks of 32, not 16
    assert table_refusal(PREFILL, 1, table) == "rank 1 table: N is 32, the engine says 16"
    _, table = rank_table(EngineSpec("mha", 2, 4, 8, "bfloat16", 16, "NHC", 2))
    assert table_refusal(PREFILL, 0, table) == "rank 0 table: region order 'NHC', the engine says 'HNC'"
    # One head per rank: where H sits moves no byte, so either order names either memory.
    sizes = dict(K=2, B=8, N=16, H=1, C=8)
    for memory in ("KBHNC", "KBNHC"):
        single = region_table({"layer0": make_cache("KBNHC", memory, sizes, torch.bfloat16)}, "KBNHC")
        for layout in ("HNC", "NHC"):
            assert table_refusal(EngineSpec("mha", 1, 2, 8, "bfloat16", 16, layout, 2), 0, single) is None
    _, table = rank_table(EngineSpec("mha", 3, 4, 8, "bfloat16", 16, "HNC", 2))
    assert table_refusal(PREFILL, 0, table) == "rank 0 table: 3 layers, the engine says 2"
    # One tensor holding every layer (vLLM's cross-layer layout): its L axis counts the layers.
    sizes = dict(L=2, K=2, B=8, N=16, H=2, C=8)
    crossed = {"layers": make_cache("LKBNHC", "BLKHNC", sizes, torch.bfloat16)}
    table = region_table(crossed, "LKBNHC")
    assert table_refusal(EngineSpec("mha", 2, 4, 8, "bfloat16", 16, "LKHNC", 2), 0, table) is None
    three = EngineSpec("mha", 3, 4, 8, "bfloat16", 16, "LKHNC", 2)
    assert table_refusal(three, 0, table) == "rank 0 table: 2 layers, the engine says 3"
    halves = {f"half{i}": make_cache("LKBNHC", "BLKHNC", sizes, torch.bfloat16) for i in range(2)}
    assert (
        table_refusal(EngineSpec("mha", 4, 4, 8, "bfloat16", 16, "LKHNC", 2), 0, region_table(halves, "LKBNHC")) is None
    )

    running = Running(peers=None, idle=3.0)
    running.keep[1] = rank_table(EngineSpec("mha", 2, 4, 8, "bfloat16", 32, "HNC", 2))
    with pytest.raises(IncompatibleEngineError, match=r"prefill rank 1 table: N is 32, the engine says 16"):
        connect(("127.0.0.1", running.port), SECRET, DECODE, timeout=10)
    [record] = running.finish()
    assert record.outcome == "refused" and "rank 1 table: N is 32" in record.detail


def test_a_peer_that_stops_beating_is_let_go_within_the_peer_timeout():
    """A host or link gone closes no socket: only the missing beats tell."""
    running = Running(peer_timeout=1.0)
    session = connect(("127.0.0.1", running.port), SECRET, DECODE, timeout=10)
    started = time.monotonic()
    try:
        [record] = running.finish(within=10)  # no beats are sent
        assert time.monotonic() - started < 3.0
        assert (record.outcome, record.detail) == ("silent", "no beat for 1 s")
        assert running.released == [record]
    finally:
        session.close()


def test_a_decode_let_go_while_it_was_frozen_is_told_so_at_done():
    """Frozen past the peer timeout (SIGSTOP, a long pause), decode sent no beat: prefill let
    go and may have given the blocks to others while they were read. ``done`` is answered
    only by a prefill that still held them; without that word nothing read is trusted."""
    running = Running(peer_timeout=1.0)
    session = connect(("127.0.0.1", running.port), SECRET, DECODE, timeout=10)
    try:
        [record] = running.finish(within=10)
        assert record.outcome == "silent" and running.released == [record]
        with pytest.raises(HoldLostError, match=r"did not confirm it held the blocks until 'done'.* may have been"):
            session.done(ok=True, timeout=2)
    finally:
        session.close()


@pytest.mark.parametrize("answer", [None, BEAT, "nothing"])
def test_done_without_prefills_word_that_it_held_the_blocks_is_a_lost_hold(answer):
    """A prefill that does not answer ``done`` in time (frozen), or answers anything but
    ``held``, has not said it held the blocks while they were read."""
    mine, theirs = socket.socketpair()
    session = Session(mine, "prefill-x", offer=None)  # type: ignore[arg-type]
    with theirs, contextlib.closing(session):
        if answer is None:
            send(theirs, HELD, {"done": True}, timeout=1)
            session.done(ok=False, timeout=1)  # ``ok``: what decode tells, not what it hears
        else:
            if answer != "nothing":
                send(theirs, answer, {}, timeout=1)
            started = time.monotonic()
            why = "no answer to 'done' within 0.3 s"
            if answer == BEAT:
                why = "prefill sent 'beat' while it held the blocks"
            with pytest.raises(HoldLostError, match=f"prefill at prefill-x did not confirm .*: {why}") as lost:
                session.done(ok=True, timeout=0.3)
            assert time.monotonic() - started < 1.0  # its timeout, not a second more
            assert "a beat had failed" not in str(lost.value)  # none was sent
        said = receive(theirs, timeout=1, expect=DONE)
        assert said.fields().data == {"ok": answer is not None}


@pytest.mark.timeout(20)
def test_done_while_a_beat_holds_the_socket_past_its_timeout_is_a_lost_hold_and_takes_no_lock_it_lacks():
    """A beat being sent to a prefill that does not read holds the socket: ``done`` waits
    for it no longer than its timeout, says so, and leaves the lock to the beat."""
    session, theirs = _session(beat_seconds=5.0)
    held, release = threading.Event(), threading.Event()

    def beat_sending():
        with session._lock:
            held.set()
            release.wait(10)

    beat = threading.Thread(target=beat_sending)
    with theirs, contextlib.closing(session):
        beat.start()
        held.wait(5)
        try:
            started = time.monotonic()
            why = "could not send 'done' within 0.3 s: a beat being sent held the socket"
            with pytest.raises(HoldLostError, match=why):
                session.done(ok=True, timeout=0.3)
            assert time.monotonic() - started < 1.0
            assert session._lock.locked()  # still the beat's: done let go of nothing it did not take
        finally:
            release.set()
            beat.join(5)
        assert not session._lock.locked()


@pytest.mark.timeout(20)
def test_done_to_a_prefill_that_does_not_read_ends_at_its_timeout_however_full_the_socket():
    """Its send has what is left of the timeout, not more: a prefill frozen with the
    socket's buffers full (no byte of 'done' can go) is a lost hold within the timeout."""
    session, theirs = _session(beat_seconds=5.0)
    with theirs, contextlib.closing(session):
        session.sock.setblocking(False)
        with contextlib.suppress(BlockingIOError):
            while True:  # fill both buffers: prefill reads nothing
                session.sock.send(b"x" * 65536)
        started = time.monotonic()
        with pytest.raises(HoldLostError, match=r"could not send 'done' within 0\.\d+ s: the peer does not read"):
            session.done(ok=True, timeout=0.5)
        assert time.monotonic() - started < 1.5


@pytest.mark.timeout(20)
def test_a_read_is_confirmed_only_by_an_answer_to_a_beat_sent_after_it():
    """Before prefill answers, nothing is confirmed; an answer to an earlier beat confirms
    only the reads asked for before that beat went out."""
    session, theirs = _session(beat_seconds=5.0)
    with theirs, contextlib.closing(session):
        session.start_beats()
        first = session.ask()
        beat = receive(theirs, timeout=2, expect=BEAT).fields().integer("n")
        assert beat == first and not session.confirmed(first)  # sent, not yet answered
        second = session.ask()
        assert second == first + 1 and receive(theirs, timeout=2, expect=BEAT).fields().integer("n") == second
        send(theirs, HELD, {"n": first}, timeout=1)
        deadline = time.monotonic() + 2
        while not session.confirmed(first) and time.monotonic() < deadline:
            time.sleep(0.005)
        assert session.confirmed(first) and not session.confirmed(second)


@pytest.mark.timeout(20)
def test_asking_never_blocks_even_where_no_beat_thread_reads_the_asks():
    """``ask`` is called from decode's loop for every request that lands: with the beats not
    started (or the thread gone), its wake-ups fill their socket, and it must not wait."""
    session, theirs = _session()
    with theirs, contextlib.closing(session):
        session._waker.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
        done = threading.Event()

        def ask_many():
            for _ in range(200_000):
                session.ask()
            done.set()

        threading.Thread(target=ask_many, daemon=True).start()
        assert done.wait(10), "ask blocked on a full wake-up socket"


@pytest.mark.timeout(20)
def test_a_session_closed_under_its_beat_thread_ends_the_beats_and_says_so():
    session, theirs = _session(beat_seconds=0.05)
    with theirs:
        session.start_beats()
        time.sleep(0.1)
        session.sock.close()  # not through close(): the thread is not told to stop
        deadline = time.monotonic() + 5
        while _beat_threads() and time.monotonic() < deadline:
            time.sleep(0.02)
        assert not _beat_threads()
        assert session.beat_error == "could not send 'beat': [Errno 9] Bad file descriptor"
        with pytest.raises(HoldLostError, match=r"'done' \(a beat had failed: could not send 'beat': \[Errno 9\]"):
            session.done(ok=True, timeout=0.3)  # why the hold may have been let go, said with it
        session.close()


@pytest.mark.parametrize("extra", [["pid"], "pid=1"])
def test_extra_fields_that_are_no_mapping_are_refused_before_connecting(extra):
    with pytest.raises(ArgumentError, match="the engine message's extra fields must be a mapping"):
        connect(("127.0.0.1", 1), SECRET, DECODE, timeout=1, extra=extra)


def _asked_and_confirmed(session, within=2.0):
    """Beats started, one asked for: its mark, once prefill's answer confirmed it."""
    session.start_beats()
    mark = session.ask()
    deadline = time.monotonic() + within
    while not session.confirmed(mark) and time.monotonic() < deadline:
        time.sleep(0.005)
    assert session.confirmed(mark)
    return mark


def test_a_read_is_confirmed_by_the_answer_to_a_beat_asked_for_after_it():
    """``ask`` once a read has ended: a beat goes out at once (not at the next interval, here
    5 s away), and prefill's ``held`` answer to it confirms that read; a read asked for later
    is not confirmed by it."""
    running = Running(peer_timeout=20.0)
    session = connect(("127.0.0.1", running.port), SECRET, DECODE, timeout=10)
    try:
        started = time.monotonic()
        first = _asked_and_confirmed(session)
        assert time.monotonic() - started < 1.0
        assert not session.confirmed(first + 1)  # no beat sent after the next read yet
        session.done(ok=True, timeout=5)
        assert session.confirmed(first + 1)  # ``held`` at done: every read
    finally:
        session.close()
    [record] = running.finish()
    assert record.outcome == "done"


def test_reads_confirmed_before_prefill_let_go_stay_confirmed_and_none_after():
    """Frozen past the peer timeout: prefill lets go. What it confirmed before stays good;
    a read that ended afterwards is confirmed by nothing, and done says the hold was lost."""
    running = Running(peer_timeout=0.4)
    session = connect(("127.0.0.1", running.port), SECRET, DECODE, timeout=10)
    try:
        before = _asked_and_confirmed(session)
        with session._lock:  # frozen: no beat goes out
            [record] = running.finish(within=10)
        assert record.outcome == "silent"
        after = session.ask()
        with pytest.raises(HoldLostError):
            session.done(ok=True, timeout=2)
        assert session.confirmed(before) and not session.confirmed(after)
    finally:
        session.close()


def test_decode_sends_its_small_frames_at_once():
    """Beats and ``done`` are a few dozen bytes each: Nagle's algorithm would hold one back
    until the last is acknowledged, so decode's socket has it off."""
    running = Running(peer_timeout=30.0)
    session = connect(("127.0.0.1", running.port), SECRET, DECODE, timeout=10)
    try:
        assert session.sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) != 0
    finally:
        session.close()
    running.finish(within=10)


def test_decodes_own_refusal_is_cut_to_what_prefill_reads(monkeypatch):
    """A refusal decode sends back is cut to the 400 characters prefill reads of a reason,
    so prefill records it as a refusal, with its first 400 characters, not as a bad frame."""
    why = "the table is not what the engine says " * 13  # 494 characters
    monkeypatch.setattr(peers_module, "table_refusal", lambda spec, rank, table: why)
    running = Running(peers=None, idle=1.0)
    with pytest.raises(IncompatibleEngineError, match="the table is not what"):
        connect(("127.0.0.1", running.port), SECRET, DECODE, timeout=10)
    [record] = running.finish(within=5)
    assert (record.outcome, record.detail) == ("refused", f"prefill {why}"[:400])


def _full_pair() -> tuple[socket.socket, socket.socket]:
    """A connected pair whose reader reads nothing and whose buffers are full, the writer
    left non-blocking as the server keeps its sockets."""
    writer, reader = socket.socketpair()
    writer.setblocking(False)
    with contextlib.suppress(BlockingIOError):
        while True:
            writer.send(b"x" * 65536)
    return writer, reader


def test_the_servers_send_gives_up_on_a_peer_that_does_not_read_at_its_deadline():
    writer, reader = _full_pair()
    with writer, reader:
        started = time.monotonic()
        with pytest.raises(ProtocolError, match=r"could not send 'challenge' within 0.3 s: the peer does not read"):
            server_module._send(writer, CHALLENGE, {"nonce": "00"}, 0.3)
        assert 0.25 < time.monotonic() - started < 2.0
        assert writer.gettimeout() == 0.0, "the socket is left non-blocking, as the server keeps it"
        # No time at all: refused before a byte is offered.
        with pytest.raises(ProtocolError, match=r"within 0 s: the peer does not read"):
            server_module._send(writer, CHALLENGE, {"nonce": "00"}, 0.0)


def test_the_servers_send_to_a_peer_that_is_gone_is_a_protocol_error():
    writer, reader = socket.socketpair()
    reader.close()
    with writer, pytest.raises(ProtocolError, match=r"could not send 'refuse': "):
        server_module._send(writer, REFUSE, {"reason": "gone"}, 1.0)


def test_a_peer_whose_process_ends_is_let_go_at_once():
    running = Running(peer_timeout=30.0)
    session = connect(("127.0.0.1", running.port), SECRET, DECODE, timeout=10)
    started = time.monotonic()
    session.close()
    [record] = running.finish(within=10)
    assert time.monotonic() - started < 1.0
    assert record.outcome == "closed" and running.released == [record]


def test_prefill_must_prove_the_secret_too():
    """An impostor listening where decode expects prefill cannot prove the secret."""
    with socket.create_server(("127.0.0.1", 0)) as listener:

        def impostor():
            conn, _ = listener.accept()
            with conn:
                knock = receive(conn, timeout=5, expect=KNOCK)
                send(conn, "challenge", {"nonce": os.urandom(16).hex(), "proof": "00" * 32}, timeout=5)
                del knock
                time.sleep(1)

        thread = threading.Thread(target=impostor)
        thread.start()
        with pytest.raises(ProtocolError, match="did not prove the shared secret"):
            connect(listener.getsockname(), SECRET, DECODE, timeout=5)
        thread.join()


@pytest.mark.parametrize("over", [0, 1])
def test_an_engine_message_of_64_kib_is_heard_and_one_byte_more_is_not(over):
    """Decode's engine message (its spec and the application's fields) is bounded: 64 KiB."""
    from kvhost.nixl.peers import ENGINE

    base = len(encode(ENGINE, {"pad": "", "proof": "0" * 64, "engine": DECODE.to_dict()}))
    pad = "x" * ((64 << 10) - base + over)
    running = Running(peers=1, idle=3.0, peer_timeout=1.0)
    if over:
        # Refused here, before connecting: prefill would close the connection unread and this
        # side hear only that it was reset.
        with pytest.raises(ArgumentError, match=r"is 65537 bytes; prefill reads at most 65536"):
            connect(("127.0.0.1", running.port), SECRET, DECODE, timeout=5, extra={"pad": pad})
        # Sent all the same, prefill closes the connection on the header's lengths, before the body.
        with socket.create_connection(("127.0.0.1", running.port)) as sock:
            mine = os.urandom(16)
            send(sock, KNOCK, {"nonce": mine.hex()}, timeout=5)
            challenge = receive(sock, timeout=5, expect=CHALLENGE)
            nonces = (mine, bytes.fromhex(challenge.fields().text("nonce", max_length=64)))
            header = {"pad": pad, "proof": proof(SECRET, "decode", nonces), "engine": DECODE.to_dict()}
            with contextlib.suppress(OSError):
                sock.sendall(encode(ENGINE, header))
            assert _closed_by_listener(sock, within=3.0)
        assert running.finish() == []  # no peer: it never got as far as an offer
    else:
        session = connect(("127.0.0.1", running.port), SECRET, DECODE, timeout=5, extra={"pad": pad})
        with contextlib.closing(session):
            assert running.asked[0].fields.text("pad", max_length=1 << 16) == pad
            session.done(ok=True, timeout=5)
        running.finish()


def test_strays_and_impostors_are_dropped_and_do_not_stall_a_real_peer():
    running = Running(auth_timeout=1.0, peer_timeout=5.0)
    strays = []
    try:
        for data in (b"GET / HTTP/1.1\r\n\r\n" + os.urandom(100), b"", encode(KNOCK, {"nonce": "zz"})):
            sock = socket.create_connection(("127.0.0.1", running.port))
            sock.sendall(data)
            strays.append(sock)
        big = encode(KNOCK, {"nonce": "x" * 4000})
        strays.append(socket.create_connection(("127.0.0.1", running.port)))
        strays[-1].sendall(big[:24])  # claims a frame far over the limit
        started = time.monotonic()
        with pytest.raises(ProtocolError, match="did not prove"):
            connect(("127.0.0.1", running.port), b"\x01" * 32, DECODE, timeout=5)  # a wrong secret
        session = connect(("127.0.0.1", running.port), SECRET, DECODE, timeout=10)
        assert time.monotonic() - started < 1.0, "strays stalled the real peer"
        session.done(ok=True, timeout=5)
        session.close()
        [record] = running.finish()
        assert record.outcome == "done"
        assert running.server.dropped == len(strays) + 1
        for sock in strays:  # each was closed by the server within the auth timeout
            sock.settimeout(3)
            with contextlib.suppress(OSError):
                while sock.recv(4096):
                    pass
    finally:
        for sock in strays:
            sock.close()


@pytest.mark.parametrize("option", ["peer_timeout", "auth_timeout", "send_timeout"])
@pytest.mark.parametrize("value", [0, -1.0, float("nan"), True])
def test_a_server_refuses_waits_that_are_not_positive_seconds(option, value):
    expected = f"^{option.replace('_', ' ')}: expected a number of seconds in \\(0,"
    with socket.create_server(("127.0.0.1", 0)) as listener, pytest.raises(KVHostError, match=expected):
        Server(listener, SECRET, PREFILL, lambda peer: None, **{option: value})  # type: ignore[arg-type,return-value]


@pytest.mark.parametrize("value", [0, -1.0, float("inf")])
def test_serve_refuses_an_idle_timeout_that_is_not_positive_seconds(value):
    with socket.create_server(("127.0.0.1", 0)) as listener:
        server = Server(listener, SECRET, PREFILL, lambda peer: None)  # type: ignore[arg-type,return-value]
        with pytest.raises(KVHostError, match=r"^idle timeout: expected a number of seconds in \(0,"):
            server.serve(peers=1, idle_timeout=value)
        assert listener.getblocking()  # refused before anything was set up


@pytest.mark.parametrize(
    ("value", "shown"), [(True, "True"), (2.5, "2.5"), (float("nan"), "nan"), (-3, "-3"), (0, "0"), ("2", "'2'")]
)
def test_serve_refuses_a_number_of_peers_that_is_not_an_int_of_at_least_one(value, shown):
    """A bool, a float or a string is no count of peers: NaN served until the idle stop,
    -3 returned at once, "2" was a bare TypeError."""
    with socket.create_server(("127.0.0.1", 0)) as listener:
        server = Server(listener, SECRET, PREFILL, lambda peer: None)  # type: ignore[arg-type,return-value]
        started = time.monotonic()
        with pytest.raises(ArgumentError, match=rf"^peers: expected None or an int of at least 1, got {shown}$"):
            server.serve(peers=value, idle_timeout=0.5)
        assert time.monotonic() - started < 0.4 and listener.getblocking()  # refused before anything was set up


def test_a_drain_with_nothing_held_ends_serve_at_once():
    """A drain takes no new peer and waits for held ones only: with none held, serve says
    so and returns at once, whatever time the drain was given; a drain's time is seconds."""
    with socket.create_server(("127.0.0.1", 0)) as listener:
        lines: list[str] = []
        server = Server(listener, SECRET, PREFILL, lambda peer: None, log=lines.append)  # type: ignore[arg-type,return-value]
        assert server.draining is False
        with pytest.raises(KVHostError, match=r"^drain timeout: expected a number of seconds"):
            server.drain(float("nan"))
        assert server.draining is False
        server.drain(30)
        assert server.draining is True
        started = time.monotonic()
        server.serve(peers=None, idle_timeout=60)
        assert time.monotonic() - started < 5
        assert lines[0].startswith("draining: no new decode engine; 0 held finish their reads, ")
        assert lines[1:] == ["drained: every hold ended"]


def test_a_drain_lets_a_held_decode_finish_and_takes_no_other():
    """Draining: the held decode beats and says done as before; a connection still proving
    itself is closed at once; a new one is not taken (its handshake finds no answer); the
    drain is said once, and serve returns once the hold ends."""
    running = Running(peers=None, idle=30.0, peer_timeout=1.0)
    session = connect(("127.0.0.1", running.port), SECRET, DECODE, timeout=10)
    try:
        session.start_beats()
        with socket.create_connection(("127.0.0.1", running.port)) as stray:  # says nothing yet
            time.sleep(0.3)  # accepted
            running.server.drain(30)
            stray.settimeout(3)
            assert stray.recv(64) == b""  # closed by the drain, not left until its proof's deadline
        with pytest.raises(KVHostError):
            connect(("127.0.0.1", running.port), SECRET, DECODE, timeout=1.0)
        time.sleep(1.5)  # past the peer timeout: the held decode's beats still answered
        assert running.thread.is_alive() and not running.released
        session.done(ok=True, timeout=5)
    finally:
        session.close()
    [record] = running.finish()
    assert record.outcome == "done" and running.server.dropped == 1
    draining = [line for line in running.lines if line.startswith("draining:")]
    assert draining == [draining[0]] and "1 held finish their reads" in draining[0]
    assert running.lines[-2:] == [f"decode at {record.address}: done", "drained: every hold ended"]


def test_a_drain_ends_at_its_time_with_a_hold_still_open():
    running = Running(peers=None, idle=30.0, peer_timeout=5.0)
    session = connect(("127.0.0.1", running.port), SECRET, DECODE, timeout=10)
    try:
        session.start_beats()
        started = time.monotonic()
        running.server.drain(0.5)
        running.thread.join(10)
        assert 0.4 < time.monotonic() - started < 5 and not running.thread.is_alive()
    finally:
        session.close()
    [record] = running.finish()
    assert "drained: 1 hold(s) still open at the drain timeout" in running.lines
    assert record.outcome == "closed" and running.released == [record]


def test_a_server_serves_until_its_number_of_peers_have_ended_refusals_not_counted():
    running = Running(peers=2, peer_timeout=2.0)
    address = ("127.0.0.1", running.port)
    with pytest.raises(IncompatibleEngineError):
        connect(address, SECRET, EngineSpec(**{**DECODE.to_dict(), "layers": 3}), timeout=10)
    first = connect(address, SECRET, DECODE, timeout=10)
    first.done(ok=True, timeout=5)
    first.close()
    time.sleep(0.5)
    assert running.thread.is_alive(), "one refusal and one peer are not two peers"
    second = connect(address, SECRET, DECODE, timeout=10)
    second.done(ok=True, timeout=5)
    second.close()
    records = running.finish(within=5)
    assert [r.outcome for r in records] == ["refused", "done", "done"]


def _knocked(port, source="127.0.0.1"):
    """A connection the server has taken in: it knocked and was challenged, and proved nothing
    yet. Returns the socket and the nonces (its own, the server's) a proof is made over."""
    sock = socket.create_connection(("127.0.0.1", port), source_address=(source, 0))
    mine = os.urandom(16)
    send(sock, KNOCK, {"nonce": mine.hex()}, timeout=5)
    theirs = bytes.fromhex(receive(sock, timeout=5, expect=CHALLENGE).fields().text("nonce"))
    return sock, (mine, theirs)


def test_past_its_bound_of_connections_the_server_closes_the_oldest_unproven_one():
    running = Running(peers=None, idle=1.0, auth_timeout=30.0)
    held = [_knocked(running.port)[0] for _ in range(MAX_CONNECTIONS)]
    try:
        assert MAX_CONNECTIONS == 64
        assert not _closed_by_listener(held[0], within=0.3), "closed at the bound, not past it"
        held.append(_knocked(running.port)[0])
        assert _closed_by_listener(held[0], within=2.0)
        assert not any(_closed_by_listener(sock, within=0.1) for sock in (held[1], held[-2], held[-1]))
        assert running.server.dropped == 1
    finally:
        for sock in held:
            sock.close()
    assert running.finish() == [] and running.server.dropped == MAX_CONNECTIONS + 1


@pytest.mark.timeout(30)
def test_a_knock_read_late_is_not_judged_by_the_time_the_server_spent_elsewhere():
    """The server spends longer than the auth timeout in one peer's application offer; a
    decode accepted before it knocks meanwhile and answers its challenge at once: it is
    served, not dropped for a deadline that ran out while the server could not read it."""
    running = Running(peers=2, idle=10.0, delays=(2.0,), auth_timeout=1.0)
    outcome: dict[str, str] = {}

    def first():
        time.sleep(0.2)
        session = connect(("127.0.0.1", running.port), SECRET, DECODE, timeout=8)
        with contextlib.closing(session):
            session.done(ok=True, timeout=5)

    thread = threading.Thread(target=first)
    with socket.create_connection(("127.0.0.1", running.port)) as sock:  # accepted while the server is idle
        thread.start()
        time.sleep(0.6)  # knocks while the server is in the first peer's offer (0.2 .. 2.2 s)
        mine = os.urandom(16)
        send(sock, KNOCK, {"nonce": mine.hex()}, timeout=5)
        challenge = receive(sock, timeout=8, expect=CHALLENGE)
        nonces = (mine, bytes.fromhex(challenge.fields().text("nonce", max_length=64)))
        send(sock, ENGINE, {"proof": proof(SECRET, "decode", nonces), "engine": DECODE.to_dict()}, timeout=5)
        outcome["second"] = receive(sock, timeout=8).kind
    thread.join(20)
    records = running.finish(20)
    assert outcome["second"] == OFFER and running.server.dropped == 0 and len(records) == 2


@pytest.mark.timeout(30)
def test_a_held_peer_that_stops_beating_gets_no_grace_for_the_servers_long_steps():
    """Only a connection still proving the secret is given the time the loop spent in the
    application's steps: a held peer whose beats stopped before another peer's offer step
    (longer than its peer timeout) is ended as silent as soon as that step returns, before
    the loop serves anything else (that other peer's offer is written next)."""
    running = Running(peers=2, delays=(0.0, 3.5), peer_timeout=2.0)
    address = ("127.0.0.1", running.port)
    silent = connect(address, SECRET, DECODE, timeout=10)  # takes its offer and never beats
    with contextlib.closing(silent):
        second = connect(address, SECRET, DECODE, timeout=20)  # its offer step holds the loop 3.5 s
        with contextlib.closing(second):
            second.done(ok=True, timeout=5)
        first, other = running.finish()
    assert (first.outcome, first.detail, other.outcome) == ("silent", "no beat for 2 s", "done")
    assert running.lines[:3] == [
        f"offered 2 requests to decode at {first.address}",
        f"decode at {first.address}: silent: no beat for 2 s",
        f"offered 2 requests to decode at {other.address}",
    ]


@pytest.mark.timeout(30)
def test_a_connection_accepted_after_long_steps_is_given_no_grace_for_them():
    """The grace a connection still proving the secret gets is the time spent in steps since
    it was accepted: steps that ended before it connected (a decode's offer of 3 s) are not
    its, and it is closed at its own auth timeout."""
    stopping = threading.Event()
    running = Running(peers=None, idle=20.0, stop=stopping.is_set, delays=(3.0,), auth_timeout=1.0, peer_timeout=5.0)
    try:
        session = connect(("127.0.0.1", running.port), SECRET, DECODE, timeout=10)  # 3 s in its offer step
        with contextlib.closing(session):
            session.done(ok=True, timeout=5)
        assert running.server._away >= 3.0
        with socket.create_connection(("127.0.0.1", running.port)) as stray:
            started = time.monotonic()
            assert _closed_by_listener(stray, within=2.5), "given the grace of steps taken before it connected"
            assert time.monotonic() - started > 0.8
    finally:
        stopping.set()
    assert [r.outcome for r in running.finish()] == ["done"] and running.server.dropped == 1


def test_a_challenged_decode_outlasts_strays_that_never_knock():
    """A decode between its challenge and its engine message is unproven too; strays that
    connect and say nothing are dropped before it, however many come."""
    running = Running(peers=1, idle=5.0, auth_timeout=30.0, peer_timeout=5.0)
    decode_sock, nonces = _knocked(running.port)
    strays = [socket.create_connection(("127.0.0.1", running.port)) for _ in range(MAX_CONNECTIONS + 8)]
    assert any(_closed_by_listener(stray, within=2.0) for stray in strays[:9])
    assert [r.outcome for r in _served_among(running, decode_sock, nonces, strays)] == ["done"]


def _served_among(running, decode_sock, nonces, strays):
    """The decode, still open among ``strays``, proves the secret and is served; every socket
    closed after. The server's records."""
    try:
        assert not _closed_by_listener(decode_sock, within=0.2)
        send(decode_sock, ENGINE, {"proof": proof(SECRET, "decode", nonces), "engine": DECODE.to_dict()}, timeout=5)
        assert receive(decode_sock, timeout=5).kind == "offer"
        send(decode_sock, DONE, {"ok": True}, timeout=5)
    finally:
        decode_sock.close()
        for stray in strays:
            stray.close()
    return running.finish()


def test_a_flood_from_one_host_churns_its_own_connections_not_a_decodes_from_another():
    """Strays from one address that knock and are challenged, as a decode is: past the bound
    the server drops theirs (the host holding the most unproven), never the decode's, which
    was the oldest and, by age alone, would go first."""
    running = Running(peers=1, idle=5.0, auth_timeout=30.0, peer_timeout=5.0)
    decode_sock, nonces = _knocked(running.port, source="127.0.0.2")
    strays = [_knocked(running.port)[0] for _ in range(MAX_CONNECTIONS + 8)]
    assert sum(_closed_by_listener(stray, within=0.5) for stray in strays[:12]) == 9
    records = _served_among(running, decode_sock, nonces, strays)
    assert [(r.outcome, r.address.split(":")[0]) for r in records] == [("done", "127.0.0.2")]


def test_a_decode_turned_away_before_its_challenge_connects_again(monkeypatch):
    """A server full of proven peers closes a newcomer at once; ``connect`` tries again
    within its timeout, and is served once a hold ends."""
    monkeypatch.setattr(server_module, "MAX_CONNECTIONS", 1)
    running = Running(peers=2, peer_timeout=5.0)
    first = connect(("127.0.0.1", running.port), SECRET, DECODE, timeout=10)
    ending = threading.Timer(0.6, lambda: first.done(ok=True, timeout=5))
    ending.start()
    try:
        started = time.monotonic()
        second = connect(("127.0.0.1", running.port), SECRET, DECODE, timeout=10)
        assert time.monotonic() - started >= 0.5 and running.server.dropped >= 1
        with contextlib.closing(second):
            second.done(ok=True, timeout=5)
    finally:
        ending.join()
        first.close()
    assert [r.outcome for r in running.finish()] == ["done", "done"]
    monkeypatch.setattr(server_module, "MAX_CONNECTIONS", 0)  # no room ever: turned away until the timeout
    full = Running(peers=None, idle=3.0)
    started = time.monotonic()
    with pytest.raises(PeerClosedError, match="closed the connection before its challenge"):
        connect(("127.0.0.1", full.port), SECRET, DECODE, timeout=1.0)
    assert 0.8 <= time.monotonic() - started < 1.15  # no try begins past the deadline
    full.finish()


def test_a_server_full_of_proven_peers_closes_a_new_connection_at_once(monkeypatch):
    monkeypatch.setattr(server_module, "MAX_CONNECTIONS", 2)
    running = Running(peers=2, peer_timeout=5.0)
    sessions = [connect(("127.0.0.1", running.port), SECRET, DECODE, timeout=10) for _ in range(2)]
    try:
        with socket.create_connection(("127.0.0.1", running.port)) as newcomer:
            assert _closed_by_listener(newcomer, within=2.0)
        time.sleep(0.1)
        assert running.server.dropped == 1
        for session in sessions:
            session.done(ok=True, timeout=5)
    finally:
        for session in sessions:
            session.close()
    assert [r.outcome for r in running.finish()] == ["done", "done"]


def test_a_connection_closed_as_the_oldest_while_its_bytes_wait_is_not_read(monkeypatch):
    """The listener and the oldest connection ready in one select, the listener first: the new
    connection closes the old one, whose event is then skipped (the server must not read a
    closed connection).

    epoll lists ready sockets in the order they became ready, and a socket it has just
    reported stays listed until the next select finds it idle: so the server is held (its
    ``stop`` is a gate) only after a select has run since it read the knock, and the oldest
    sends only once the listener is seen ready. Without either, the oldest can come first
    (it did under load), and the test would pass whether the event is skipped or not."""
    monkeypatch.setattr(server_module, "MAX_CONNECTIONS", 1)
    gate, stopped_at_gate = threading.Event(), threading.Event()
    gate.set()
    loops = []

    def stop() -> bool:
        loops.append(None)  # one a loop, before its select
        if not gate.is_set():  # it stays shut until the test opens it: the server waits here
            stopped_at_gate.set()
        return not gate.wait(10)

    running = Running(peers=None, idle=1.0, stop=stop)
    oldest, _ = _knocked(running.port)
    seen, deadline = len(loops), time.monotonic() + 5
    while len(loops) < seen + 2 and time.monotonic() < deadline:
        time.sleep(0.01)  # a whole loop, select included, after the one that read the knock
    gate.clear()
    assert stopped_at_gate.wait(5)  # the server waits before its next select, whatever the load
    newcomer = socket.create_connection(("127.0.0.1", running.port))
    assert select.select([running.server.listener], [], [], 5)[0]
    oldest.sendall(encode(KNOCK, {"nonce": os.urandom(16).hex()})[:5])
    (oldest_here,) = running.server._connections
    assert select.select([oldest_here], [], [], 5)[0]
    gate.set()
    try:
        assert _closed_by_listener(oldest, within=2.0)
        send(newcomer, KNOCK, {"nonce": os.urandom(16).hex()}, timeout=5)
        receive(newcomer, timeout=5, expect=CHALLENGE)  # the server still serves
        assert running.thread.is_alive()
    finally:
        oldest.close()
        newcomer.close()
    assert running.finish() == [] and running.server.dropped == 2


def test_a_stray_that_never_proves_the_secret_does_not_keep_an_idle_server_serving():
    running = Running(peers=None, idle=1.0, auth_timeout=30.0)
    with socket.create_connection(("127.0.0.1", running.port)) as stray:
        started = time.monotonic()
        running.finish(within=5)
        assert time.monotonic() - started < 3
        assert _closed_by_listener(stray, within=1.0)
    assert any("no decode engine for 1 s" in line for line in running.lines)


def test_an_offer_that_fails_refuses_that_peer_and_the_others_are_served():
    """The application's offer (or release) raising anything is that peer's end, not every
    peer's: the decode hears why, and the server goes on."""
    errors = [TransferError("registering the cache failed"), "not an offer", None]
    released = []

    def offer(peer):
        error = errors.pop(0)
        if isinstance(error, Exception):
            raise error
        if error is not None:
            return None  # an application's bug: what it returns cannot be sent
        return Offer(PREFILL, [t for _, t in keep], [b"meta0", b"meta1"], [RemoteRequest("r", 0, 4, [1])])

    def release(record):
        released.append(record)
        raise RuntimeError("the pool is gone")

    keep = [rank_table(PREFILL) for _ in range(PREFILL.tp_size)]
    listener = socket.create_server(("127.0.0.1", 0))
    lines = []
    server = Server(listener, SECRET, PREFILL, offer, release=release, log=lines.append, peer_timeout=5.0)
    thread = threading.Thread(target=server.serve, kwargs=dict(peers=1, idle_timeout=10))
    thread.start()
    try:
        address = ("127.0.0.1", listener.getsockname()[1])
        with pytest.raises(IncompatibleEngineError, match="refused: the offer failed: TransferError: registering"):
            connect(address, SECRET, DECODE, timeout=10)
        with pytest.raises(IncompatibleEngineError, match="refused: the offer failed: AttributeError: 'NoneType'"):
            connect(address, SECRET, DECODE, timeout=10)
        session = connect(address, SECRET, DECODE, timeout=10)
        with contextlib.closing(session):
            session.done(ok=True, timeout=5)
    finally:
        thread.join(10)
        listener.close()
    assert not thread.is_alive()
    assert [r.outcome for r in server.records] == ["refused", "refused", "done"]
    assert len(released) == 2  # the one offered nothing it could send, and the one served
    assert any("release for decode at" in line and "RuntimeError: the pool is gone" in line for line in lines)


class OutOfDescriptors(socket.socket):
    """A listener whose accept fails as a process out of file descriptors does."""

    accepts = 0

    def accept(self):
        type(self).accepts += 1
        raise OSError(errno.EMFILE, "Too many open files")


def test_a_server_out_of_file_descriptors_pauses_accepting_instead_of_spinning():
    """Told once, tried again once a pause (0.1 s); a serve that ends in a pause leaves none
    to the next (whose selector would be given the listener twice)."""
    OutOfDescriptors.accepts = 0
    listener = OutOfDescriptors(socket.AF_INET, socket.SOCK_STREAM)
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    waiting = socket.create_connection(listener.getsockname())  # stays queued: the listener stays readable
    lines = []
    server = Server(listener, SECRET, PREFILL, lambda peer: None, log=lines.append)  # type: ignore[arg-type,return-value]
    try:
        for seconds in (1.0, 0.5):
            stop_at = time.monotonic() + seconds
            server.serve(peers=None, idle_timeout=5, stop=lambda stop_at=stop_at: time.monotonic() > stop_at)
    finally:
        waiting.close()
        listener.close()
    assert 8 <= OutOfDescriptors.accepts <= 18  # one try per pause in 1.5 s, not thousands
    assert lines == ["cannot accept a connection (Too many open files): pausing 0.1 s at a time"]


class ScriptedAccepts(socket.socket):
    """A listener whose accepts fail with the errnos of ``script`` in turn (None: a real
    accept), then are real."""

    script: ClassVar[list[int | None]] = []

    def accept(self):
        code = self.script.pop(0) if self.script else None
        if code is not None:
            raise OSError(code, os.strerror(code))
        return super().accept()


def _serve_scripted(script, seconds, queued=1):
    """A server on a ScriptedAccepts listener with ``queued`` connections waiting, for
    ``seconds`` (serving on after the script ran out): the server and its log lines."""
    ScriptedAccepts.script = list(script)
    listener = ScriptedAccepts(socket.AF_INET, socket.SOCK_STREAM)
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    waiting = [socket.create_connection(listener.getsockname()) for _ in range(queued)]
    lines = []
    server = Server(listener, SECRET, PREFILL, lambda peer: None, log=lines.append, auth_timeout=30.0)  # type: ignore[arg-type,return-value]
    try:
        stop_at = time.monotonic() + seconds
        server.serve(peers=None, idle_timeout=30, stop=lambda: time.monotonic() > stop_at)
    finally:
        for sock in waiting:
            sock.close()
        listener.close()
    assert not ScriptedAccepts.script, "the script did not run out"
    return server, lines


def test_a_connection_the_peer_gave_up_before_accept_is_skipped_without_a_pause():
    """An accept that fails for the peer's sake (it reset the connection while it waited in the
    listen queue) is no shortage of descriptors: nothing is told, the listener is not paused,
    and the connection waiting behind it is taken."""
    server, lines = _serve_scripted([errno.ECONNABORTED, None], seconds=1.0, queued=1)
    assert lines == [] and server.dropped == 1  # the waiting connection taken, then closed as the serve ended
    assert not server._short_of_descriptors


def test_each_episode_out_of_file_descriptors_is_told_once():
    """Two accepts fail, one succeeds, the next fails again: the second shortage is a new
    episode, told again (a server that ran out once and recovered must not hide a later one).
    After the last pause an accept succeeds, and the server serves on (its listener back in
    its selector once, not at every loop)."""
    emfile = errno.EMFILE
    server, lines = _serve_scripted([emfile, emfile, None, emfile, None], seconds=2.0, queued=2)
    told = "cannot accept a connection (Too many open files): pausing 0.1 s at a time"
    assert lines == [told, told] and server.dropped == 2


class CloseFails(socket.socket):
    """A connection whose close fails (after closing, as a close interrupted may) while
    ``failures`` are left."""

    failures = 0

    def close(self):
        super().close()
        if type(self).failures:
            type(self).failures -= 1
            raise OSError(errno.EIO, os.strerror(errno.EIO))


class AcceptsCloseFails(socket.socket):
    def accept(self):
        sock, address = super().accept()
        return CloseFails(fileno=sock.detach()), address


def test_a_connection_whose_close_fails_is_told_and_its_hold_ends_and_is_released_all_the_same():
    listener = AcceptsCloseFails(socket.AF_INET, socket.SOCK_STREAM)
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    stopping = threading.Event()
    running = Running(peers=None, stop=stopping.is_set, peer_timeout=5.0, listener=listener)
    sessions = [connect(("127.0.0.1", running.port), SECRET, DECODE, timeout=10) for _ in range(2)]
    try:
        CloseFails.failures = 1
        stopping.set()
        first, second = running.finish()
    finally:
        CloseFails.failures = 0
        for session in sessions:
            session.close()
    for record in (first, second):  # a close that reports an error still ends the hold, and says so
        assert (record.outcome, record.detail) == ("closed", "the server stopped") and record in running.released
    assert running.lines[-3:] == [
        f"closing decode at {first.address} failed: OSError: [Errno 5] Input/output error",
        f"decode at {first.address}: closed: the server stopped",
        f"decode at {second.address}: closed: the server stopped",
    ]


def test_the_idle_clock_starts_when_the_last_connection_ends():
    running = Running(peers=None, idle=1.0, peer_timeout=5.0)
    session = connect(("127.0.0.1", running.port), SECRET, DECODE, timeout=10)
    with contextlib.closing(session):
        session.start_beats()
        time.sleep(1.5)  # a hold longer than the idle timeout
        session.done(ok=True, timeout=5)
    ended = time.monotonic()
    time.sleep(0.5)
    assert running.thread.is_alive(), "the server stopped less than its idle timeout after the last peer"
    running.finish(within=5)
    assert time.monotonic() - ended >= 0.8  # the clock starts at the last loop that saw the peer (50 ms apart)


HELD_PEER_SENDS = {
    "a knock": (encode(KNOCK, {"nonce": "00" * 16}), "failed", "unexpected 'knock' message"),
    "an engine": (encode(ENGINE, {"proof": "0" * 64}), "failed", "unexpected 'engine' message"),
    "an offer": (encode("offer", {}), "failed", "unexpected 'offer' message"),
    "a refusal of 400 characters": (encode(REFUSE, {"reason": "r" * 400}), "refused", "r" * 400),
    "a refusal of 401": (
        encode(REFUSE, {"reason": "r" * 401}),
        "failed",
        f"refuse.reason: expected a string of 1 to 400 characters, got '{'r' * 56}...",
    ),
    "a frame over 1 KiB": (
        encode(BEAT, {"pad": "x" * 1024}),
        "failed",
        "a frame of 1069 bytes, more than the 1024 allowed here",
    ),
    "a beat with no number to answer": (encode(BEAT, {}), "failed", "beat.n: missing"),
    "bytes that are no frame": (
        b"GET / HTTP/1.1\r\n\r\n" + bytes(24),
        "failed",
        "not a kvhost frame: magic b'GET ', expected b'KVHM'",
    ),
}


@pytest.mark.parametrize("case", HELD_PEER_SENDS)
def test_what_a_held_peer_sends_besides_beats_and_done_ends_its_hold_and_is_released(case):
    frame, outcome, detail = HELD_PEER_SENDS[case]
    running = Running(peers=None, idle=1.0, peer_timeout=5.0)  # a refused peer is not one served
    session = connect(("127.0.0.1", running.port), SECRET, DECODE, timeout=10)
    with contextlib.closing(session):
        session.sock.sendall(frame)
        [record] = running.finish(within=5)
    assert (record.outcome, record.requests) == (outcome, 2)
    assert record.detail == detail
    assert running.released == [record], "the application's hold is let go, whoever ended it"
    assert 0.0 <= record.held_seconds < 5.0
    assert running.lines == [
        f"offered 2 requests to decode at {record.address}",
        f"decode at {record.address}: {outcome}: {detail}",
        "no decode engine for 1 s: stopping",
    ]


def test_a_beat_numbered_up_to_2_to_the_62_is_answered_and_one_past_it_ends_the_hold():
    running = Running(peers=None, idle=1.0, peer_timeout=5.0)
    with _proven_and_silent(running.port) as sock:
        receive(sock, timeout=5, expect=OFFER)
        send(sock, BEAT, {"n": 1 << 62}, timeout=5)
        assert receive(sock, timeout=5, expect=HELD).header == {"n": 1 << 62}
        send(sock, BEAT, {"n": (1 << 62) + 1}, timeout=5)
        [record] = running.finish(within=5)
    assert (record.outcome, record.detail) == (
        "failed",
        f"beat.n: expected an integer in [0, {1 << 62}], got {(1 << 62) + 1}",
    )


def test_a_held_peer_that_beats_but_never_reads_the_answers_is_ended_not_waited_for():
    """Each beat is answered with ``held`` at once; a peer that beats on and reads none of the
    answers fills its socket's buffers (made small here), and is ended then, its hold released."""
    running = Running(peers=None, idle=1.0, peer_timeout=5.0)
    running.listener.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)  # its connections' too
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # before connecting: the window stays small
    with sock:
        sock.connect(("127.0.0.1", running.port))
        mine = os.urandom(16)
        send(sock, KNOCK, {"nonce": mine.hex()}, timeout=5)
        nonces = (mine, bytes.fromhex(receive(sock, timeout=5, expect=CHALLENGE).fields().text("nonce")))
        send(sock, ENGINE, {"proof": proof(SECRET, "decode", nonces), "engine": DECODE.to_dict()}, timeout=5)
        receive(sock, timeout=5, expect=OFFER)
        deadline = time.monotonic() + 10
        n = 0
        while not running.released and time.monotonic() < deadline:
            n += 1
            try:
                send(sock, BEAT, {"n": n}, timeout=5)
            except ProtocolError:  # ended: the socket was closed (or reset) under the beats
                break
        [record] = running.finish(within=5)
    assert (record.outcome, record.detail) == ("failed", "it does not read prefill's answers to its beats")
    assert running.released == [record]


def test_a_done_that_cannot_be_answered_ends_the_hold_once_as_failed():
    """``done`` arrives while the peer's socket is full of prefill's answers it never read: it
    cannot be told ``held``, so its hold ends as failed (what it said kept), once, and the
    loop goes on (ending it a second time would stop the serving). The server's loop step is
    driven by hand here: through a real loop, when the buffer fills is the kernel's choice."""
    released: list[server_module.PeerRecord] = []
    writer, reader = _full_pair()  # prefill's end, whose peer reads nothing
    with socket.create_server(("127.0.0.1", 0)) as listener, reader, selectors.DefaultSelector() as selector:
        server = Server(listener, SECRET, PREFILL, lambda peer: None, release=released.append)  # type: ignore[arg-type,return-value]
        conn = server_module._Connection(
            writer, "127.0.0.1:1", "127.0.0.1", time.monotonic() + 5.0, stage=BEAT, offered=True
        )
        conn.record = server_module.PeerRecord(conn.address)
        server._connections[writer] = conn
        selector.register(writer, selectors.EVENT_READ)
        reader.sendall(encode(DONE, {"ok": True}))
        server._read(selector, conn)
        assert not server._connections and not selector.get_map()
    assert (conn.record.outcome, conn.record.detail, conn.record.ok) == (
        "failed",
        "it does not read prefill's answers to its beats",
        True,
    )
    assert released == [conn.record] and server.ended == {"failed": 1} and server.done_ok == 0


def test_an_offer_decode_refuses_is_released_by_prefill():
    running = Running(peers=None, idle=1.0, table_spec=EngineSpec(**{**PREFILL.to_dict(), "block_size": 32}))
    with pytest.raises(IncompatibleEngineError, match="rank 0 table: N is 32, the engine says 16"):
        connect(("127.0.0.1", running.port), SECRET, DECODE, timeout=10)
    [record] = running.finish(within=5)
    assert (record.outcome, record.requests) == ("refused", 2)
    assert "rank 0 table: N is 32, the engine says 16" in record.detail
    assert running.released == [record]


def test_the_applications_refusal_reaches_decode_cut_to_400_characters_and_holds_nothing():
    why = "no requests for you " * 25  # 500 characters
    running = Running(peers=None, idle=1.0, refuse=why)
    with pytest.raises(IncompatibleEngineError) as refused:
        connect(("127.0.0.1", running.port), SECRET, DECODE, timeout=10)
    assert str(refused.value) == f"prefill at 127.0.0.1:{running.port} refused: {why[:400]}"
    [record] = running.finish(within=5)
    assert (record.outcome, record.detail, record.requests) == ("refused", why, 0)
    assert running.released == [], "no offer was made: nothing to let go"


REASONS = {
    "line end": ("no requests\nfor you", "no requests\\nfor you"),
    "escape and surrogate": ("\x1b[2J\ud800 gone", "\\x1b[2J\\ud800 gone"),
    "empty": ("", "no reason given"),
    "escapes past 400": ("\n" * 300, "\\n" * 200),
    "printable beyond ASCII": ("café déjà vu: 块", "café déjà vu: 块"),  # kept as written, not escaped
}


@pytest.mark.parametrize(("why", "heard"), REASONS.values(), ids=REASONS.keys())
def test_the_applications_unprintable_refusal_reaches_decode_escaped_as_a_refusal(why, heard):
    """Decode reads a reason only as printable text: a line end in it reached decode as a
    bad frame, not a refusal, and its reason was lost."""
    running = Running(peers=None, idle=1.0, refuse=why)
    with pytest.raises(IncompatibleEngineError) as refused:
        connect(("127.0.0.1", running.port), SECRET, DECODE, timeout=10)
    assert str(refused.value) == f"prefill at 127.0.0.1:{running.port} refused: {heard}"
    [record] = running.finish(within=5)
    assert (record.outcome, record.detail) == ("refused", why)


@pytest.mark.parametrize(("why", "heard"), REASONS.values(), ids=REASONS.keys())
def test_a_reason_either_side_refuses_with_is_printable_text_the_other_reads(why, heard):
    """One rule for both sides' refusals (prefill's application's, decode's of an offer):
    what is sent passes the reading side's check of printable text."""
    from kvhost.nixl.fields import check_text
    from kvhost.nixl.peers import MAX_REASON_CHARACTERS, printable_reason

    sent = printable_reason(why)
    assert sent == heard and check_text(sent, "reason", max_length=MAX_REASON_CHARACTERS) == sent
    assert printable_reason("x" * 1000) == "x" * MAX_REASON_CHARACTERS


@pytest.mark.parametrize("proof", ["0" * 64, "0" * 65], ids=["64 digits", "65 digits"])
def test_a_wrong_proof_is_dropped_before_the_application_hears_of_it(proof):
    running = Running(peers=None, idle=1.0)
    sock, _ = _knocked(running.port)
    with sock:
        send(sock, ENGINE, {"proof": proof, "engine": DECODE.to_dict()}, timeout=5)
        assert _closed_by_listener(sock, within=2.0)
    assert running.finish() == [] and running.asked == [] and running.server.dropped == 1


def test_a_second_knock_is_not_challenged_again():
    running = Running(peers=None, idle=1.0)
    sock, _ = _knocked(running.port)
    with sock:
        send(sock, KNOCK, {"nonce": os.urandom(16).hex()}, timeout=5)
        assert _closed_by_listener(sock, within=2.0)
    assert running.finish() == [] and running.server.dropped == 1


def test_connections_that_do_not_prove_the_secret_in_time_are_closed_at_their_deadline():
    running = Running(peers=None, idle=1.0, auth_timeout=0.5)
    started = time.monotonic()
    silent = socket.create_connection(("127.0.0.1", running.port))
    knocked, _ = _knocked(running.port)
    with silent, knocked:
        assert _closed_by_listener(silent, within=3.0) and _closed_by_listener(knocked, within=3.0)
    assert 0.4 < time.monotonic() - started < 2.0
    assert running.finish() == [] and running.server.dropped == 2


def _proven_and_silent(port):
    """A decode engine that proves the secret and sends its spec, then reads nothing."""
    sock, nonces = _knocked(port)
    send(sock, ENGINE, {"proof": proof(SECRET, "decode", nonces), "engine": DECODE.to_dict()}, timeout=5)
    return sock


BIG = [bytes(8 << 20), bytes(8 << 20)]  # an offer far larger than the sockets' buffers


def test_an_offer_the_peer_does_not_read_fails_within_the_send_timeout_and_is_released():
    running = Running(peers=None, idle=1.0, send_timeout=0.5, metadata=BIG)
    started = time.monotonic()
    with _proven_and_silent(running.port):
        [record] = running.finish(within=10)
    assert 0.4 < time.monotonic() - started < 3.0
    assert (record.outcome, record.detail) == ("failed", "could not send 'offer' within 0.5 s: the peer does not read")
    assert running.released == [record]


def test_an_offer_whose_peer_resets_the_connection_fails_naming_the_error():
    running = Running(peers=None, idle=1.0, send_timeout=20.0, metadata=BIG)
    sock = _proven_and_silent(running.port)
    time.sleep(0.5)  # the server is now blocked sending
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    sock.close()  # a reset, not a close
    [record] = running.finish(within=10)
    assert record.outcome == "failed" and record.detail.startswith("could not send 'offer': [Errno")
    assert running.released == [record]


def test_a_peer_that_sends_part_of_a_frame_does_not_stall_the_others():
    running = Running(peers=None, idle=1.0, peer_timeout=5.0, send_timeout=10.0)
    slow = connect(("127.0.0.1", running.port), SECRET, DECODE, timeout=10)
    with contextlib.closing(slow):
        slow.sock.sendall(encode(BEAT, {})[:5])
        time.sleep(0.2)
        started = time.monotonic()
        other = connect(("127.0.0.1", running.port), SECRET, DECODE, timeout=10)
        with contextlib.closing(other):
            assert time.monotonic() - started < 1.0, "a peer's half frame stalled the server"
            other.done(ok=True, timeout=5)
    records = running.finish(within=10)
    assert sorted(r.outcome for r in records) == ["closed", "done"]


def test_an_idle_server_stops_on_its_own():
    running = Running(peers=None, idle=0.5)
    records = running.finish(within=5)
    assert records == [] and running.lines == ["no decode engine for 0.5 s: stopping"]


def test_a_server_serves_several_decode_engines_at_once():
    running = Running(peers=3, peer_timeout=2.0)
    sessions = [connect(("127.0.0.1", running.port), SECRET, DECODE, timeout=10) for _ in range(3)]
    for session in sessions:
        session.start_beats()
    sessions[0].done(ok=True, timeout=5)
    sessions[1].close()
    sessions[2].done(ok=False, timeout=5)
    for session in sessions:
        session.close()
    records = running.finish()
    assert sorted((r.outcome, r.ok) for r in records) == [("closed", None), ("done", False), ("done", True)]
    server = running.server
    assert (server.proven, server.ended, server.done_ok) == (3, {"closed": 1, "done": 2}, 1)


def test_a_long_lived_server_keeps_the_latest_records_and_counts_every_peer(monkeypatch):
    """A server may serve for months, and a peer that holds the secret may come back in a
    loop: only the latest MAX_RECORDS records are kept; the counts (what ``serve`` stops on
    and the prefill reports) keep every peer, refused ones included."""
    monkeypatch.setattr(server_module, "MAX_RECORDS", 2)
    running = Running(peers=3, peer_timeout=5.0)
    for ok in (True, False, True):
        session = connect(("127.0.0.1", running.port), SECRET, DECODE, timeout=10)
        session.done(ok=ok, timeout=5)
        session.close()
        time.sleep(0.1)  # ended in this order
    assert [r.ok for r in running.finish()] == [False, True]
    assert (running.server.proven, running.server.ended, running.server.done_ok) == (3, {"done": 3}, 2)


def test_a_server_keeps_the_records_of_its_latest_1024_peers():
    """The bound the test above lowers: what a server keeps of peers long ended."""
    with socket.create_server(("127.0.0.1", 0)) as listener:
        server = Server(listener, SECRET, PREFILL, lambda peer: None)  # type: ignore[arg-type,return-value]
    assert server.records.maxlen == server_module.MAX_RECORDS == 1024


def test_secret_files_are_private_and_checked(tmp_path):
    path = str(tmp_path / "secret")
    secret = write_secret_file(path)
    assert read_secret_file(path) == secret and os.stat(path).st_mode & 0o777 == 0o600
    with pytest.raises(ProtocolError, match="File exists"):
        write_secret_file(path)
    os.chmod(path, 0o644)
    with pytest.raises(ProtocolError, match="readable by others"):
        read_secret_file(path)
    short = tmp_path / "short"
    short.write_text("abcd\n")
    short.chmod(0o600)
    with pytest.raises(ProtocolError, match="a secret of at least 32 bytes"):
        read_secret_file(str(short))
    with pytest.raises(ProtocolError, match="No such file"):
        read_secret_file(str(tmp_path / "missing"))


@pytest.mark.parametrize("bits", [0o001, 0o002, 0o004, 0o010, 0o020, 0o040])
def test_a_secret_file_any_other_may_touch_is_refused(tmp_path, bits):
    path = str(tmp_path / "secret")
    write_secret_file(path)
    os.chmod(path, 0o600 | bits)
    with pytest.raises(ProtocolError, match=rf"readable by others \(mode {0o600 | bits:o}\)"):
        read_secret_file(path)


def test_a_secret_of_the_most_digits_is_read_whole_and_a_longer_one_refused(tmp_path):
    from kvhost.nixl.peers import MAX_SECRET_DIGITS

    path = tmp_path / "secret"
    path.write_text("ab" * (MAX_SECRET_DIGITS // 2) + "\n")
    path.chmod(0o600)
    assert read_secret_file(str(path)) == b"\xab" * (MAX_SECRET_DIGITS // 2)
    path.write_text("ab" * (MAX_SECRET_DIGITS // 2 + 1) + "\n")
    with pytest.raises(ProtocolError, match=f"more than {MAX_SECRET_DIGITS} hex digits"):
        read_secret_file(str(path))


@pytest.mark.parametrize("line_end", ["\n", "\r\n", ""])
def test_a_secret_on_standard_input_is_read_whole_and_a_longer_one_refused(monkeypatch, line_end):
    import sys

    from kvhost.nixl.peers import MAX_SECRET_DIGITS

    for pairs, expected in (
        (MAX_SECRET_DIGITS // 2, b"\xab" * (MAX_SECRET_DIGITS // 2)),
        (MAX_SECRET_DIGITS // 2 + 1, None),
    ):
        read, write = os.pipe()
        os.write(write, ("ab" * pairs + line_end).encode())
        os.close(write)
        with os.fdopen(read) as stdin:
            monkeypatch.setattr(sys, "stdin", stdin)
            if expected is None:
                with pytest.raises(ProtocolError, match=f"standard input: more than {MAX_SECRET_DIGITS} hex digits"):
                    read_secret_file("-", timeout=5)
            else:
                assert read_secret_file("-", timeout=5) == expected


def test_a_secret_on_standard_input_is_one_line_within_the_timeout(monkeypatch):
    """A writer that sends digits and never ends the line is refused at the deadline (not
    waited for); what follows a line end is not read as part of it."""
    import sys

    read, write = os.pipe()
    os.write(write, b"ab" * 32)  # no line end, and the pipe stays open
    try:
        with os.fdopen(read) as stdin:
            monkeypatch.setattr(sys, "stdin", stdin)
            started = time.monotonic()
            with pytest.raises(ProtocolError, match=r"standard input: no line within 0.5 s"):
                read_secret_file("-", timeout=0.5)
            assert time.monotonic() - started < 2
    finally:
        os.close(write)
    read, write = os.pipe()
    os.write(write, b"ab" * 32 + b"\nnot part of the secret\n")
    try:
        with os.fdopen(read) as stdin:
            monkeypatch.setattr(sys, "stdin", stdin)
            assert read_secret_file("-", timeout=5) == b"\xab" * 32
    finally:
        os.close(write)


def test_a_secret_file_that_is_no_regular_file_or_no_text_is_refused_at_once(tmp_path):
    fifo = tmp_path / "fifo.secret"
    os.mkfifo(fifo, 0o600)  # no writer: opening it for reading would wait for one
    started = time.monotonic()
    with pytest.raises(ProtocolError, match=f"secret file {fifo}: not a regular file"):
        read_secret_file(str(fifo))
    assert time.monotonic() - started < 1
    garbled = tmp_path / "garbled.secret"
    garbled.write_bytes(b"\xff" * 64)
    garbled.chmod(0o600)
    opened = len(os.listdir("/proc/self/fd"))
    with pytest.raises(ProtocolError, match=f"secret file {garbled}: expected hex digits, got bytes that are not"):
        read_secret_file(str(garbled))
    good = tmp_path / "good.secret"
    write_secret_file(str(good))
    with (
        patch.object(peers_module.os, "read", side_effect=OSError(errno.EIO, "Input/output error")),
        pytest.raises(ProtocolError, match=f"secret file {good}: Input/output error"),
    ):
        read_secret_file(str(good))
    assert len(read_secret_file(str(good))) == 32
    assert len(os.listdir("/proc/self/fd")) == opened  # every file opened was closed, refused or read


def test_a_proof_binds_the_secret_the_role_and_both_nonces():
    """HMAC-SHA256 of role and both nonces: a proof for one pair of nonces proves nothing
    for another (a recorded proof cannot be replayed against a fresh challenge)."""
    import hashlib
    import hmac

    from kvhost.nixl.peers import proof, proves

    nonces = (bytes(range(16)), bytes(range(16, 32)))
    expected = hmac.new(SECRET, b"decode" + nonces[0] + nonces[1], hashlib.sha256).hexdigest()
    assert proof(SECRET, "decode", nonces) == expected and proves(SECRET, "decode", nonces, expected)
    others = [
        ((b"\xff" + nonces[0][1:], nonces[1]), "decode", SECRET),  # decode's nonce changed
        ((nonces[0], b"\xff" + nonces[1][1:]), "decode", SECRET),  # prefill's
        ((nonces[1], nonces[0]), "decode", SECRET),  # the two swapped
        (nonces, "prefill", SECRET),
        (nonces, "decode", b"\x01" * 32),
    ]
    for other_nonces, role, secret in others:
        assert not proves(secret, role, other_nonces, expected), (other_nonces, role)


@pytest.mark.parametrize(
    ("nonce", "reason"),
    [
        ("zz" * 16, "expected 16 bytes in hex"),
        ("00" * 15, "expected 16 bytes in hex"),
        ("0" * 31, "expected 16 bytes in hex"),
        ("", "expected a string of 1 to 32 characters"),
        ("00" * 17, "expected a string of 1 to 32 characters"),
    ],
)
def test_a_nonce_that_is_not_16_bytes_in_hex_is_refused(nonce, reason):
    from kvhost.nixl.fields import Fields
    from kvhost.nixl.peers import nonce_of

    with pytest.raises(ProtocolError, match=rf"knock\.nonce: {reason}"):
        nonce_of(Fields({"nonce": nonce}, "knock"))
    assert nonce_of(Fields({"nonce": "ab" * 16}, "knock")) == b"\xab" * 16


# --- what a prefill may answer: every field of an offer checked by decode ------------------


class FakePrefill:
    """A prefill engine on a thread that proves the secret, then answers decode's engine
    message with ``kind``/``header``/``blob`` as given (an offer a real one would not send);
    ``heard`` holds what decode sent after that (a refusal), if anything."""

    def __init__(self, kind, header, blob=b"", port=0):
        from kvhost.nixl.peers import CHALLENGE, ENGINE, proof

        self.listener = socket.create_server(("127.0.0.1", port))
        self.address = self.listener.getsockname()
        self.heard = []

        def serve():
            conn, _ = self.listener.accept()
            with conn:
                knock = receive(conn, timeout=5, expect=KNOCK)
                mine = os.urandom(16)
                nonces = (bytes.fromhex(knock.fields().text("nonce")), mine)
                send(conn, CHALLENGE, {"nonce": mine.hex(), "proof": proof(SECRET, "prefill", nonces)}, timeout=5)
                receive(conn, timeout=5, expect=ENGINE)
                send(conn, kind, header, blob, timeout=5)
                with contextlib.suppress(ProtocolError):
                    self.heard.append(receive(conn, timeout=5))

        self.thread = threading.Thread(target=serve, daemon=True)
        self.thread.start()

    def close(self):
        self.thread.join(10)
        self.listener.close()


def offer_header(**changes):
    keep = [rank_table(PREFILL) for _ in range(PREFILL.tp_size)]
    offer = Offer(PREFILL, [t for _, t in keep], [b"meta0", b"meta1"], [RemoteRequest("req-0", 0, 40, [1, 4, 2])])
    return {**offer.header(), **changes}, keep


def read_offer(header, blob=b"meta0meta1", kind="offer"):
    fake = FakePrefill(kind, header, blob)
    try:
        return connect(fake.address, SECRET, DECODE, timeout=5), fake
    finally:
        fake.close()


@pytest.mark.parametrize("beat", [0.05, 60.0])
def test_beats_at_the_bounds_are_taken(beat):
    header, _keep = offer_header(beat_seconds=beat)
    session, _ = read_offer(header)
    with contextlib.closing(session):
        assert session.offer.beat_seconds == beat and session.offer.metadata == [b"meta0", b"meta1"]
        assert "fields=" not in repr(session.offer)  # the whole raw offer stays out of logs


@pytest.mark.parametrize(
    ("changes", "blob", "message"),
    [
        (dict(beat_seconds=0.049), b"meta0meta1", r"offer\.beat_seconds: 0\.049 is not in \[0\.05, 60\.0\]"),
        (dict(beat_seconds=60.5), b"meta0meta1", r"offer\.beat_seconds: 60\.5 is not in"),
        (dict(metadata_bytes=np.array([5, 5], dtype=np.uint32)), b"meta0meta1x", r"\[5, 5\] for 2 ranks and 11 blob"),
        (dict(metadata_bytes=np.array([10], dtype=np.uint32)), b"meta0meta1", r"\[10\] for 2 ranks and 10 blob"),
        (dict(metadata_bytes=np.array([0, 10], dtype=np.uint32)), b"meta0meta1", r"metadata_bytes\[0\]: expected"),
    ],
)
def test_a_malformed_offer_is_a_protocol_error(changes, blob, message):
    header, _keep = offer_header(**changes)
    with pytest.raises(ProtocolError, match=message):
        read_offer(header, blob)


def test_an_offer_with_a_table_missing_or_one_too_many_is_refused():
    header, _keep = offer_header()
    with pytest.raises(ProtocolError, match=r"offer\.tables: 1 tables for TP 2"):
        read_offer({**header, "tables": header["tables"][:1]})
    with pytest.raises(ProtocolError, match=r"offer\.tables: 3 tables for TP 2"):
        read_offer({**header, "tables": [*header["tables"], header["tables"][0]]})
    with pytest.raises(ProtocolError, match=r"offer\.tables: .*at most 3"):
        read_offer({**header, "tables": header["tables"] * 2})


def test_an_offer_decode_cannot_serve_is_refused_back_to_prefill():
    header, _keep = offer_header(engine={**PREFILL.to_dict(), "dtype": "float16"})
    fake = FakePrefill("offer", header, b"meta0meta1")
    try:
        with pytest.raises(IncompatibleEngineError, match=r"dtype: decode bfloat16, prefill float16"):
            connect(fake.address, SECRET, DECODE, timeout=5)
    finally:
        fake.close()
    [refusal_sent] = fake.heard
    assert refusal_sent.kind == "refuse" and "dtype: decode bfloat16" in refusal_sent.fields().text(
        "reason", max_length=400
    )


def test_an_offer_whose_rank_tables_differ_is_refused_back_to_prefill():
    """Each table matches the spec (one head per rank: H may sit either side of N), but a
    decode reads every rank with one plan: tables that differ are refused at the offer."""
    spec = EngineSpec("mha", 2, 2, 8, "bfloat16", 16, "HNC", 2)
    sizes = dict(K=2, B=8, N=16, H=1, C=8)
    keep = [
        {f"layer{i}": make_cache("KBNHC", memory, sizes, torch.bfloat16) for i in range(2)}
        for memory in ("KBHNC", "KBNHC")
    ]
    tables = [region_table(caches, "KBNHC") for caches in keep]
    header = Offer(spec, tables, [b"meta0", b"meta1"], [RemoteRequest("req-0", 0, 40, [1, 4, 2])]).header()
    fake = FakePrefill("offer", header, b"meta0meta1")
    try:
        with pytest.raises(
            IncompatibleEngineError,
            match=r"prefill rank 1 table: region order 'NHC' and sizes .* differ from rank 0's 'HNC'",
        ):
            connect(fake.address, SECRET, EngineSpec("mha", 2, 2, 8, "bfloat16", 64, "NHC", 1), timeout=5)
    finally:
        fake.close()
    [refusal_sent] = fake.heard
    assert refusal_sent.kind == "refuse" and "rank 1 table" in refusal_sent.fields().text("reason", max_length=400)


def test_block_ids_must_fit_every_rank_table():
    """Ranks may hold tables of different sizes; a request's ids must be blocks of each."""
    keep = [rank_table(PREFILL, blocks=8), rank_table(PREFILL, blocks=12)]
    tables = [t for _, t in keep]
    with pytest.raises(KVHostError, match=r"request 'req-0': remote_ids: block id 10 at position 2 is out of range"):
        Offer(PREFILL, tables, [b"meta0", b"meta1"], [RemoteRequest("req-0", 0, 40, [1, 4, 10])]).header()
    header = Offer(PREFILL, tables, [b"meta0", b"meta1"], [RemoteRequest("req-0", 0, 40, [1, 4, 7])]).header()
    header["requests"]["block_ids"] = np.array([1, 4, 10], dtype=np.uint32)  # a peer that sends it all the same
    with pytest.raises(ProtocolError, match=r"block_ids\[2\]: expected an integer in \[0, 7\], got 10"):
        read_offer(header)


def test_metadata_of_one_byte_per_rank_is_taken():
    header, _keep = offer_header(metadata_bytes=np.array([1, 1], dtype=np.uint32))
    session, _ = read_offer(header, b"mn")
    with contextlib.closing(session):
        assert session.offer.metadata == [b"m", b"n"]


def test_a_refusal_of_400_characters_is_read_and_a_longer_one_is_not():
    with pytest.raises(IncompatibleEngineError, match=r"refused: x{400}$"):
        read_offer({"reason": "x" * 400}, b"", kind="refuse")
    with pytest.raises(ProtocolError, match=r"reason: expected a string of 1 to 400 characters"):
        read_offer({"reason": "x" * 401}, b"", kind="refuse")


def test_an_answer_that_is_neither_offer_nor_refusal_is_a_protocol_error():
    with pytest.raises(ProtocolError, match=r"expected an offer, got 'beat'"):
        read_offer({}, b"", kind="beat")


@pytest.mark.timeout(20)
def test_a_prefill_that_stops_answering_runs_out_the_connect_timeout():
    """Accepts, then says nothing: connect gives up when its timeout is spent, not later."""
    with socket.create_server(("127.0.0.1", 0)) as listener:
        started = time.monotonic()
        with pytest.raises(ProtocolError, match="timed out"):
            connect(listener.getsockname(), SECRET, DECODE, timeout=1.0)
        assert 0.9 < time.monotonic() - started < 2.5


@pytest.mark.timeout(20)
def test_connecting_is_retried_until_prefill_listens_and_no_longer():
    with socket.create_server(("127.0.0.1", 0)) as probe:
        port = probe.getsockname()[1]  # nobody listens there once it is closed
    started = time.monotonic()
    tries = []
    real = peers_module._resolve

    def counted(*args, **kwargs):
        tries.append(None)
        return real(*args, **kwargs)

    with (
        patch.object(peers_module, "_resolve", counted),
        pytest.raises(ProtocolError, match=r"could not connect to prefill at .* before the connect timeout: \w"),
    ):
        connect(("127.0.0.1", port), SECRET, DECODE, timeout=0.6)
    # Retried every 0.2 s while a retry could still end before the deadline.
    assert 0.3 < time.monotonic() - started < 0.75
    assert 2 <= len(tries) <= 4

    # A prefill that starts listening after decode began connecting is still reached.
    header, _keep = offer_header()
    late = {}

    def listen_late():
        time.sleep(0.6)
        late["prefill"] = FakePrefill("offer", header, b"meta0meta1", port=port)

    thread = threading.Thread(target=listen_late)
    thread.start()
    try:
        session = connect(("127.0.0.1", port), SECRET, DECODE, timeout=5)
    finally:
        thread.join(5)
        late["prefill"].close()
    with contextlib.closing(session):
        assert session.offer.metadata == [b"meta0", b"meta1"]


@pytest.mark.parametrize(
    ("text", "address"),
    [
        ("8080", ("127.0.0.1", 8080)),
        ("10.0.0.2:0", ("10.0.0.2", 0)),
        ("host:65535", ("host", 65535)),
        ("[::1]:80", ("::1", 80)),
        ("[fe80::1%eth0]:7600", ("fe80::1%eth0", 7600)),
        (":81", ("127.0.0.1", 81)),
    ],
)
def test_addresses_that_parse(text, address):
    assert parse_address(text) == address


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("::1", "an IPv6 address goes in brackets"),  # was (":", 1)
        ("2001:db8::7000", "an IPv6 address goes in brackets"),  # was ("2001:db8:", 7000)
        ("a]:80", "an IPv6 address goes in brackets"),
        ("[host:80", "is not \\[ADDRESS\\]:PORT"),
        ("[::1]", "is not \\[ADDRESS\\]:PORT"),
        ("[a]b]:80", "is not \\[ADDRESS\\]:PORT"),
    ],
)
def test_an_ipv6_address_outside_brackets_or_half_bracketed_is_refused(text, message):
    """Split at its last colon, an IPv6 address lost a part and named another host."""
    with pytest.raises(ArgumentError, match=message):
        parse_address(text)


@pytest.mark.parametrize("text", ["host:65536", "host:", "host:-1", "host:http", "", "99999"])
def test_addresses_that_do_not(text):
    with pytest.raises(ArgumentError, match=r"is not HOST:PORT with a port in \[0, 65535\]"):
        parse_address(text)


@pytest.mark.parametrize("host", ["a..b", "x" * 64 + ".example"])
def test_host_names_no_resolver_takes_are_refused_at_once(host):
    """An empty label or one of more than 63 characters: refused as the address is read, and
    by ``connect`` at once (not retried until its timeout) when given as a pair."""
    with pytest.raises(ArgumentError, match=f"'{host}:7600': '{host}' is not a host name"):
        parse_address(f"{host}:7600")
    started = time.monotonic()
    with pytest.raises(ProtocolError, match=f"cannot connect to prefill at {host}:7600: not a host name"):
        connect((host, 7600), SECRET, DECODE, timeout=5)
    assert time.monotonic() - started < 1


def _resolver(answers, asked=None):
    """A stand-in for ``getaddrinfo``: numbers as the real one takes them, a name as ``answers``
    says (a list of addresses, an error to raise, or a function that blocks); each name
    looked up is added to ``asked``."""
    real = socket.getaddrinfo

    def getaddrinfo(host, port, *args, flags=0, **kwargs):
        if flags & socket.AI_NUMERICHOST:
            return real(host, port, *args, flags=flags, **kwargs)
        if asked is not None:
            asked.append(host)
        if isinstance(answers, BaseException):
            raise answers
        return answers() if callable(answers) else answers

    return patch.object(peers_module.socket, "getaddrinfo", getaddrinfo)


def _free_lookup_slots() -> int:
    taken = 0
    while peers_module._lookups.acquire(blocking=False):
        taken += 1
    for _ in range(taken):
        peers_module._lookups.release()
    return taken


@pytest.mark.timeout(20)
def test_a_resolver_that_does_not_answer_runs_out_the_connect_timeout_and_no_more():
    """``getaddrinfo`` has no timeout of its own; connect's deadline holds over the lookup, and
    lookups left running are bounded in number (and do not hold the process open)."""
    answer = threading.Event()
    with _resolver(lambda: answer.wait(30) and []), contextlib.ExitStack() as finally_:
        finally_.callback(answer.set)  # whatever fails below, the lookups end and give their slots back
        started = time.monotonic()
        late = r"lookup of host name 'stuck\.test' did not finish before the connect timeout"
        with pytest.raises(ProtocolError, match=late):
            connect(("stuck.test", 7600), SECRET, DECODE, timeout=0.5)
        assert time.monotonic() - started < 1.0
        for _ in range(peers_module.MAX_LOOKUPS - 1):
            with pytest.raises(ProtocolError):
                connect(("stuck.test", 7600), SECRET, DECODE, timeout=0.01)
        resolving = [t for t in threading.enumerate() if t.name.startswith("kvhost-resolve-")]
        assert len(resolving) == peers_module.MAX_LOOKUPS
        assert all(thread.daemon for thread in resolving)
        started = time.monotonic()
        with pytest.raises(ProtocolError, match=f"{peers_module.MAX_LOOKUPS} host name lookups were still running"):
            connect(("stuck.test", 7600), SECRET, DECODE, timeout=0.3)
        assert 0.25 < time.monotonic() - started < 0.8  # it waited for a slot, until its timeout
        still = [t for t in threading.enumerate() if t.name.startswith("kvhost-resolve-")]
        assert len(still) == peers_module.MAX_LOOKUPS
        answer.set()
        for thread in resolving:
            thread.join(5)
        assert _free_lookup_slots() == peers_module.MAX_LOOKUPS  # every slot was given back


@pytest.mark.timeout(20)
def test_a_name_no_resolver_knows_is_retried_until_the_connect_timeout():
    asked = []
    unknown = socket.gaierror(socket.EAI_NONAME, "Name or service not known")
    started = time.monotonic()
    with (
        _resolver(unknown, asked),
        pytest.raises(ProtocolError, match=r"could not connect to prefill at nowhere\.test:7600 .*: Name or service"),
    ):
        connect(("nowhere.test", 7600), SECRET, DECODE, timeout=0.5)
    assert 0.3 < time.monotonic() - started < 1.0
    assert asked == ["nowhere.test"] * len(asked) and 2 <= len(asked) <= 3


@pytest.mark.timeout(20)
def test_a_lookup_that_cannot_start_its_thread_gives_its_slot_back():
    def no_thread(self):
        raise RuntimeError("can't start new thread")

    with (
        _resolver([]),
        patch.object(peers_module.threading.Thread, "start", no_thread),
        pytest.raises(ProtocolError, match=r"could not start a thread to look up host name 'busy\.test'"),
    ):
        connect(("busy.test", 7600), SECRET, DECODE, timeout=0.5)  # tried again and again until the timeout
    assert _free_lookup_slots() == peers_module.MAX_LOOKUPS  # every slot still free


@pytest.mark.timeout(20)
def test_an_interrupt_before_the_lookup_thread_starts_gives_its_slot_back():
    def interrupted(self):
        raise KeyboardInterrupt

    with (
        _resolver([]),
        patch.object(peers_module.threading.Thread, "start", interrupted),
        pytest.raises(KeyboardInterrupt),
    ):
        connect(("busy.test", 7600), SECRET, DECODE, timeout=0.5)
    assert _free_lookup_slots() == peers_module.MAX_LOOKUPS


@pytest.mark.timeout(20)
def test_an_interrupt_after_the_lookup_thread_started_gives_its_slot_back_once():
    """Ctrl-C inside ``Thread.start`` after the thread began: the call gives the slot back at
    once, and the thread, ending later, does not give it back a second time."""
    answer, failures = threading.Event(), []
    start = threading.Thread.start

    def started_then_interrupted(self):
        start(self)
        raise KeyboardInterrupt

    with (
        _resolver(lambda: answer.wait(10) and []),
        patch.object(peers_module.threading.Thread, "start", started_then_interrupted),
        patch.object(threading, "excepthook", failures.append),
    ):
        with pytest.raises(KeyboardInterrupt):
            connect(("busy.test", 7600), SECRET, DECODE, timeout=5)
        assert _free_lookup_slots() == peers_module.MAX_LOOKUPS  # given back while the lookup runs
        resolving = [t for t in threading.enumerate() if t.name == "kvhost-resolve-busy.test"]
        assert len(resolving) == 1
        answer.set()
        resolving[0].join(5)
    assert not failures  # a second release would have raised in the thread
    assert _free_lookup_slots() == peers_module.MAX_LOOKUPS


_MADE: list[socket.socket] = []


class _Recorded(socket.socket):
    """A socket that remembers the sockets made to connect (not those ``accept`` makes)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        if "fileno" not in kwargs:
            _MADE.append(self)


@pytest.mark.timeout(20)
def test_a_name_is_connected_at_its_first_address_that_answers():
    """One lookup; the address that refused is closed, the next one connected."""
    header, _keep = offer_header()
    prefill = FakePrefill("offer", header, b"meta0meta1")
    with socket.create_server(("127.0.0.1", 0)) as probe:
        closed = probe.getsockname()  # nobody listens there once it is closed
    addresses = [(socket.AF_INET, socket.SOCK_STREAM, 6, "", where) for where in (closed, prefill.address)]
    asked = []
    _MADE.clear()
    try:
        with _resolver(addresses, asked), patch.object(peers_module.socket, "socket", _Recorded):
            session = connect(("two-homes.test", prefill.address[1]), SECRET, DECODE, timeout=5)
    finally:
        prefill.close()
    with contextlib.closing(session):
        assert session.offer.metadata == [b"meta0", b"meta1"]
        assert session.sock.getpeername() == prefill.address
        assert session.sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY)
        assert asked == ["two-homes.test"]
        made = [s for s in _MADE if s.family != socket.AF_UNIX]  # the session's own wake-up pair aside
        assert [s.fileno() == -1 for s in made] == [True, False] and made[1] is session.sock
    with _resolver([]), pytest.raises(ProtocolError, match=r"'nowhere\.test' resolved to no address"):
        connect(("nowhere.test", 7600), SECRET, DECODE, timeout=0.1)


@contextlib.contextmanager
def _dropping_listener():
    """A listener whose accept queue is full: it drops a new connection's SYN and says nothing
    (as a firewall that drops, or a host gone). Yields its address."""
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(0)
        queued = []
        try:
            for _ in range(64):  # until one is not taken: the queue is full
                filler = socket.socket()
                filler.settimeout(0.2)
                queued.append(filler)
                try:
                    filler.connect(listener.getsockname())
                except TimeoutError:
                    break
            else:
                pytest.fail("the listener's accept queue never filled")
            yield listener.getsockname()
        finally:
            for filler in queued:
                filler.close()


@pytest.mark.timeout(20)
def test_a_prefill_whose_listener_drops_the_connection_runs_out_the_connect_timeout():
    """The connection itself (not only the handshake after it) waits no longer than the timeout."""
    with _dropping_listener() as address:
        started = time.monotonic()
        with pytest.raises(ProtocolError, match=r"could not connect to prefill .*: timed out"):
            connect(address, SECRET, DECODE, timeout=1.0)
        assert 0.9 < time.monotonic() - started < 2.5


class _NoIPv6(socket.socket):
    """A host booted without IPv6: such sockets cannot be made."""

    def __init__(self, family=-1, *args, **kwargs):
        if family == socket.AF_INET6:
            raise OSError(errno.EAFNOSUPPORT, "Address family not supported by protocol")
        super().__init__(family, *args, **kwargs)


@pytest.mark.timeout(20)
def test_an_address_that_cannot_be_used_or_does_not_answer_leaves_time_for_the_next():
    """A name's IPv6 address on a host without IPv6, and one that drops what we send, before
    the prefill's: the first is passed over, the second given its share of the timeout."""
    header, _keep = offer_header()
    prefill = FakePrefill("offer", header, b"meta0meta1")
    try:
        with _dropping_listener() as dropping:
            addresses = [
                (socket.AF_INET6, socket.SOCK_STREAM, 6, "", ("::1", prefill.address[1], 0, 0)),
                (socket.AF_INET, socket.SOCK_STREAM, 6, "", dropping),
                (socket.AF_INET, socket.SOCK_STREAM, 6, "", prefill.address),
            ]
            started = time.monotonic()
            with _resolver(addresses), patch.object(peers_module.socket, "socket", _NoIPv6):
                session = connect(("three-homes.test", prefill.address[1]), SECRET, DECODE, timeout=3.0)
            took = time.monotonic() - started
    finally:
        prefill.close()
    with contextlib.closing(session):
        assert session.sock.getpeername() == prefill.address
    assert 1.0 < took < 2.2  # half of what was left went to the address that dropped


def test_a_forked_child_has_every_lookup_slot():
    """A child does not inherit the lookup threads that would give their slots back."""
    for _ in range(peers_module.MAX_LOOKUPS):
        assert peers_module._lookups.acquire(blocking=False)
    try:
        child = os.fork()
        if child == 0:  # the child: every slot free, then out without pytest's teardown
            free = [peers_module._lookups.acquire(blocking=False) for _ in range(peers_module.MAX_LOOKUPS)]
            os._exit(0 if all(free) else 1)
        _, status = os.waitpid(child, 0)
        assert os.waitstatus_to_exitcode(status) == 0
        assert not peers_module._lookups.acquire(blocking=False)  # the parent's are still taken
    finally:
        for _ in range(peers_module.MAX_LOOKUPS):
            peers_module._lookups.release()


@pytest.mark.timeout(20)
def test_a_lookup_that_takes_a_while_is_waited_for():
    header, _keep = offer_header()
    prefill = FakePrefill("offer", header, b"meta0meta1")
    addresses = [(socket.AF_INET, socket.SOCK_STREAM, 6, "", prefill.address)]
    asked = []
    try:
        with _resolver(lambda: time.sleep(0.3) or addresses, asked):
            session = connect(("slow-dns.test", prefill.address[1]), SECRET, DECODE, timeout=5)
    finally:
        prefill.close()
    with contextlib.closing(session):
        assert session.sock.getpeername() == prefill.address
    assert asked == ["slow-dns.test"]  # one lookup, waited for


@pytest.mark.timeout(20)
def test_a_name_the_real_resolver_knows_is_connected():
    header, _keep = offer_header()
    prefill = FakePrefill("offer", header, b"meta0meta1")
    try:
        session = connect(("localhost", prefill.address[1]), SECRET, DECODE, timeout=5)
    finally:
        prefill.close()
    with contextlib.closing(session):
        assert session.offer.metadata == [b"meta0", b"meta1"]


# --- the beats of a session ----------------------------------------------------------------


def _session(beat_seconds=0.05):
    from kvhost.nixl.peers import Session

    mine, theirs = socket.socketpair()
    return Session(mine, "pair", Offer(PREFILL, [], [], [], beat_seconds=beat_seconds)), theirs


def _beat_threads():
    return [t for t in threading.enumerate() if t.name == "beats to pair"]


@pytest.mark.timeout(20)
def test_beats_and_their_answers_work_on_a_descriptor_past_selects_1024():
    """A serving process holds thousands of descriptors: select() refuses one past 1024
    (the beat thread ended unsaid, and prefill let go of a decode that was reading)."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < 2100:
        pytest.skip("this process may not hold descriptors past 2100")
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, 2100), hard))
    try:
        session, theirs = _session()
        high = os.dup2(session.sock.fileno(), 2050)
        session.sock.close()
        session.sock = socket.socket(fileno=high)
        with theirs, contextlib.closing(session):
            session.start_beats()
            mark = session.ask()
            beat = receive(theirs, timeout=2, expect=BEAT)
            send(theirs, HELD, {"n": beat.fields().integer("n")}, timeout=1)
            deadline = time.monotonic() + 2
            while not session.confirmed(mark) and time.monotonic() < deadline:
                time.sleep(0.005)
            assert session.confirmed(mark) and session.beat_error is None
            send(theirs, HELD, {"done": True}, timeout=1)
            session.done(ok=True, timeout=2)
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


@pytest.mark.timeout(20)
def test_beats_come_from_one_daemon_thread_until_done_and_none_after():
    session, theirs = _session()
    with theirs:
        session.start_beats()
        session.start_beats()  # a second call starts nothing more
        threads = _beat_threads()
        assert len(threads) == 1 and threads[0].daemon
        assert [receive(theirs, timeout=2).kind for _ in range(3)] == ["beat"] * 3
        send(theirs, HELD, {"done": True}, timeout=1)  # prefill's answer, waiting for done to read it
        session.done(ok=True, timeout=2)
        kinds = []
        while True:  # the beats already on the way, then done, then nothing
            message = receive(theirs, timeout=2)
            kinds.append(message.kind)
            if message.kind == "done":
                break
        assert set(kinds[:-1]) <= {"beat"} and message.fields().data == {"ok": True}
        theirs.settimeout(0.3)
        with pytest.raises(TimeoutError):
            theirs.recv(1)
        session.close()
        assert not _beat_threads()


@pytest.mark.timeout(20)
def test_a_beat_that_waited_for_the_lock_while_done_went_out_is_not_sent():
    """A beat whose interval ended just before ``done`` set the stop, and that got the socket
    only after done went out, is dropped: prefill reads nothing after done."""
    session, theirs = _session(beat_seconds=0.05)
    done_sent = threading.Event()
    real = threading.Lock()

    class DoneFirst:  # the beat thread gets the lock only once done has gone out
        def acquire(self, timeout=-1):
            if threading.current_thread().name.startswith("beats to"):
                done_sent.wait(5)
            return real.acquire(timeout=timeout)

        def release(self):
            real.release()

        def __enter__(self):
            self.acquire()

        def __exit__(self, *exc):
            self.release()

    session._lock = DoneFirst()
    with theirs:
        session.start_beats()
        time.sleep(0.2)  # the beat thread is past its first interval, waiting for the lock
        send(theirs, HELD, {"done": True}, timeout=1)
        session.done(ok=True, timeout=2)
        done_sent.set()
        assert receive(theirs, timeout=2).kind == "done"
        theirs.settimeout(0.3)
        with pytest.raises(TimeoutError):
            theirs.recv(1)
        session.close()


@pytest.mark.timeout(30)
@pytest.mark.parametrize("beating", [False, True], ids=["no beats", "beats"])
def test_done_keeps_its_timeout_while_prefill_floods_answers(beating):
    """A prefill that sends valid ``held`` answers faster than they are read held ``done``
    (and the beat thread, with the socket's lock) until it stopped: 8 s for a 1 s timeout."""
    session, theirs = _session(beat_seconds=0.1)
    stop = threading.Event()
    answers = encode(HELD, {"n": 0}) * 20_000  # sent in one go: the socket stays full while it is read

    def flood():
        # Whole frames only (a send cut by a timeout would leave half a frame, which reads as
        # corrupted): it blocks while the socket is full, and ends when decode's side closes.
        theirs.settimeout(None)
        stop_at = time.monotonic() + 6  # the most an unbounded reader is held for
        with contextlib.suppress(OSError):
            while not stop.is_set() and time.monotonic() < stop_at:
                theirs.sendall(answers)

    flooding = threading.Thread(target=flood, daemon=True)
    flooding.start()
    try:
        if beating:
            session.start_beats()
            time.sleep(0.6)
        beats_sent = session._sent
        started = time.monotonic()
        with pytest.raises(HoldLostError, match=r"did not confirm .*: no answer to 'done' within 0\.5 s;"):
            session.done(ok=True, timeout=0.5)
        assert time.monotonic() - started < 1.5
        assert beats_sent >= 2 or not beating, "the beats stopped while answers were read"
    finally:
        stop.set()
        session.close()  # the flood's send fails: decode's side is gone
        flooding.join(5)
        theirs.close()
    assert not flooding.is_alive()


@pytest.mark.timeout(20)
def test_done_refuses_a_timeout_of_zero_and_sends_nothing():
    """No answer comes in no time: done(timeout=0) could only fail, its send half-way
    through the frame (a socket given 0 s is non-blocking)."""
    session, theirs = _session()
    with theirs, contextlib.closing(session):
        with pytest.raises(
            InvalidTimeoutError, match=r"^done timeout: expected a number of seconds in \(0, 604800\], got 0\.0$"
        ):
            session.done(ok=True, timeout=0)
        theirs.setblocking(False)
        with pytest.raises(BlockingIOError):
            theirs.recv(1)  # no 'done' was sent


@pytest.mark.timeout(20)
def test_close_ends_the_beats_at_once():
    session, theirs = _session(beat_seconds=1.0)
    with theirs:
        session.start_beats()
        started = time.monotonic()
        session.close()
        assert not _beat_threads() and time.monotonic() - started < 0.5


@pytest.mark.timeout(20)
def test_a_beat_that_cannot_be_sent_ends_the_beats_and_says_why():
    session, theirs = _session()
    theirs.close()  # the peer is gone
    session.start_beats()
    deadline = time.monotonic() + 5
    while _beat_threads() and time.monotonic() < deadline:
        time.sleep(0.02)
    assert not _beat_threads()
    why = session.beat_error
    assert why is not None and ("could not send 'beat'" in why or "the peer closed the connection" in why), why
    session.close()


UNPRINTABLE = {"lone surrogate": "\ud800abc", "line end": "ok\nforged line", "escape": "\x1b[2J", "nul": "a\x00"}


@pytest.mark.parametrize("text", UNPRINTABLE.values(), ids=UNPRINTABLE.keys())
def test_a_peer_s_text_must_be_printable(text):
    """A peer's strings reach logs, messages and digests: JSON's escapes can spell what no
    encoder takes (a lone surrogate) or what forges a log line."""
    with pytest.raises(ProtocolError, match=r"^x\.name: expected printable text, got "):
        check_text(text, "x.name")
    assert check_text("naïve 名前 ok", "x.name") == "naïve 名前 ok"


@pytest.mark.parametrize("text", UNPRINTABLE.values(), ids=UNPRINTABLE.keys())
def test_a_stranger_s_unprintable_proof_is_dropped_and_the_server_serves_on(text):
    running = Running(peers=1, idle=5.0, peer_timeout=2.0)
    healthy = connect(("127.0.0.1", running.port), SECRET, DECODE, timeout=10)
    with contextlib.closing(healthy):
        healthy.start_beats()
        stranger, _ = _knocked(running.port)
        with stranger:
            send(stranger, ENGINE, {"proof": text, "engine": DECODE.to_dict()}, timeout=5)
            assert _closed_by_listener(stranger, within=3.0)
        assert running.thread.is_alive()
        healthy.done(ok=True, timeout=5)
    [record] = running.finish()
    assert record.outcome == "done" and running.server.dropped == 1


def test_a_refusal_with_unprintable_text_fails_the_peer_without_reaching_the_log():
    running = Running(peers=1, idle=5.0)
    session = connect(("127.0.0.1", running.port), SECRET, DECODE, timeout=10)
    with contextlib.closing(session):
        send(session.sock, REFUSE, {"reason": "no\n\udfff"}, timeout=5)
        [record] = running.finish()
    assert record.outcome == "failed" and record.detail.startswith("refuse.reason: expected printable text")
    assert all(line.isprintable() for line in running.lines)


@pytest.mark.parametrize(("secret", "got"), [(b"", "0 bytes"), (bytes(31), "31 bytes"), ("ab" * 32, "str")])
def test_a_secret_too_short_or_not_bytes_is_refused_by_both_ends(secret, got):
    """An empty key lets anyone prove it; a str would fail at the first knock."""
    message = f"the shared secret must be at least 32 bytes, got {got}"
    with socket.create_server(("127.0.0.1", 0)) as listener:
        with pytest.raises(ProtocolError, match=message):
            Server(listener, secret, PREFILL, lambda peer: None)
        with pytest.raises(ProtocolError, match=message):
            connect(listener.getsockname(), secret, DECODE, timeout=5)
        listener.setblocking(False)  # nothing connected: the check comes first
        with pytest.raises(BlockingIOError):
            listener.accept()
    longer = Server(socket.socket(), bytes(64), PREFILL, lambda peer: None)  # longer secrets are fine
    longer.listener.close()


def test_an_offer_its_peer_does_not_read_stalls_no_other_peer():
    """The offer goes out as its peer reads it: a peer that reads nothing for longer than the
    others' beat deadline does not get them ended as silent (and released while reading)."""
    running = Running(peers=None, idle=1.0, peer_timeout=0.5, send_timeout=2.0, metadata=BIG)
    healthy = connect(("127.0.0.1", running.port), SECRET, DECODE, timeout=10)
    with contextlib.closing(healthy):
        healthy.start_beats()
        with _proven_and_silent(running.port):
            time.sleep(2.5)  # past the silent one's send timeout
            assert healthy.beat_error is None and running.released and running.released[0].outcome == "failed"
        healthy.done(ok=True, timeout=5)
    records = running.finish(within=10)
    assert sorted((r.outcome, r.detail) for r in records) == [
        ("done", ""),
        ("failed", "could not send 'offer' within 2 s: the peer does not read"),
    ]


def test_an_offer_being_sent_is_not_charged_for_another_peer_s_long_offer_step():
    """The loop writes an offer only between steps: while the application's offer for a second
    peer takes longer than the send timeout, the first peer's offer waits unwritten, and that
    time is the server's, not the peer's."""
    running = Running(peers=2, idle=10.0, send_timeout=1.0, metadata=BIG, delays=(0.0, 3.0))
    with _proven_and_silent(running.port) as first:
        deadline = time.monotonic() + 10
        while not running.asked and time.monotonic() < deadline:
            time.sleep(0.01)
        second, nonces = _knocked(running.port)
        with second:
            send(second, ENGINE, {"proof": proof(SECRET, "decode", nonces), "engine": DECODE.to_dict()}, timeout=5)
            while len(running.asked) < 2 and time.monotonic() < deadline:
                time.sleep(0.01)
            # The loop is in the second's offer step: the first reads what its socket buffered,
            # then the rest once the loop is back, past its own send timeout by then.
            for sock in (first, second):
                assert len(receive(sock, timeout=10, expect=OFFER).blob) == 2 * len(BIG[0])
                send(sock, DONE, {"ok": True}, timeout=5)
            records = running.finish(within=10)
    assert [(r.outcome, r.ok) for r in records] == [("done", True), ("done", True)]


@pytest.mark.parametrize("silent_first", [True, False])
def test_an_offer_not_read_is_given_the_send_timeout_plus_the_steps_taken_while_it_was_sent(silent_first):
    """A peer that never reads fails once the send timeout has passed beyond the time the
    loop spent in steps while its offer was out (another peer's offer of 1.5 s), and only
    that: steps taken before its offer began are not its."""
    # The healthy peer's handshake must reach its offer step within the silent one's send
    # timeout (1 s, ample even under load); its offer step then takes 1.5 s.
    running = Running(peers=2, idle=10.0, send_timeout=1.0, metadata=BIG, delays=(0.0, 1.5) if silent_first else (1.5,))
    started = time.monotonic()
    silent = _proven_and_silent(running.port) if silent_first else None
    deadline = time.monotonic() + 10
    while silent and not running.asked and time.monotonic() < deadline:
        time.sleep(0.01)
    healthy = connect(("127.0.0.1", running.port), SECRET, DECODE, timeout=10)  # its offer takes 1 s
    with contextlib.closing(healthy):
        healthy.done(ok=True, timeout=5)
    with silent or _proven_and_silent(running.port):
        records = running.finish(within=10)
    [failed] = [r for r in records if r.outcome == "failed"]
    assert failed.detail == "could not send 'offer' within 1 s: the peer does not read"
    if silent_first:  # its offer was out during the other's 1.5 s step: 1 + 1.5 s
        assert 2.2 < failed.held_seconds < 6.0
    else:  # the 1.5 s step came before its offer (counted there, 1 + 2 x 1.5 s)
        assert failed.held_seconds < 2.5
    assert time.monotonic() - started < 10


def _offer_message(spec=PREFILL):
    keep = [rank_table(spec) for _ in range(spec.tp_size)]
    offer = Offer(spec, [t for _, t in keep], [b"m"] * spec.tp_size, [RemoteRequest("req-0", 0, 5, [1])])
    return decode(encode(OFFER, offer.header(), b"".join(offer.metadata)))


def test_an_offer_s_table_count_is_checked_before_any_table_is_read():
    message = _offer_message()
    message.header["tables"].append({"not": "a table"})
    with pytest.raises(ProtocolError, match=r"^offer\.tables: 3 tables for TP 2$"):
        parse_offer(message, DECODE)


def test_an_offer_s_tables_share_one_stream_budget(monkeypatch):
    """Every table's arrays may point at the same bytes: the bound is on the whole offer."""
    message = _offer_message()
    per_table = len(parse_offer(message, DECODE).tables[0].streams)
    monkeypatch.setattr(peers_module, "MAX_STREAMS", 2 * per_table)
    assert len(parse_offer(message, DECODE).tables) == 2
    monkeypatch.setattr(peers_module, "MAX_STREAMS", 2 * per_table - 1)
    second_table = rf"^offer\.tables\[1\]\.streams\.layer.*\[0, {per_table - 1}\], got {per_table}"
    with pytest.raises(ProtocolError, match=second_table):
        parse_offer(message, DECODE)


def test_a_repeated_name_is_found_in_one_pass():
    """The repeat comes last in 65,000 names: found at once, not by a scan per name."""
    names = [f"r{i}" for i in range(65_000)] + ["r0"]
    started = time.monotonic()
    with pytest.raises(ProtocolError, match=r"^x\.name\[65000\]: 'r0' appears twice$"):
        Fields({"name": names}, "x").texts("name", max_items=1 << 17, distinct=True)
    assert time.monotonic() - started < 2.0


def test_a_log_that_fails_ends_no_serving_and_every_held_peer_is_released():
    """A prefill whose stdout's reader went away: its log raises on every line. Peers are
    still served, and when the serve ends every held one is released."""
    told = []

    def broken_log(line):
        told.append(line)
        raise BrokenPipeError(errno.EPIPE, "Broken pipe")

    stopping = threading.Event()
    running = Running(peers=None, stop=stopping.is_set, log=broken_log, peer_timeout=5.0)
    sessions = [connect(("127.0.0.1", running.port), SECRET, DECODE, timeout=10) for _ in range(3)]
    try:
        for session in sessions:
            session.start_beats()
        sessions[0].done(ok=True, timeout=5)  # a hold that ends while serving: logged (and failing), released
        time.sleep(0.3)
        stopping.set()
        records = running.finish()
    finally:
        for session in sessions:
            session.close()
    assert [r.outcome for r in records] == ["done", "closed", "closed"]
    assert running.released == records  # every hold released, the two the server's stop ended included
    assert told.count(f"offered 2 requests to decode at {records[2].address}") == 1  # the log was still asked


def test_a_long_offer_does_not_end_peers_whose_beats_arrived_meanwhile():
    """The application's offer for a second peer takes longer than the peer timeout; the
    first peer beat all along and must still be held once the offer returns."""
    running = Running(peers=2, delays=(0.0, 1.6), peer_timeout=1.0)
    address = ("127.0.0.1", running.port)
    first = connect(address, SECRET, DECODE, timeout=10)
    try:
        first.start_beats()
        second = connect(address, SECRET, DECODE, timeout=10)  # its offer holds the server's loop for 1.6 s
        with contextlib.closing(second):
            second.start_beats()
            time.sleep(0.3)
            first.done(ok=True, timeout=5)
            second.done(ok=True, timeout=5)
    finally:
        first.close()
    records = running.finish()
    assert [(r.outcome, r.detail) for r in records] == [("done", ""), ("done", "")]


@pytest.mark.parametrize("value", [0.05, 0.19])
def test_a_server_refuses_a_peer_timeout_no_decode_can_beat_within(value):
    with (
        socket.create_server(("127.0.0.1", 0)) as listener,
        pytest.raises(KVHostError, match=r"peer timeout .*: at least 0\.2 s, four of the shortest beats \(0\.05 s\)"),
    ):
        Server(listener, SECRET, PREFILL, lambda peer: None, peer_timeout=value)  # type: ignore[arg-type,return-value]
    with socket.create_server(("127.0.0.1", 0)) as listener:
        assert Server(listener, SECRET, PREFILL, lambda peer: None, peer_timeout=0.2).beat_seconds == 0.05  # type: ignore[arg-type,return-value]


def test_a_handshake_that_fails_names_the_prefill_and_the_step():
    """A decode of several prefill engines must tell which failed, and waiting for what."""
    running = Running(peers=None, idle=3.0, delays=(3.0,))  # proves the secret, then offers late
    name = f"prefill at 127.0.0.1:{running.port}"
    with pytest.raises(ProtocolError, match=rf"^{name}, at its offer: timed out waiting for the header"):
        connect(("127.0.0.1", running.port), SECRET, DECODE, timeout=1.0)
    running.finish()

    with socket.create_server(("127.0.0.1", 0)) as listener:  # a service that is not a prefill at all
        port = listener.getsockname()[1]

        closed = []

        def answer_http():
            sock, _ = listener.accept()
            with sock:
                sock.recv(4096)
                sock.sendall(b"HTTP/1.1 400 Bad Request\r\n\r\n" + bytes(64))
                sock.settimeout(5)
                try:
                    closed.append(sock.recv(1) == b"")  # the decode closed its end: EOF
                except ConnectionResetError:  # closed with our bytes unread: a reset
                    closed.append(True)
                except TimeoutError:
                    closed.append(False)

        thread = threading.Thread(target=answer_http)
        thread.start()
        with pytest.raises(ProtocolError, match=rf"^prefill at 127\.0\.0\.1:{port}, at its challenge: ") as failed:
            connect(("127.0.0.1", port), SECRET, DECODE, timeout=1.0)
            # (the traceback ``failed`` keeps holds the failed call's frames: the socket is closed by
            # the handshake itself, not by the garbage collector)
        thread.join(10)
        assert closed == [True] and failed.value is not None


@pytest.mark.parametrize(
    ("address", "message"),
    [
        (("127.0.0.1", 65536 + 7600), r"the port must be an int in \[1, 65535\]"),  # the resolver would take 7600
        (("127.0.0.1", 65536), "the port must be an int"),
        (("127.0.0.1", 0), "the port must be an int"),
        (("127.0.0.1", -1), "the port must be an int"),
        (("127.0.0.1", True), "the port must be an int"),
        (("127.0.0.1", 7600.0), "the port must be an int"),
        (("127.0.0.1", "7600"), "the port must be an int"),
        (("127.0.0.1\x00.evil.example", 7600), r"'127\.0\.0\.1\\x00\.evil\.example' is not a host name"),
        (("", 7600), "'' is not a host name"),
        (("a b", 7600), "'a b' is not a host name"),
        ((b"127.0.0.1", 7600), "is not a host name"),
        (["127.0.0.1", 7600], "an address must be a \\(host, port\\) pair"),
        (("127.0.0.1", 7600, 0), "an address must be a \\(host, port\\) pair"),
    ],
)
def test_connect_takes_an_address_as_given_and_never_coerces_it(address, message):
    started = time.monotonic()
    with pytest.raises(ArgumentError, match=message):
        connect(address, SECRET, DECODE, timeout=5)  # type: ignore[arg-type]
    assert time.monotonic() - started < 0.5  # refused, not tried until the timeout


@pytest.mark.parametrize("port", [1, 65535])
def test_connect_takes_the_first_and_last_port_as_addresses(port):
    with pytest.raises(ProtocolError, match=rf"could not connect to prefill at 127\.0\.0\.1:{port} "):
        connect(("127.0.0.1", port), SECRET, DECODE, timeout=0.3)  # nothing listens there: refused, tried again


@pytest.mark.parametrize("text", ["host\x00name:7600", "host\tname:7600", "[::1\n]:7600", "h:\u0663"])
def test_parse_address_refuses_control_characters_and_digits_that_are_not_ascii(text):
    with pytest.raises(ArgumentError):
        parse_address(text)


def test_a_session_closed_while_done_waits_for_the_answer_ends_done_with_the_hold_lost():
    """``close`` on another thread while ``done`` waits: the next wait met a closed socket and
    raised a ValueError (poll of descriptor -1), not a KVHostError."""
    mine, theirs = socket.socketpair()
    session = Session(mine, "pair", Offer(PREFILL, [], [], [], beat_seconds=5.0))
    outcome: list[BaseException | None] = []

    def finish() -> None:
        try:
            session.done(ok=True, timeout=3.0)
            outcome.append(None)
        except BaseException as err:  # looked at below
            outcome.append(err)

    waiting = threading.Thread(target=finish)
    waiting.start()
    try:
        assert theirs.recv(4096)  # its 'done': it waits for the answer now
        time.sleep(0.05)
        session.close()
        theirs.send(b"x")  # wakes its wait on the socket closed under it
        waiting.join(5)
    finally:
        theirs.close()
    assert isinstance(outcome[0], HoldLostError) and "closed on this side" in str(outcome[0])


def test_a_socket_on_descriptor_0_is_waited_on_like_any_other():
    """Only a closed socket (descriptor -1) is refused: one that took descriptor 0 (a process
    started with stdin closed) is polled."""
    code = (
        "import os, socket\n"
        "from kvhost.nixl.peers import _readable\n"
        "os.close(0)\n"
        "mine, theirs = socket.socketpair()\n"
        "assert mine.fileno() == 0, mine.fileno()\n"
        "print(_readable([mine], 0.01) == [])\n"
        "theirs.send(b'x')\n"
        "print(_readable([mine], 1.0) == [mine])\n"
    )
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert run.stdout.split() == ["True", "True"], run.stdout + run.stderr[-2000:]


def test_the_entry_points_refuse_arguments_of_the_wrong_kind_as_kvhost_errors(tmp_path):
    """What a caller hands the handshake's entry points is checked for its kind first: a
    number for an address, no spec, a path with a NUL, a header or blob that is no mapping
    or bytes raised AttributeError, TypeError, ValueError or RecursionError from inside."""
    with pytest.raises(ArgumentError, match="an address must be a str, HOST:PORT, got int"):
        parse_address(7600)  # type: ignore[arg-type]
    with pytest.raises(ArgumentError, match="spec must be an EngineSpec, got NoneType"):
        connect(("127.0.0.1", 1), SECRET, None, timeout=0.3)  # type: ignore[arg-type]
    with pytest.raises(ArgumentError, match="a secret file is a path, got int"):
        read_secret_file(5)  # type: ignore[arg-type]
    with pytest.raises(ArgumentError, match="embedded null byte"):
        read_secret_file(str(tmp_path / "a\x00b"))
    with pytest.raises(InvalidTimeoutError, match="secret timeout"):
        read_secret_file(str(tmp_path / "absent"), timeout="x")  # type: ignore[arg-type]  # a file, not "-"
    with pytest.raises(ArgumentError, match="extra fields must be a mapping, got list"):
        connect(("127.0.0.1", 1), SECRET, DECODE, timeout=0.3, extra=[])  # type: ignore[arg-type]
    with socket.create_server(("127.0.0.1", 0)) as listener:
        with pytest.raises(ArgumentError, match="spec must be an EngineSpec, got NoneType"):
            Server(listener, SECRET, None, lambda hello: None)  # type: ignore[arg-type]
        with pytest.raises(ArgumentError, match=r"offer .* must be callables"):
            Server(listener, SECRET, PREFILL, None)  # type: ignore[arg-type]
    with pytest.raises(ArgumentError, match="listener must be a listening socket, got str"):
        Server("127.0.0.1:7600", SECRET, PREFILL, lambda hello: None)  # type: ignore[arg-type]
    looped: dict[str, object] = {}
    looped["self"] = looped
    for kind, header, blob, message in (
        (5, {}, b"", "a message is a kind"),
        ("hello", [1], b"", "a message is a kind"),
        ("hello", {}, "text", "its blob must be bytes, got str"),
        ("hello", looped, b"", "cannot be sent as JSON"),
    ):
        with pytest.raises(ProtocolError, match=message):
            encode(kind, header, blob)  # type: ignore[arg-type]
    with pytest.raises(ProtocolError, match="a frame is bytes, got NoneType"):
        decode(None)  # type: ignore[arg-type]
    assert decode(encode("hello", {"n": 1})).header["n"] == 1


def test_done_sends_only_a_bool_and_the_server_takes_only_callables():
    """``done(ok=)`` reaches prefill as given: "no" would have been read as a word there.
    A log or a stop that is no callable was taken and failed later, swallowed or as a TypeError."""
    mine, theirs = socket.socketpair()
    with mine, theirs:
        session = Session(mine, "pair", Offer(PREFILL, [], [], [], beat_seconds=5.0))
        for ok in ("no", None, 1):
            with pytest.raises(ArgumentError, match="ok must be True or False"):
                session.done(ok=ok, timeout=1)  # type: ignore[arg-type]
        theirs.setblocking(False)
        with pytest.raises(BlockingIOError):
            theirs.recv(1)  # nothing was sent
    with socket.create_server(("127.0.0.1", 0)) as listener:
        with pytest.raises(ArgumentError, match="must be callables"):
            Server(listener, SECRET, PREFILL, lambda hello: None, log=5)  # type: ignore[arg-type]
        server = Server(listener, SECRET, PREFILL, lambda hello: None)
        for stop in (False, True, 0):
            with pytest.raises(ArgumentError, match="stop: expected None or a callable"):
                server.serve(peers=None, idle_timeout=1, stop=stop)  # type: ignore[arg-type]


def test_bounds_a_caller_sets_are_integers_not_nan():
    """A bound of NaN compared false with every size, so it bounded nothing: the frame limit,
    a table's streams and a merge's bytes are integers (a bool is none)."""
    from kvhost.nixl import RegionTable
    from kvhost.nixl.plans import merge_rows

    mine, theirs = socket.socketpair()
    with mine, theirs:
        for limit in (float("nan"), True, -1, "64"):
            with pytest.raises(ArgumentError, match="limit must be a non-negative integer, got "):
                receive(mine, timeout=1, limit=limit)  # type: ignore[arg-type]
        send(theirs, "hello", {}, timeout=1)
        with pytest.raises(ProtocolError, match="exceeds the limit of 0 bytes"):
            receive(mine, timeout=1, limit=0)  # the least bound: a frame of anything is past it
    for bound in (float("nan"), True, -1):
        with pytest.raises(ArgumentError, match="max_streams must be a non-negative integer, got "):
            RegionTable.from_dict({}, max_streams=bound)  # type: ignore[arg-type]
        rows = np.zeros((0, 3), dtype=np.int64)
        with pytest.raises(ArgumentError, match="max_bytes must be an integer of at least 1"):
            merge_rows(rows, rows, bound, np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64))  # type: ignore[arg-type]
