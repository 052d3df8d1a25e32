"""Ways of handing the batch's descriptors to NIXL, timed side by side by ``kvhost bench
--transfer``: their names, the readers that are not kvhost's own (``Prepared``: vLLM's
per-block way; ``Batched``: kvhost's reader posting the batch as one transfer), and how a
way's transfers are driven (``pull``, ``repost``).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from kvhost.nixl import Agent, Reader, RegionTable, Transfer, TransferError, TransferPlan
from kvhost.nixl.agent import NIXL_LOCAL_AGENT, Link, released_on_error
from kvhost_tools.bench.sender import TIMEOUT_S

if TYPE_CHECKING:
    from kvhost_tools.bench.sender import Batch

PER_PIECE = "per-piece"
PER_PIECE_BATCH = "per-piece-batch"
PREPPED = "per-piece-prepped"
PREPPED_BATCH = "per-piece-prepped-batch"
UNMERGED = "per-piece-prepped-unmerged"
KVHOST = "kvhost"
BATCH = "kvhost-batch"
HANDOFF = "hand-off"
LAYERED = "hand-off-layered"
PACKED = "kvhost-packed"
HANDOFF_PACKED = "hand-off-packed"
BOUNDS = (64 << 10, 256 << 10, 4 << 20, 1 << 40)  # other merge bounds, beside MAX_DESCRIPTOR_BYTES
# Descriptor sizes of the transport sweep: the batch's bytes, read from one contiguous span
# per layer in descriptors of this size (0: one per layer).
SWEEP = (4 << 10, 16 << 10, 64 << 10, 256 << 10, 1 << 20, 4 << 20, 0)


Pair = tuple[Sequence[int], Sequence[int]]  # a request's local ids and remote ids


class Batched:
    """A reader posting the whole batch (``pairs``) as one transfer (``read_batch``): kvhost's
    ``Reader``, or the prepared lists (``Prepared``); ``first``, when given, runs before each
    transfer is made (the sender packing the batch's blocks, for ``kvhost-packed``)."""

    def __init__(
        self,
        reader: Reader | Prepared,
        pairs: Sequence[tuple[Sequence[int], Sequence[int]]],
        first: Callable[[], object] | None = None,
    ) -> None:
        self.reader, self.pairs, self.first = reader, pairs, first
        self.peer = reader.peer

    def read(self) -> Callable[[], None]:
        def run() -> None:
            if self.first is not None:
                self.first()
            pull(lambda _: self.reader.read_batch(self.pairs), 1, 1)

        return run

    def close(self) -> None:
        self.reader.close()


class Prepared:
    """Every piece of both tables prepared once (``prep_xfer_dlist``), and transfers made by
    index (``make_prepped_xfer``): the per-block way of vLLM's NixlConnector."""

    def __init__(self, agent: Agent, plan: TransferPlan, peer: str, *, nixl_merges: bool = True) -> None:
        self.agent, self.nixl, self.plan, self.peer = agent, agent.nixl, plan, peer
        self.nixl_merges = nixl_merges
        remote_streams = [plan.remote.streams[i] for i in plan.remote_streams]
        self.local_rows = _every_piece(plan.local, plan.local.streams, plan)
        self.remote_rows = _every_piece(plan.remote, remote_streams, plan)
        self.local = self.nixl.prep_xfer_dlist(NIXL_LOCAL_AGENT, self.local_rows, plan.local.memory)
        self.remote = self.nixl.prep_xfer_dlist(peer, self.remote_rows, plan.remote.memory)

    def indices(self, local_ids: Sequence[int], remote_ids: Sequence[int]) -> tuple[np.ndarray, np.ndarray]:
        """Indices of a request's pieces in the prepared lists, in ``descriptor_pairs``' order."""
        plan = self.plan
        chunks = np.arange(len(remote_ids) * plan.remote_parts, dtype=np.int64)
        out = []
        for table, ids, parts in (
            (plan.local, np.asarray(local_ids), plan.local_parts),
            (plan.remote, np.asarray(remote_ids), plan.remote_parts),
        ):
            within = ids[chunks // parts] * parts + chunks % parts
            per_stream = table.num_blocks * parts
            streams = np.arange(len(plan.local.streams), dtype=np.int64)[:, None] * per_stream
            out.append((streams + within[None, :]).reshape(-1).astype(np.int32))
        return out[0], out[1]

    def batch_indices(self, pairs: Sequence[Pair]) -> tuple[np.ndarray, np.ndarray]:
        """``indices`` of the requests, request after request."""
        indices = [self.indices(local_ids, remote_ids) for local_ids, remote_ids in pairs]
        local, remote = (np.concatenate(side) for side in zip(*indices))
        return local, remote

    def posted(self, pairs: Sequence[Pair], local_domains: np.ndarray, remote_domains: np.ndarray) -> int:
        """Descriptors ``make_batch(pairs)`` hands the transport: one per piece, or, where NIXL
        merges, what its joins of neighbouring indices leave (NIXL does not report the count).
        ``local_domains``/``remote_domains`` label the plan's streams as ``Reader`` does."""
        local, remote = self.batch_indices(pairs)
        if not self.nixl_merges:
            return int(local.size)
        plan = self.plan
        local_labels = local_domains[local // (plan.local.num_blocks * plan.local_parts)]
        partners = np.asarray(plan.remote_streams, dtype=np.int64)
        remote_labels = remote_domains[partners[remote // (plan.remote.num_blocks * plan.remote_parts)]]
        return neighbours_joined(self.local_rows[local], self.remote_rows[remote], local_labels, remote_labels)

    def make(self, local_ids: Sequence[int], remote_ids: Sequence[int]) -> Any:
        return self.make_batch([(local_ids, remote_ids)])

    def make_batch(self, pairs: Sequence[Pair]) -> Any:
        """One transfer of the requests' pieces, request after request (what one request's
        transfer posts, for each in turn): NIXL joins neighbours within a request as in its
        own transfer, and across two requests where one's last piece continues into the next's."""
        local, remote = self.batch_indices(pairs)
        return self.nixl.make_prepped_xfer(
            "READ", self.local, local, self.remote, remote, skip_desc_merge=not self.nixl_merges
        )

    def read(self, local_ids: Sequence[int], remote_ids: Sequence[int]) -> Transfer:
        return self.read_batch([(local_ids, remote_ids)])

    def read_batch(self, pairs: Sequence[Pair]) -> Transfer:
        handle = self.make_batch(pairs)
        blocks = sum(len(remote_ids) for _, remote_ids in pairs)
        pieces = blocks * self.plan.remote_parts * len(self.plan.local.streams)
        link = Link(self.agent, self.peer)
        return Transfer.post(link, handle, self.plan.bytes_for(blocks), "READ", descriptors=pieces)

    def close(self) -> None:
        """Free both prepared lists, unless a transfer of the agent may still be using them."""
        if not self.agent.in_flight():
            self.local.release()
            self.remote.release()


def neighbours_joined(
    local: np.ndarray, remote: np.ndarray, local_labels: np.ndarray, remote_labels: np.ndarray
) -> int:
    """Descriptors left of the rows ``local``/``remote`` (address, length, device; pair by pair)
    once each pair is joined to the one before it where both sides start where that one ends,
    in one merge domain on each side (labels; a negative one joins nothing): NIXL's merge of a
    prepared transfer's neighbouring indices, which has no bound."""
    if local.shape[0] == 0:
        return 0
    continues = np.ones(local.shape[0] - 1, dtype=bool)
    for rows, labels in ((local, local_labels), (remote, remote_labels)):
        continues &= rows[1:, 0] == rows[:-1, 0] + rows[:-1, 1]
        continues &= (labels[1:] == labels[:-1]) & (labels[1:] >= 0)
    return int(local.shape[0] - continues.sum())


def _every_piece(table: RegionTable, streams: Sequence[Any], plan: TransferPlan) -> np.ndarray:
    """(address, length, device) of every piece of every block of ``streams``: stream-major,
    then block, then part."""
    parts = plan.local_parts if table is plan.local else plan.remote_parts
    bases = np.array([s.address for s in streams], dtype=np.uint64)
    strides = np.array([s.block_stride for s in streams], dtype=np.uint64)
    blocks = np.arange(table.num_blocks, dtype=np.uint64)
    offsets = np.arange(parts, dtype=np.uint64) * np.uint64(plan.chunk_bytes)
    addresses = bases[:, None, None] + blocks[None, :, None] * strides[:, None, None] + offsets[None, None, :]
    rows = np.empty((addresses.size, 3), dtype=np.uint64)
    rows[:, 0] = addresses.reshape(-1)
    rows[:, 1] = plan.chunk_bytes
    rows[:, 2] = table.device_id
    return rows


def pull(start: Callable[[int], Transfer], requests: int, inflight: int) -> None:
    """Start request ``i`` with ``start(i)``, up to ``inflight`` at once, until every one is
    done. Where one fails or time runs out, those running are released; one still in flight
    cannot be (``Transfer.release``): its agent keeps it, and a note on the error says so."""
    pending = list(range(requests))[::-1]
    running: list[Transfer] = []
    deadline = time.monotonic() + TIMEOUT_S
    with released_on_error(running):
        while pending or running:
            while pending and len(running) < inflight:
                running.append(start(pending.pop()))
            done = [t for t in running if t.poll()]
            for transfer in done:
                running.remove(transfer)
                transfer.release()
            if not done:
                if time.monotonic() > deadline:
                    raise TransferError(f"transfers did not finish within {TIMEOUT_S:g} s", timed_out=True)
                time.sleep(2e-4)


@dataclass(eq=False)
class Request:
    """A NIXL READ made once (``initialize_xfer``) and posted again and again (``repost``),
    each post a ``Transfer`` its agent knows of (``last``: the latest): one that does not land
    keeps the agent and its memory. ``free`` frees it unless its agent holds a post of it."""

    agent: Agent
    peer: str
    handle: Any
    nbytes: int
    descriptors: int
    last: Transfer | None = None

    def post(self) -> Transfer:
        link = Link(self.agent, self.peer)
        self.last = Transfer.post(
            link, self.handle, self.nbytes, "READ", descriptors=self.descriptors, owns_handle=False
        )
        return self.last

    def free(self) -> None:
        """Free NIXL's request, unless a post of it is not yet released: one in flight, or one
        whose post failed partway (its agent keeps those: freeing the request under them would
        let NIXL free what the read still uses)."""
        if not any(transfer.handle is self.handle for transfer in list(self.agent.posted)):
            self.handle.release()


def span_name(size: int) -> str:
    if size == 0:
        return "span/layer"
    return f"span/{size >> 20}MiB" if size >= 1 << 20 else f"span/{size >> 10}KiB"


def repost(request: Request) -> Callable[[], None]:
    """Post a NIXL request made once, and wait for it."""
    return lambda: pull(lambda _: request.post(), 1, 1)


def bound_name(bound: int) -> str:
    if bound >= 1 << 30:
        return f"{KVHOST}<=any"
    return f"{KVHOST}<={bound >> 20}MiB" if bound >= 1 << 20 else f"{KVHOST}<={bound >> 10}KiB"


def layered_descriptors(reader: Reader, batch: Batch) -> int:
    """Descriptors the layer-by-layer hand-off posts, every layer together."""
    return sum(rows.shape[0] for rows, _ in reader.layer_descriptors(batch.pairs()).values())
