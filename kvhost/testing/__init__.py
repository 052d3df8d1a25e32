"""The conformance oracle and test helpers, for kvhost's suite, backends, plugins and connectors.

- ``oracle``: truth in logical axes, the wire bytes a sender writes (written from the wire
  model in docs/design.md, not from kvhost's planner), and ``ReceiveCase``, which checks a
  post-process against both; ``CopyCase``, which checks a copy against both sides as they
  were before it.
- ``connectors``: what a NIXL read leaves behind between two real caches (``nixl_read``)
  and a token-for-token comparison (``assert_same_tokens``), to test a connector without a
  network.
"""

from kvhost.testing.connectors import assert_same_tokens, nixl_read
from kvhost.testing.oracle import (
    CopyCase,
    ReceiveCase,
    Wired,
    block_letters,
    fill_random,
    make_cache,
    raw,
    read_tokens,
    set_raw,
    wire_stream,
    write_wire,
)

__all__ = [
    "CopyCase",
    "ReceiveCase",
    "Wired",
    "assert_same_tokens",
    "block_letters",
    "fill_random",
    "make_cache",
    "nixl_read",
    "raw",
    "read_tokens",
    "set_raw",
    "wire_stream",
    "write_wire",
]
