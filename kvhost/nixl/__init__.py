"""NIXL for KV blocks: block tables, transfer plans, agents, and the handshake between peers.

A connector registers its layer dict with an ``Agent`` and gets a ``RegionTable``: where
every block region of every layer lives, and the letters of its layout. Two engines swap
tables and agent metadata (``peers`` and ``server``, over ``framing``'s checksummed frames);
``plan_transfer(local, remote)`` then turns a request's block ids on both sides into NIXL
descriptors so that the bytes land as the wire model (docs/design.md) says, and
``kvhost.receive`` rearranges them in place.

    tables.py     RegionTable, region_table: where a layer dict's regions live
    plans.py      TransferPlan, plan_transfer: two tables paired, descriptor rows per request, merged
    agent.py      Agent, Reader, Transfer: NIXL itself, imported on first use (load_nixl)
    hugepages.py  huge pages under registered host memory (a same-host peer reads it at memcpy speed)
    engine.py     EngineSpec: what an engine holds; refusal: can two engines work together
    ranks.py      tensor parallelism either way: head_shares, plan_ranks (RankPlan), RankReader
    peers.py      engines on different hosts: the secret proved both ways, offers, beats (connect)
    server.py     the prefill side: Server serves many decode engines, lets go when one goes away
    handshake.py  RemoteRequest: the requests an offer names, as columns; the bounds on unproven peers
    framing.py    the framed, checksummed control messages (encode, decode, send, receive)
    fields.py     strict checks of what a peer sends (Fields) and of every timeout
    errors.py     NixlUnavailableError, TransferError, ProtocolError (PeerClosedError, HoldLostError),
                  InvalidTimeoutError

Importing this package imports no NIXL: ``Agent`` loads it when one is made.
"""

from kvhost.nixl.agent import NIXL_MODULES, Agent, Reader, Transfer, load_nixl, merge_domains
from kvhost.nixl.engine import EngineSpec, IncompatibleEngineError, refusal
from kvhost.nixl.errors import (
    HoldLostError,
    InvalidTimeoutError,
    NixlUnavailableError,
    PeerClosedError,
    ProtocolError,
    TransferError,
)
from kvhost.nixl.fields import MAX_WAIT_SECONDS, Fields, check_seconds
from kvhost.nixl.framing import Message, decode, encode, receive, send
from kvhost.nixl.handshake import RemoteRequest
from kvhost.nixl.hugepages import HugePages, back_host_tensors_with_huge_pages, back_with_huge_pages
from kvhost.nixl.peers import Offer, Session, connect
from kvhost.nixl.plans import MAX_DESCRIPTOR_BYTES, TransferPlan, extent_rows, merge_rows, plan_transfer, stream_extents
from kvhost.nixl.ranks import HeadShare, RankPlan, RankReader, head_shares, latent_source, plan_ranks
from kvhost.nixl.server import PeerHello, PeerRecord, Server
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
    "MAX_DESCRIPTOR_BYTES",
    "MAX_STREAMS",
    "MAX_WAIT_SECONDS",
    "MEMORY_OF_DEVICE",
    "NIXL_MODULES",
    "Agent",
    "EngineSpec",
    "Fields",
    "HeadShare",
    "HoldLostError",
    "HugePages",
    "IncompatibleEngineError",
    "InvalidTimeoutError",
    "Message",
    "NixlUnavailableError",
    "Offer",
    "PeerClosedError",
    "PeerHello",
    "PeerRecord",
    "ProtocolError",
    "RankPlan",
    "RankReader",
    "Reader",
    "RegionTable",
    "RemoteRequest",
    "Server",
    "Session",
    "Stream",
    "Transfer",
    "TransferError",
    "TransferPlan",
    "back_host_tensors_with_huge_pages",
    "back_with_huge_pages",
    "check_seconds",
    "connect",
    "decode",
    "encode",
    "extent_rows",
    "head_shares",
    "latent_source",
    "load_nixl",
    "memory_spans",
    "merge_domains",
    "merge_rows",
    "plan_ranks",
    "plan_transfer",
    "receive",
    "refusal",
    "region_table",
    "send",
    "stream_extents",
]
