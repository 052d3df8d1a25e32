"""The control socket: malformed, truncated or corrupted metadata messages are ProtocolErrors.

A hello from prefill carries its block table, its requests and its NIXL agent metadata.
Every way it can be wrong (cut short, bytes flipped, fields missing or of the wrong type or
out of range, garbage agent metadata) must end in a ``ProtocolError`` (a ``KVHostError``)
that names what was wrong, never another exception, a hang or a crash.
"""

from __future__ import annotations

import contextlib
import copy
import importlib.util
import json
import random
import socket
import struct
import subprocess
import sys
import threading
import zlib

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvhost import demo
from kvhost.errors import KVHostError
from kvhost.nixl import NIXL_MODULES, region_table
from kvhost.testing import make_cache
from kvhost.wire_protocol import HEADER_BYTES, MAGIC, ProtocolError, decode, encode, receive

NIXL_INSTALLED = any(importlib.util.find_spec(name.split(".")[0]) for name in NIXL_MODULES)
needs_nixl = pytest.mark.skipif(not NIXL_INSTALLED, reason="NIXL is not installed (pip install 'kvhost[nixl]')")
METADATA = b"nixlSerDes|" + bytes(range(256)) * 2  # stands in for agent metadata; NIXL is not asked


def hello_header():
    caches = {f"layer{i}": make_cache("KBNHC", "KBHNC", dict(K=2, B=12, N=4, H=2, C=4)) for i in range(2)}
    table = region_table(caches, "KBNHC")
    requests = [
        {"name": "req-000", "number": 0, "tokens": 9, "block_ids": [3, 1, 7]},
        {"name": "req-001", "number": 1, "tokens": 4, "block_ids": [0]},
    ]
    return {"pid": 4321, "table": table.to_dict(), "requests": requests, "fill_seconds": 0.25}


HEADER = hello_header()
FRAME = encode("hello", HEADER, METADATA)


def parse(frame):
    return demo.parse_hello(decode(frame))


def test_a_good_hello_parses():
    hello = parse(FRAME)
    assert [r.name for r in hello.requests] == ["req-000", "req-001"]
    assert hello.requests[0].remote_ids == [3, 1, 7] and hello.requests[0].tokens == 9
    assert hello.table.order == "HNC" and hello.table.num_blocks == 12 and len(hello.table.streams) == 4
    assert hello.metadata == METADATA and hello.pid == 4321


def test_every_truncation_is_rejected():
    for cut in range(len(FRAME)):
        with pytest.raises(ProtocolError, match="truncated"):
            decode(FRAME[:cut])


def test_flipped_bytes_are_rejected():
    rng = random.Random(0)
    positions = list(range(HEADER_BYTES)) + rng.sample(range(HEADER_BYTES, len(FRAME)), 40)
    for position in positions:
        corrupted = bytearray(FRAME)
        corrupted[position] ^= 1 << rng.randrange(8)
        with pytest.raises(ProtocolError):
            decode(bytes(corrupted))
    with pytest.raises(ProtocolError, match="unexpected bytes"):
        decode(FRAME + b"\0")


def framed(body: bytes, blob: bytes = METADATA) -> bytes:
    """A frame around any body, with a correct checksum: only the content is wrong."""
    crc = zlib.crc32(blob, zlib.crc32(body))
    return struct.pack(">4sBIII", MAGIC, 1, len(body), len(blob), crc) + body + blob


@pytest.mark.parametrize(
    ("frame", "message"),
    [
        pytest.param(b"HTTP/1.1 200 OK\r\n\r\n" + b"x" * 20, "not a kvhost frame", id="bad-magic"),
        pytest.param(struct.pack(">4sBIII", MAGIC, 9, 2, 0, 0) + b"{}", "version 9", id="bad-version"),
        pytest.param(struct.pack(">4sBIII", MAGIC, 1, 1 << 30, 0, 0), "exceeds the limit", id="json-too-long"),
        pytest.param(struct.pack(">4sBIII", MAGIC, 1, 2, 1 << 30, 0), "exceeds the limit", id="blob-too-long"),
        pytest.param(framed(b"\xff\xfe{}"), "not valid JSON", id="not-utf8"),
        pytest.param(framed(b'{"kind": "hello", '), "not valid JSON", id="json-cut"),
        pytest.param(framed(b"[1, 2, 3]"), "must be a JSON object", id="json-array"),
        pytest.param(framed(b'{"pid": 1}'), "no string 'kind'", id="no-kind"),
        pytest.param(framed(b'{"kind": "hello", "pid": NaN}'), "NaN", id="nan"),
        pytest.param(framed(b'{"kind": "hello", "pid": ' + b"9" * 5000 + b"}"), "not valid JSON", id="huge-int"),
        pytest.param(framed(b"[" * 100000 + b"]" * 100000), "not valid JSON", id="deep-nesting"),
    ],
)
def test_malformed_frames(frame, message):
    with pytest.raises(ProtocolError, match=message):
        parse(frame)


def mutated(change):
    header = copy.deepcopy(HEADER)
    change(header)
    return encode("hello", header, METADATA)


def set_path(path, value):
    def change(header):
        target = header
        for key in path[:-1]:
            target = target[key]
        if value is DELETE:
            del target[path[-1]]
        else:
            target[path[-1]] = value

    return change


DELETE = object()
T = "table"
FIELD_CASES = {
    "no-table": (set_path([T], DELETE), r"hello\.table: missing"),
    "table-not-object": (set_path([T], [1, 2]), r"hello\.table: expected an object"),
    "memory-unknown": (set_path([T, "memory"], "GPU9"), r"memory: 'GPU9' is not one of"),
    "order-unknown-letter": (set_path([T, "order"], "HNX"), r"order: 'HNX' must be distinct letters"),
    "order-repeated": (set_path([T, "order"], "HNN"), r"must be distinct letters"),
    "order-no-C": (set_path([T, "order"], "HN"), r"lacks C"),
    "split-wrong": (set_path([T, "split"], "C"), r"split: 'C' must be empty or 'H'"),
    "split-not-streams": (set_path([T, "split"], "H"), r"split letters 'H' must index the streams"),
    "sizes-letter-B": (set_path([T, "sizes", "B"], 4), r"unknown letter 'B'"),
    "sizes-zero": (set_path([T, "sizes", "H"], 0), r"sizes\.H: expected an integer in \[1,"),
    "sizes-bool": (set_path([T, "sizes", "N"], True), r"sizes\.N: expected an integer .* got True"),
    "sizes-extra-letter": (set_path([T, "sizes", "L"], 3), r"sizes name .* but order and stream coordinates"),
    "itemsize-3": (set_path([T, "itemsize"], 3), r"itemsize: 3 is not 1, 2, 4 or 8"),
    "itemsize-float": (set_path([T, "itemsize"], 2.0), r"itemsize: expected an integer"),
    "num-blocks-negative": (set_path([T, "num_blocks"], -1), r"num_blocks: expected an integer"),
    "streams-empty": (set_path([T, "streams"], []), r"streams: empty"),
    "stream-short": (set_path([T, "streams", 0], ["layer0", []]), r"streams\[0\]: expected \[layer, coords"),
    "stream-layer-int": (set_path([T, "streams", 0, 0], 7), r"streams\[0\]: layer name must be"),
    "stream-coord-letter": (set_path([T, "streams", 0, 1], [["Z", 0]]), r"bad coordinate \['Z', 0\]"),
    "stream-coord-range": (
        set_path([T, "streams", 0, 1], [["K", 2]]),
        r"coordinate K: expected an integer in \[0, 1\]",
    ),
    "stream-coord-in-run": (set_path([T, "streams", 0, 1], [["N", 0]]), r"coordinate N lies inside the run"),
    "stream-address-zero": (set_path([T, "streams", 0, 2], 0), r"address: expected an integer in \[1,"),
    "stream-address-huge": (set_path([T, "streams", 0, 2], 1 << 64), r"address: expected an integer"),
    "stream-stride-small": (set_path([T, "streams", 0, 3], 8), r"block stride: expected an integer in \[64,"),
    "stream-past-end": (set_path([T, "streams", 0, 2], (1 << 64) - 100), r"past the end of the address space"),
    "stream-twice": (lambda h: h[T]["streams"].__setitem__(1, h[T]["streams"][0]), r"appears twice"),
    "stream-letters-differ": (set_path([T, "streams", 1, 1], []), r"indexed by different letters"),
    "no-requests": (set_path(["requests"], DELETE), r"hello\.requests: missing"),
    "requests-empty": (set_path(["requests"], []), r"hello\.requests: empty"),
    "requests-not-list": (set_path(["requests"], {"a": 1}), r"hello\.requests: expected a list"),
    "request-not-object": (set_path(["requests", 0], "req"), r"requests\[0\]: expected an object"),
    "request-no-name": (set_path(["requests", 0, "name"], DELETE), r"requests\[0\]\.name: missing"),
    "request-name-empty": (set_path(["requests", 0, "name"], ""), r"name: expected a string of 1 to 64"),
    "request-tokens-zero": (set_path(["requests", 0, "tokens"], 0), r"tokens: expected an integer in \[1,"),
    "request-block-out-of-range": (
        set_path(["requests", 0, "block_ids", 1], 12),
        r"block_ids\[1\]: expected .* \[0, 11\]",
    ),
    "request-block-negative": (set_path(["requests", 0, "block_ids", 0], -3), r"block_ids\[0\]: expected an integer"),
    "request-too-few-blocks": (set_path(["requests", 0, "block_ids"], [3, 1]), r"9 tokens need 3 blocks of 4, got 2"),
    "request-name-twice": (set_path(["requests", 1, "name"], "req-000"), r"'req-000' appears twice"),
    "pid-missing": (set_path(["pid"], DELETE), r"hello\.pid: missing"),
    "pid-string": (set_path(["pid"], "4321"), r"hello\.pid: expected an integer"),
}


@pytest.mark.parametrize("case", FIELD_CASES)
def test_malformed_fields_are_named(case):
    change, message = FIELD_CASES[case]
    with pytest.raises(ProtocolError, match=message):
        parse(mutated(change))


def test_unsendable_headers_are_protocol_errors():
    with pytest.raises(ProtocolError, match="cannot be sent as JSON"):
        encode("hello", {"pid": float("inf")})
    with pytest.raises(ProtocolError, match="cannot be sent as JSON"):
        encode("hello", {"pid": object()})


def test_hello_without_agent_metadata():
    with pytest.raises(ProtocolError, match="no agent metadata"):
        parse(encode("hello", HEADER, b""))


JSON_VALUES = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**70), 2**70)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=4),
    max_leaves=12,
)


def json_paths(value, prefix=()):
    yield prefix
    if isinstance(value, dict):
        for key, item in value.items():
            yield from json_paths(item, (*prefix, key))
    elif isinstance(value, list):
        for i, item in enumerate(value):
            yield from json_paths(item, (*prefix, i))


PATHS = [p for p in json_paths(HEADER) if p]


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.sampled_from(PATHS), JSON_VALUES)
def test_any_value_anywhere_is_accepted_or_a_protocol_error(path, value):
    with contextlib.suppress(ProtocolError):
        parse(mutated(set_path(list(path), value)))


@settings(max_examples=150, deadline=None)
@given(st.binary(max_size=64), st.integers(0, len(FRAME) - 1))
def test_any_bytes_spliced_in_are_a_protocol_error(junk, at):
    """Bytes at..at+len(junk) replaced by junk: the frame is one byte short, whatever the junk."""
    with pytest.raises(ProtocolError):
        parse(FRAME[:at] + junk + FRAME[at + len(junk) + 1 :])


# --- over a real socket ---------------------------------------------------------------


def serve(send_bytes, close=True):
    """A listener and a peer thread that connects and sends ``send_bytes`` (then closes)."""
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    done = threading.Event()

    def peer():
        with socket.create_connection(("127.0.0.1", port)) as sock:
            sock.sendall(send_bytes)
            if not close:
                done.wait(5)

    thread = threading.Thread(target=peer, daemon=True)
    thread.start()
    return listener, done, thread


@pytest.mark.timeout(20)
@pytest.mark.parametrize(
    ("payload", "close", "message"),
    [
        pytest.param(FRAME[:10], True, "truncated frame|closed after", id="cut-in-header"),
        pytest.param(FRAME[:300], True, r"connection closed after \d+ of \d+ JSON body bytes", id="cut-in-body"),
        pytest.param(FRAME[:-5], True, "closed after .* blob bytes", id="cut-in-blob"),
        pytest.param(FRAME[:300], False, "timed out waiting for the JSON body", id="stalls"),
        pytest.param(encode("done", {}), True, "expected a 'hello' message, got 'done'", id="wrong-kind"),
        pytest.param(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n", True, "not a kvhost frame", id="http"),
    ],
)
def test_decode_rejects_a_bad_hello_on_the_socket(payload, close, message):
    listener, done, thread = serve(payload, close)
    with listener, pytest.raises(ProtocolError, match=message):
        demo.accept_hello(listener, None, timeout=1.0)
    done.set()
    thread.join(5)


@pytest.mark.timeout(20)
def test_a_listener_nobody_connects_to_times_out():
    with socket.create_server(("127.0.0.1", 0)) as listener, pytest.raises(ProtocolError, match="did not connect"):
        demo.accept_hello(listener, None, timeout=0.3)


@pytest.mark.timeout(20)
def test_receive_reads_a_frame_split_across_sends():
    left, right = socket.socketpair()
    with left, right:

        def trickle():
            for i in range(0, len(FRAME), 37):
                right.sendall(FRAME[i : i + 37])

        thread = threading.Thread(target=trickle)
        thread.start()
        message = receive(left, timeout=5, expect="hello")
        thread.join()
    assert message.header == {k: v for k, v in json.loads(json.dumps(HEADER)).items()}
    assert message.blob == METADATA


@needs_nixl
@pytest.mark.timeout(60)
def test_garbage_agent_metadata_is_rejected_by_a_real_agent():
    """Garbage never crashes: NIXL refuses it and kvhost says so with a ProtocolError.

    (NIXL 1.5.1 may then refuse that peer name for good, so the genuine metadata is loaded
    by a fresh agent; on the socket the frame's CRC stops damaged bytes before NIXL.)
    """
    from kvhost.nixl import Agent

    rng = random.Random(1)
    with Agent("fuzzed") as agent, Agent("genuine") as genuine, Agent("fresh") as fresh:
        real = genuine.metadata()
        cases = [b"", b"x", real[:20], real[: len(real) // 2], real[:-1], bytes(rng.randrange(256) for _ in range(300))]
        for _ in range(14):
            damaged = bytearray(real)
            for _ in range(3):
                damaged[rng.randrange(11, len(damaged))] ^= 0xFF
            cases.append(bytes(damaged))
        rejected = 0
        for metadata in cases:
            try:
                agent.remove_peer(agent.add_peer(metadata))
            except ProtocolError as err:
                assert "rejected by NIXL" in str(err)
                rejected += 1
        assert rejected >= len(cases) - 4  # a damaged byte inside an address or length may still parse
        assert fresh.add_peer(real) == "genuine"
    damaged_frame = bytearray(encode("hello", HEADER, real))
    damaged_frame[-10] ^= 0xFF
    with pytest.raises(ProtocolError, match="checksum mismatch"):
        decode(bytes(damaged_frame))


FAKE_PREFILL = """
import socket, sys
with socket.create_connection(("127.0.0.1", int(sys.argv[1]))) as sock:
    sock.sendall(bytes.fromhex(sys.argv[2]))
    sock.recv(1)
"""


@needs_nixl
@pytest.mark.timeout(120)
def test_decode_exits_with_a_clear_error_on_a_malformed_hello(monkeypatch, capsys):
    """The whole decode side, with a prefill process that sends a hello whose table is wrong."""
    bad = mutated(set_path([T, "order"], "HNX"))

    def fake_prefill(port, argv):
        command = [sys.executable, "-c", FAKE_PREFILL, str(port), bad.hex()]
        return subprocess.Popen(command, stdin=subprocess.DEVNULL)

    monkeypatch.setattr(demo, "start_prefill", fake_prefill)
    code = demo.main(["--requests", "2", "--layers", "1", "--heads", "2", "--head-dim", "4", "--max-tokens", "20"])
    out = capsys.readouterr().out
    assert code == demo.EXIT_ERROR
    assert "ProtocolError: hello.table.order: 'HNX' must be distinct letters" in out
    assert "FAILED: the hand-off did not run" in out
    assert issubclass(ProtocolError, KVHostError)
