"""The requests a prefill engine offers, as they travel, and the bounds on a peer not yet proven.

A prefill engine's offer (``kvhost.nixl.peers``) names the requests whose blocks it holds
for a decode engine as columns: names in JSON; numbers, token counts and the block ids of
all of them back to back as arrays (``request_columns``). ``parse_requests`` reads them
back with every field checked: at most ``MAX_REQUESTS`` requests of at most
``MAX_TOKENS`` tokens each, and as many block ids as their tokens fill blocks.

The small frames of the handshake are bounded by ``AUTH_FRAME_BYTES``: a connection's
knock before it has proved the shared secret, prefill's challenge as decode reads it, and
what a held peer sends (beats, done). A connection has ``AUTH_SECONDS`` to prove the
secret (``kvhost.nixl.server``); it is dropped otherwise.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvhost.errors import ArgumentError
from kvhost.ids import checked_ids, integer_value
from kvhost.nixl.errors import ProtocolError
from kvhost.nixl.fields import MAX_ARRAY_BYTES, Fields, check_text
from kvhost.nixl.tables import RegionTable

MAX_REQUESTS = 1 << 14  # requests one offer may name
MAX_NUMBER = 1 << 31  # a request's number
MAX_TOKENS = 1 << 24  # tokens of one request
# A frame before the secret is proved (decode's engine message aside) or from a held peer
# may be this many bytes; a connection has this many seconds to prove the secret.
AUTH_FRAME_BYTES = 1024
AUTH_SECONDS = 5.0


@dataclass(frozen=True)
class RemoteRequest:
    """A request whose blocks the peer holds: ``remote_ids`` are blocks of the peer's table."""

    name: str
    number: int
    tokens: int
    remote_ids: Sequence[int] | np.ndarray


def request_columns(requests: Sequence[RemoteRequest], table: RegionTable, block_size: int) -> dict[str, Any]:
    """Requests whose blocks ``table`` holds, as columns: names (JSON); numbers, token counts
    and the block ids of all of them back to back (arrays); ``block_size``: the engine's.

    Each request is checked here as ``parse_requests`` checks it on arrival, and nothing is
    coerced (a float of tokens, or of a block id, is not cut to an integer): a mistake is
    the application's, named here, not a refusal by the peer after the offer went out.
    """
    if len(requests) > MAX_REQUESTS:
        raise ArgumentError(f"an offer names at most {MAX_REQUESTS} requests, got {len(requests)}")
    id_type = np.uint32 if table.num_blocks <= 1 << 32 else np.uint64
    names: set[str] = set()
    block_ids = []
    for index, request in enumerate(requests):
        name = check_text(request.name, f"requests[{index}].name", max_length=64)
        if name in names:
            raise ArgumentError(f"requests[{index}]: {name!r} is offered twice")
        names.add(name)
        checked = {}  # their own values (``integer_value``)
        for what, value, least, most in (
            ("number", request.number, 0, MAX_NUMBER),
            ("tokens", request.tokens, 1, MAX_TOKENS),
        ):
            number = integer_value(value)
            if number is None or not least <= number <= most:
                raise ArgumentError(
                    f"request {name!r}: {what} must be an integer in [{least}, {most}], got {value!r:.40}"
                )
            checked[what] = number
        ids = checked_ids(request.remote_ids, f"request {name!r}: remote_ids", table.num_blocks)
        needed = -(-checked["tokens"] // block_size)
        if ids.size != needed:
            raise ArgumentError(
                f"request {name!r}: {ids.size} block ids, but {request.tokens} tokens fill {needed} blocks of "
                f"{block_size}"
            )
        block_ids.append(ids.astype(id_type))
    return {
        "name": [r.name for r in requests],
        "number": np.array([r.number for r in requests], dtype=np.uint32),
        "tokens": np.array([r.tokens for r in requests], dtype=np.uint32),
        "block_ids": np.concatenate(block_ids) if block_ids else np.zeros(0, dtype=id_type),
    }


def _check_distinct(ids: np.ndarray, starts: list[int], ends: list[int], names: list[str], where: str) -> None:
    """Refuse a request that names one remote block twice (its tokens at two places): the
    reader would refuse it too, after the offer was taken. One request at a time, in the
    ids' own (narrow) type: the extra memory is a few bytes per id of the largest request."""
    for name, start, end in zip(names, starts, ends):
        if end - start > 1:
            ordered = np.sort(ids[start:end])
            repeated = ordered[1:] == ordered[:-1]  # a byte an id: not an index of every repeat
            if repeated.any():
                first = int(ordered[int(np.argmax(repeated))])
                raise ProtocolError(f"{where}.block_ids: request {name!r} names block {first} twice")


def parse_requests(columns: Fields, block_size: int, num_blocks: int) -> list[RemoteRequest]:
    """Requests sent as ``request_columns``, every field checked: each request's block ids (a
    view of the frame's bytes) must be as many as its tokens fill blocks of ``block_size``,
    each below ``num_blocks``. Names are distinct."""
    where = columns.where
    names = columns.texts("name", max_items=MAX_REQUESTS, max_length=64, distinct=True)
    numbers = columns.array("number", maximum=MAX_NUMBER, max_length=MAX_REQUESTS)
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
    stops = ends.tolist()
    starts = [0, *stops[:-1]]
    _check_distinct(ids, starts, stops, names, where)
    return [
        RemoteRequest(name, number, count, ids[start:end])
        for name, number, count, start, end in zip(names, numbers.tolist(), tokens.tolist(), starts, stops)
    ]
