"""The control socket: malformed, truncated or corrupted metadata messages are ProtocolErrors.

An offer from prefill carries its engine spec, its block table, its requests, its NIXL agent
metadata and fields of the application's own. Every way it can be wrong (cut short, bytes
flipped, fields missing or of the wrong type or out of range, garbage agent metadata) must
end in a ``ProtocolError`` (a ``KVHostError``) that names what was wrong, never another
exception, a hang or a crash.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import itertools
import os
import random
import socket
import struct
import threading
import time
import zlib

import numpy as np
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp
from test_nixl import needs_nixl

from kvhost.errors import ArgumentError, KVHostError
from kvhost.nixl import (
    EngineSpec,
    Fields,
    Offer,
    ProtocolError,
    RegionTable,
    RemoteRequest,
    decode,
    encode,
    receive,
    region_table,
    send,
)
from kvhost.nixl.errors import PeerClosedError
from kvhost.nixl.framing import (
    HEADER_BYTES,
    MAGIC,
    MAX_BLOB_BYTES,
    MAX_JSON_VALUES,
    VERSION,
    Message,
    json_values,
    parse_header,
    read_arrived,
)
from kvhost.nixl.handshake import MAX_REQUESTS, parse_requests, request_columns
from kvhost.nixl.peers import CHALLENGE, ENGINE, KNOCK, OFFER, connect, nonce_of, parse_offer, proof
from kvhost.testing import make_cache
from kvhost_tools.demo import config as demo_config
from kvhost_tools.demo import decode as demo_decode

METADATA = b"nixlSerDes|" + bytes(range(256)) * 2  # stands in for agent metadata; NIXL is not asked


SPEC = EngineSpec("mha", 2, 2, 4, "bfloat16", 4, "HNC", 1)  # what the table below holds
TABLE = region_table(
    {f"layer{i}": make_cache("KBNHC", "KBHNC", dict(K=2, B=12, N=4, H=2, C=4)) for i in range(2)}, "KBNHC"
)
REQUESTS = [RemoteRequest("req-000", 0, 9, [3, 1, 7]), RemoteRequest("req-001", 1, 4, [0])]
EXTRA = {"pid": 4321, "fill_seconds": 0.25}  # the application's own fields, as the demo's prefill adds them


def offer_header():
    """An offer as prefill sends it: the requests as columns, the bulk integers as arrays
    (binary), names as JSON; the agent metadata goes as the frame's blob."""
    return Offer(SPEC, [TABLE], [METADATA], REQUESTS, extra=EXTRA).header()


HEADER = offer_header()
FRAME = encode(OFFER, HEADER, METADATA)


@pytest.mark.parametrize(
    ("change", "words"),
    [
        (dict(spec=None), "an offer's spec must be an EngineSpec, got None"),
        (dict(tables=[]), "an offer's tables must be a sequence of 1 (a rank's each), got []"),
        (dict(tables=[TABLE, TABLE]), "an offer's tables must be a sequence of 1"),
        (dict(tables=TABLE), "an offer's tables must be a sequence of 1"),
        (dict(tables=[TABLE.to_dict()]), "an offer's tables[0] must be a RegionTable, got {"),
        (dict(metadata=["nixl"]), "an offer's metadata[0] must be an agent's metadata (1 to"),
        (dict(metadata=[b""]), "an offer's metadata[0] must be an agent's metadata"),
        (dict(metadata=[b"x" * (MAX_BLOB_BYTES + 1)]), "an offer's metadata[0] must be an agent's metadata"),
        (dict(metadata=[]), "an offer's metadata must be a sequence of 1"),
        (dict(beat_seconds=0.01), "an offer's beat_seconds 0.01 is not in [0.05, 60.0]"),
        (dict(beat_seconds=61), "an offer's beat_seconds 61 is not in"),
        (dict(beat_seconds="1"), "an offer's beat_seconds: expected a number of seconds"),
        (dict(beat_seconds=float("nan")), "an offer's beat_seconds: expected a number of seconds"),
    ],
)
def test_an_offer_decode_would_refuse_is_refused_as_the_senders_mistake(change, words):
    offer = dataclasses.replace(Offer(SPEC, [TABLE], [METADATA], REQUESTS), **change)
    with pytest.raises(KVHostError) as raised:
        offer.header()
    assert str(raised.value).startswith(words)
    header = dataclasses.replace(offer, **{k: getattr(Offer(SPEC, [TABLE], [METADATA], REQUESTS), k) for k in change})
    assert header.header()["beat_seconds"] == 1.0  # the same offer, mended, is sent


def test_an_offer_at_its_bounds_is_sent():
    for beat in (0.05, 60.0):
        assert Offer(SPEC, [TABLE], [METADATA], REQUESTS, beat_seconds=beat).header()["beat_seconds"] == beat
    most = b"x" * MAX_BLOB_BYTES
    assert Offer(SPEC, [TABLE], [most], REQUESTS).header()["metadata_bytes"].tolist() == [MAX_BLOB_BYTES]


def parse_message(message):
    """The offer, and the application's own fields read as an application reads them: a
    pid in [1, 2^31], a number of seconds."""
    offer = parse_offer(message, SPEC)
    assert offer.fields is not None
    offer.fields.integer("pid", minimum=1, maximum=1 << 31)
    offer.fields.seconds("fill_seconds", default=0.0)
    return offer


def parse(frame):
    return parse_message(decode(frame))


def test_a_good_offer_parses():
    offer = parse(FRAME)
    assert "fields" not in repr(offer)  # the whole raw offer stays out of logs
    assert [r.name for r in offer.requests] == ["req-000", "req-001"]
    assert offer.requests[0].remote_ids.tolist() == [3, 1, 7] and offer.requests[0].tokens == 9
    assert offer.requests[1].remote_ids.tolist() == [0] and offer.requests[1].number == 1
    [table] = offer.tables
    assert table == TABLE and table.order == "HNC" and table.num_blocks == 12 and len(table.streams) == 4
    assert offer.spec == SPEC and offer.metadata == [METADATA] and offer.beat_seconds == 1.0
    assert offer.fields is not None and offer.fields.integer("pid") == 4321
    assert offer.fields.seconds("fill_seconds") == 0.25


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


def framed(body: bytes, blob: bytes = METADATA, arrays: bytes = b"") -> bytes:
    """A frame around any body, with a correct checksum: only the content is wrong."""
    crc = zlib.crc32(arrays, zlib.crc32(blob, zlib.crc32(body)))
    return struct.pack(">4sBIIII", MAGIC, VERSION, len(body), len(blob), len(arrays), crc) + body + blob + arrays


def lengths(json_len, blob_len=0, array_len=0, version=VERSION):
    return struct.pack(">4sBIIII", MAGIC, version, json_len, blob_len, array_len, 0)


@pytest.mark.parametrize(
    ("frame", "message"),
    [
        pytest.param(b"HTTP/1.1 200 OK\r\n\r\n" + b"x" * 20, "not a kvhost frame", id="bad-magic"),
        pytest.param(lengths(2, version=9) + b"{}", "version 9", id="bad-version"),
        pytest.param(lengths(1, 0, version=1) + b"{}", "version 1", id="version-1"),
        pytest.param(lengths(2 << 20), "JSON length 2097152 exceeds the limit", id="json-too-long"),
        pytest.param(lengths(2, 1 << 30), "blob length .* exceeds the limit", id="blob-too-long"),
        pytest.param(lengths(2, 0, 1 << 30), "array length .* exceeds the limit", id="arrays-too-long"),
        pytest.param(
            framed(b'{"kind":"offer","v":[' + b"{}," * MAX_JSON_VALUES + b"{}]}"),
            r"may hold \d+ JSON values, more than the limit of 65536",
            id="too-many-json-values",
        ),
        pytest.param(framed(b"\xff\xfe{}"), "not valid JSON", id="not-utf8"),
        pytest.param(framed(b'{"kind": "offer", '), "not valid JSON", id="json-cut"),
        pytest.param(framed(b"[1, 2, 3]"), "must be a JSON object", id="json-array"),
        pytest.param(framed(b'{"pid": 1}'), "no string 'kind'", id="no-kind"),
        pytest.param(framed(b'{"kind": "offer", "pid": NaN}'), "NaN", id="nan"),
        pytest.param(framed(b'{"kind": "offer", "pid": ' + b"9" * 5000 + b"}"), "not valid JSON", id="huge-int"),
        pytest.param(framed(b"[" * 60000 + b"]" * 60000), "not valid JSON", id="deep-nesting"),
    ],
)
def test_malformed_frames(frame, message):
    with pytest.raises(ProtocolError, match=message):
        parse(frame)


def mutated(change):
    header = copy.deepcopy(HEADER)
    change(header)
    return encode(OFFER, header, METADATA)


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
T = ["tables", 0]
S = [*T, "streams"]
R = "requests"


def set_item(path, index, value):
    """Set one element of the array at ``path`` (a copy: the arrays are shared)."""

    def change(header):
        target = header
        for key in path[:-1]:
            target = target[key]
        array = target[path[-1]].copy()
        array[index] = value
        target[path[-1]] = array

    return change


def u32(*values):
    return np.array(values, dtype=np.uint32)


FIELD_CASES = {
    "no-tables": (set_path(["tables"], DELETE), r"offer\.tables: missing"),
    "table-not-object": (set_path(T, [1, 2]), r"offer\.tables\[0\]: expected an object"),
    "memory-unknown": (set_path([*T, "memory"], "GPU9"), r"memory: 'GPU9' is not one of"),
    "order-unknown-letter": (set_path([*T, "order"], "HNX"), r"order: 'HNX' must be distinct letters"),
    "order-repeated": (set_path([*T, "order"], "HNN"), r"must be distinct letters"),
    "order-no-C": (set_path([*T, "order"], "HN"), r"lacks C"),
    "split-wrong": (set_path([*T, "split"], "C"), r"split: 'C' must be empty or 'H'"),
    "split-not-streams": (set_path([*T, "split"], "H"), r"split letters 'H' must index the streams"),
    "sizes-letter-B": (set_path([*T, "sizes", "B"], 4), r"unknown letter 'B'"),
    "sizes-zero": (set_path([*T, "sizes", "H"], 0), r"sizes\.H: expected an integer in \[1,"),
    "sizes-bool": (set_path([*T, "sizes", "N"], True), r"sizes\.N: expected an integer .* got True"),
    "sizes-extra-letter": (set_path([*T, "sizes", "L"], 3), r"sizes name .* but order and stream coordinates"),
    "itemsize-3": (set_path([*T, "itemsize"], 3), r"itemsize: 3 is not 1, 2, 4 or 8"),
    "itemsize-float": (set_path([*T, "itemsize"], 2.0), r"itemsize: expected an integer"),
    "num-blocks-negative": (set_path([*T, "num_blocks"], -1), r"num_blocks: expected an integer"),
    "num-blocks-2^33": (set_path([*T, "num_blocks"], 1 << 33), r"num_blocks: expected an integer in \[1, 4294967296\]"),
    "layers-missing": (set_path([*T, "layers"], DELETE), r"offer\.tables\[0\]\.layers: missing"),
    "layers-name-empty": (
        set_path([*T, "layers", 0], ""),
        r"offer\.tables\[0\]\.layers\[0\]: expected a string of 1 to 256",
    ),
    "layers-twice": (set_path([*T, "layers", 1], "layer0"), r"offer\.tables\[0\]\.layers\[1\]: 'layer0' appears twice"),
    "coords-not-text": (
        set_path([*T, "coords"], ["K"]),
        r"offer\.tables\[0\]\.coords: expected a string of coordinate letters",
    ),
    "coords-letter": (set_path([*T, "coords"], "Z"), r"offer\.tables\[0\]\.coords: bad coordinate 'Z'"),
    "coords-in-run": (set_path([*T, "coords"], "N"), r"coordinate N lies inside the run"),
    "coords-order": (set_path([*T, "coords"], "K#"), r"'K#' must be distinct letters in '#LKHNC' order"),
    "streams-empty": (
        lambda h: h["tables"][0].update(streams={k: v[:0] for k, v in h["tables"][0]["streams"].items()}),
        r"offer\.tables\[0\]\.streams: empty",
    ),
    "streams-not-object": (set_path(S, [[1, 2]]), r"offer\.tables\[0\]\.streams: expected an object"),
    "stream-layer-range": (
        set_item([*S, "layer"], 1, 5),
        r"streams\.layer\[1\]: expected an integer in \[0, 1\], got 5",
    ),
    "stream-layer-list": (set_path([*S, "layer"], [0, 0, 1, 1]), r"streams\.layer: expected an integer array"),
    "stream-coords-count": (set_path([*S, "coords"], u32(0, 1, 0)), r"streams\.coords: 3 values for 4 streams of 1"),
    "stream-coord-range": (
        set_item([*S, "coords"], 2, 2),
        r"streams\.coords\[2\]: stream 2's coordinate K: .* \[0, 1\], got 2",
    ),
    "stream-address-zero": (set_item([*S, "address"], 0, 0), r"streams\.address\[0\]: expected an integer in \[1,"),
    "stream-address-count": (set_path([*S, "address"], np.ones(3, np.uint64)), r"streams\.address: 3 values for 4"),
    "stream-stride-small": (set_item([*S, "stride"], 3, 8), r"streams\.stride\[3\]: expected an integer in \[64,"),
    "stream-stride-huge": (set_item([*S, "stride"], 0, 1 << 60), r"streams\.stride\[0\]: .* \[64, 281474976710656\]"),
    "stream-past-end": (set_item([*S, "address"], 1, (1 << 64) - 100), r"streams\[1\]: blocks run past the end"),
    "stream-twice": (set_item([*S, "coords"], 1, 0), r"streams\[1\]: layer0\[K=0\] appears twice"),
    "no-requests": (set_path([R], DELETE), r"offer\.requests: missing"),
    "requests-not-object": (set_path([R], [{"name": "a"}]), r"offer\.requests: expected an object"),
    "request-name-empty": (set_path([R, "name", 0], ""), r"requests\.name\[0\]: expected a string of 1 to 64"),
    "request-name-twice": (set_path([R, "name", 1], "req-000"), r"name\[1\]: 'req-000' appears twice"),
    "request-names-too-many": (
        set_path([R, "name"], ["r"] * 20000),
        r"requests\.name: expected a list of at most 16384",
    ),
    "request-tokens-zero": (set_item([R, "tokens"], 0, 0), r"requests\.tokens\[0\]: expected an integer in \[1,"),
    "request-tokens-huge": (set_item([R, "tokens"], 1, 1 << 30), r"tokens\[1\]: expected .* \[1, 16777216\]"),
    "request-tokens-count": (set_path([R, "tokens"], u32(9)), r"requests\.tokens: 1 values for 2 requests"),
    "request-numbers-list": (set_path([R, "number"], [0, 1]), r"requests\.number: expected an integer array"),
    "request-block-out-of-range": (
        set_item([R, "block_ids"], 1, 12),
        r"block_ids\[1\]: expected an integer in \[0, 11\], got 12",
    ),
    "request-block-twice": (
        set_item([R, "block_ids"], 2, 3),
        r"offer\.requests\.block_ids: request 'req-000' names block 3 twice",
    ),
    "request-too-few-blocks": (
        set_path([R, "block_ids"], u32(3, 1, 7)),
        r"block_ids: 3 block ids, but the requests' tokens need 4 blocks of 4",
    ),
    "fill-seconds-string": (set_path(["fill_seconds"], "0.2"), r"offer\.fill_seconds: expected a number of seconds"),
    "fill-seconds-huge": (set_path(["fill_seconds"], 10**400), r"offer\.fill_seconds: expected a number of seconds"),
    "pid-missing": (set_path(["pid"], DELETE), r"offer\.pid: missing"),
    "pid-string": (set_path(["pid"], "4321"), r"offer\.pid: expected an integer"),
    "pid-zero": (set_path(["pid"], 0), r"offer\.pid: expected an integer in \[1, 2147483648\], got 0"),
    "pid-above": (set_path(["pid"], (1 << 31) + 1), r"offer\.pid: expected an integer in \[1, 2147483648\]"),
    "request-number-above": (
        set_item([R, "number"], 1, (1 << 31) + 1),
        r"requests\.number\[1\]: expected an integer in \[0, 2147483648\]",
    ),
}


def test_two_requests_may_read_one_remote_block():
    """A prefix the prefill shares between requests: the same block in two requests is
    read twice, into each one's own blocks (only one request naming it twice is refused)."""
    offer = parse(mutated(set_item([R, "block_ids"], 3, 3)))
    assert [r.remote_ids.tolist() for r in offer.requests] == [[3, 1, 7], [3]]


def test_the_bounds_of_a_pid_and_a_request_number_are_taken():
    for pid, number in ((1, 0), (1 << 31, 1 << 31)):
        offer = parse(
            mutated(
                lambda h, pid=pid, number=number: (set_path(["pid"], pid)(h), set_item([R, "number"], 1, number)(h))
            )
        )
        assert offer.fields is not None
        assert (offer.fields.integer("pid"), offer.requests[1].number) == (pid, number)


@pytest.mark.parametrize("case", FIELD_CASES)
def test_malformed_fields_are_named(case):
    change, message = FIELD_CASES[case]
    with pytest.raises(ProtocolError, match=message):
        parse(mutated(change))


def test_a_coordinate_out_of_range_is_named_by_its_place_in_the_array_and_its_stream():
    """With two coordinates per stream (K and a head), the array's place and the stream differ."""
    caches = {"l0": make_cache("KBNHC", "KHBNC", dict(K=2, B=4, N=4, H=2, C=8))}
    table = region_table(caches, "KBNHC").to_dict()
    assert table["coords"] == "KH"
    table["streams"]["coords"][3] = 2  # stream 1's head: there are 2
    named = r"^table\.streams\.coords\[3\]: stream 1's coordinate H: .*\[0, 1\], got 2$"
    with pytest.raises(ProtocolError, match=named):
        RegionTable.from_dict(table)


def test_numpy_integers_travel_as_the_numbers_they_hold():
    header = {"count": np.int64(-3), "sizes": [np.uint32(7), np.int8(1)], "nested": {"n": np.uint64(2**64 - 1)}}
    a, b = socket.socketpair()
    with a, b:
        send(a, "hello", header, timeout=1.0)
        got = receive(b, timeout=1.0, expect="hello").header
    assert got == {"count": -3, "sizes": [7, 1], "nested": {"n": 2**64 - 1}}
    assert all(type(v) is int for v in (got["count"], *got["sizes"], got["nested"]["n"]))
    with pytest.raises(ProtocolError, match="cannot be sent as JSON"):
        encode(OFFER, {"flag": np.bool_(True)})  # a numpy bool is not a number, nor JSON's true


def test_unsendable_headers_are_protocol_errors():
    with pytest.raises(ProtocolError, match="cannot be sent as JSON"):
        encode(OFFER, {"pid": float("inf")})
    with pytest.raises(ProtocolError, match="cannot be sent as JSON"):
        encode(OFFER, {"pid": object()})
    with pytest.raises(ProtocolError, match="message 'offer': its header must not name 'kind'"):
        encode(OFFER, {"kind": "refuse", "reason": "a header's kind would replace the message's"})


def test_an_offer_without_agent_metadata_is_refused():
    """The blob must hold every rank's metadata, each of at least one byte."""
    missing = rf"offer\.metadata_bytes: \[{len(METADATA)}\] for 1 ranks and 0 blob bytes"
    with pytest.raises(ProtocolError, match=missing):
        parse(encode(OFFER, HEADER, b""))
    header = {**HEADER, "metadata_bytes": np.zeros(1, dtype=np.uint32)}
    with pytest.raises(ProtocolError, match=r"offer\.metadata_bytes\[0\]: expected an integer in \[1, "):
        parse(encode(OFFER, header, b""))


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


def get_path(header, path):
    for key in path:
        header = header[key]
    return header


PATHS = [p for p in json_paths(HEADER) if p]
ARRAY_PATHS = [p for p in PATHS if isinstance(get_path(HEADER, p), np.ndarray)]


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.sampled_from(PATHS), JSON_VALUES)
def test_any_value_anywhere_is_accepted_or_a_protocol_error(path, value):
    with contextlib.suppress(ProtocolError):
        parse(mutated(set_path(list(path), value)))


ARRAYS = st.sampled_from(["u1", "<u2", ">u4", "<u4", "<u8"]).flatmap(
    lambda dtype: hnp.arrays(dtype, st.integers(0, 6), elements=st.integers(0, np.iinfo(np.dtype(dtype)).max))
)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.sampled_from(ARRAY_PATHS), ARRAYS)
def test_any_integer_array_in_place_of_one_is_accepted_or_a_protocol_error(path, array):
    """Arrays of any unsigned type, length and values where the offer has an array."""
    with contextlib.suppress(ProtocolError):
        parse(mutated(set_path(list(path), array)))


REFERENCES = st.fixed_dictionaries(
    {
        "array": st.sampled_from(["u1", "<u2", "<u4", "<u8", "<i4", ">u4", "f8", "", 7]),
        "offset": st.integers(-5, 300) | st.just(1 << 64),
        "count": st.integers(-5, 300) | st.just(1 << 62),
    }
)


@settings(max_examples=200, deadline=None)
@given(REFERENCES, st.binary(max_size=96))
def test_any_array_reference_is_read_in_bounds_or_refused(reference, arrays):
    """A reference names a type, an offset and a count in the frame's array bytes: whatever
    they are, it is read in bounds, aligned and in range, or refused naming the field."""
    try:
        values = Fields({"ids": reference}, "m", arrays).array("ids", maximum=200, max_length=50)
    except ProtocolError as err:
        assert str(err).startswith("m.ids")
        return
    assert reference["offset"] % values.itemsize == 0 and reference["offset"] + values.nbytes <= len(arrays)
    assert values.size <= 50 and (values <= 200).all() and not values.flags.writeable


@pytest.mark.parametrize(
    ("reference", "message"),
    [
        ({"array": "<i4", "offset": 0, "count": 1}, r"m\.ids\.array: '<i4' is not one of"),
        ({"array": "<u4", "offset": 2, "count": 1}, r"m\.ids\.offset: 2 is not a multiple of the item size 4"),
        ({"array": "<u4", "offset": 0, "count": 5}, r"m\.ids: 5 items of 4 bytes from offset 0 run past the 16"),
        ({"array": "<u4", "offset": 0, "count": 1, "x": 1}, r"m\.ids: expected an integer array"),
        ({"array": "<u4", "offset": 0, "count": 4}, r"m\.ids\[2\]: expected an integer in \[0, 9\], got 77"),
        ([1, 2, 3], r"m\.ids: expected an integer array \{array, offset, count\}, got \[1, 2, 3\]"),
    ],
)
def test_bad_array_references_are_named(reference, message):
    arrays = np.array([1, 2, 77, 3], dtype="<u4").tobytes()
    with pytest.raises(ProtocolError, match=message):
        Fields({"ids": reference}, "m", arrays).array("ids", maximum=9)


@settings(max_examples=150, deadline=None)
@given(st.binary(max_size=64), st.integers(0, len(FRAME) - 1))
def test_any_bytes_spliced_in_are_a_protocol_error(junk, at):
    """Bytes at..at+len(junk) replaced by junk, and one byte dropped: whatever the junk, a
    frame that differs is refused (its length, its header, or its checksum)."""
    spliced = FRAME[:at] + junk + FRAME[at + len(junk) + 1 :]
    assume(spliced != FRAME)  # the last byte replaced by itself
    with pytest.raises(ProtocolError):
        parse(spliced)


# --- over a real socket ---------------------------------------------------------------

SECRET = bytes(range(32))


def proving_prefill(listener, answer, close=True):
    """A prefill on a thread that proves the secret to the decode engine that connects,
    takes its engine message and answers with the bytes ``answer`` (then closes, or holds
    the connection until the returned event is set)."""
    done = threading.Event()

    def prefill():
        conn, _ = listener.accept()
        with conn:
            knock = receive(conn, timeout=5, expect=KNOCK)
            mine = os.urandom(16)
            nonces = (nonce_of(knock.fields()), mine)
            send(conn, CHALLENGE, {"nonce": mine.hex(), "proof": proof(SECRET, "prefill", nonces)}, timeout=5)
            receive(conn, timeout=5, expect=ENGINE)
            conn.sendall(answer)
            if not close:
                done.wait(5)

    thread = threading.Thread(target=prefill, daemon=True)
    thread.start()
    return done, thread


@pytest.mark.timeout(20)
@pytest.mark.parametrize(
    ("payload", "close", "message"),
    [
        pytest.param(FRAME[:10], True, "truncated frame|closed after", id="cut-in-header"),
        pytest.param(FRAME[:300], True, r"connection closed after \d+ of \d+ JSON body bytes", id="cut-in-body"),
        pytest.param(FRAME[:-5], True, "closed after .* arrays bytes", id="cut-in-arrays"),
        pytest.param(FRAME[:300], False, "timed out waiting for the JSON body", id="stalls"),
        pytest.param(encode("done", {}), True, "expected an offer, got 'done'", id="wrong-kind"),
        pytest.param(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n", True, "not a kvhost frame", id="http"),
    ],
)
def test_decode_rejects_a_bad_offer_on_the_socket(payload, close, message):
    """Prefill proved who it is, then sent a bad offer: its error, named."""
    with socket.create_server(("127.0.0.1", 0)) as listener:
        done, thread = proving_prefill(listener, payload, close)
        with pytest.raises(ProtocolError, match=message):
            connect(listener.getsockname(), SECRET, SPEC, timeout=1.0)
        done.set()
        thread.join(5)


def test_a_frame_of_another_kind_than_expected_is_named():
    a, b = socket.socketpair()
    with a, b:
        send(a, "done", {}, timeout=1.0)
        with pytest.raises(ProtocolError, match=r"^expected a 'hello' message, got 'done'$"):
            receive(b, timeout=1.0, expect="hello")
        send(a, "hello", {"n": 1}, timeout=1.0)
        assert receive(b, timeout=1.0, expect="hello").header == {"n": 1}
        for bad in (True, b"hello", ["hello"]):  # the caller's mistake, said before anything is read
            send(a, "hello", {"n": 2}, timeout=1.0)
            with pytest.raises(ArgumentError, match=r"^expect names a message kind \(a str\), got "):
                receive(b, timeout=1.0, expect=bad)  # type: ignore[arg-type]
            assert receive(b, timeout=1.0, expect="hello").header == {"n": 2}  # the frame was left unread


def _arrived(sock: socket.socket, data: bytearray) -> Message | None:
    return read_arrived(sock, data, limit=1 << 20)


def test_read_arrived_reads_frames_piece_by_piece_and_never_past_one():
    """On a non-blocking socket: None until a frame is whole, then the message (blob and
    arrays too), ``data`` emptied; a second frame already behind it is left for the next call."""
    ids = np.arange(5, dtype=np.uint64)
    first = encode("offer", {"ids": ids, "note": "first"}, b"metadata")
    second = encode("done", {"ids": ids[::-1].copy()}, b"more")
    writer, reader = socket.socketpair()
    with writer, reader:
        reader.setblocking(False)
        data = bytearray()
        assert _arrived(reader, data) is None
        cuts = [0, 3, HEADER_BYTES, HEADER_BYTES + 7, len(first) - 9, len(first)]
        for start, end in itertools.pairwise(cuts[:-1]):
            writer.sendall(first[start:end])
            assert _arrived(reader, data) is None and len(data) == end
        writer.sendall(first[cuts[-2] :] + second)  # the rest of the first, and all of the second
        message = _arrived(reader, data)
        assert message is not None and not data
        assert (message.kind, message.blob, message.header["note"]) == ("offer", b"metadata", "first")
        assert Fields(message.header, "offer", message.arrays).array("ids").tolist() == ids.tolist()
        message = _arrived(reader, data)
        assert message is not None and not data
        assert (message.kind, message.blob) == ("done", b"more")
        assert Fields(message.header, "done", message.arrays).array("ids").tolist() == ids[::-1].tolist()
        assert _arrived(reader, data) is None


def test_read_arrived_says_where_a_peer_closed_and_when_the_socket_failed():
    frame = encode("done", {})
    closes = {
        b"": r"^the peer closed the connection$",
        frame[:10]: r"^the peer closed the connection 10 bytes into a frame$",
    }
    for sent, said in closes.items():
        writer, reader = socket.socketpair()
        with reader:
            writer.sendall(sent)
            writer.close()
            with pytest.raises(PeerClosedError, match=said):
                _arrived(reader, bytearray())  # blocking here: reads what was sent, then the close
    writer, reader = socket.socketpair()
    writer.close()
    reader.close()
    with pytest.raises(PeerClosedError, match=r"^the connection failed: "):
        _arrived(reader, bytearray())


def test_an_offer_without_extra_fields_has_only_its_own():
    header = Offer(SPEC, [TABLE], [METADATA], [RemoteRequest("r", 0, 1, [2])]).header()
    assert sorted(header) == ["beat_seconds", "engine", "metadata_bytes", "requests", "tables"]
    assert header["beat_seconds"] == 1.0


@pytest.mark.parametrize(("num_blocks", "id_type"), [(12, np.uint32), (1 << 32, np.uint32), ((1 << 32) + 1, np.uint64)])
def test_block_ids_go_as_the_narrowest_integers_the_table_needs(num_blocks, id_type):
    """Ids below 2^32 go as 4 bytes each; a table of more blocks sends 8, and its highest
    id comes back whole."""
    table = dataclasses.replace(TABLE, num_blocks=num_blocks)
    ids = [0, num_blocks - 1]
    columns = request_columns([RemoteRequest("r", 0, 2 * table.block_size, ids)], table, table.block_size)
    assert columns["block_ids"].dtype == id_type
    message = decode(encode(OFFER, {"requests": columns}))
    back = parse_requests(message.fields().fields("requests"), table.block_size, num_blocks)
    assert back[0].remote_ids.tolist() == ids


def test_no_requests_go_as_empty_columns():
    columns = request_columns([], TABLE, TABLE.block_size)
    assert columns["name"] == [] and columns["block_ids"].size == 0 and columns["block_ids"].dtype == np.uint32
    message = decode(encode(OFFER, {"requests": columns}))
    assert parse_requests(message.fields().fields("requests"), TABLE.block_size, TABLE.num_blocks) == []


@pytest.mark.parametrize(
    ("request_", "message"),
    [
        (RemoteRequest("r", 0, 5.9, [0, 1]), r"request 'r': tokens must be an integer in \[1, 16777216\], got 5.9"),
        (RemoteRequest("r", 0, True, [0]), r"request 'r': tokens must be an integer .*got True"),
        (RemoteRequest("r", 0, 0, []), r"request 'r': tokens must be an integer in \[1, 16777216\], got 0"),
        (RemoteRequest("r", 1 << 32, 5, [0, 1]), r"request 'r': number must be an integer in \[0, 2147483648\]"),
        (RemoteRequest("r", -1, 5, [0, 1]), r"request 'r': number must be an integer in \[0, 2147483648\], got -1"),
        (RemoteRequest("r", 0, 5, [0.7, 1.2]), r"request 'r': remote_ids: block ids must be integers, got 0.7"),
        (RemoteRequest("r", 0, 5, [0, 1, 2]), r"request 'r': 3 block ids, but 5 tokens fill 2 blocks of 4"),
        (RemoteRequest("r", 0, 5, [0, 12]), r"request 'r': remote_ids: block id 12 at position 1 is out of range"),
        (RemoteRequest("r", 0, 5, [3, 3]), r"request 'r': remote_ids: .*3"),
        (RemoteRequest("x" * 65, 0, 5, [0, 1]), r"requests\[1\].name: expected a string of 1 to 64 characters"),
        (RemoteRequest("a\nb", 0, 5, [0, 1]), r"requests\[1\].name: expected printable text"),
    ],
)
def test_a_request_prefill_could_not_offer_is_refused_where_it_is_given(request_, message):
    """What ``parse_requests`` would refuse on arrival is refused as the offer is made, and
    nothing is coerced on the way (a float of tokens was cut to an integer, unsaid)."""
    with pytest.raises(KVHostError, match=message):
        Offer(SPEC, [TABLE], [METADATA], [RemoteRequest("ok", 0, 4, [5]), request_]).header()


def test_an_offer_of_the_most_requests_is_made_and_one_more_is_refused_where_it_is_given():
    most = [RemoteRequest(f"r{i}", i, 1, [i % 12]) for i in range(MAX_REQUESTS - 1)]
    most.append(RemoteRequest("the highest number", 1 << 31, 1, [0]))  # as parse_requests takes it
    header = Offer(SPEC, [TABLE], [METADATA], most).header()
    assert len(header["requests"]["name"]) == MAX_REQUESTS
    with pytest.raises(KVHostError, match=f"an offer names at most {MAX_REQUESTS} requests, got {MAX_REQUESTS + 1}"):
        Offer(SPEC, [TABLE], [METADATA], [*most, RemoteRequest("one more", 0, 1, [0])]).header()


def test_the_same_request_offered_twice_is_refused_where_it_is_given():
    with pytest.raises(KVHostError, match=r"requests\[1\]: 'r' is offered twice"):
        Offer(SPEC, [TABLE], [METADATA], [RemoteRequest("r", 0, 4, [5]), RemoteRequest("r", 1, 4, [6])]).header()


@pytest.mark.parametrize("key", ["engine", "tables", "metadata_bytes", "requests", "beat_seconds", 7])
def test_an_offers_extra_fields_may_not_overwrite_the_protocols_own(key):
    with pytest.raises(KVHostError, match="extra field"):
        Offer(SPEC, [TABLE], [METADATA], REQUESTS, extra={key: "mine"}).header()


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ({"proof": "mine"}, "the engine message's extra field 'proof' is the protocol's own"),
        ({"engine": {}}, "the engine message's extra field 'engine' is the protocol's own"),
        (
            {"pad": "x" * (64 << 10)},
            r"the engine message with these extra fields is \d+ bytes; prefill reads at most 65536",
        ),
        ({"bad": {1, 2}}, "cannot be sent as JSON"),
    ],
)
def test_decodes_extra_fields_are_checked_before_it_connects(extra, message):
    """Refused before a connection is made: prefill would drop an engine message over its
    bound unread (this side heard only that the connection was reset), and a field named
    like the protocol's own would be overwritten, unsaid."""
    with socket.create_server(("127.0.0.1", 0)) as listener:
        listener.settimeout(0.2)
        with pytest.raises(KVHostError, match=message):
            connect(listener.getsockname(), b"s" * 32, SPEC, timeout=5, extra=extra)
        with pytest.raises(TimeoutError):
            listener.accept()  # nobody called


@pytest.mark.timeout(20)
def test_receive_reads_a_frame_split_across_sends():
    left, right = socket.socketpair()
    with left, right:

        def trickle():
            for i in range(0, len(FRAME), 37):
                right.sendall(FRAME[i : i + 37])

        thread = threading.Thread(target=trickle)
        thread.start()
        message = receive(left, timeout=5, expect=OFFER)
        thread.join()
    assert message.blob == METADATA
    offer = parse_message(message)
    assert offer.tables == [TABLE]
    assert [r.remote_ids.tolist() for r in offer.requests] == [[3, 1, 7], [0]]


@pytest.mark.timeout(20)
def test_a_frame_above_the_limit_is_refused_from_its_header():
    """Before a peer proves who it is, a frame may not be larger than ``limit``: refused on
    the header's lengths, before its body is read (or allocated)."""
    left, right = socket.socketpair()
    with left, right:
        right.sendall(FRAME[:HEADER_BYTES])
        with pytest.raises(ProtocolError, match=r"frame of \d+ bytes exceeds the limit of 100 bytes"):
            receive(left, timeout=5, limit=100)


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
    damaged_frame = bytearray(encode(OFFER, HEADER, real))
    damaged_frame[-10] ^= 0xFF
    with pytest.raises(ProtocolError, match="checksum mismatch"):
        decode(bytes(damaged_frame))


@needs_nixl
@pytest.mark.timeout(120)
def test_decode_exits_with_a_clear_error_on_a_malformed_offer(capsys, tmp_path):
    """The whole decode engine, against a prefill that proves the secret and then offers a
    table whose order is wrong."""
    from kvhost.nixl.peers import write_secret_file

    secret_file = str(tmp_path / "secret")
    secret = write_secret_file(secret_file)
    spec = EngineSpec("mha", 2, 2, 4, "bfloat16", 4, "HNC", 1)
    table = region_table(
        {f"layer{i}": make_cache("KBNHC", "KBHNC", dict(K=2, B=12, N=4, H=2, C=4)) for i in range(2)}, "KBNHC"
    )
    header = Offer(spec, [table], [METADATA], []).header()
    header["tables"][0]["order"] = "HNX"

    with socket.create_server(("127.0.0.1", 0)) as listener:

        def prefill():
            conn, _ = listener.accept()
            with conn:
                knock = receive(conn, timeout=60, expect=KNOCK)
                nonces = (nonce_of(knock.fields()), bytes(16))
                send(conn, CHALLENGE, {"nonce": bytes(16).hex(), "proof": proof(secret, "prefill", nonces)}, timeout=5)
                receive(conn, timeout=60, expect=ENGINE)
                send(conn, OFFER, header, METADATA, timeout=5)
                conn.recv(1)

        thread = threading.Thread(target=prefill, daemon=True)
        thread.start()
        argv = ["--requests", "2", "--layers", "2", "--heads", "2", "--head-dim", "4", "--block-size", "4"]
        port = listener.getsockname()[1]
        code = demo_decode.main([*argv, "--prefill", f"127.0.0.1:{port}", "--secret-file", secret_file])
    out = capsys.readouterr().out
    assert code == demo_config.EXIT_ERROR
    assert f"  error     prefill at 127.0.0.1:{port}, at its offer: offer.tables[0].order: 'HNX' must be" in out
    assert "FAILED: the hand-off did not run" in out
    assert issubclass(ProtocolError, KVHostError)


# --- the frame format, byte for byte, and its limits at their edges --------------------

WIRE_HEADER = struct.Struct(">4sBIIII")  # magic, version, JSON, blob and array lengths, CRC


def by_hand(body: bytes, blob: bytes = b"", arrays: bytes = b"") -> bytes:
    """A frame as the format says it is, built without kvhost's encoder."""
    crc = zlib.crc32(arrays, zlib.crc32(blob, zlib.crc32(body)))
    return WIRE_HEADER.pack(b"KVHM", 2, len(body), len(blob), len(arrays), crc) + body + blob + arrays


def test_a_frame_is_the_documented_bytes():
    """Version 2: magic, version, three big-endian lengths, the CRC of JSON, blob and arrays
    in turn; JSON without spaces, ``kind`` first; arrays little-endian, each aligned to its
    item size after the ones before it."""
    assert encode("ping", {"n": 1}, b"xy") == by_hand(b'{"kind":"ping","n":1}', b"xy")
    small, wide = np.array([1, 2, 3], dtype=np.uint8), np.array([5, 1 << 40], dtype=np.uint64)
    body = b'{"kind":"ids","a":{"array":"u1","offset":0,"count":3},"b":{"array":"<u8","offset":8,"count":2}}'
    arrays = bytes([1, 2, 3]) + bytes(5) + (5).to_bytes(8, "little") + (1 << 40).to_bytes(8, "little")
    frame = encode("ids", {"a": small, "b": wide})
    assert frame == by_hand(body, arrays=arrays)
    message = decode(frame)
    assert message.fields().array("a").tolist() == [1, 2, 3] and message.fields().array("b").tolist() == [5, 1 << 40]


def test_a_message_names_its_fields_by_kind_unless_told_and_keeps_arrays_out_of_its_repr():
    message = decode(encode("offer", {"x": "y", "ids": np.arange(3, dtype=np.uint16)}))
    assert message.fields().where == "offer" and message.fields("offer.requests[2]").where == "offer.requests[2]"
    assert "arrays" not in repr(message)


@pytest.mark.parametrize(
    "array", [np.zeros((2, 2), dtype=np.uint8), np.zeros(3, dtype=np.int32)], ids=["2-D", "signed"]
)
def test_only_flat_unsigned_arrays_are_sent(array):
    with pytest.raises(ProtocolError, match="arrays must be flat unsigned integers"):
        encode("ids", {"a": array})


def zeros_body(count: int) -> bytes:
    """A JSON object of exactly ``count + 5`` values: itself, ``kind`` and ``a`` (a key and a
    value each) and ``count`` zeros in ``a``."""
    return b'{"kind":"k","a":[' + b",".join([b"0"] * count) + b"]}"


def test_json_values_are_counted_exactly_and_the_limit_is_inclusive():
    assert MAX_JSON_VALUES == 1 << 16
    at_limit = (1 << 16) - 5
    for body, values in ((b'{"kind":"k"}', 3), (zeros_body(2), 7), (zeros_body(at_limit), 1 << 16)):
        assert json_values(body) == values
    assert decode(by_hand(zeros_body(at_limit))).fields().items("a", max_length=at_limit) == [0] * at_limit
    with pytest.raises(ProtocolError, match=f"may hold {(1 << 16) + 1} JSON values, more than the limit of 65536"):
        decode(by_hand(zeros_body(at_limit + 1)))
    assert decode(encode("k", {"a": [0] * at_limit})).kind == "k"
    with pytest.raises(ProtocolError, match="too large"):
        encode("k", {"a": [0] * (at_limit + 1)})


@pytest.mark.parametrize(
    ("what", "limit", "lengths"),
    [
        ("JSON", 1 << 20, lambda n: (n, 0, 0)),
        ("blob", 16 << 20, lambda n: (10, n, 0)),
        ("array", 64 << 20, lambda n: (10, 0, n)),
    ],
)
def test_each_length_in_a_header_may_reach_its_limit_and_not_pass_it(what, limit, lengths):
    assert parse_header(WIRE_HEADER.pack(b"KVHM", 2, *lengths(limit), 0)) == (*lengths(limit), 0)
    with pytest.raises(ProtocolError, match=f"{what} length {limit + 1} exceeds the limit of {limit} bytes"):
        parse_header(WIRE_HEADER.pack(b"KVHM", 2, *lengths(limit + 1), 0))


def test_the_sender_keeps_to_the_same_limits():
    body = b'{"kind":"k","p":""}'
    fits = "x" * ((1 << 20) - len(body))
    assert len(encode("k", {"p": fits})) == HEADER_BYTES + (1 << 20)
    with pytest.raises(ProtocolError, match=f"too large: {(1 << 20) + 1} JSON bytes"):
        encode("k", {"p": fits + "x"})
    assert len(encode("k", {}, bytes(16 << 20))) == HEADER_BYTES + len(b'{"kind":"k"}') + (16 << 20)
    with pytest.raises(ProtocolError, match=f"{(16 << 20) + 1} blob bytes"):
        encode("k", {}, bytes((16 << 20) + 1))
    assert decode(encode("k", {"a": np.zeros(64 << 20, dtype=np.uint8)})).fields().array("a").size == 64 << 20
    with pytest.raises(ProtocolError, match=f"{(64 << 20) + 1} array bytes"):
        encode("k", {"a": np.zeros((64 << 20) + 1, dtype=np.uint8)})


@pytest.mark.timeout(20)
def test_a_limit_on_the_frame_counts_json_blob_and_arrays_together():
    frame = encode("k", {"a": np.arange(4, dtype=np.uint8)}, b"blob")
    size = len(frame) - HEADER_BYTES
    for limit, fits in ((size, True), (size - 1, False)):
        left, right = socket.socketpair()
        with left, right:
            right.sendall(frame)
            if fits:
                assert receive(left, timeout=5, limit=limit).blob == b"blob"
            else:
                with pytest.raises(ProtocolError, match=f"frame of {size} bytes exceeds the limit of {limit} bytes"):
                    receive(left, timeout=5, limit=limit)


@pytest.mark.timeout(20)
def test_a_peer_that_closes_mid_frame_is_named_at_once_not_at_the_deadline():
    left, right = socket.socketpair()
    with left:
        right.sendall(FRAME[: HEADER_BYTES + 5])
        right.close()
        started = time.monotonic()
        with pytest.raises(ProtocolError, match="truncated message: connection closed after 5 of"):
            receive(left, timeout=10)
        assert time.monotonic() - started < 5


@pytest.mark.timeout(20)
def test_a_send_to_a_peer_that_does_not_read_or_is_gone_is_a_protocol_error_in_time():
    left, right = socket.socketpair()
    with left, right:
        left.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
        started = time.monotonic()
        with pytest.raises(ProtocolError, match=r"could not send 'k' within 0.3 s: the peer does not read"):
            send(left, "k", {}, bytes(8 << 20), timeout=0.3)
        assert time.monotonic() - started < 5
    left, right = socket.socketpair()
    with left:
        right.close()
        with pytest.raises(ProtocolError, match="could not send 'k': "):
            send(left, "k", {}, bytes(1 << 20), timeout=5)


def test_integers_reach_the_top_of_u64_and_seconds_start_at_zero():
    from kvhost.nixl.errors import InvalidTimeoutError
    from kvhost.nixl.fields import check_int, check_seconds

    top = (1 << 64) - 1
    assert check_int(top, "n") == top
    with pytest.raises(ProtocolError, match=rf"n: expected an integer in \[0, {top}\], got {1 << 64}"):
        check_int(1 << 64, "n")
    assert Fields({"n": top}, "offer").integer("n") == top and Fields({"n": 0}, "offer").integer("n") == 0
    with pytest.raises(ProtocolError, match=rf"offer.n: expected an integer in \[0, {top}\], got -1"):
        Fields({"n": -1}, "offer").integer("n")
    assert check_seconds(0, "wait") == 0.0 and check_seconds(7 * 24 * 3600, "wait") == 7 * 24 * 3600
    for bad in (-1e-9, 7 * 24 * 3600 + 1):
        with pytest.raises(InvalidTimeoutError, match=r"wait: expected a number of seconds in \[0, 604800\]"):
            check_seconds(bad, "wait")
    with pytest.raises(InvalidTimeoutError, match=r"wait: expected a number of seconds in \(0, 604800\]"):
        check_seconds(0, "wait", positive=True)


def test_field_defaults_are_their_documented_bounds():
    """Each getter's default bound, at its edge: texts of 256 characters, lists of 65,536
    items, arrays of unsigned values from 0; ``seconds`` falls back to its default only when
    the field is absent."""
    from kvhost.nixl.fields import check_int, check_text

    fields = Fields({"t": "x" * 256, "long": "x" * 257, "l": [0] * (1 << 16), "over": [0] * ((1 << 16) + 1)}, "m")
    assert fields.text("t") == "x" * 256 and check_text("x" * 256, "t") == "x" * 256
    with pytest.raises(ProtocolError, match=r"m\.long: expected a string of 1 to 256 characters"):
        fields.text("long")
    with pytest.raises(ProtocolError, match="t: expected a string of 1 to 256 characters"):
        check_text("x" * 257, "t")
    assert len(fields.items("l")) == 1 << 16
    with pytest.raises(ProtocolError, match=r"m\.over: expected a list of at most 65536 items"):
        fields.items("over")
    texts = Fields({"ok": ["a"] * (1 << 16), "many": ["a"] * ((1 << 16) + 1), "wide": ["x" * 257]}, "m")
    assert len(texts.texts("ok")) == 1 << 16
    with pytest.raises(ProtocolError, match=r"m\.many: expected a list of at most 65536 items"):
        texts.texts("many")
    with pytest.raises(ProtocolError, match=r"m.wide\[0\]: expected a string of 1 to 256 characters"):
        texts.texts("wide")
    with pytest.raises(ProtocolError, match=r"n: expected an integer in \[0, "):
        check_int(-1, "n")
    timing = Fields({"given": 2.5}, "m")
    assert timing.seconds("given") == 2.5 and timing.seconds("given", default=9) == 2.5
    assert timing.seconds("absent", default=9) == 9.0
    with pytest.raises(ProtocolError, match=r"m\.absent: missing"):
        timing.seconds("absent")


def test_arrays_in_process_and_on_the_wire_are_checked_alike_and_read_only():
    from kvhost.nixl.fields import check_array

    flat = np.array([0, 7, 3], dtype=np.uint16)
    got = check_array(flat, "a", b"")
    assert got.tolist() == [0, 7, 3] and not got.flags.writeable and np.shares_memory(got, flat)
    for bad in (np.zeros((2, 2), dtype=np.uint8), np.zeros(3, dtype=np.int64), np.zeros(3, dtype=np.float32)):
        with pytest.raises(ProtocolError, match="a: expected a flat unsigned integer array"):
            check_array(bad, "a", b"")
    with pytest.raises(ProtocolError, match="a: 5 values, more than the limit of 4"):
        check_array(np.zeros(5, dtype=np.uint8), "a", b"", max_length=4)
    with pytest.raises(ProtocolError, match=r"a\[1\]: expected an integer in \[0, 6\], got 7"):
        check_array(np.array([0, 7, 7, 3], dtype=np.uint8), "a", b"", maximum=6)  # the first one named
    with pytest.raises(ProtocolError, match=r"a\[0\]: expected an integer in \[1, "):
        check_array(np.array([0, 2, 0], dtype=np.uint8), "a", b"", minimum=1)
    wire = check_array({"array": "u1", "offset": 0, "count": 3}, "a", bytes([0, 5, 9]))
    assert wire.tolist() == [0, 5, 9] and not wire.flags.writeable
    with pytest.raises(ProtocolError, match=r"a.array: \['u1'\] is not one of"):
        check_array({"array": ["u1"], "offset": 0, "count": 0}, "a", b"")


def test_values_in_messages_are_cut_to_60_characters():
    from kvhost.nixl.fields import show

    assert show("x" * 58) == repr("x" * 58)  # 60 characters with its quotes: whole
    assert show("x" * 59) == repr("x" * 59)[:57] + "..."
    assert len(show(list(range(100)))) == 60
    assert show(float("nan")) == "nan" and show(float("-inf")) == "-inf" and show(1.5) == "1.5"
    assert show(np.float64("nan")) == "nan" and show(np.float64("inf")) == "inf"  # not np.float64(nan)


@pytest.mark.timeout(20)
def test_a_connection_reset_mid_frame_is_named():
    """The peer resets the connection (TCP RST: SO_LINGER 0) after part of a frame."""
    with socket.create_server(("127.0.0.1", 0)) as listener:
        peer = socket.create_connection(listener.getsockname())
        conn, _ = listener.accept()
        with conn:
            peer.sendall(FRAME[: HEADER_BYTES + 5])
            peer.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            peer.close()
            time.sleep(0.2)
            with pytest.raises(ProtocolError, match="connection failed while reading the JSON body"):
                receive(conn, timeout=5)
