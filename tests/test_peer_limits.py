"""A peer can send anything, a link can go down, a process can freeze: every wait kvhost
makes has a deadline, and every resource a peer can make it allocate is bounded.

- Timeouts: NaN, infinity, negative numbers, bools and non-numbers are refused, by
  ``Transfer.wait``, ``framing.receive``/``send`` and the demo's options alike.
- A control frame costs memory in proportion to its size (peaks measured with tracemalloc).
- A peer's block table that declares billions of blocks costs memory only for the blocks a
  request names (measured in a subprocess whose address space is capped, so a regression
  fails with MemoryError instead of exhausting the machine).
- Stray connections to a prefill engine's control port are dropped; the hand-off goes on.
- ``kvhost demo`` exits 0 (every request verified), 1 (only: requests failed) or 2
  (anything else), impossible options with one line naming the option; so do
  ``kvhost prefill`` and ``kvhost decode``.
- The engines' NIXL/UCX agents listen on loopback unless the user says otherwise (the
  sockets of running demos are checked in test_demo.py).
"""

from __future__ import annotations

import contextlib
import functools
import json
import math
import os
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
import tracemalloc
import types

import numpy as np
import pytest
from test_nixl import needs_nixl
from test_nixl_protocol import FRAME

from kvhost.errors import KVHostError
from kvhost.nixl import (
    MAX_STREAMS,
    EngineSpec,
    IncompatibleEngineError,
    InvalidTimeoutError,
    ProtocolError,
    RegionTable,
    Stream,
    Transfer,
    connect,
    decode,
    encode,
    handshake,
    receive,
    send,
)
from kvhost.nixl.fields import MAX_ARRAY_BYTES
from kvhost.nixl.framing import HEADER_BYTES, MAX_JSON_BYTES, MAX_JSON_VALUES
from kvhost.nixl.peers import DONE, ENGINE, KNOCK, OFFER, parse_offer, proof, read_secret_file
from kvhost.nixl.server import MAX_CONNECTIONS
from kvhost_tools.demo import cli as demo_cli
from kvhost_tools.demo import config as demo_config
from kvhost_tools.demo import decode as demo_decode
from kvhost_tools.demo import netenv
from kvhost_tools.demo import prefill as demo_prefill

MiB = 1 << 20

# --- every wait has a finite deadline -----------------------------------------------------------

ENDLESS = [math.nan, math.inf, -math.inf, -1, -1e-9, True, False, "1", None, 1e9, np.float64("nan")]


@pytest.mark.parametrize("timeout", ENDLESS, ids=repr)
def test_transfer_wait_refuses_a_timeout_that_is_not_finite_seconds(timeout):
    transfer = Transfer(types.SimpleNamespace(peer="p"), handle=None, nbytes=0, op="READ", descriptors=0)
    started = time.monotonic()
    with pytest.raises(InvalidTimeoutError, match=r"Transfer\.wait timeout: expected a number of seconds") as raised:
        transfer.wait(timeout)
    assert isinstance(raised.value, KVHostError)
    assert (str(timeout) if isinstance(timeout, float) else repr(timeout)) in str(raised.value)
    assert time.monotonic() - started < 1  # refused, not waited on


@pytest.mark.parametrize("interval", [0, math.nan, math.inf, 2.0, -1])
def test_transfer_wait_refuses_a_poll_interval_out_of_range(interval):
    transfer = Transfer(types.SimpleNamespace(peer="p"), handle=None, nbytes=0, op="READ", descriptors=0)
    with pytest.raises(InvalidTimeoutError, match=r"Transfer\.wait interval"):
        transfer.wait(1.0, interval=interval)


@pytest.mark.timeout(20)
@pytest.mark.parametrize("timeout", ENDLESS, ids=repr)
def test_receive_and_send_refuse_a_timeout_that_is_not_finite_seconds(timeout):
    left, right = socket.socketpair()
    with left, right:
        right.sendall(encode("x", {}))
        with pytest.raises(
            InvalidTimeoutError, match=r"receive timeout: expected a number of seconds in \[0, 604800\]"
        ):
            receive(left, timeout=timeout)
        with pytest.raises(InvalidTimeoutError, match=r"send timeout"):
            send(left, "x", {}, timeout=timeout)
    listener = socket.create_server(("127.0.0.1", 0))
    with listener, pytest.raises(InvalidTimeoutError, match=r"connect timeout"):
        connect(listener.getsockname(), SECRET, peers_tests().DECODE, timeout=timeout)


@pytest.mark.timeout(20)
def test_a_silent_peer_times_out_at_the_deadline():
    left, right = socket.socketpair()
    with left, right:
        right.sendall(encode(OFFER, {})[: HEADER_BYTES + 3])
        started = time.monotonic()
        with pytest.raises(ProtocolError, match=r"timed out waiting for the JSON body: 3 of \d+ bytes"):
            receive(left, timeout=0.3)
        assert 0.25 < time.monotonic() - started < 3


@pytest.mark.timeout(20)
def test_a_send_given_no_time_is_refused_before_a_byte_goes_out():
    """A socket given 0 s is non-blocking: its send stopped where the buffer filled, half a
    frame on the wire, and said the peer had closed."""
    left, right = socket.socketpair()
    with left, right:
        left.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
        with pytest.raises(
            InvalidTimeoutError, match=r"^send timeout: expected a number of seconds in \(0, 604800\], got 0\.0$"
        ):
            send(left, "k", {}, bytes(8 << 20), timeout=0)
        right.setblocking(False)
        with pytest.raises(BlockingIOError):
            right.recv(1)  # nothing was sent


@pytest.mark.timeout(20)
def test_a_header_declaring_megabytes_that_never_come_costs_only_the_bytes_that_did():
    """The arrays' room is made as their bytes arrive: 26 bytes declaring 64 MiB held 64 MiB
    until the deadline."""
    header = struct.pack(">4sBIIII", b"KVHM", 2, 0, 0, MAX_ARRAY_BYTES, 0)
    left, right = socket.socketpair()
    with left, right:
        right.sendall(header + bytes(1000))
        tracemalloc.start()
        try:
            started = time.monotonic()
            with pytest.raises(
                ProtocolError, match=rf"^timed out waiting for the arrays: 1000 of {MAX_ARRAY_BYTES} bytes arrived$"
            ):
                receive(left, timeout=0.3)
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
    assert time.monotonic() - started < 3
    assert peak < MiB // 4, f"peak {peak / MiB:.1f} MiB for 1000 bytes of a declared {MAX_ARRAY_BYTES / MiB:g} MiB"


@pytest.mark.parametrize("option", ["--timeout", "--connect-timeout", "--step"])
@pytest.mark.parametrize("value", ["nan", "inf", "-inf", "0", "-5", "1e9", "soon"])
def test_the_demo_refuses_time_options_that_are_not_finite_seconds(option, value, capsys):
    with pytest.raises(SystemExit) as exit_info:
        demo_cli.main([f"{option}={value}"])  # (a value like -inf would read as an option)
    assert exit_info.value.code == 2
    assert f"argument {option}: expected a number of seconds in (0, 604800], got {value!r}" in capsys.readouterr().err


# --- a frame costs memory in proportion to its size -------------------------------------------


def peak_bytes(work):
    """Peak bytes Python and numpy allocate while ``work()`` runs (tracemalloc)."""
    tracemalloc.start()
    try:
        tracemalloc.reset_peak()
        base = tracemalloc.get_traced_memory()[0]
        with contextlib.suppress(ProtocolError):
            work()
        return tracemalloc.get_traced_memory()[1] - base
    finally:
        tracemalloc.stop()


def received_and_parsed(frame, parse=lambda message: message):
    """Send ``frame`` over a socket pair from a thread; receive and parse it here."""
    left, right = socket.socketpair()

    def peer():
        with contextlib.suppress(OSError):  # refused unread: the receiver closes
            right.sendall(frame)

    thread = threading.Thread(target=peer, daemon=True)

    def work():
        thread.start()
        try:
            parse(receive(left, timeout=60))
        finally:
            left.close()
            thread.join(60)
            right.close()

    return work


def json_frame(item: bytes, count: int) -> bytes:
    """A frame whose JSON is a list of ``count`` copies of ``item``, with a correct checksum
    and lengths, whatever the caps (a peer need not respect them)."""
    import struct
    import zlib

    body = b'{"kind":"x","v":[' + b",".join([item] * count) + b"]}"
    return struct.pack(">4sBIIII", b"KVHM", 2, len(body), 0, 0, zlib.crc32(body)) + body


# The JSON a byte of frame turns into the most Python objects for: empty objects and lists,
# one-character strings, floats, small ints, and objects with distinct keys.
JSON_ITEMS = {
    "objects": b"{}",
    "lists": b"[]",
    "strings": b'"a"',
    "floats": b"1.5",
    "ints": b"1000",
    "keyed": b'{"k":{}}',
}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("shape", JSON_ITEMS)
def test_json_costs_a_bounded_amount_whatever_it_holds(shape):
    """The most expensive JSON per byte, as much of it as the JSON cap lets through (refused
    unparsed above the value cap), and as much as the value cap lets through: a few MiB at
    most. With a 64 MiB JSON cap and no value cap, 64 MiB of ``{}`` took 1.6 GiB to parse."""
    item = JSON_ITEMS[shape]
    at_byte_cap = json_frame(item, (MAX_JSON_BYTES - 40) // (len(item) + 1))
    per_item = 1 + sum(item.count(c) for c in (b"{", b"[", b":", b","))  # what json_values counts
    at_value_cap = json_frame(item, (MAX_JSON_VALUES - 8) // per_item)
    for frame in (at_byte_cap, at_value_cap):
        peak = peak_bytes(received_and_parsed(frame))
        assert peak <= 2 * len(frame) + 16 * MiB, (
            f"{shape}: {len(frame) / MiB:.1f} MiB frame, peak {peak / MiB:.0f} MiB"
        )


def big_offer(id_bytes: int, streams: int) -> tuple[bytes, EngineSpec, int]:
    """An offer at the caps: one rank's table of ``streams`` streams (layers x K/V) of 2^32
    declared blocks of one token, and ``id_bytes`` bytes of block ids (4 bytes each) in 4
    requests; and the engine it says it is."""
    layers = streams // 2
    spec = EngineSpec("mha", layers, 1, 1, "uint8", 1, "HNC", 1)
    table = {
        "memory": "DRAM",
        "device_id": 0,
        "order": "HNC",
        "split": "",
        "sizes": {"K": 2, "H": 1, "N": 1, "C": 1},
        "itemsize": 1,
        "num_blocks": 1 << 32,
        "layers": [f"l{i}" for i in range(layers)],
        "coords": "K",
        "streams": {
            "layer": np.repeat(np.arange(layers, dtype=np.uint32), 2),
            "coords": np.tile(np.arange(2, dtype=np.uint32), layers),
            "address": np.arange(1, streams + 1, dtype=np.uint64) << np.uint64(40),
            "stride": np.full(streams, 64, dtype=np.uint64),
        },
    }
    tokens = np.full(4, id_bytes // 16, dtype=np.uint32)
    requests = {
        "name": ["a", "b", "c", "d"],
        "number": np.arange(4, dtype=np.uint32),
        "tokens": tokens,
        "block_ids": np.tile(np.arange(id_bytes // 16, dtype=np.uint32), 4),  # distinct in each request
    }
    header = {
        "engine": spec.to_dict(),
        "tables": [table],
        "metadata_bytes": np.array([8], dtype=np.uint32),
        "requests": requests,
        "beat_seconds": 1.0,
    }
    return encode(OFFER, header, b"metadata"), spec, int(tokens.sum())


@pytest.mark.timeout(180)
def test_an_offer_at_the_caps_costs_its_size_and_a_bounded_rest():
    """An offer as large as the caps allow: 2^16 streams and 60 MiB of block ids. Its arrays
    are read in place, its ids checked without copies; what is not in proportion to the
    frame (one Python object per stream, per layer name, per request) is capped."""
    frame, spec, ids = big_offer(MAX_ARRAY_BYTES - 4 * MiB, MAX_STREAMS)
    parsed = []
    peak = peak_bytes(received_and_parsed(frame, lambda message: parsed.append(parse_offer(message, spec))))
    assert parsed, "the offer was refused"
    [table] = parsed[0].tables
    assert len(table.streams) == MAX_STREAMS and sum(r.remote_ids.size for r in parsed[0].requests) == ids
    assert peak <= 1.25 * len(frame) + 40 * MiB, f"{len(frame) / MiB:.0f} MiB frame, peak {peak / MiB:.0f} MiB"


def test_bulk_integers_are_not_accepted_as_json():
    """Block ids as a JSON list (what version 1 sent) are refused: only arrays carry them."""
    frame, spec, _ = big_offer(64, 4)
    message = decode(frame)
    message.header["requests"]["block_ids"] = [0] * 64
    with pytest.raises(ProtocolError, match=r"offer\.requests\.block_ids: expected an integer array"):
        parse_offer(message, spec)


def test_refusing_a_value_out_of_range_or_a_repeated_id_costs_a_byte_a_value():
    """The first value out of range, and the first repeated id, are found with masks: an index
    of every bad value (8 bytes each) made a 64 MiB frame of one-byte ids cost 576 MiB to refuse."""
    from kvhost.nixl.fields import check_array
    from kvhost.nixl.handshake import _check_distinct

    count = 16 * MiB
    arrays = bytes([255]) * count
    value = {"array": "u1", "offset": 0, "count": count}
    with pytest.raises(ProtocolError, match=r"^ids\[0\]: expected an integer in \[0, 5\], got 255$"):
        check_array(value, "ids", arrays, maximum=5)
    assert peak_bytes(lambda: check_array(value, "ids", arrays, maximum=5)) <= 1.5 * count
    ids = np.zeros(count, dtype=np.uint8)
    with pytest.raises(ProtocolError, match=r"^offer\.block_ids: request 'a' names block 0 twice$"):
        _check_distinct(ids, [0], [count], ["a"], "offer")
    assert peak_bytes(lambda: _check_distinct(ids, [0], [count], ["a"], "offer")) <= 2.5 * count


def test_a_table_is_held_to_its_engine_s_sizes_before_its_streams_are_read():
    """A table whose sizes the engine refutes (a head count of 2^24, which would let 2^16
    streams each carry a coordinate of its own) is refused before a stream is read."""
    frame, spec, _ = big_offer(64, 4)
    message = decode(frame)
    table = message.header["tables"][0]
    table["sizes"]["H"] = 1 << 24
    table["streams"] = {"not": "read"}
    with pytest.raises(IncompatibleEngineError, match=r"^prefill rank 0 table: H is 16777216, the engine says "):
        parse_offer(message, spec)
    table["sizes"]["H"] = spec.heads_per_rank
    table["sizes"]["K"] = 3
    with pytest.raises(IncompatibleEngineError, match=r"^prefill rank 0 table: K is 3, an mha cache has K and V: 2$"):
        parse_offer(message, spec)


@pytest.mark.parametrize(("past", "refused"), [(0, True), (1, False)])
def test_a_stream_must_end_below_two_to_the_64(past, refused):
    """An end of exactly 2^64 would wrap to 0 where ends are kept as uint64."""
    run, blocks, stride = 8, 4, 64
    base = (1 << 64) - (blocks - 1) * stride - run - past
    table = {
        "memory": "DRAM", "device_id": 0, "order": "NC", "split": "", "sizes": {"N": 1, "C": 8},
        "itemsize": 1, "num_blocks": blocks, "layers": ["l0"], "coords": "",
        "streams": {
            "layer": np.zeros(1, dtype=np.uint32), "coords": np.zeros(0, dtype=np.uint32),
            "address": np.array([base], dtype=np.uint64), "stride": np.array([stride], dtype=np.uint64),
        },
    }  # fmt: skip
    if refused:
        with pytest.raises(ProtocolError, match=r"^table\.streams\[0\]: blocks run past the end of the address"):
            RegionTable.from_dict(table)
    else:
        assert RegionTable.from_dict(table).streams[0].address == base


def test_stream_objects_are_small():
    """One Python object per stream is the one cost a table has per stream: keep it small."""
    assert not hasattr(Stream("l", (("K", 0),), 1, 64), "__dict__")
    assert RegionTable.__dataclass_fields__  # (a dataclass, compared field by field)


# --- a table declaring billions of blocks costs only what requests name -------------------------


CAPPED = """
import resource, sys, tracemalloc
import numpy as np
from kvhost.nixl import RegionTable, plan_transfer, Stream
from kvhost.nixl import decode, encode

def vm():
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) * 1024 for line in status if line.startswith("VmSize"))

limit = vm() + (2 << 30)  # 2 GiB of address space beyond the interpreter with torch and numpy
resource.setrlimit(resource.RLIMIT_AS, (limit, resource.getrlimit(resource.RLIMIT_AS)[1]))
"""

BILLIONS = (
    CAPPED
    + """
streams = int(sys.argv[1])
layers = streams // 2
remote = {
    "memory": "DRAM", "device_id": 0, "order": "HNC", "split": "", "sizes": {"K": 2, "H": 2, "N": 4, "C": 8},
    "itemsize": 2, "num_blocks": 1 << 32, "layers": [f"l{i}" for i in range(layers)], "coords": "K",
    "streams": {
        "layer": np.repeat(np.arange(layers, dtype=np.uint32), 2),
        "coords": np.tile(np.arange(2, dtype=np.uint32), layers),
        "address": (np.arange(streams, dtype=np.uint64) + np.uint64(1)) << np.uint64(45),
        "stride": np.full(streams, 128, dtype=np.uint64),
    },
}
frame = encode("table", {"table": remote})
local_streams = tuple(Stream(f"l{s // 2}", (("K", s % 2),), 4096 + s * 4096, 1024) for s in range(streams))
local = RegionTable("DRAM", 0, "HNC", "", {"K": 2, "H": 2, "N": 16, "C": 8}, 2, 4, local_streams)
tracemalloc.start()
message = decode(frame)
table = RegionTable.from_dict(message.header["table"], "table", message.arrays)
plan = plan_transfer(local, table)
last = (1 << 32) - 1
local_rows, remote_rows = plan.descriptor_pairs([3], [last - 3, 7, last, 0])
peak = tracemalloc.get_traced_memory()[1]
assert remote_rows.shape == (streams * 4, 3) and local_rows.shape == (streams * 4, 3), remote_rows.shape
assert int(remote_rows[2, 0]) == (1 << 45) + last * 128  # stream 0, the request's third block
print(len(frame), peak)
"""
)


@pytest.mark.timeout(120)
def test_a_table_declaring_billions_of_blocks_costs_only_the_requested_blocks():
    """2^32 declared blocks in each of 2^14 streams: parsing the table, planning and the
    descriptors of a 4-block request cost a few MiB (they once built a row for every block
    of every stream: 2^46 rows)."""
    streams = 1 << 14
    out = subprocess.run([sys.executable, "-c", BILLIONS, str(streams)], capture_output=True, text=True, timeout=110)
    assert out.returncode == 0, out.stderr[-2000:]
    frame_bytes, peak = map(int, out.stdout.split())
    # Per stream: a Stream object, and 4 descriptor rows a side (24 bytes each) with temporaries.
    assert peak <= 2 * frame_bytes + streams * 1024 + 8 * MiB, f"frame {frame_bytes} bytes, peak {peak / MiB:.1f} MiB"


READER = (
    CAPPED
    + """
import torch
from kvhost.nixl import Agent, TransferError
from kvhost.testing import make_cache

sender_caches = {f"l{i}": make_cache("KBNHC", "KBHNC", dict(K=2, B=8, N=4, H=2, C=8)) for i in range(2)}
local_caches = {f"l{i}": make_cache("KBNHC", "KBNHC", dict(K=2, B=4, N=16, H=2, C=8)) for i in range(2)}
with Agent("billions-sender") as sender, Agent("billions-receiver") as receiver:
    honest = sender.register(sender_caches, "KBNHC")
    peer = receiver.add_peer(sender.metadata())
    local = receiver.register(local_caches, "KBNHC")
    data = honest.to_dict()
    data["num_blocks"] = 1 << 32  # the same memory, claiming 2^32 blocks
    message = decode(encode("table", {"table": data}))
    forged = RegionTable.from_dict(message.header["table"], "table", message.arrays)
    tracemalloc.start()
    try:
        receiver.reader(plan_transfer(local, forged), peer)
        print("accepted")
    except TransferError as err:
        print("refused", tracemalloc.get_traced_memory()[1], err)
    # The honest table still reads.
    reader = receiver.reader(plan_transfer(local, honest), peer)
    reader.read([1], [7, 0, 5, 2]).wait(timeout=20)
"""
)


@needs_nixl
@pytest.mark.timeout(120)
def test_a_reader_refuses_a_table_naming_memory_its_peer_did_not_register():
    """With real NIXL: a peer's table claiming 2^32 blocks of memory it registered 8 of is
    refused when the reader is made, at the cost of two descriptors per stream."""
    out = subprocess.run([sys.executable, "-c", READER], capture_output=True, text=True, timeout=110)
    assert out.returncode == 0, out.stderr[-3000:]
    verdict = out.stdout.strip().splitlines()[-1]
    assert verdict.startswith("refused"), verdict
    _, peak, reason = verdict.split(" ", 2)
    assert "has not registered" in reason and "4294967296 blocks" in reason
    assert int(peak) < 4 * MiB


# --- stray connections to the control port -----------------------------------------------------

SECRET = bytes(range(100, 132))


def peers_tests():
    """tests/test_peers.py, for its ``Running`` server, its engines and its secret: imported
    when a test runs, as that module imports this one."""
    import test_peers

    return test_peers


class Strays:
    """Connections made to prefill's port before decode's, each misbehaving its own way.
    ``secret`` is the real one: a stray proves it over no nonces, with no knock first."""

    def __init__(self, port, secret, silent=2):
        knock = encode(KNOCK, {"nonce": os.urandom(16).hex()})
        wrong = encode(ENGINE, {"proof": "0" * 64, "engine": {}})
        replayed = encode(ENGINE, {"proof": proof(secret, "decode", (b"", b"")), "engine": {}})
        self.sockets = []
        self.sockets.append(self._connect(port, b"GET / HTTP/1.1\r\n\r\n" + os.urandom(200)))  # garbage
        self.sockets += [self._connect(port, b"") for _ in range(silent)]  # connect and say nothing
        self.sockets.append(self._connect(port, encode(KNOCK, {"nonce": "zz"})))  # a knock without a nonce
        self.sockets.append(self._connect(port, knock + wrong))  # a knock, then a wrong proof
        self.sockets.append(self._connect(port, knock[:-1]))  # a knock, one byte short: waits
        self.sockets.append(self._connect(port, replayed))  # the secret's proof, no knock first
        self.sockets.append(self._connect(port, FRAME))  # a real offer, no proof first
        big = encode(KNOCK, {"nonce": "x" * 4000})
        self.sockets.append(self._connect(port, big[:HEADER_BYTES]))  # claims a frame too large
        self.slow = self._connect(port, b"")
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._trickle, daemon=True)  # slow-loris: a byte a second
        self.thread.start()

    def _connect(self, port, data):
        sock = socket.create_connection(("127.0.0.1", port))
        if data:
            sock.sendall(data)
        return sock

    def _trickle(self):
        frame = encode(KNOCK, {"nonce": os.urandom(16).hex()})
        for byte in frame:
            if self.stop.wait(1.0):
                return
            with contextlib.suppress(OSError):
                self.slow.sendall(bytes([byte]))

    def all_closed_by_the_other_side(self, within):
        """Each stray reads EOF (or a reset) from prefill within ``within`` seconds."""
        deadline = time.monotonic() + within
        for sock in [*self.sockets, self.slow]:
            sock.settimeout(max(deadline - time.monotonic(), 0.01))
            try:
                while sock.recv(4096):
                    pass
            except TimeoutError:
                return False
            except OSError:
                pass
        return True

    def close(self):
        self.stop.set()
        for sock in [*self.sockets, self.slow]:
            sock.close()


@pytest.mark.timeout(60)
def test_stray_connections_are_dropped_and_decode_is_still_served():
    """Garbage, silence, bad knocks, a wrong proof, a proof with no knock, a slow-loris, an
    offer without proof: all connected before decode, none stalls it, all are dropped."""
    peers = peers_tests()
    running = peers.Running(peer_timeout=5.0, auth_timeout=handshake.AUTH_SECONDS)
    started = time.monotonic()
    strays = Strays(running.port, peers.SECRET)
    try:
        time.sleep(0.3)
        session = connect(("127.0.0.1", running.port), peers.SECRET, peers.DECODE, timeout=20)
        seconds = time.monotonic() - started
        with contextlib.closing(session):
            assert [r.name for r in session.offer.requests] == ["req-0", "req-1"]
            session.done(ok=True, timeout=5)
        assert seconds < handshake.AUTH_SECONDS, f"decode served after {seconds:.1f} s: the strays stalled it"
        [record] = running.finish()
        assert record.outcome == "done" and running.asked[0].spec == peers.DECODE
        assert running.server.dropped == len(strays.sockets) + 1
        assert strays.all_closed_by_the_other_side(within=1.0)
    finally:
        strays.close()


@pytest.mark.timeout(60)
def test_more_strays_than_prefill_will_hold_do_not_shut_decode_out():
    peers = peers_tests()
    running = peers.Running(peer_timeout=5.0, auth_timeout=20.0)
    silent = [socket.create_connection(("127.0.0.1", running.port)) for _ in range(3 * MAX_CONNECTIONS)]
    try:
        session = connect(("127.0.0.1", running.port), peers.SECRET, peers.DECODE, timeout=20)
        with contextlib.closing(session):
            assert len(session.offer.requests) == 2
            session.done(ok=True, timeout=5)
        [record] = running.finish()
        assert record.outcome == "done" and running.server.dropped == len(silent)
    finally:
        for sock in silent:
            sock.close()


def _closed_by_listener(sock, within):
    sock.settimeout(within)
    try:
        return sock.recv(1) == b""
    except TimeoutError:
        return False
    except OSError:  # reset: closed too
        return True


@pytest.mark.timeout(20)
def test_a_first_frame_over_the_auth_limit_is_dropped_on_its_header():
    """A header declaring more than AUTH_FRAME_BYTES is refused as soon as it is read: the
    body is never waited for (nor a buffer of its size made); decode is served after."""
    peers = peers_tests()
    padded = encode(KNOCK, {"nonce": os.urandom(16).hex(), "pad": "x" * handshake.AUTH_FRAME_BYTES})
    running = peers.Running(peer_timeout=5.0, auth_timeout=10.0)
    with socket.create_connection(("127.0.0.1", running.port)) as stray:
        stray.sendall(padded[:HEADER_BYTES])
        started = time.monotonic()
        assert _closed_by_listener(stray, within=3.0)
        assert time.monotonic() - started < 2.0
    session = connect(("127.0.0.1", running.port), peers.SECRET, peers.DECODE, timeout=10)
    with contextlib.closing(session):
        session.done(ok=True, timeout=5)
    [record] = running.finish()
    assert record.outcome == "done" and running.server.dropped == 1


@pytest.mark.timeout(20)
@pytest.mark.parametrize("extra", [0, 1])
def test_a_knock_of_the_auth_limit_is_challenged_and_one_byte_more_is_not(extra):
    peers = peers_tests()
    base = len(encode(KNOCK, {"nonce": os.urandom(16).hex(), "pad": ""}))
    frame = encode(KNOCK, {"nonce": os.urandom(16).hex(), "pad": "x" * (handshake.AUTH_FRAME_BYTES - base + extra)})
    assert len(frame) == handshake.AUTH_FRAME_BYTES + extra
    running = peers.Running(peers=None, idle=1.0)
    with socket.create_connection(("127.0.0.1", running.port)) as sock:
        sock.sendall(frame)
        if extra:
            assert _closed_by_listener(sock, within=3.0)
        else:
            assert receive(sock, timeout=5).kind == "challenge"
    assert running.finish() == [] and running.server.dropped == 1


@pytest.mark.timeout(30)
def test_a_proof_with_no_knock_first_proves_nothing():
    """An engine message as a connection's first frame, with the secret's proof over no
    nonces (all a recording could hold): no proof; the application never hears of it."""
    peers = peers_tests()
    running = peers.Running(peers=None, idle=1.0)
    header = {"proof": proof(peers.SECRET, "decode", (b"", b"")), "engine": peers.DECODE.to_dict()}
    with socket.create_connection(("127.0.0.1", running.port)) as impostor:
        impostor.sendall(encode(ENGINE, header))
        assert _closed_by_listener(impostor, within=3.0)
    assert running.finish() == [] and running.asked == [] and running.server.dropped == 1


@pytest.mark.timeout(30)
def test_the_engine_message_may_come_a_while_after_the_knock():
    """Once challenged, decode has what is left of the auth timeout to prove the secret."""
    peers = peers_tests()
    running = peers.Running(peer_timeout=5.0, auth_timeout=5.0)
    sock, nonces = peers._knocked(running.port)
    with sock:
        time.sleep(1.5)
        header = {"proof": proof(peers.SECRET, "decode", nonces), "engine": peers.DECODE.to_dict()}
        send(sock, ENGINE, header, timeout=5)
        offer = parse_offer(receive(sock, timeout=5, expect=OFFER), peers.DECODE)
        assert [r.name for r in offer.requests] == ["req-0", "req-1"]
        send(sock, DONE, {"ok": True}, timeout=5)
        [record] = running.finish()
    assert (record.outcome, record.ok) == ("done", True) and running.server.dropped == 0


ENGINE_OPTIONS = ["--requests", "3", "--layers", "1", "--heads", "2", "--head-dim", "8", "--max-tokens", "100"]


@needs_nixl
@pytest.mark.timeout(240)
def test_the_hand_off_verifies_with_strays_on_the_port_first(tmp_path, capsys):
    """A prefill engine (its own process) with strays connected to its port before decode
    (here, in process): none stalls decode, and prefill counts them all as dropped."""
    from kvhost.nixl import peers

    secret_file = str(tmp_path / "secret")
    secret = peers.write_secret_file(secret_file)
    with socket.create_server(("127.0.0.1", 0)) as listener:
        port = listener.getsockname()[1]
        command = [sys.executable, "-m", "kvhost_tools.demo", "prefill", *ENGINE_OPTIONS, "--secret-file", secret_file]
        command += ["--listen", f"127.0.0.1:{port}", "--listen-fd", str(listener.fileno())]
        prefill = subprocess.Popen(command, stdout=subprocess.PIPE, text=True, pass_fds=[listener.fileno()])
    strays = Strays(port, secret)
    try:
        code = demo_decode.main(
            [
                *ENGINE_OPTIONS,
                "--prefill",
                f"127.0.0.1:{port}",
                "--secret-file",
                secret_file,
                "--connect-timeout",
                "180",
            ]
        )
        out = capsys.readouterr().out
        assert code == demo_config.EXIT_OK, out
        assert "result    OK: every byte of every request verified" in out
        said, _ = prefill.communicate(timeout=60)
        assert prefill.returncode == 0, said
        assert f"1 served, 0 refused, {len(strays.sockets) + 1} stray connection(s)" in said
    finally:
        strays.close()
        if prefill.poll() is None:
            prefill.kill()
            prefill.wait()


def test_secrets_come_from_stdin_or_a_private_file_within_a_deadline(monkeypatch):
    read, write = os.pipe()
    with os.fdopen(read, "r") as stream, os.fdopen(write, "w") as out:
        out.write(SECRET.hex() + "\n")
        out.flush()
        monkeypatch.setattr(sys, "stdin", stream)
        assert read_secret_file("-", timeout=1.0) == SECRET
    read, write = os.pipe()
    with os.fdopen(read, "r") as stream, os.fdopen(write, "w"):
        monkeypatch.setattr(sys, "stdin", stream)
        started = time.monotonic()
        with pytest.raises(ProtocolError, match=r"standard input: no line within 0\.2 s"):
            read_secret_file("-", timeout=0.2)  # nothing written: the deadline ends the wait
        assert time.monotonic() - started < 2


# --- exit codes and impossible options ---------------------------------------------------------

IMPOSSIBLE = {
    "timeout-nan": (["--timeout", "nan"], "argument --timeout: expected a number of seconds in (0, 604800], got 'nan'"),
    "timeout-inf": (["--timeout", "inf"], "argument --timeout: expected a number of seconds"),
    "timeout-zero": (["--timeout", "0"], "argument --timeout:"),
    "timeout-negative": (["--timeout", "-1"], "argument --timeout:"),
    "timeout-years": (["--timeout", "1e9"], "argument --timeout:"),
    "timeout-word": (["--timeout", "soon"], "argument --timeout:"),
    "connect-timeout-nan": (["--connect-timeout", "nan"], "argument --connect-timeout:"),
    "connect-timeout-inf": (["--connect-timeout", "inf"], "argument --connect-timeout:"),
    "step-inf": (["--step", "inf"], "argument --step:"),
    "layers-too-many": (["--layers", "100000", "--heads", "1024"], "--layers must be in [1, 32768], got 100000"),
    "layers-and-heads-too-big": (["--layers", "30000", "--heads", "1024"], "--layers 30000 x --heads 1024"),
    "pool-too-big": (
        ["--requests", "16384", "--max-tokens", "16777216", "--min-tokens", "1000000"],
        "--requests 16384",
    ),
    "head-dim-too-big": (["--head-dim", "16000000"], "--head-dim 16000000"),
    "requests-too-many": (["--requests", "1000000"], "--requests must be in [1, 16384], got 1000000"),
    "max-tokens-too-many": (["--max-tokens", "100000000"], "--max-tokens must be in [1, 16777216]"),
    "heads-zero": (["--heads", "0"], "--heads must be in [1,"),
    "layers-not-a-number": (["--layers", "1e5"], "argument --layers: invalid int value: '1e5'"),
    "block-size-zero": (["--prefill-block-size", "0"], "--prefill-block-size must be in [1,"),
    "seed-negative": (["--seed", "-1"], "--seed must be in [0,"),
    "inflight-zero": (["--inflight", "0"], "--inflight must be in [1,"),
    "decode-ranks-zero": (["--decode-ranks", "0"], "--decode-tp must be in [1,"),
    "prefill-tp-too-many": (["--prefill-tp", "2048"], "--prefill-tp must be in [1, 1024], got 2048"),
    "dtype": (["--dtype", "float64"], "argument --dtype: invalid choice"),
}


@pytest.mark.parametrize("case", IMPOSSIBLE)
def test_impossible_options_exit_2_with_one_line_naming_the_option(case, capsys, monkeypatch):
    argv, message = IMPOSSIBLE[case]
    monkeypatch.setattr(demo_config, "memory_available", lambda: 8 << 30)  # the same verdicts on any machine
    with pytest.raises(SystemExit) as exit_info:
        demo_cli.main(argv)
    assert exit_info.value.code == demo_config.EXIT_ERROR
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("kvhost demo: error: "), err
    assert message in err


def test_the_memory_estimate_names_what_drives_it():
    def needed(*argv):
        args = demo_cli.parser().parse_args(list(argv))
        prefills, decode = demo_cli.engines_of(args)
        return demo_config.memory_needed(
            demo_cli.model_of(args), demo_cli.workload_of(args), prefills[0], decode, staging=False
        )

    big, small = needed("--layers", "30000", "--heads", "1024"), needed()
    assert big > 100 << 30  # far beyond this machine
    assert big > 30000 * 1024 / (4 * 8) * small / 2  # in proportion to layers x heads
    assert demo_config.memory_available() is None or demo_config.memory_available() > 0


def test_the_tools_repeat_the_library_limits():
    from kvhost.nixl import engine, handshake

    assert demo_config.DTYPE_SIZES == engine.DTYPE_SIZES
    assert (demo_config.MAX_REQUESTS, demo_config.MAX_TOKENS) == (handshake.MAX_REQUESTS, handshake.MAX_TOKENS)


@pytest.mark.timeout(120)
def test_the_command_exits_2_with_one_line_and_no_traceback():
    """The real command, in its own processes: the brief's example, an estimate above any
    machine's memory, and a NaN timeout."""
    commands = {
        "--layers": ["--layers", "100000", "--heads", "1024"],
        "--heads 65536": ["--layers", "32768", "--heads", "65536", "--head-dim", "65536"],
        "--timeout": ["--timeout", "nan"],
    }
    runs = {
        name: subprocess.Popen(
            [sys.executable, "-m", "kvhost_tools.cli", "demo", *argv],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for name, argv in commands.items()
    }
    for name, run in runs.items():
        out, err = run.communicate(timeout=100)
        assert run.returncode == 2, (name, out, err)
        assert out == "" and err.count("\n") == 1 and err.startswith("kvhost demo: error: "), (name, err)
        assert name in err and "Traceback" not in err and "MemoryError" not in err


@pytest.mark.timeout(60)
@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_an_engine_without_a_secret_exits_2(role):
    out = subprocess.run(
        [sys.executable, "-m", "kvhost_tools.demo", role, "--secret-file", "-", "--connect-timeout", "1"],
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=50,
    )
    assert out.returncode == 2, out.stderr
    line = "standard input: expected a secret of at least 32 bytes as hex digits"
    if role == "prefill":
        assert out.stderr.strip() == f"prefill: {line}"
    else:
        assert f"  error     {line}" in out.stdout and "result    FAILED: the hand-off did not run" in out.stdout


WITH_SIGINT = (
    "import runpy, signal, sys; signal.signal(signal.SIGINT, signal.default_int_handler); "
    "sys.argv = ['kvhost_tools.demo', *sys.argv[1:]]; runpy.run_module('kvhost_tools.demo', run_name='__main__')"
)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("stop", [signal.SIGTERM, signal.SIGINT, signal.SIGHUP])
def test_a_stopped_engine_says_so_in_one_line_and_exits_128_plus_the_signal(stop, tmp_path):
    """A supervisor's SIGTERM (or a hang-up) ends an engine as Ctrl-C does: its cleanup runs
    (decode's JSON is written), one line says what stopped it, no traceback, 128 + the
    signal's number. (UCX would take SIGHUP for itself, were it not told otherwise.)"""
    secret = tmp_path / "secret"
    secret.write_text(os.urandom(32).hex())
    secret.chmod(0o600)
    # A shell's background job (CI's) starts with SIGINT ignored, and Python then never turns
    # it into KeyboardInterrupt: the engines get it back, as a terminal's would.
    command = [sys.executable, "-c", WITH_SIGINT]
    small = ["--layers", "2", "--requests", "2", "--secret-file", str(secret)]
    engines = []
    try:
        prefill = subprocess.Popen(
            [*command, "prefill", *small, "--listen", "127.0.0.1:0", "--serve", "0"],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )  # fmt: skip
        engines.append(prefill)
        assert prefill.stdout is not None and "listening" in prefill.stdout.readline()
        prefill.send_signal(stop)
        out, err = prefill.communicate(timeout=30)
        assert (prefill.returncode, err) == (128 + stop, f"prefill: stopped by {stop.name}\n"), out
        with socket.create_server(("127.0.0.1", 0)) as silent:  # accepts, and never answers the knock
            report = tmp_path / "decode.json"
            address = f"127.0.0.1:{silent.getsockname()[1]}"
            decode = subprocess.Popen(
                [*command, "decode", *small, "--prefill", address, "--json", str(report)],
                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            )  # fmt: skip
            engines.append(decode)
            silent.settimeout(60)
            knocked, _ = silent.accept()  # decode is in its handshake
            with knocked:
                decode.send_signal(stop)
                out, err = decode.communicate(timeout=30)
    finally:
        for engine in engines:
            engine.kill()
            engine.wait()
    assert decode.returncode == 128 + stop and err == f"decode: stopped by {stop.name}\n", (out, err)
    assert f"error     stopped by {stop.name}" in out and "Traceback" not in out
    data = json.loads(report.read_text())
    assert data["ok"] is False and data["error"] == f"stopped by {stop.name}"


def small_engines(tmp_path):
    """Options of small engines sharing a secret (8 requests of 2 layers), and how to start one."""
    secret = tmp_path / "secret"
    secret.write_text(os.urandom(32).hex())
    secret.chmod(0o600)
    options = ["--layers", "2", "--requests", "8", "--secret-file", str(secret)]
    return options, [sys.executable, "-m", "kvhost_tools.demo"]


@pytest.mark.timeout(180)
@pytest.mark.parametrize("stops", [1, 2])
def test_a_sigterm_drains_prefill_and_a_second_stops_it_at_once(stops, tmp_path):
    """A rolling restart: prefill's first SIGTERM (sent by decode once 2 of 8 requests
    arrived) takes no new decode and lets the one it holds finish its reads: every request
    verifies, and prefill exits as stopped. A second SIGTERM stops it at once: decode's
    reads fail."""
    small, command = small_engines(tmp_path)
    prefill = subprocess.Popen(
        [*command, "prefill", *small, "--listen", "127.0.0.1:0", "--serve", "0", "--drain-timeout", "60"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert prefill.stdout is not None
        listening = prefill.stdout.readline()
        address = listening.split("listening ", 1)[1].split(" ", 1)[0]
        kill = "; sleep 0.5; ".join([f"kill -TERM {prefill.pid}"] * stops)
        decode = subprocess.run(
            [*command, "decode", *small, "--prefill", address, "--fault-after", "2", "--fault-command", kill],
            capture_output=True, text=True, timeout=120,
        )  # fmt: skip
        out, err = prefill.communicate(timeout=60)
    finally:
        prefill.kill()
        prefill.wait()
    assert prefill.returncode == 128 + signal.SIGTERM and err == "prefill: stopped by SIGTERM\n", (out, err)
    if stops == 1:
        assert decode.returncode == 0 and "verify    8/8 requests" in decode.stdout, decode.stdout + decode.stderr
        assert "prefill: draining: no new decode engine; 1 held finish their reads" in out
        assert "prefill: drained: every hold ended" in out and "1 served, 0 refused" in out
    else:
        assert decode.returncode == 1 and "verify    8/8" not in decode.stdout, decode.stdout
        assert "drained" not in out


@pytest.mark.timeout(180)
def test_a_decode_stopped_mid_read_reports_what_had_arrived(tmp_path):
    """A decode stopped once 2 of 8 requests arrived (its fault command signals decode
    itself) says so in its report and its JSON, not that the hand-off never ran."""
    small, command = small_engines(tmp_path)
    prefill = subprocess.Popen(
        [*command, "prefill", *small, "--listen", "127.0.0.1:0"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    report = tmp_path / "decode.json"
    try:
        assert prefill.stdout is not None
        address = prefill.stdout.readline().split("listening ", 1)[1].split(" ", 1)[0]
        decode = subprocess.run(
            [*command, "decode", *small, "--prefill", address, "--json", str(report),
             "--fault-after", "2", "--fault-command", "kill -TERM $PPID"],
            capture_output=True, text=True, timeout=120,
        )  # fmt: skip
        prefill.communicate(timeout=60)
    finally:
        prefill.kill()
        prefill.wait()
    assert decode.returncode == 128 + signal.SIGTERM, decode.stdout + decode.stderr
    received = json.loads(report.read_text())["received"]
    assert 2 <= len(received) < 8, received
    assert f"result    FAILED: the hand-off stopped after {len(received)} request(s) arrived" in decode.stdout


@pytest.fixture
def sigint_interrupts():
    """SIGINT raising KeyboardInterrupt, as a terminal starts a command (a background job of
    a script, CI's, has it ignored), and left as it was after the test."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, previous)


def test_a_stop_raises_once_and_later_ones_are_said_while_the_command_finishes(capfd, sigint_interrupts):
    """The first SIGTERM or SIGHUP raises ``Stopped``, which names it; a later one, or any
    once the command says it is finishing, is said on stderr and left alone (a second stop
    lost decode's report and JSON); the handlers before are back after the block."""
    from kvhost_tools.demo.stopping import Stopped, stop_on_sigterm, stopped_by

    before = {signum: signal.getsignal(signum) for signum in (signal.SIGTERM, signal.SIGHUP, signal.SIGINT)}
    for first in (signal.SIGTERM, signal.SIGHUP, signal.SIGINT):
        with stop_on_sigterm() as stops:
            with pytest.raises(KeyboardInterrupt) as raised:
                os.kill(os.getpid(), first)
                time.sleep(1)  # the handler runs before this returns
            assert stopped_by(raised.value) == (first.name, 128 + first) and stops.stopping
            assert isinstance(raised.value, Stopped) == (first != signal.SIGINT)
            for later in (signal.SIGTERM, signal.SIGHUP, signal.SIGINT):
                os.kill(os.getpid(), later)  # said, not raised
        assert capfd.readouterr().err.splitlines() == [
            f"{s}: already stopping" for s in ("SIGTERM", "SIGHUP", "SIGINT")
        ]
        assert {signum: signal.getsignal(signum) for signum in before} == before
    with stop_on_sigterm() as stops:
        stops.quiet()  # finishing: a first stop is said too
        os.kill(os.getpid(), signal.SIGTERM)
    assert capfd.readouterr().err == "SIGTERM: already stopping\n"


def test_a_command_that_drains_takes_its_first_sigterm_as_a_drain_and_its_second_as_a_stop(sigint_interrupts):
    """Where the command says how it drains (prefill), a first SIGTERM drains and raises
    nothing; a second SIGTERM stops it. SIGINT and SIGHUP stop it at once, drain or not."""
    from kvhost_tools.demo.stopping import Stopped, stop_on_sigterm

    for first, drains in ((signal.SIGTERM, True), (signal.SIGINT, False), (signal.SIGHUP, False)):
        drained: list[int] = []
        with stop_on_sigterm() as stops:
            stops.drain = functools.partial(drained.append, 1)
            if drains:
                os.kill(os.getpid(), first)
                time.sleep(0.2)
                assert drained == [1] and stops.drained_by == first and not stops.stopping
            with pytest.raises(KeyboardInterrupt) as raised:
                os.kill(os.getpid(), first)
                time.sleep(1)
            assert isinstance(raised.value, Stopped) == (first != signal.SIGINT) and stops.stopping
            assert drained == ([1] if drains else []) and (stops.drained_by is not None) == drains


def test_sigint_ignored_as_the_command_started_is_left_ignored():
    """A non-interactive shell starts a background job with SIGINT ignored, so that Ctrl-C
    does not reach it: kept so (SIGTERM stops it)."""
    from kvhost_tools.demo.stopping import stop_on_sigterm

    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        with stop_on_sigterm() as stops:
            assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN and signal.SIGINT not in stops.handled
            os.kill(os.getpid(), signal.SIGINT)  # nothing happens
    finally:
        signal.signal(signal.SIGINT, previous)


def _state_and_parent(pid):
    """A process's state letter and parent (from /proc), or None once it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            state, parent = stat.read().rsplit(")", 1)[1].split()[:2]
    except (OSError, ValueError):
        return None
    return state, int(parent)


def _children(pid):
    """Live processes whose parent is ``pid``."""
    found = [(int(e), _state_and_parent(e)) for e in os.listdir("/proc") if e.isdigit()]
    return [child for child, known in found if known and known[1] == pid and known[0] != "Z"]


def _alive(pid):
    known = _state_and_parent(pid)
    return known is not None and known[0] != "Z"


@pytest.mark.timeout(120)
def test_a_demo_stopped_by_sigterm_stops_its_engines_first():
    demo = subprocess.Popen(
        [sys.executable, "-m", "kvhost_tools.cli", "demo", "--layers", "2", "--requests", "4", "--no-progress",
         "--freeze-prefill-after", "1", "--timeout", "60"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    engines = []
    try:
        deadline = time.monotonic() + 60
        while len(engines := _children(demo.pid)) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert len(engines) >= 2, "the demo did not start its engines"
        demo.send_signal(signal.SIGTERM)
        _, err = demo.communicate(timeout=60)
        assert demo.returncode == 128 + signal.SIGTERM and err.endswith("kvhost demo: stopped by SIGTERM\n"), err
        deadline = time.monotonic() + 15  # an engine the demo was starting when it stopped ends with it, by itself
        while [pid for pid in engines if _alive(pid)] and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not [pid for pid in engines if _alive(pid)], "an engine outlived the demo"
    finally:  # nothing left running whatever failed
        demo.kill()
        demo.wait()
        for pid in engines:
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)


STARTER = """
import os, subprocess, sys, time
env = {**os.environ, "KVHOST_DEMO_PARENT": str(os.getpid())}
child = subprocess.Popen([sys.executable, "-m", "kvhost_tools.demo", "prefill", *sys.argv[1:]], env=env,
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
print(child.pid, flush=True)
for line in child.stdout:
    if "listening" in line:
        print(line, end="", flush=True)
        break
time.sleep(600)
"""


@pytest.mark.timeout(120)
def test_an_engine_whose_demo_is_killed_stops_too(tmp_path):
    """An engine the demo could not stop (the demo killed, or stopped while starting it) is
    told by the kernel (Linux) that its parent is gone, and stops."""
    secret = tmp_path / "secret"
    secret.write_text(os.urandom(32).hex())
    secret.chmod(0o600)
    argv = ["--layers", "2", "--requests", "2", "--secret-file", str(secret), "--listen", "127.0.0.1:0"]
    starter = subprocess.Popen([sys.executable, "-c", STARTER, *argv], stdout=subprocess.PIPE, text=True)
    assert starter.stdout is not None
    engine = int(starter.stdout.readline())
    try:
        assert "listening" in starter.stdout.readline()
        starter.kill()
        starter.wait()
        deadline = time.monotonic() + 20
        while _alive(engine) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not _alive(engine), "the engine outlived its demo"
    finally:
        starter.kill()
        starter.wait()
        with contextlib.suppress(OSError):
            os.kill(engine, signal.SIGKILL)


ALLOCATION_FAILURES = {
    "torch": RuntimeError(
        "[enforce fail at alloc_cpu.cpp:118] data. DefaultCPUAllocator: not enough memory: "
        "you tried to allocate 1099511627776 bytes."
    ),
    "python": MemoryError(),
}


@pytest.mark.parametrize("failure", ALLOCATION_FAILURES)
def test_memory_running_out_after_the_estimate_exits_2(failure, monkeypatch, capsys, tmp_path):
    """Memory taken by others between the estimate and the allocation: exit 2, said plainly."""

    def no_memory(*args, **kwargs):
        raise ALLOCATION_FAILURES[failure]

    monkeypatch.setattr(demo_config.Model, "caches", no_memory)
    secret = str(tmp_path / "secret")
    code = demo_prefill.main(["--layers", "2", "--secret-file", secret, "--listen", "127.0.0.1:0"])
    err = capsys.readouterr().err
    assert code == demo_config.EXIT_ERROR
    assert err.startswith("prefill: out of memory: --layers 2 x --heads 8 x --head-dim 64 x --dtype bfloat16")
    assert err.count("\n") == 1


def test_a_bug_exits_2_not_1(monkeypatch, capsys):
    def bug(*args, **kwargs):
        raise ZeroDivisionError("a bug")

    monkeypatch.setattr(demo_cli, "run", bug)
    assert demo_cli.main([]) == demo_config.EXIT_ERROR
    assert "ZeroDivisionError: a bug" in capsys.readouterr().err


# --- where the agents listen -------------------------------------------------------------------


@pytest.mark.timeout(120)
def test_prefill_listening_on_a_host_name_keeps_ucx_on_its_addresss_interface(tmp_path):
    """``--listen localhost:0``: the name resolves to loopback, and UCX is kept there (it
    was left on every interface: only an address was looked up)."""
    secret = tmp_path / "secret"
    env = {k: v for k, v in os.environ.items() if k != "UCX_NET_DEVICES"}
    command = [sys.executable, "-m", "kvhost_tools.demo", "prefill", "--layers", "2", "--requests", "2"]
    command += ["--secret-file", str(secret), "--listen", "localhost:0", "--serve", "0", "--idle-timeout", "1"]
    prefill = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        assert prefill.stdout is not None
        lines = [prefill.stdout.readline(), prefill.stdout.readline()]  # the secret written, then listening
    finally:
        prefill.kill()
        prefill.communicate()
    listening = [line for line in lines if line.startswith("prefill: listening")]
    assert listening and "listening 127.0.0.1:" in listening[0] and " (127.0.0.1)" in listening[0], lines  # lo


def test_ucx_is_kept_on_loopback_and_quiet_unless_the_user_says_otherwise():
    env = {}
    assert netenv.set_defaults(env, ["127.0.0.1"]) == env
    assert env == {"UCX_NET_DEVICES": "lo", "UCX_LOG_LEVEL": "error", "NIXL_LOG_LEVEL": "ERROR"}
    env = {"UCX_NET_DEVICES": "eth0", "UCX_LOG_LEVEL": "info"}
    netenv.set_defaults(env, ["127.0.0.1"])
    assert env["UCX_NET_DEVICES"] == "eth0" and env["UCX_LOG_LEVEL"] == "info"
    env = {}
    netenv.set_defaults(env, ["0.0.0.0"])  # every interface: UCX chooses
    assert "UCX_NET_DEVICES" not in env
    assert netenv.interface_of("127.0.0.1") == "lo" and netenv.interface_of("192.0.2.123") is None
