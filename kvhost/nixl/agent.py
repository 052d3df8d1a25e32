"""Agents: a NIXL agent, the memory it registers, and the transfers it posts towards a peer.

An ``Agent`` is what one engine holds for its lifetime: ``register`` pins a layer dict and
returns its ``RegionTable``, ``metadata`` is what a peer needs to reach it, and ``reader``
prepares a ``TransferPlan`` towards one peer; each ``Reader.read`` (or ``write``) posts
one ``Transfer``, which is polled or waited on with a deadline.

NIXL is imported on first use (``load_nixl``), never with kvhost: the ``nixl`` meta
package when installed, else ``nixl_cu13`` or ``nixl_cu12``.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import importlib
import threading
import time
import weakref
from bisect import bisect_left, insort
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from functools import cache, partial
from types import ModuleType
from typing import Any

import numpy as np

from kvhost.caches import CacheSet, Layer
from kvhost.errors import ArgumentError, LayoutError
from kvhost.ids import Ids
from kvhost.nixl.errors import InvalidTimeoutError, NixlUnavailableError, ProtocolError, TransferError
from kvhost.nixl.fields import check_flag, check_seconds, check_text, show
from kvhost.nixl.hugepages import HugePages, back_host_tensors_with_huge_pages
from kvhost.nixl.plans import MAX_DESCRIPTOR_BYTES, TransferPlan, extent_rows, stream_extents
from kvhost.nixl.tables import RegionTable, as_cache_set, memory_spans, region_table
from kvhost.nixl.ucx import give_ucx_defaults

# The ``nixl`` meta package forwards ``nixl._api`` to whichever CUDA build is installed.
NIXL_MODULES = ("nixl._api", "nixl_cu13._api", "nixl_cu12._api")
# UCX worker threads an Agent asks NIXL for (num_threads): vLLM 0.33's default, which also
# keeps the NIC resources each thread takes (UARs on Mellanox NICs) few.
DEFAULT_THREADS = 4
MAX_THREADS = 64
CLOSE_WAIT_SECONDS = 30.0  # what close waits for posts under way on other threads
# A peer names its own agent: the name must be text that names only it. NIXL reads this
# one as the local agent where a transfer's side is named (prep_xfer_dlist), and a name
# reaches every message about the peer, so its length is bounded (a FQDN and more).
NIXL_LOCAL_AGENT = "NIXL_INIT_AGENT"
MAX_PEER_NAME = 1024
PEER_GONE = "NIXL_ERR_REMOTE_DISCONNECT"  # what NIXL raises for a transfer whose peer went away
MAX_REFUSED_PROBES = 64  # NIXL calls merge_domains may see refused (each logs an error line)

# Agents with a transfer posted and neither over nor released, held here whatever their callers drop:
# NIXL's "cancel" does not stop a read under way (see ``Transfer.release``), so freeing such
# an agent (its registered memory, its keys to the peer) would leave the read writing into
# freed memory. At exit they are never freed (the OS takes back the memory, not UCX's
# teardown, which corrupted the heap here when it ran under such a read).
_HOLDING: dict[int, Agent] = {}  # by id
# By the id of each agent held: its transfers posted and not yet over (neither landed nor
# failed) nor released, so that a transfer's end settles its agent without a look at the
# others it posted (those landed and never released made every later landing cost as
# many). Kept here, not on the agent, like ``_HOLDING``: which agents may be written into
# is the module's to know.
_WRITING: dict[int, set[Transfer]] = {}
_holding_lock = threading.RLock()
_exiting = False


def _hold(agent: Agent, transfer: Transfer) -> None:
    """``transfer`` is about to be posted: it, and its agent with it, are kept until it is
    over or released."""
    with _holding_lock:
        agent.posted.add(transfer)
        if id(agent) not in _HOLDING and _exiting:  # posted on a thread still running at exit
            keep_past_exit(agent)
        _HOLDING[id(agent)] = agent
        _WRITING.setdefault(id(agent), set()).add(transfer)


def _let_go(agent: Agent, transfer: Transfer) -> None:
    with _holding_lock:
        agent.posted.discard(transfer)
        if transfer in agent.uncancelled:
            agent.uncancelled.remove(transfer)
    _settle(agent, transfer)


def _settle(agent: Agent, transfer: Transfer) -> None:
    """``transfer`` is over (landed, failed) or released: let the module go of ``agent``
    once no transfer it posted may still write (one landed and never released holds
    nothing: its agent may be freed, and NIXL frees its handle)."""
    with _holding_lock:
        writing = _WRITING.get(id(agent))
        if writing is not None:
            writing.discard(transfer)
        if not writing:
            _HOLDING.pop(id(agent), None)
            _WRITING.pop(id(agent), None)


def _in_flight(posted: Iterable[Transfer]) -> list[Transfer]:
    """Those of ``posted`` that are neither landed nor failed."""
    with _holding_lock:
        return [transfer for transfer in posted if transfer.finished is None and not transfer.failed]


@atexit.register
def _keep_agents_holding_transfers_past_exit() -> None:
    global _exiting
    with _holding_lock:
        _exiting = True
        for agent in _HOLDING.values():
            keep_past_exit(agent)


def check_peer_name(peer: object) -> None:
    if type(peer) is not str:
        raise ArgumentError(f"a peer is named by the text add_peer returned, got {show(peer)}")


def keep_past_exit(owner: object) -> None:
    """Never free ``owner`` (nor what it holds: a NIXL agent, registered memory), however
    its references go, the interpreter's exit included: where a transfer may still write
    into its memory, the OS taking the memory back at exit is the only safe end."""
    ctypes.pythonapi.Py_IncRef(ctypes.py_object(owner))


def _peer_name(loaded: object) -> str:
    """The agent name NIXL read from a peer's metadata (bytes, or str in some bindings), as
    text that names only that peer; a ProtocolError where it is not."""
    try:
        name = loaded.decode() if isinstance(loaded, bytes) else loaded
    except UnicodeDecodeError:
        raise ProtocolError(f"peer agent name {show(loaded)} is not UTF-8 text") from None
    name = check_text(name, "peer agent name", max_length=MAX_PEER_NAME)
    if name == NIXL_LOCAL_AGENT:
        raise ProtocolError(f"peer agent name {name!r} is NIXL's name for the local agent")
    return name


# NIXL 1.x metadata begins with this, the name's length (8 bytes, little-endian), the name, "|".
_METADATA_HEAD = b"nixlSerDes|Agent"


def _metadata_name(metadata: bytes) -> str | None:
    """The agent name a peer's metadata carries, read without NIXL where it is laid out as
    NIXL 1.x lays it out; None where it is not (NIXL then names the peer when it loads it)."""
    if not metadata.startswith(_METADATA_HEAD):
        return None
    start = len(_METADATA_HEAD) + 8
    length = int.from_bytes(metadata[len(_METADATA_HEAD) : start], "little")
    if length > 4 * MAX_PEER_NAME or metadata[start + length : start + length + 1] != b"|":
        return None
    try:
        return metadata[start : start + length].decode()
    except UnicodeDecodeError:
        return None


@cache
def load_nixl() -> ModuleType:
    """The NIXL Python API module (``nixl_agent``, ``nixl_agent_config``)."""
    reasons = []
    for name in NIXL_MODULES:
        try:
            return importlib.import_module(name)
        except ImportError as err:
            reasons.append(f"{name}: {err}")
    raise NixlUnavailableError(
        f"NIXL is not installed ({'; '.join(reasons)}); install it with pip install 'kvhost[nixl]'"
    )


class Agent:
    """A NIXL agent and the caches it exposes: what one engine holds for its lifetime.

    ``register`` pins a layer dict (tensors are kept alive until ``close``) and returns its
    table; ``metadata()`` is what the peer needs to reach it; ``reader`` reads or writes
    the requests of a plan towards one peer.

    ``progress_thread``: NIXL's progress thread drives the transport in the background. It
    polls without pause (about half a core when idle, measured on a 2-core machine); an
    agent that polls its transfers itself (``Transfer.poll``, ``get_new_notifs``) may go
    without it.

    ``threads``: UCX's worker threads (NIXL's ``num_threads``; 0: one worker, driven by the
    caller). A transfer of many descriptors is split between them, so its copies run on
    that many cores: on one machine a batch read as one transfer went from 0.39-0.43 to
    0.60-0.63 of memcpy with 2 or 4 threads on 2 cores, while transfers of a request's
    few dozen descriptors stayed as they were (``kvhost bench --transfer``). Idle, the
    threads used no CPU. The default is vLLM 0.33's for its NIXL connector.

    An agent gives UCX the settings of ``kvhost.nixl.ucx.ucx_defaults()`` that the
    environment does not name (``os.environ``) before it starts NIXL: set one before to keep
    UCX's own choice.
    """

    def __init__(
        self,
        name: str,
        *,
        backends: Sequence[str] = ("UCX",),
        progress_thread: bool = True,
        threads: int = DEFAULT_THREADS,
    ) -> None:
        if isinstance(threads, bool) or not isinstance(threads, int) or not 0 <= threads <= MAX_THREADS:
            raise ArgumentError(f"threads {threads!r} must be an integer from 0 to {MAX_THREADS}")
        check_flag(progress_thread, "progress_thread")
        if not isinstance(name, str) or not name:
            raise ArgumentError(f"an agent's name must be a non-empty str, got {show(name)}")
        if not isinstance(backends, (list, tuple)) or not all(isinstance(b, str) for b in backends):
            raise ArgumentError(f"backends must be a list of NIXL backend names, as ['UCX'], got {show(backends)}")
        module = load_nixl()
        give_ucx_defaults()
        try:
            config = module.nixl_agent_config(
                enable_prog_thread=progress_thread, backends=list(backends), num_threads=threads
            )
            self._nixl: Any = module.nixl_agent(name, config)
        except Exception as err:  # NIXL raises its own exception types from C++
            raise NixlUnavailableError(f"could not start NIXL agent {name!r}: {type(err).__name__}: {err}") from None
        missing = [b for b in backends if b not in self._nixl.backends]
        if missing:
            plugins = ", ".join(self._nixl.get_plugin_list())
            raise NixlUnavailableError(f"NIXL backend(s) {missing} unavailable (plugins: {plugins})")
        self.name = name
        self._registered: list[tuple[Any, CacheSet]] = []
        # The (start, end) of every span registered, sorted, by NIXL memory type and device:
        # none overlaps another (``_check_unregistered``).
        self._registered_spans: dict[tuple[str, int], list[tuple[int, int]]] = {}
        self._peers: dict[str, bytes] = {}  # each peer's metadata as last loaded
        # Its readers while anyone holds them, to close them with it: a long-lived agent
        # that makes a reader per peer or plan keeps none it was given back.
        self._readers: weakref.WeakSet[Reader] = weakref.WeakSet()
        # Posted and not yet released (``_hold``, ``_let_go``): while one may still write, the
        # module keeps the agent and its memory (``_HOLDING``); while there is one, close lets
        # go of nothing.
        self.posted: set[Transfer] = set()
        self.uncancelled: list[Transfer] = []  # asked to release while in flight: they may still write
        self.huge_pages = HugePages()  # what asking for huge pages did, over every registration
        self.closed = False
        # Closing against everything else: registering, peers, readers, and posts (counted in
        # ``_posts``; close waits for them), so that a thread's read never meets memory that
        # another thread's close has deregistered, nor posts a transfer close cannot know of.
        # Registering and loading a peer hold it for their whole NIXL call (a peer's metadata
        # took 40-100 ms to load here): NIXL's agent, made without a listener thread, takes
        # no two calls at once (its sync mode NONE), so a post waits for them.
        self._lock = threading.Condition(threading.RLock())
        self._posts = 0
        self._posts_to: dict[str, int] = {}  # the same, by peer: remove_peer waits for none

    @property
    def nixl(self) -> Any:
        """The NIXL agent itself (``nixl_agent``): what ``Reader`` and ``Transfer`` drive, and
        what a connector uses for what this class does not wrap (notifications)."""
        return self._nixl

    def register(
        self, caches: Mapping[str, Layer] | CacheSet, axes: str | None = None, *, huge_pages: bool = True
    ) -> RegionTable:
        """Register every tensor of a layer dict with NIXL; returns its table.

        ``huge_pages``: ask the kernel to back host memory (not pinned for a device) with
        transparent huge pages first, which lets a peer on the same machine read it near
        memcpy speed (see ``kvhost.nixl.hugepages``); what the kernel did adds to
        ``self.huge_pages``. Advice only: it never fails a registration.

        Memory that overlaps memory this agent registered before (the same caches again
        among it) is refused, an ArgumentError naming the layer, before NIXL is asked.
        """
        check_flag(huge_pages, "huge_pages")
        cache_set = as_cache_set(caches, axes)
        table = region_table(cache_set)
        tensors = [m.tensor for m in cache_set.members]
        with self._lock:
            self._check_open()
            where = (table.memory, table.device_id)
            self._check_unregistered(cache_set, self._registered_spans.get(where, []))
            if huge_pages:
                self.huge_pages += back_host_tensors_with_huge_pages(tensors)
            spans = memory_spans(tensors)
            rows = [(start, length, table.device_id, "") for start, length in spans]
            try:
                descs = self._nixl.register_memory(rows, table.memory)
            except Exception as err:
                failed = f"agent {self.name!r}: registering {len(rows)} memory spans failed: {err}"
                raise TransferError(failed) from None
            # The set, not only its tensors: its members hold the storages, so memory a tensor
            # re-pointed (set_) lets go of stays ours while NIXL may still move bytes there.
            self._registered.append((descs, cache_set))
            registered = self._registered_spans.setdefault(where, [])
            for start, length in spans:
                insort(registered, (start, start + length))
        return table

    def _check_unregistered(self, cache_set: CacheSet, registered: list[tuple[int, int]]) -> None:
        """An ArgumentError, naming the layer, where a tensor of ``cache_set`` overlaps memory
        this agent registered before (``registered``: sorted, none overlapping another): NIXL
        would hold both registrations, its metadata grow with each, and a peer's NIXL refuse
        descriptors where they overlap (see ``add_peer``). Layers of one set may share memory."""
        for member in cache_set.members:
            for start, length in memory_spans([member.tensor]):
                before = bisect_left(registered, (start + length,)) - 1  # the last span to start before its end
                if before >= 0 and registered[before][1] > start:
                    first, end = registered[before]
                    raise ArgumentError(
                        f"agent {self.name!r}: {member.name} (bytes {start:#x} to {start + length:#x}) overlaps "
                        f"memory it registered before ({first:#x} to {end:#x}): register memory once"
                    )

    def check_memory(self) -> None:
        """Raise unless every registered tensor is still where, and what, it was when it was
        registered. NIXL moves bytes at the registered addresses: a tensor grown since
        (``resize_``, which frees its old memory) would have a peer write into whatever
        lies there now. Readers check before every read they post; a side whose memory
        peers read checks before it offers it (``metadata``)."""
        for _, cache_set in self._registered:
            try:
                cache_set.check_current()
            except LayoutError as err:
                raise LayoutError(f"agent {self.name!r}: registered memory changed: {err}") from None

    def metadata(self) -> bytes:
        """This agent's metadata (connection info and registered memory) for its peers."""
        with self._lock:
            self._check_open()
            self.check_memory()
            return bytes(self._nixl.get_agent_metadata())

    def add_peer(self, metadata: bytes) -> str:
        """Load a peer's metadata; returns its agent name. Bad metadata is a ProtocolError.

        Metadata of a peer already known replaces what was loaded before. NIXL itself adds
        the new registrations to the old ones, and where a region the peer has since
        deregistered overlaps one it registered after, NIXL finds neither: every descriptor
        there is refused. So a known peer is removed and loaded afresh; readers towards it
        made before must be made again. While a transfer towards it is posted and not
        released, new metadata is refused (TransferError) before NIXL loads any of it. The
        same metadata loaded again changes nothing.
        """
        if not isinstance(metadata, (bytes, bytearray, memoryview)):
            raise ProtocolError(f"peer agent metadata must be bytes, got {type(metadata).__name__}")
        metadata = bytes(metadata)
        with self._lock:
            self._check_open()
            named = _metadata_name(metadata)
            if named in self._peers and self._peers[named] != metadata:
                # Refused before NIXL loads anything, where it is refused at all: NIXL would
                # hold the new registrations merged with the old ones.
                self._check_unused(named)
            peer = self._load_peer(metadata)
            if self._peers.get(peer, metadata) != metadata:  # a name the metadata's layout did not give
                self.remove_peer(peer)
                peer = self._load_peer(metadata)
            self._peers[peer] = metadata
            return peer

    def _load_peer(self, metadata: bytes) -> str:
        try:
            loaded = self._nixl.add_remote_agent(metadata)
        except Exception as err:
            raise ProtocolError(f"peer agent metadata ({len(metadata)} bytes) rejected by NIXL: {err}") from None
        try:
            return _peer_name(loaded)
        except ProtocolError:
            with contextlib.suppress(Exception):  # NIXL has loaded it: let go of it under its own name
                self._nixl.remove_remote_agent(loaded)
            raise

    def remove_peer(self, peer: str) -> None:
        """Let go of a peer NIXL has loaded. Refused (TransferError) while a transfer towards
        it is being posted, or posted and not released: it uses the keys NIXL holds for the peer."""
        check_peer_name(peer)
        with self._lock:
            self._check_unused(peer)
            if peer in self._peers:
                del self._peers[peer]
                with contextlib.suppress(Exception):  # a peer that died may already be gone
                    self._nixl.remove_remote_agent(peer)

    def _check_unused(self, peer: str) -> None:
        owed = sum(transfer.link.peer == peer for transfer in list(self.posted)) + self._posts_to.get(peer, 0)
        if owed:
            raise TransferError(
                f"agent {self.name!r}: peer {peer!r} has {owed} transfer(s) posted and not released: "
                "it stays loaded until they are"
            )

    def reader(
        self, plan: TransferPlan, peer: str, *, max_descriptor_bytes: int | None = MAX_DESCRIPTOR_BYTES
    ) -> Reader:
        """A reader of ``plan`` towards ``peer``, to read (or write) requests; see ``Reader``
        for ``max_descriptor_bytes``."""
        with self._lock:
            self._check_open()
            if not isinstance(plan, TransferPlan):
                raise ArgumentError(f"plan must be a TransferPlan (plan_transfer's), got {show(plan)}")
            check_peer_name(peer)
            if peer not in self._peers:
                raise TransferError(f"agent {self.name!r} has no peer {peer!r}: add_peer its metadata first")
            reader = Reader(self, plan, peer, max_descriptor_bytes=max_descriptor_bytes)
            self._readers.add(reader)
            return reader

    def in_flight(self) -> list[Transfer]:
        """Its transfers posted and not yet over (neither landed nor failed): they may still
        write into its memory, and use the NIXL requests they were posted from."""
        return _in_flight(self.posted)

    @contextlib.contextmanager
    def posting(self, peer: str) -> Iterator[None]:
        """A post towards ``peer`` under way (``post_rows``): refused once the agent is
        closed, and waited for by ``close``, so that every transfer close must release is
        known to it by then; ``remove_peer`` refuses the peer meanwhile (the post uses its keys)."""
        check_peer_name(peer)
        counted = False
        try:
            with self._lock:
                self._check_open()
                self._posts += 1
                self._posts_to[peer] = self._posts_to.get(peer, 0) + 1
                counted = True  # no call between: an interrupt cannot land after the count and before this
            yield
        finally:
            if counted:
                with self._lock:
                    self._posts -= 1
                    self._posts_to[peer] -= 1
                    if not self._posts_to[peer]:
                        del self._posts_to[peer]
                    self._lock.notify_all()

    def close(self) -> None:
        """Close readers, drop peers, deregister memory (and let go of its tensors). Safe to
        call twice: the second finds nothing left to undo.

        Every transfer posted and not yet released is released first. One still in flight
        cannot be (``Transfer.release``): while one is left, nothing else is undone either
        (its peer's keys, the memory it writes into and its tensors stay, held by the module
        for as long as it may write) and a TransferError says so; a later ``close`` tries
        again, and goes on once every such transfer has landed or failed.

        Posts other threads have under way are waited for (each is a few NIXL calls), at
        most ``CLOSE_WAIT_SECONDS``; past that nothing is undone and a TransferError says so."""
        with self._lock:
            self.closed = True
            if not self._lock.wait_for(lambda: self._posts == 0, timeout=CLOSE_WAIT_SECONDS):
                raise TransferError(
                    f"agent {self.name!r}: {self._posts} post(s) still under way after {CLOSE_WAIT_SECONDS:g} s: "
                    "its memory stays registered",
                    timed_out=True,
                )
            self._close()

    def _close(self) -> None:
        for reader in list(self._readers):
            reader.close()
        for transfer in dict.fromkeys([*self.posted, *self.uncancelled]):
            with contextlib.suppress(TransferError):  # one left in flight is counted below
                transfer.release()
        if self.uncancelled:
            peers = sorted({t.link.peer for t in self.uncancelled})
            raise TransferError(
                f"agent {self.name!r}: {len(self.uncancelled)} transfer(s) from {peers} still in flight may write: "
                "its peers, memory and tensors stay until they land or fail (close again then)"
            )
        for peer in list(self._peers):
            self.remove_peer(peer)
        for descs, _ in self._registered:
            with contextlib.suppress(Exception):  # nothing more to undo if this fails
                self._nixl.deregister_memory(descs)
        # A peer's read under way is not stopped by deregistering: over TCP it went on
        # reading the tensors let go of next, and this process crashed. The NIXL agent (its
        # UCX worker, threads and connections) ends first; the peer's read then fails.
        with contextlib.suppress(AttributeError):  # ended by an earlier close
            del self._nixl.agent
        self._registered.clear()
        self._registered_spans.clear()

    def __enter__(self) -> Agent:
        return self

    def __exit__(self, kind: object, error: BaseException | None, trace: object) -> None:
        if error is None:
            self.close()
            return
        try:
            self.close()
        except TransferError as left:  # the body's error comes first; this one goes with it
            error.add_note(str(left))

    def _check_open(self) -> None:
        if self.closed:
            raise TransferError(f"agent {self.name!r} is closed")


class Reader:
    """One plan towards one peer; starts one transfer per call.

    Each transfer's descriptor lists are built for its request's blocks alone (NIXL
    ``initialize_xfer``), never for every block a table declares, so a peer's table that
    declares billions of blocks costs nothing until a request names them, and then only
    those. When the reader is made, both tables' extents (the first and last block of every
    stream) are checked against the memory NIXL knows to be registered: a peer's table that
    names memory its agent has not registered is refused here, not at its first read.

    Pieces that continue one another on both sides go as one descriptor of up to
    ``max_descriptor_bytes`` (``TransferPlan.merged_pairs``); None gives one descriptor per
    piece, as engines post them today. A merged descriptor must lie in one registered
    region on each side, so the reader asks NIXL once which memory one descriptor may span
    (``merge_domains``): each stream whole, and streams that meet (layers laid out block by
    block in one buffer) together where one region holds them all.
    """

    def __init__(
        self, agent: Agent, plan: TransferPlan, peer: str, *, max_descriptor_bytes: int | None = MAX_DESCRIPTOR_BYTES
    ) -> None:
        check_descriptor_bound(max_descriptor_bytes)
        if not isinstance(agent, Agent) or not isinstance(plan, TransferPlan):
            raise ArgumentError(
                f"a Reader takes an Agent and a TransferPlan (plan_transfer's), got "
                f"{type(agent).__name__} and {type(plan).__name__}"
            )
        check_peer_name(peer)
        self.agent = agent
        self.plan = plan
        self.peer = peer
        check_registered(agent, plan.local, None)
        check_registered(agent, plan.remote, peer)
        self.max_descriptor_bytes = max_descriptor_bytes
        self.local_domains = self.remote_domains = None
        if max_descriptor_bytes is not None:
            self.local_domains = merge_domains(agent.nixl, NIXL_LOCAL_AGENT, plan.local)
            self.remote_domains = merge_domains(agent.nixl, peer, plan.remote)
        self.closed = False

    def read(self, local_ids: Ids, remote_ids: Ids, *, notify: bytes = b"") -> Transfer:
        """Start pulling the peer's ``remote_ids`` into ``local_ids``; ``notify`` reaches the peer when done."""
        return self._start("READ", local_ids, remote_ids, notify)

    def write(self, local_ids: Ids, remote_ids: Ids, *, notify: bytes = b"") -> Transfer:
        """Start pushing ``local_ids`` to the peer's ``remote_ids`` (the same pairing, the other way)."""
        return self._start("WRITE", local_ids, remote_ids, notify)

    def read_batch(self, requests: Sequence[tuple[Ids, Ids]], *, notify: bytes = b"") -> Transfer:
        """Start pulling several requests (``(local_ids, remote_ids)`` each) as one transfer:
        one NIXL request, its descriptors worked out for the whole batch at once
        (``TransferPlan.merged_batch``); a step's requests from one peer go together."""
        self._check_open()
        self.agent.check_memory()
        return self._post("READ", self.batch_descriptors(requests), notify)

    def read_layers(self, requests: Sequence[tuple[Ids, Ids]], *, timeout: float) -> Iterator[str]:
        """Pull several requests layer by layer: yields each local layer's name (in the local
        table's order) once its bytes have landed, the next layer's transfer already posted,
        so that the caller can post-process the layer (``KVHost.receive(layers=[name])``)
        while the next one moves.

        One transfer is in flight at a time: with UCX worker threads, NIXL's post of a
        transfer waited here until the one in flight was done (the demo's 4 layers posted
        at once took 26-30 ms to post, one transfer 1.7 ms), so posting further ahead gains
        nothing. Descriptors as ``layer_descriptors``; the batch is checked whole, and
        ``timeout``, each layer's deadline in seconds, before the first is posted (when the
        first layer is asked for). The caller tells the peer once every layer has landed;
        leaving the loop early releases the transfer in flight (raising if it is still in flight).
        """
        seconds = check_seconds(timeout, "Reader.read_layers timeout")
        self._check_open()
        self.agent.check_memory()  # once: a layer's post must not wait for a look at every tensor
        layers = self.layer_descriptors(requests)
        return layer_by_layer(lambda name: [self._post("READ", layers[name], b"")], list(layers), seconds)

    def _start(self, op: str, local_ids: Ids, remote_ids: Ids, notify: bytes) -> Transfer:
        self._check_open()
        self.agent.check_memory()
        return self._post(op, self.descriptors(local_ids, remote_ids), notify)

    def _post(self, op: str, rows: tuple[np.ndarray, np.ndarray], notify: bytes) -> Transfer:
        memory = (self.plan.local.memory, self.plan.remote.memory)
        return post_rows(self.agent, self.peer, op, *rows, memory, notify=notify)

    def descriptors(self, local_ids: Ids, remote_ids: Ids) -> tuple[np.ndarray, np.ndarray]:
        """The (address, length, device id) rows a read of these blocks posts: local and remote."""
        if self.max_descriptor_bytes is None:
            return self.plan.descriptor_pairs(local_ids, remote_ids)
        return self.plan.merged_pairs(
            local_ids,
            remote_ids,
            max_bytes=self.max_descriptor_bytes,
            local_domains=self.local_domains,
            remote_domains=self.remote_domains,
        )

    def batch_descriptors(self, requests: Sequence[tuple[Ids, Ids]]) -> tuple[np.ndarray, np.ndarray]:
        """The rows one transfer of several requests posts: local and remote."""
        if self.max_descriptor_bytes is None:
            return self.plan.descriptor_batch(requests)
        return self.plan.merged_batch(
            requests,
            max_bytes=self.max_descriptor_bytes,
            local_domains=self.local_domains,
            remote_domains=self.remote_domains,
        )

    def layer_descriptors(self, requests: Sequence[tuple[Ids, Ids]]) -> dict[str, tuple[np.ndarray, np.ndarray]]:
        """The rows each layer's transfer of ``read_layers`` posts: local and remote, by layer.
        Without a bound, one per piece (a bound of one piece merges nothing)."""
        return self.plan.merged_layers(
            requests,
            max_bytes=self.max_descriptor_bytes or self.plan.chunk_bytes,
            local_domains=self.local_domains,
            remote_domains=self.remote_domains,
        )

    def close(self) -> None:
        self.closed = True
        self.agent._readers.discard(self)

    def _check_open(self) -> None:
        if self.closed:
            raise TransferError(f"reader towards {self.peer!r} is closed")


def check_descriptor_bound(max_descriptor_bytes: int | None) -> None:
    """A reader's bound on one merged descriptor: a positive int, or None (one per piece)."""
    if max_descriptor_bytes is None:
        return
    if isinstance(max_descriptor_bytes, bool) or not isinstance(max_descriptor_bytes, int) or max_descriptor_bytes < 1:
        raise TransferError(f"max_descriptor_bytes must be a positive integer or None, got {max_descriptor_bytes!r}")


class Probes:
    """The refused NIXL probes ``merge_domains`` calls may still make: one count shared by
    every call of a reader towards one owner, whose count of calls (one per part of a plan)
    a peer's block size sets."""

    def __init__(self, refusals: int = MAX_REFUSED_PROBES) -> None:
        self.left = refusals

    def registered(self, nixl: Any, owner: str, rows: np.ndarray, memory: str) -> bool:
        """Whether NIXL accepts ``rows`` in one region of ``owner``'s; False, untried, once
        the refusals are spent."""
        if self.left <= 0:
            return False
        accepted = _registered(nixl, owner, rows, memory)
        self.left -= not accepted
        return accepted


def merge_domains(nixl: Any, owner: str, table: RegionTable, probes: Probes | None = None) -> np.ndarray:
    """Per stream of ``table``, a label: streams with one label lie in one region NIXL has
    registered for ``owner`` (``NIXL_LOCAL_AGENT``: this agent), so one descriptor may span
    them; -1 where not even the stream's own blocks do (memory registered block by block).

    Streams whose extents meet are tried together first (one descriptor covering them
    all), then, where that is refused, each stream on its own: one NIXL call when every
    cluster is registered whole, one per cluster and stream where it is not. Each refusal
    costs NIXL an error line in its log and some 20 us, so after ``MAX_REFUSED_PROBES`` of
    them (counted by ``probes``, which the calls towards one owner share; None: this call's
    own) the streams left are labelled -1 (a peer that registered its memory block by block
    would otherwise cost one of each per stream, up to 65,536, and per part of a plan):
    they only merge less.
    """
    probes = Probes() if probes is None else probes
    extents = stream_extents(table)
    count = extents.shape[0]
    order = np.argsort(extents[:, 0], kind="stable")
    ends = extents[order, 0] + extents[order, 1]
    reach = np.maximum.accumulate(ends)
    cluster_of = np.concatenate(([0], np.cumsum(extents[order[1:], 0] > reach[:-1])))
    clusters = int(cluster_of[-1]) + 1
    first = np.flatnonzero(np.concatenate(([True], np.diff(cluster_of) > 0)))
    spans = np.empty((clusters, 3), dtype=np.uint64)
    spans[:, 0] = extents[order[first], 0]
    spans[:, 1] = np.maximum.reduceat(ends, first) - spans[:, 0]
    spans[:, 2] = table.device_id
    labels = np.full(count, -1, dtype=np.int64)
    registered = partial(probes.registered, nixl, owner, memory=table.memory)
    if registered(spans):
        labels[order] = cluster_of
        return labels
    for cluster in range(clusters):
        members = order[cluster_of == cluster]
        if members.size > 1 and registered(spans[cluster : cluster + 1]):
            labels[members] = cluster
            continue
        for stream in members.tolist():
            if registered(extents[stream : stream + 1]):
                labels[stream] = clusters + stream
    return labels


def _registered(nixl: Any, owner: str, rows: np.ndarray, memory: str) -> bool:
    """Whether NIXL accepts every row as lying in one region registered for ``owner``."""
    try:
        nixl.prep_xfer_dlist(owner, rows, memory).release()
    except Exception:  # NIXL refuses a list with any descriptor outside registered memory
        return False
    return True


def check_registered(agent: Agent, table: RegionTable, peer: str | None) -> None:
    """NIXL must accept the first and last block of every stream of ``table``: this agent's
    (``peer`` None) or ``peer``'s registered memory. A TransferError names the side at fault."""
    owner = NIXL_LOCAL_AGENT if peer is None else peer
    try:
        agent.nixl.prep_xfer_dlist(owner, extent_rows(table), table.memory).release()
    except Exception as err:
        if peer is None:
            raise TransferError(f"the local table names memory this agent has not registered: {err}") from None
        raise TransferError(
            f"preparing the descriptors of peer {peer!r} failed ({err}): "
            f"its table names memory it has not registered ({len(table.streams)} streams of "
            f"{table.num_blocks} blocks of {table.run_bytes} bytes)"
        ) from None


def wait_all(transfers: Sequence[Transfer], seconds: float, *, interval: float = 1e-4) -> None:
    """Poll every transfer until all are done; TransferError(timed_out=True), naming the
    peers still owed, once ``seconds`` (checked by the caller) have passed."""
    deadline = time.monotonic() + seconds
    pending = list(transfers)
    while True:
        pending = [transfer for transfer in pending if not transfer.poll()]
        if not pending:
            return
        if time.monotonic() > deadline:
            peers = ", ".join(repr(transfer.link.peer) for transfer in pending)
            raise TransferError(f"{pending[0].op} from {peers} did not finish within {seconds:g} s", timed_out=True)
        time.sleep(interval)


def layer_by_layer(post: Callable[[str], list[Transfer]], names: Sequence[str], seconds: float) -> Iterator[str]:
    """Post each layer's transfers (``post(name)``) once the layer before has landed, and
    yield its name once its own have, within ``seconds`` of the wait for it: one layer in
    flight, the next already posted when the caller gets the one before. Every transfer is
    released as the loop goes, ends or is left (left early, the layer in flight has its
    deadline to land first); one still in flight cannot be (``Transfer.release``) and the
    error names it. A layer that fails or times out is named, with its place in ``names``
    (those before it landed)."""
    in_flight = post(names[0])
    try:
        for index, name in enumerate(names):
            try:
                wait_all(in_flight, seconds)
            except TransferError as err:
                message = f"layer {name!r} ({index + 1} of {len(names)}): {err}"
                try:
                    release_all(in_flight)
                except TransferError as left:  # some are still in flight: say so with the cause
                    message = f"{message}; {left}"
                in_flight = []
                raise TransferError(message, timed_out=err.timed_out) from None
            release_all(in_flight)
            in_flight = post(names[index + 1]) if index + 1 < len(names) else []
            yield name
    finally:
        if in_flight:  # left early: the layer in flight gets its deadline to land, then is released
            with contextlib.suppress(TransferError):  # one that failed is over: released below
                wait_all(in_flight, seconds)
            release_all(in_flight)


def post_all(posts: Iterable[Callable[[], Sequence[Transfer]]]) -> list[Transfer]:
    """The transfers of every ``post``, in order, or none: where one cannot be posted, those
    posted before it are released, so that a caller never holds part of a set (those still in
    flight cannot be, ``Transfer.release``: a note on the error names them)."""
    transfers: list[Transfer] = []
    with released_on_error(transfers):
        for post in posts:
            transfers.extend(post())
    return transfers


@contextlib.contextmanager
def released_on_error(transfers: Sequence[Transfer]) -> Iterator[None]:
    """Where the body raises, release ``transfers`` (as they stand then) and raise its error;
    those still in flight cannot be released (``Transfer.release``): a note on the error
    names them, as they may still write."""
    try:
        yield
    except BaseException as err:
        try:
            release_all(transfers)
        except TransferError as left:
            err.add_note(str(left))
        raise


def release_all(transfers: Sequence[Transfer]) -> None:
    """Release every transfer; one TransferError names those still in flight (``Transfer.release``)."""
    errors = []
    for transfer in transfers:
        try:
            transfer.release()
        except TransferError as err:
            errors.append(str(err))
    if errors:
        raise TransferError("; ".join(errors))


@dataclass(frozen=True)
class Link:
    """An agent and one of its peers: what a transfer needs to be polled and named."""

    agent: Agent
    peer: str


def post_rows(
    agent: Agent,
    peer: str,
    op: str,
    local_rows: np.ndarray,
    remote_rows: np.ndarray,
    memory: tuple[str, str],
    *,
    notify: bytes = b"",
) -> Transfer:
    """Post one transfer of descriptor rows (a ``Reader``'s, or ``kvhost.nixl.ranks``'): local
    rows ``memory[0]``, the peer's ``memory[1]``."""
    if type(notify) is not bytes:  # NIXL would send a str's UTF-8 and take other kinds its own way
        raise ArgumentError(f"{op} from {peer!r}: notify must be bytes, got {show(notify)}")
    nixl = agent.nixl
    with agent.posting(peer):
        try:
            local = nixl.get_xfer_descs(local_rows, memory[0])
            remote = nixl.get_xfer_descs(remote_rows, memory[1])
            handle = nixl.initialize_xfer(op, local, remote, peer, notify)
        except Exception as err:
            raise TransferError(f"{op} from {peer!r}: creating the transfer failed: {err}") from None
        nbytes, count = int(local_rows[:, 1].sum()), local_rows.shape[0]
        return Transfer.post(Link(agent, peer), handle, nbytes, op, descriptors=count)


@dataclass(eq=False)
class Transfer:
    """One posted transfer: ``poll()`` until True, or ``wait(timeout)``; ``release()`` when done."""

    link: Link  # the agent and the peer it reads from
    handle: Any = field(repr=False)
    nbytes: int
    op: str
    descriptors: int  # descriptor pairs posted
    started: float = field(default_factory=time.perf_counter)
    finished: float | None = None
    failed: bool = False  # NIXL said it failed on the wire, or that its peer went away: nothing more lands
    released: bool = False
    # Whether releasing it frees NIXL's request (False: a request made once and posted again,
    # freed by its maker once no post of it may still write).
    owns_handle: bool = field(default=True, repr=False)
    # One release at a time (close on one thread, a worker's release on another): NIXL frees
    # a handle released twice twice.
    _releasing: threading.Lock = field(default_factory=threading.Lock, repr=False)

    @classmethod
    def post(
        cls, link: Link, handle: Any, nbytes: int, op: str, *, descriptors: int, owns_handle: bool = True
    ) -> Transfer:
        """Post a created NIXL transfer (``handle``) towards ``link``'s peer. Where posting
        fails (NIXL raises, or answers with an error state) the caller never gets a transfer
        to release: it is released here where it is over, and otherwise kept by its agent
        (``Agent.uncancelled``): NIXL's UCX backend posts a transfer's pieces one by one and
        stops at the first that fails, leaving those before it in flight.

        ``owns_handle`` False: ``handle`` is a request its maker posts again once this post
        is over, and frees itself; releasing the transfer then leaves the request alone."""
        transfer = cls(link, handle, nbytes, op, descriptors, owns_handle=owns_handle)
        _hold(link.agent, transfer)  # first: an interrupt once NIXL has posted it leaves one close knows of
        try:
            state = link.agent.nixl.transfer(handle)
        except Exception as err:
            message = f"{op} from {link.peer!r}: posting the transfer failed: {err}"
            transfer._fail(over=peer_gone(err))
            try:
                transfer.release()
            except TransferError:
                message += "; what it had posted may still write into its local blocks: kept, not freed"
            raise TransferError(message) from None
        try:
            transfer._note(state)
        except TransferError:
            with contextlib.suppress(TransferError):  # kept where still in flight: its agent knows it
                transfer.release()
            raise
        return transfer

    def poll(self) -> bool:
        """True once every byte has landed; raises TransferError when the transport failed."""
        if self.finished is not None:
            return True
        with self._releasing:  # a release on another thread (a close) frees the handle asked here
            if self.released:
                raise TransferError(f"{self.op} from {self.link.peer!r} was released before it finished")
            return self._ask()

    def _ask(self) -> bool:
        """NIXL's state of the transfer: True once landed; a TransferError once it failed
        (``failed`` says whether nothing more lands)."""
        try:
            state = self.link.agent.nixl.check_xfer_state(self.handle)
        except Exception as err:
            self._fail(over=peer_gone(err))
            raise TransferError(f"{self.op} from {self.link.peer!r} failed: {err}") from None
        return self._note(state)

    def wait(self, timeout: float, *, interval: float = 1e-4) -> None:
        """Block until done; TransferError(timed_out=True) after ``timeout`` seconds.

        ``timeout`` must be a finite number of seconds (``fields.check_seconds``):
        NaN, infinity, a negative number or a bool is an InvalidTimeoutError, never a wait
        without end. ``interval`` (between polls) is in (0, 1].
        """
        seconds = check_seconds(timeout, "Transfer.wait timeout")
        pause = check_seconds(interval, "Transfer.wait interval", positive=True)
        if pause > 1:
            raise InvalidTimeoutError(f"Transfer.wait interval: expected at most 1 s between polls, got {pause:g}")
        wait_all([self], seconds, interval=pause)

    @property
    def seconds(self) -> float:
        return (self.finished or time.perf_counter()) - self.started

    def release(self) -> None:
        """Free the handle of a transfer that is over: landed, or failed on the wire.

        One still in flight is kept, not freed: NIXL's release of it returns as if it had
        cancelled it, but a read under way goes on (over UCX's TCP, 4,194,255 of 4,194,304
        elements landed in the local blocks once the frozen peer ran again), and freeing it
        lets NIXL free the keys and memory the read still uses (the heap was corrupted when
        the peer later died). A TransferError says it may still write into its local blocks,
        which must not be reused until it is released; its agent keeps its memory
        (``Agent.uncancelled``), and a later ``release`` frees it once NIXL says it is over.
        Where NIXL cannot say, it counts as in flight.
        """
        with self._releasing:
            if self.released:
                return
            if not self._over():
                with _holding_lock:
                    if self not in self.link.agent.uncancelled:
                        self.link.agent.uncancelled.append(self)
                raise TransferError(
                    f"{self.op} from {self.link.peer!r} is still in flight and cannot be cancelled: it may still "
                    "write into its local blocks, which must not be reused until it is released"
                )
            self._free()

    def _over(self) -> bool:
        """Whether NIXL says nothing more lands: done, failed, or its peer gone. Any other
        error it raises says nothing of what is in flight."""
        if self.finished is not None or self.failed:
            return True
        try:
            return self._ask()
        except TransferError:
            return self.failed

    def _free(self) -> None:
        if self.owns_handle:
            with contextlib.suppress(Exception):  # over: whatever NIXL says of its handle, nothing more lands
                self.handle.release()
        # NIXL's handle object keeps its agent alive (UCX's worker threads, connections): a
        # caller that keeps the released transfer must not keep the agent past its close.
        self.handle = None
        self.released = True
        _let_go(self.link.agent, self)

    def _note(self, state: str) -> bool:
        if state == "DONE":
            self.finished = time.perf_counter()
            _settle(self.link.agent, self)
            return True
        if state == "PROC":
            return False
        self._fail(over=state == "ERR")
        raise TransferError(f"{self.op} from {self.link.peer!r} failed: transport state {state!r}")

    def _fail(self, *, over: bool) -> None:
        """NIXL said the transfer failed; ``over``: in a way that lands nothing more (on the
        wire, or its peer gone). Once over it stays so, whatever NIXL says when asked again,
        and its agent may be let go of; otherwise it counts as in flight."""
        if over:
            self.failed = True
            _settle(self.link.agent, self)


def peer_gone(err: Exception) -> bool:
    """Whether NIXL's error says the transfer's peer went away (nothing more lands)."""
    return PEER_GONE in f"{type(err).__name__}: {err}"
