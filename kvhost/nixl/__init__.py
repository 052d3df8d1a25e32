"""NIXL for KV blocks: block tables, transfer plans, agents, and the handshake between peers.

A connector registers its layer dict with an ``Agent`` and gets a ``RegionTable``: where
every block region of every layer lives, and the letters of its layout. Two engines swap
tables and agent metadata (``handshake``, over ``framing``'s checksummed frames);
``plan_transfer(local, remote)`` then turns a request's block ids on both sides into NIXL
descriptors so that the bytes land as the wire model (docs/design.md) says, and
``kvhost.receive`` rearranges them in place.

    tables.py     RegionTable, region_table: where a layer dict's regions live
    plans.py      TransferPlan, plan_transfer: two tables paired, descriptor rows per request
    agent.py      Agent, Reader, Transfer: NIXL itself, imported on first use (load_nixl)
    handshake.py  auth, hello and done between two engines; accept_hello on a listening socket
    framing.py    the framed, checksummed control messages (encode, decode, send, receive)
    fields.py     strict checks of what a peer sends (Fields) and of every timeout
    errors.py     NixlUnavailableError, TransferError, ProtocolError, InvalidTimeoutError

Importing this package imports no NIXL: ``Agent`` loads it when one is made.
"""

from kvhost.nixl.agent import NIXL_MODULES, Agent, Reader, Transfer, load_nixl
from kvhost.nixl.errors import InvalidTimeoutError, NixlUnavailableError, ProtocolError, TransferError
from kvhost.nixl.fields import MAX_WAIT_SECONDS, Fields, check_seconds
from kvhost.nixl.framing import Message, decode, encode, receive, send
from kvhost.nixl.handshake import Hello, RemoteRequest, accept_hello, parse_hello, prove, send_hello
from kvhost.nixl.plans import TransferPlan, extent_rows, plan_transfer
from kvhost.nixl.tables import (
    COORD_LETTERS,
    MAX_STREAMS,
    MEMORY_OF_DEVICE,
    RegionTable,
    Stream,
    memory_spans,
    region_table,
)

__all__ = [
    "COORD_LETTERS",
    "MAX_STREAMS",
    "MAX_WAIT_SECONDS",
    "MEMORY_OF_DEVICE",
    "NIXL_MODULES",
    "Agent",
    "Fields",
    "Hello",
    "InvalidTimeoutError",
    "Message",
    "NixlUnavailableError",
    "ProtocolError",
    "Reader",
    "RegionTable",
    "RemoteRequest",
    "Stream",
    "Transfer",
    "TransferError",
    "TransferPlan",
    "accept_hello",
    "check_seconds",
    "decode",
    "encode",
    "extent_rows",
    "load_nixl",
    "memory_spans",
    "parse_hello",
    "plan_transfer",
    "prove",
    "receive",
    "region_table",
    "send",
    "send_hello",
]
