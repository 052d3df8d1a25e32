"""``kvhost bench --transfer``: a NIXL hand-off, side by side with memcpy, per piece and merged.

The demo's batch (``kvhost demo``'s options, ``--demo``: 40 requests of mixed length, its
model, its block sizes and layouts, block ids as its allocators hand them out) moves from
a sender process to this one over NIXL (UCX), the way ``kvhost demo`` moves it. The sender
(``sender.py``: the batch, and ``python -m kvhost_tools.bench.sender``, under ``ip netns
exec`` with ``--peer-netns``) fills the prefill cache, registers it and sends its table and
agent metadata over a socket pair; before every timed call it evicts the blocks that are
read from it, as this process evicts what it touches (``machine.Device``). This module
connects, checks and times; the ways of handing descriptors to NIXL are in ``ways.py``,
the results and their table in ``transfer_report.py``. Methods, interleaved in a random
order per round, medians over rounds (``timing.measure``):

- ``memcpy``: a plain copy of the same bytes in this process (the roofline);
- ``per-piece``: one descriptor per sender region (or the r sub-regions of one receiver
  block), lists built per transfer (NIXL ``initialize_xfer``): kvhost's reader before
  merging;
- ``per-piece-prepped``: the same descriptors prepared once for every block of both caches
  (``prep_xfer_dlist``) and picked by index per transfer (``make_prepped_xfer``): how
  vLLM's NixlConnector hands its per-block descriptors to NIXL. NIXL's ``makeXferReq``
  itself joins neighbouring indices whose descriptors continue one another on both sides
  (unless ``skip_desc_merge``), without a size bound, so this way posts merged
  descriptors too;
- ``per-piece-prepped-unmerged``: the same with ``skip_desc_merge=True``: one operation per
  piece through the prepared path;
- ``kvhost``: kvhost's merged descriptors (``Reader``, up to ``MAX_DESCRIPTOR_BYTES``),
  lists built per transfer; ``kvhost<=N``: the same with other bounds, which shows the
  transport's per-operation cost against descriptor size;
- ``kvhost-batch``: the same descriptors, the whole batch planned at once
  (``TransferPlan.merged_batch``) and read as one transfer (``Reader.read_batch``): what a
  decode step that takes every request ready from one peer together posts;
- ``per-piece-batch``: the control of ``kvhost-batch``: the whole batch as one transfer, but
  one descriptor per piece, as ``per-piece`` posts them: what posting the batch at once
  gains without merging, and so what merging adds to it; ``per-piece-prepped-batch``: the
  prepared lists' indices of the whole batch as one transfer (vLLM's way, batched), which
  NIXL merges within each request as kvhost does: what kvhost's merge adds to the batch;
- ``hand-off``: ``kvhost-batch``'s transfer, then one ``kvhost.receive`` of the batch (a
  ``KVHost`` registered once): everything on the critical path from the first read to
  blocks attention can read;
- ``hand-off-layered``: the same bytes as one transfer per layer (``Reader.read_layers``),
  each layer received (``KVHost.receive(layers=...)``) as soon as its transfer is done,
  while the next layer's moves;
- ``kvhost-packed``: the sender, asked over its control socket, first copies the batch's
  blocks request after request into one registered buffer laid out like its cache
  (``KVHost.copy_to``), then one transfer reads them from there: a request's sender blocks
  are one run, so only the receiver's runs cut descriptors (the round trip and the copy are
  in the time); ``hand-off-packed``: that, then the receive;
- ``build ...``: creating every request's transfer without posting it (descriptor rows
  and NIXL's request), per way of handing descriptors to NIXL: what each costs;
- ``span/N``: the transport alone (``--sweep``): the batch's bytes read from one
  contiguous span of each layer in descriptors of N bytes, one request made once and
  posted again each round: the transport's per-operation cost against descriptor size,
  and its bandwidth when descriptors are as large as they come.

``--demo`` takes, besides the demo's options, ``--prefill-layout``/``--decode-layout``,
their block sizes, and ``--cross-layer``: both caches one tensor each with a block's layers
back to back (vLLM's cross-layer layout, as ``kvhost demo --cross-layer``), so that one
region per block holds every layer.

Each request is read with up to ``--inflight`` transfers in flight, as the demo does.
Before timing, every way's bytes are checked to be the same, and the hand-off's blocks to
hold the sender's tokens bit for bit.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import random
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
import torch

import kvhost
from kvhost.caches import CacheSet
from kvhost.nixl import Agent, Reader, TransferPlan, plan_transfer
from kvhost.nixl.hugepages import back_with_huge_pages
from kvhost.testing import raw, read_tokens
from kvhost_tools.bench.machine import Device, block_ranges
from kvhost_tools.bench.methods import Workspace
from kvhost_tools.bench.sender import TIMEOUT_S, Batch, Peer, Setting
from kvhost_tools.bench.timing import measure
from kvhost_tools.bench.transfer_report import summarise
from kvhost_tools.bench.ways import (
    BATCH,
    HANDOFF,
    HANDOFF_PACKED,
    KVHOST,
    LAYERED,
    PACKED,
    PER_PIECE,
    PER_PIECE_BATCH,
    PREPPED,
    PREPPED_BATCH,
    UNMERGED,
    Batched,
    Prepared,
    Request,
    bound_name,
    pull,
    repost,
    span_name,
)
from kvhost_tools.bench.workloads import PRESETS

SENTINEL = 0xA5


class BothSides(Device):
    """Evicts what this process touches, and asks the sender to evict what is read from it."""

    def __init__(self, cache: str, peer: Peer) -> None:
        super().__init__("cpu", cache)
        self.peer = peer

    def flush(self, touched: np.ndarray | None = None) -> None:
        super().flush(touched)
        if self.cold:
            self.peer.evict()


# --- the run -------------------------------------------------------------------------------------


@dataclass
class Setup:
    """Both sides connected: the batch, the plan, and every way to read it."""

    batch: Batch
    agent: Agent
    peer: Peer
    local: dict[str, torch.Tensor]
    plan: TransferPlan
    readers: dict[str, Any] = field(default_factory=dict)  # name -> Reader, Batched or Prepared
    requests: list[Request] = field(default_factory=list)  # NIXL requests made once, freed at the end

    def close_readers(self) -> None:
        for reader in self.readers.values():
            reader.close()

    def close(self) -> None:
        """Let go of everything, the sender last whatever fails before it. Requests and
        prepared lists a transfer still in flight may use are kept, and the agent's close
        says what is in flight (``Agent.close``)."""
        try:
            for request in self.requests:
                request.free()
            self.requests.clear()
            self.close_readers()
            self.agent.close()
        finally:
            self.peer.close()

    def transfer(self, name: str, inflight: int) -> Callable[[], None]:
        reader, batch = self.readers[name], self.batch
        if isinstance(reader, Batched):
            return reader.read()
        count = len(batch.remote_ids)
        return lambda: pull(lambda i: reader.read(batch.local_ids[i], batch.remote_ids[i]), count, inflight)

    def build(self, name: str) -> Callable[[], None]:
        """Create every request's NIXL transfer (the batch's one, for ``kvhost-batch``) and
        release it unposted: what handing the descriptors over costs, without moving a byte."""
        reader = self.readers[name]
        pairs = self.batch.pairs()

        def make(local_ids: Sequence[int], remote_ids: Sequence[int]) -> Any:
            if isinstance(reader, Prepared):
                return reader.make(local_ids, remote_ids)
            return self.request(reader.descriptors(local_ids, remote_ids), reader.peer)

        def build() -> None:
            if isinstance(reader, Batched):
                inner = reader.reader
                if isinstance(inner, Prepared):
                    inner.make_batch(reader.pairs).release()
                else:
                    self.request(inner.batch_descriptors(reader.pairs), reader.peer).release()
                return
            for local_ids, remote_ids in pairs:
                make(local_ids, remote_ids).release()

        return build

    def request(self, rows: tuple[np.ndarray, np.ndarray], peer: str) -> Any:
        """NIXL's READ request for ``rows`` (local and remote), made and not posted."""
        nixl = self.agent.nixl
        local = nixl.get_xfer_descs(rows[0], self.plan.local.memory)
        return nixl.initialize_xfer("READ", local, nixl.get_xfer_descs(rows[1], self.plan.remote.memory), peer)

    def plan_only(self, name: str) -> Callable[[], None]:
        """Work out every request's descriptors (rows, or indices into prepared lists) without
        handing them to NIXL: kvhost's share of ``build``."""
        reader = self.readers[name]
        pairs = self.batch.pairs()

        def plan() -> None:
            inner = reader.reader if isinstance(reader, Batched) else reader
            if isinstance(reader, Batched) and isinstance(inner, Reader):
                inner.batch_descriptors(reader.pairs)
                return
            rows = inner.indices if isinstance(inner, Prepared) else inner.descriptors
            for local_ids, remote_ids in pairs:
                rows(local_ids, remote_ids)

        return plan

    def span(self, size: int, nbytes: int) -> Request:
        """One NIXL request reading ``nbytes`` from one contiguous span of each layer into one of
        each local layer, in descriptors of ``size`` bytes (0: one per layer)."""
        nixl = self.agent.nixl
        local = CacheSet(self.local, self.batch.setting.axes)
        starts = {name: min(m.tensor.data_ptr() for m in ms) for name, ms in local.layers.items()}
        remote_starts: dict[str, int] = {}
        for stream in self.plan.remote.streams:
            remote_starts[stream.layer] = min(remote_starts.get(stream.layer, stream.address), stream.address)
        per_layer = nbytes // len(starts)
        size = size or per_layer
        offsets = np.arange(0, per_layer, size, dtype=np.uint64)
        lengths = np.minimum(np.uint64(size), np.uint64(per_layer) - offsets)
        rows = []
        for bases in (list(starts.values()), [remote_starts[name] for name in starts]):
            at = (np.array(bases, dtype=np.uint64)[:, None] + offsets[None, :]).reshape(-1)
            rows.append(np.stack([at, np.tile(lengths, len(bases)), np.zeros_like(at)], axis=1))
        memory = self.plan.local.memory
        peer = self.readers[KVHOST].peer
        local_descs, remote_descs = (nixl.get_xfer_descs(r, memory) for r in rows)
        handle = nixl.initialize_xfer("READ", local_descs, remote_descs, peer)
        return Request(self.agent, peer, handle, int(lengths.sum()) * len(starts), rows[0].shape[0])

    def descriptors(self, name: str) -> int:
        """Descriptors the transport is handed for the whole batch. For the prepared way as
        NIXL merges it: neighbouring indices joined where they continue one another in one
        registered region on both sides, without a bound (``ways.neighbours_joined``)."""
        reader, batch = self.readers[name], self.batch
        domains = self.readers[KVHOST].local_domains, self.readers[KVHOST].remote_domains
        if isinstance(reader, Batched) and isinstance(reader.reader, Prepared):
            return reader.reader.posted(reader.pairs, *domains)
        if isinstance(reader, Prepared):  # a transfer per request
            return sum(reader.posted([pair], *domains) for pair in batch.pairs())
        if isinstance(reader, Batched) and isinstance(reader.reader, Reader):
            return int(reader.reader.batch_descriptors(reader.pairs)[0].shape[0])
        return sum(reader.descriptors(lo, re)[0].shape[0] for lo, re in zip(batch.local_ids, batch.remote_ids))


def connect(args: argparse.Namespace) -> Setup:
    setting = Setting.parse(args.demo)
    batch = Batch.of(setting)
    env = dict(item.split("=", 1) for item in args.peer_env)
    # Until the setup is handed over, a failure or a stop (SIGTERM, Ctrl-C) on the way closes
    # what was opened, the sender process first among them: it must not outlive this one.
    with contextlib.ExitStack() as opened:
        peer = Peer(args, env, pack=True)
        opened.callback(peer.close)
        agent = Agent(f"bench-decode-{os.getpid()}", progress_thread=args.progress == "thread", threads=args.threads)
        opened.callback(agent.close)
        local = setting.model.caches(setting.decode, batch.local_pool)
        local_table = agent.register(local, setting.axes, huge_pages=args.huge_pages == "on")
        plan = plan_transfer(local_table, peer.table)
        name = agent.add_peer(peer.metadata)
        setup = Setup(batch, agent, peer, local, plan)
        opened.callback(setup.close_readers)
        setup.readers[PER_PIECE] = agent.reader(plan, name, max_descriptor_bytes=None)
        setup.readers[PREPPED] = Prepared(agent, plan, name)
        setup.readers[UNMERGED] = Prepared(agent, plan, name, nixl_merges=False)
        setup.readers[KVHOST] = agent.reader(plan, name)
        setup.readers[BATCH] = Batched(setup.readers[KVHOST], batch.pairs())
        setup.readers[PER_PIECE_BATCH] = Batched(setup.readers[PER_PIECE], batch.pairs())
        setup.readers[PREPPED_BATCH] = Batched(setup.readers[PREPPED], batch.pairs())
        assert peer.pack_table is not None
        packed = agent.reader(plan_transfer(local_table, peer.pack_table), name)
        setup.readers[PACKED] = Batched(packed, batch.packed_pairs(), first=peer.pack)
        for bound in args.bounds:
            setup.readers[bound_name(bound)] = agent.reader(plan, name, max_descriptor_bytes=bound)
        opened.pop_all()  # run() closes them from here on
    return setup


def verify(setup: Setup, inflight: int) -> None:
    """Every way lands the same bytes, and after ``kvhost.receive`` every request's blocks hold
    the sender's tokens, bit for bit; blocks no request names keep the sentinel."""
    axes = setup.batch.setting.axes
    local_set = CacheSet(setup.local, axes)
    names = (PER_PIECE, PREPPED, UNMERGED, KVHOST, BATCH, PER_PIECE_BATCH, PREPPED_BATCH, PACKED)
    ways = [setup.transfer(name, inflight) for name in names]
    same_landing(setup.local, ways)
    post_process(setup)
    truth = CacheSet(setup.batch.sender_caches(), axes)
    check_tokens(setup.batch, local_set, truth)
    fill_sentinel(setup.local)
    layered(setup, kvhost.KVHost(setup.local, axes=axes))()
    check_tokens(setup.batch, local_set, truth)


def same_landing(local: Mapping[str, torch.Tensor], ways: Sequence[Callable[[], object]]) -> None:
    """Each way, run on caches filled with ``SENTINEL``, lands the same bytes as the first."""
    first: list[torch.Tensor] | None = None
    for number, way in enumerate(ways):
        fill_sentinel(local)
        way()
        landed = [raw(tensor).clone() for tensor in local.values()]
        if first is None:
            first = landed
        elif not all(torch.equal(a, b) for a, b in zip(first, landed)):
            raise AssertionError(f"way {number} of {len(ways)} landed other bytes than the first (per-piece)")


def fill_sentinel(local: Mapping[str, torch.Tensor]) -> None:
    """Every byte of the receiver's caches set to ``SENTINEL``, before a way lands its bytes.

    On a device the fill is waited for: NIXL's writes run on UCX's own streams, which do
    not wait for torch's, and a fill still running would overwrite what landed."""
    for tensor in local.values():
        raw(tensor).view(torch.uint8).fill_(SENTINEL)
    for device in {tensor.device for tensor in local.values() if tensor.device.type != "cpu"}:
        torch.get_device_module(device).synchronize(device)


def check_tokens(batch: Batch, local_set: CacheSet, truth: CacheSet) -> None:
    """Every request's blocks hold the sender's tokens (``truth``: ``batch.sender_caches()``,
    made again rather than read from the sender, which a transfer could have written), bit
    for bit; blocks no request names keep the sentinel."""
    size = batch.setting.prefill.block_size
    for remote_ids, local_ids in zip(batch.remote_ids, batch.local_ids):
        tokens = len(remote_ids) * size
        for r, lo in zip(truth.members, local_set.members):
            if not torch.equal(
                read_tokens(lo.tensor, lo.layout, local_ids)[:tokens], read_tokens(r.tensor, r.layout, remote_ids)
            ):
                raise AssertionError("the hand-off's blocks do not hold the sender's tokens")
    spare = sorted(set(range(batch.local_pool)) - {b for ids in batch.local_ids for b in ids})
    for member in local_set.members:
        index = torch.tensor(spare, dtype=torch.int64, device=member.tensor.device)
        kept = raw(member.tensor).index_select(member.layout.axes.index("B"), index)
        if not bool((kept.view(torch.uint8) == SENTINEL).all()):
            raise AssertionError("a block no request names was written")


def post_process(setup: Setup, host: kvhost.KVHost | None = None) -> None:
    """One ``kvhost.receive`` of the whole batch (through ``host`` when given)."""
    plan = setup.plan
    if host is None:
        kvhost.receive(
            setup.local,
            setup.batch.requests(),
            axes=setup.batch.setting.axes,
            remote_order=plan.remote_order,
            remote_block_size=plan.remote_block_size,
        )
    else:
        host.receive(setup.batch.requests(), remote_order=plan.remote_order, remote_block_size=plan.remote_block_size)


def layered(setup: Setup, host: kvhost.KVHost, tail: list[float] | None = None) -> Callable[[], None]:
    """The hand-off layer by layer, with kvhost's merged descriptors (``hand_off_layered``)."""
    return hand_off_layered(setup.readers[KVHOST], setup.batch, host, setup.plan, tail)


def hand_off_layered(
    reader: Reader, batch: Batch, host: kvhost.KVHost, plan: TransferPlan, tail: list[float] | None = None
) -> Callable[[], None]:
    """The hand-off layer by layer (``Reader.read_layers``): each layer received as soon as its
    transfer is done, the next layer's already posted. ``tail`` collects the time from the
    last layer landing to the end: what stays on the critical path."""
    pairs, requests = batch.pairs(), batch.requests()

    def handoff() -> None:
        for name in reader.read_layers(pairs, timeout=TIMEOUT_S):
            landed = time.perf_counter()
            host.receive(
                requests, remote_order=plan.remote_order, remote_block_size=plan.remote_block_size, layers=[name]
            )
        if tail is not None:
            tail.append(time.perf_counter() - landed)

    return handoff


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Connect, verify, measure; the section of the results (``"transfer"``) for this setting."""
    load_before = os.getloadavg()[0]
    setup = connect(args)
    try:
        section = measure_all(args, setup, load_before)
    except BaseException as err:
        try:
            setup.close()
        except Exception as left:  # the run's own error comes first; what closing met goes with it
            err.add_note(f"closing after it: {type(left).__name__}: {left}")
        raise
    setup.close()
    return section


def measure_all(args: argparse.Namespace, setup: Setup, load_before: float) -> dict[str, Any]:
    """Verify every way, then time them side by side; the section of the results."""
    verify(setup, args.inflight)
    nbytes = setup.plan.bytes_for(sum(len(r) for r in setup.batch.remote_ids))
    device = BothSides(args.cache, setup.peer)
    space = Workspace(device)
    axes = setup.batch.setting.axes
    host = kvhost.KVHost(setup.local, axes=axes)
    parts: dict[str, list[float]] = {name: [] for name in ("transfer", "receive", "tail", "pack", "packed_read")}
    merged = setup.transfer(BATCH, args.inflight)
    packed = setup.readers[PACKED]

    def handoff() -> None:
        started = time.perf_counter()
        merged()
        landed = time.perf_counter()
        post_process(setup, host)
        parts["transfer"].append(landed - started)
        parts["receive"].append(time.perf_counter() - landed)

    def handoff_packed() -> None:
        started = time.perf_counter()
        setup.peer.pack()
        sent = time.perf_counter()
        pull(lambda _: packed.reader.read_batch(packed.pairs), 1, 1)
        landed = time.perf_counter()
        post_process(setup, host)
        parts["pack"].append(sent - started)
        parts["packed_read"].append(landed - sent)

    transfers = [PER_PIECE, PREPPED, UNMERGED, KVHOST, BATCH, PER_PIECE_BATCH, PREPPED_BATCH, PACKED]
    transfers += [bound_name(b) for b in args.bounds]
    methods: dict[str, Callable[[], object]] = {**space.memcpy_methods(nbytes, device.device, device.device)}
    if args.huge_pages == "on":  # the roofline's memory as the caches'
        ring = space.memcpy_ranges(nbytes, device.device, device.device)
        back_with_huge_pages([(int(address), int(length)) for address, length in ring])
    methods |= {name: setup.transfer(name, args.inflight) for name in transfers}
    methods[HANDOFF] = handoff
    methods[HANDOFF_PACKED] = handoff_packed
    methods[LAYERED] = layered(setup, host, parts["tail"])
    built = (PER_PIECE, PREPPED, UNMERGED, KVHOST, BATCH, PER_PIECE_BATCH, PREPPED_BATCH)
    methods |= {f"build {name}": setup.build(name) for name in built}
    methods |= {f"plan {name}": setup.plan_only(name) for name in (PER_PIECE, PREPPED, KVHOST, BATCH)}
    spans = {span_name(size): setup.span(size, nbytes) for size in args.sweep}
    setup.requests += spans.values()
    methods |= {name: repost(request) for name, request in spans.items()}
    ids = np.array(sorted({b for r in setup.batch.local_ids for b in r}), dtype=np.int64)
    touched = np.concatenate(
        [block_ranges(setup.local, axes, ids), space.memcpy_ranges(nbytes, device.device, device.device)]
    )
    preset = replace(PRESETS["quick" if args.quick else "full"], seconds_per_point=args.seconds)
    measured = measure(methods, device, preset, args.rounds, random.Random(args.seed), touched)
    counts = {name: request.descriptors for name, request in spans.items()}
    return summarise(args, setup, measured, nbytes, transfers, parts, load_before, counts)
