"""``kvhost bench --transfer``: a NIXL hand-off, side by side with memcpy, per piece and merged.

The demo's batch (``kvhost demo``'s options, ``--demo``: 40 requests of mixed length, its
model, its block sizes and layouts, block ids as its allocators hand them out) moves from
a sender process to this one over NIXL (UCX), the way ``kvhost demo`` moves it. The sender
(``python -m kvhost_tools.bench.transfer``, under ``ip netns exec`` with ``--peer-netns``)
fills the prefill cache, registers it and sends its table and agent metadata over a
socket pair; before every timed call it evicts the blocks that are read from it, as this
process evicts what it touches (``machine.Device``). Methods, interleaved in a random
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
- ``hand-off``: ``kvhost-batch``'s transfer, then one ``kvhost.receive`` of the batch (a
  ``KVHost`` registered once): everything on the critical path from the first read to
  blocks attention can read;
- ``hand-off-layered``: the same bytes as one transfer per layer (``Reader.read_layers``),
  each layer received (``KVHost.receive(layers=...)``) as soon as its transfer is done,
  while the next layer's moves;
- ``build ...``: creating every request's transfer without posting it (descriptor rows
  and NIXL's request), per way of handing descriptors to NIXL: what each costs;
- ``span/N``: the transport alone (``--sweep``): the batch's bytes read from one
  contiguous span of each layer in descriptors of N bytes, one request made once and
  posted again each round: the transport's per-operation cost against descriptor size,
  and its bandwidth when descriptors are as large as they come.

``--demo`` takes, besides the demo's options, ``--prefill-layout``/``--decode-layout``,
their block sizes, and ``--cross-layer``: both caches one tensor each with a block's layers
back to back (vLLM's cross-layer layout; the demo itself has no such engine), so that one
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
import select
import shlex
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, NoReturn

import numpy as np
import torch

import kvhost
from kvhost.caches import CacheSet
from kvhost.errors import KVHostError
from kvhost.nixl import MAX_DESCRIPTOR_BYTES, Agent, Reader, RegionTable, Transfer, TransferPlan, plan_transfer
from kvhost.nixl.agent import DEFAULT_THREADS
from kvhost.nixl.framing import receive, send
from kvhost.nixl.hugepages import back_with_huge_pages
from kvhost.testing import fill_random, raw, read_tokens
from kvhost_tools.bench.machine import Device, block_ranges, machine
from kvhost_tools.bench.methods import ROOFLINE, Workspace
from kvhost_tools.bench.output import format_table
from kvhost_tools.bench.targets import check
from kvhost_tools.bench.timing import Measured, measure, per_round
from kvhost_tools.bench.workloads import PRESETS
from kvhost_tools.demo.config import (
    LAYOUTS,
    EngineShape,
    Model,
    Workload,
    allocate_blocks,
    blocks_for,
    local_blocks_for,
    pool_for,
)
from kvhost_tools.demo.options import add_model, add_workload, default_layout, model_of, workload_of

PER_PIECE = "per-piece"
PREPPED = "per-piece-prepped"
UNMERGED = "per-piece-prepped-unmerged"
KVHOST = "kvhost"
BATCH = "kvhost-batch"
HANDOFF = "hand-off"
LAYERED = "hand-off-layered"
BOUNDS = (64 << 10, 256 << 10, 4 << 20, 1 << 40)  # other merge bounds, beside MAX_DESCRIPTOR_BYTES
# Descriptor sizes of the transport sweep: the batch's bytes, read from one contiguous span
# per layer in descriptors of this size (0: one per layer).
SWEEP = (4 << 10, 16 << 10, 64 << 10, 256 << 10, 1 << 20, 4 << 20, 0)
QUICK_DEMO = "--layers 2 --heads 2 --head-dim 16 --requests 8 --min-tokens 5 --max-tokens 150"
TIMEOUT_S = 120.0  # any one control message, and any one transfer
SENTINEL = 0xA5
# How each side drives NIXL: "poll" (no progress thread; the receiver polls its transfers,
# the sender asks for notifications every POLL_S while it waits), or NIXL's progress
# thread on both sides, which polls without pause (half a core each when idle, here).
PROGRESS = ("poll", "thread")
# Whether both sides ask for huge pages under their registered caches (and under memcpy's
# buffers): Agent.register's default, or memory as the allocator left it.
HUGE_PAGES = ("on", "off")
POLL_S = 1e-4
SEED = 1000  # the sender's layer i holds fill_random(seed SEED + i)


class _DemoParser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        raise SystemExit(f"kvhost bench --demo: {message}")


@dataclass(frozen=True)
class Setting:
    """The demo's batch as ``--demo`` gives it: the model, the workload (with how both sides'
    allocators hand out block ids) and both engines' caches (one rank each)."""

    model: Model
    workload: Workload
    prefill: EngineShape
    decode: EngineShape

    @classmethod
    def parse(cls, text: str) -> Setting:
        p = _DemoParser(prog="kvhost bench --demo", add_help=False)
        add_model(p)
        add_workload(p)
        p.add_argument("--prefill-layout", choices=sorted(LAYOUTS), default=None)
        p.add_argument("--prefill-block-size", type=int, default=16)
        p.add_argument("--decode-layout", choices=sorted(LAYOUTS), default=None)
        p.add_argument("--decode-block-size", type=int, default=64)
        p.add_argument("--cross-layer", action="store_true")  # both caches: a block's layers back to back
        args = p.parse_args(shlex.split(text))
        prefill_layout = default_layout(args.cache, args.prefill_layout, "HND")
        decode_layout = default_layout(args.cache, args.decode_layout, "NHD")
        prefill = EngineShape(prefill_layout, args.prefill_block_size, cross_layer=args.cross_layer)
        decode = EngineShape(decode_layout, args.decode_block_size, cross_layer=args.cross_layer)
        return cls(model_of(args), workload_of(args), prefill, decode)

    @property
    def axes(self) -> str:
        return self.model.axes_for(self.prefill)  # both sides cross-layer, or neither


@dataclass(frozen=True)
class Batch:
    """The demo's batch: per request, the sender's block ids and the receiver's."""

    setting: Setting
    remote_pool: int
    local_pool: int
    remote_ids: list[list[int]]
    local_ids: list[list[int]]

    @classmethod
    def of(cls, setting: Setting) -> Batch:
        prefill, decode, workload = setting.prefill, setting.decode, setting.workload
        needed = [blocks_for(t, prefill.block_size) for t in workload.lengths()]
        local_needed = [local_blocks_for(n, prefill.block_size, decode.block_size) for n in needed]
        remote_pool, local_pool = pool_for(needed), pool_for(local_needed)
        remote_ids, _ = allocate_blocks(remote_pool, needed, workload, stream=2)
        local_ids, _ = allocate_blocks(local_pool, local_needed, workload, stream=3)
        return cls(setting, remote_pool, local_pool, remote_ids, local_ids)

    def sender_caches(self, device: str | torch.device = "cpu") -> dict[str, torch.Tensor]:
        """The sender's cache, filled as the sender fills it (seeded)."""
        caches = self.setting.model.caches(self.setting.prefill, self.remote_pool, device)
        for i, tensor in enumerate(caches.values()):
            fill_random(tensor, SEED + i)
        return caches

    def requests(self) -> dict[str, list[int]]:
        """The receiver's block ids by request name, as ``kvhost.receive`` takes them."""
        return {f"req-{i:03d}": ids for i, ids in enumerate(self.local_ids)}

    def pairs(self) -> list[tuple[list[int], list[int]]]:
        """(local ids, remote ids) per request, as a ``Reader`` takes them."""
        return list(zip(self.local_ids, self.remote_ids))


# --- the sender ------------------------------------------------------------------------------


def peer_main(argv: Sequence[str]) -> int:
    """The sender: ``--fd N`` (its end of the socket pair), ``--cache``, ``--device`` (where its
    cache lives) and the demo's options."""
    parser = argparse.ArgumentParser(prog="python -m kvhost_tools.bench.transfer")
    parser.add_argument("--fd", type=int, required=True)
    parser.add_argument("--cache", default="data")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--demo", default="")
    parser.add_argument("--progress", choices=PROGRESS, default="poll")
    parser.add_argument("--huge-pages", choices=HUGE_PAGES, default="on")
    parser.add_argument("--threads", type=int, default=DEFAULT_THREADS)
    args = parser.parse_args(argv)
    batch = Batch.of(Setting.parse(args.demo))
    axes = batch.setting.axes
    caches = batch.sender_caches(args.device)
    device = Device("cpu", args.cache)
    thread = args.progress == "thread"
    agent = Agent(f"bench-prefill-{os.getpid()}", progress_thread=thread, threads=args.threads)
    with socket.socket(fileno=args.fd) as sock, agent:
        table = agent.register(caches, axes, huge_pages=args.huge_pages == "on")
        hello = {"table": table.to_dict(), "pid": os.getpid(), "huge_pages": agent.huge_pages.describe()}
        send(sock, "hello", hello, agent.metadata(), timeout=TIMEOUT_S)
        ids = np.array(sorted({b for r in batch.remote_ids for b in r}), dtype=np.int64)
        # Only host memory is evicted (what the bench asks for); a device's cache is read as it is.
        touched = block_ranges(caches, axes, ids) if args.device == "cpu" else None
        while True:
            if not thread:  # drive the transport while no control message waits
                while not select.select([sock], [], [], POLL_S)[0]:
                    agent.nixl.get_new_notifs()
            message = receive(sock, timeout=24 * 3600.0)
            if message.kind == "evict":
                if touched is None:
                    raise KVHostError(f"evict: the sender's cache is in {args.device} memory, which is not evicted")
                device.flush(touched)
                send(sock, "evicted", {}, timeout=TIMEOUT_S)
            elif message.kind == "quit":
                return 0


class Peer:
    """The sender process, and the control socket to it; ``device``: where its cache lives."""

    def __init__(self, args: argparse.Namespace, env: dict[str, str], device: str = "cpu") -> None:
        ours, theirs = socket.socketpair()
        command = [sys.executable, "-m", "kvhost_tools.bench.transfer", "--fd", str(theirs.fileno())]
        command += ["--cache", args.cache, "--device", device, f"--demo={args.demo}", "--progress", args.progress]
        command += ["--huge-pages", args.huge_pages, "--threads", str(args.threads)]
        netns = args.peer_netns
        if netns:
            command = ["ip", "netns", "exec", netns, *command]
        self.process = subprocess.Popen(command, pass_fds=[theirs.fileno()], env=dict(os.environ, **env))
        theirs.close()
        self.sock = ours
        hello = receive(ours, timeout=TIMEOUT_S, expect="hello")
        fields = hello.fields()
        self.table = RegionTable.from_dict(fields.data["table"], "hello.table", hello.arrays)
        self.metadata = hello.blob
        self.pid = fields.integer("pid")
        self.huge_pages = str(fields.data["huge_pages"])

    def evict(self) -> None:
        send(self.sock, "evict", {}, timeout=TIMEOUT_S)
        receive(self.sock, timeout=TIMEOUT_S, expect="evicted")

    def close(self) -> None:
        with contextlib.suppress(OSError):
            send(self.sock, "quit", {}, timeout=5.0)
        self.sock.close()
        try:
            self.process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


class BothSides(Device):
    """Evicts what this process touches, and asks the sender to evict what is read from it."""

    def __init__(self, cache: str, peer: Peer) -> None:
        super().__init__("cpu", cache)
        self.peer = peer

    def flush(self, touched: np.ndarray | None = None) -> None:
        super().flush(touched)
        if self.cold:
            self.peer.evict()


# --- ways of handing descriptors to NIXL -------------------------------------------------------


class Batched:
    """kvhost's reader, posting the whole batch as one transfer (``Reader.read_batch``)."""

    def __init__(self, reader: Reader) -> None:
        self.reader = reader
        self.peer = reader.peer

    def close(self) -> None:
        self.reader.close()


class Prepared:
    """Every piece of both tables prepared once (``prep_xfer_dlist``), and transfers made by
    index (``make_prepped_xfer``): the per-block way of vLLM's NixlConnector."""

    def __init__(self, agent: Agent, plan: TransferPlan, peer: str, *, nixl_merges: bool = True) -> None:
        self.nixl, self.plan, self.peer = agent.nixl, plan, peer
        self.nixl_merges = nixl_merges
        remote_streams = [plan.remote.streams[i] for i in plan.remote_streams]
        self.local = self.nixl.prep_xfer_dlist(
            "NIXL_INIT_AGENT", _every_piece(plan.local, plan.local.streams, plan), plan.local.memory
        )
        self.remote = self.nixl.prep_xfer_dlist(
            peer, _every_piece(plan.remote, remote_streams, plan), plan.remote.memory
        )

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

    def make(self, local_ids: Sequence[int], remote_ids: Sequence[int]) -> Any:
        local, remote = self.indices(local_ids, remote_ids)
        return self.nixl.make_prepped_xfer(
            "READ", self.local, local, self.remote, remote, skip_desc_merge=not self.nixl_merges
        )

    def read(self, local_ids: Sequence[int], remote_ids: Sequence[int]) -> NixlTransfer:
        handle = self.make(local_ids, remote_ids)
        return NixlTransfer(self.nixl, handle, self.nixl.transfer(handle))

    def close(self) -> None:
        self.local.release()
        self.remote.release()


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


@dataclass
class NixlTransfer:
    """A posted NIXL request, polled like ``kvhost.nixl.Transfer``."""

    nixl: Any
    handle: Any
    state: str

    def poll(self) -> bool:
        if self.state == "PROC":
            self.state = self.nixl.check_xfer_state(self.handle)
        if self.state not in ("DONE", "PROC"):
            raise RuntimeError(f"transfer failed: {self.state}")
        return self.state == "DONE"

    def release(self) -> None:
        self.handle.release()


def pull(start: Callable[[int], Transfer | NixlTransfer], requests: int, inflight: int) -> None:
    """Start request ``i`` with ``start(i)``, up to ``inflight`` at once, until every one is done."""
    pending = list(range(requests))[::-1]
    running: list[Transfer | NixlTransfer] = []
    deadline = time.monotonic() + TIMEOUT_S
    while pending or running:
        while pending and len(running) < inflight:
            running.append(start(pending.pop()))
        done = [t for t in running if t.poll()]
        for transfer in done:
            transfer.release()
            running.remove(transfer)
        if not done:
            if time.monotonic() > deadline:
                raise RuntimeError(f"transfers did not finish within {TIMEOUT_S:g} s")
            time.sleep(2e-4)


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
    handles: list[Any] = field(default_factory=list)  # NIXL requests made once, released at the end

    def transfer(self, name: str, inflight: int) -> Callable[[], None]:
        reader, batch = self.readers[name], self.batch
        if isinstance(reader, Batched):
            pairs = self.batch.pairs()
            return lambda: pull(lambda _: reader.reader.read_batch(pairs), 1, 1)
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
            return self._request(reader.descriptors(local_ids, remote_ids), reader.peer)

        def build() -> None:
            if isinstance(reader, Batched):
                self._request(reader.reader.batch_descriptors(pairs), reader.peer).release()
                return
            for local_ids, remote_ids in pairs:
                make(local_ids, remote_ids).release()

        return build

    def _request(self, rows: tuple[np.ndarray, np.ndarray], peer: str) -> Any:
        nixl = self.agent.nixl
        local = nixl.get_xfer_descs(rows[0], self.plan.local.memory)
        return nixl.initialize_xfer("READ", local, nixl.get_xfer_descs(rows[1], self.plan.remote.memory), peer)

    def plan_only(self, name: str) -> Callable[[], None]:
        """Work out every request's descriptors (rows, or indices into prepared lists) without
        handing them to NIXL: kvhost's share of ``build``."""
        reader = self.readers[name]
        pairs = self.batch.pairs()

        def plan() -> None:
            if isinstance(reader, Batched):
                reader.reader.batch_descriptors(pairs)
                return
            rows = reader.indices if isinstance(reader, Prepared) else reader.descriptors
            for local_ids, remote_ids in pairs:
                rows(local_ids, remote_ids)

        return plan

    def span(self, size: int, nbytes: int) -> tuple[Any, int]:
        """One NIXL request reading ``nbytes`` from one contiguous span of each layer into one of
        each local layer, in descriptors of ``size`` bytes (0: one per layer); and its count."""
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
        handle = nixl.initialize_xfer(
            "READ",
            nixl.get_xfer_descs(rows[0], memory),
            nixl.get_xfer_descs(rows[1], memory),
            self.readers[KVHOST].peer,
        )
        return handle, rows[0].shape[0]

    def descriptors(self, name: str) -> int:
        """Descriptors the transport is handed for the whole batch. For the prepared way as
        NIXL merges it: neighbouring indices joined where they continue one another in one
        registered region on both sides, without a bound (kvhost's rule, unbounded)."""
        reader, batch = self.readers[name], self.batch
        if isinstance(reader, Prepared) and reader.nixl_merges:
            merged = self.readers[KVHOST]
            return sum(
                self.plan.merged_pairs(
                    lo,
                    re,
                    max_bytes=1 << 62,
                    local_domains=merged.local_domains,
                    remote_domains=merged.remote_domains,
                )[0].shape[0]
                for lo, re in zip(batch.local_ids, batch.remote_ids)
            )
        if isinstance(reader, Prepared):
            return sum(len(reader.indices(lo, re)[0]) for lo, re in zip(batch.local_ids, batch.remote_ids))
        if isinstance(reader, Batched):
            return int(reader.reader.batch_descriptors(self.batch.pairs())[0].shape[0])
        return sum(reader.descriptors(lo, re)[0].shape[0] for lo, re in zip(batch.local_ids, batch.remote_ids))


def connect(args: argparse.Namespace) -> Setup:
    setting = Setting.parse(args.demo)
    batch = Batch.of(setting)
    env = dict(item.split("=", 1) for item in args.peer_env)
    peer = Peer(args, env)
    agent = Agent(f"bench-decode-{os.getpid()}", progress_thread=args.progress == "thread", threads=args.threads)
    local = setting.model.caches(setting.decode, batch.local_pool)
    plan = plan_transfer(agent.register(local, setting.axes, huge_pages=args.huge_pages == "on"), peer.table)
    name = agent.add_peer(peer.metadata)
    setup = Setup(batch, agent, peer, local, plan)
    setup.readers[PER_PIECE] = agent.reader(plan, name, max_descriptor_bytes=None)
    setup.readers[PREPPED] = Prepared(agent, plan, name)
    setup.readers[UNMERGED] = Prepared(agent, plan, name, nixl_merges=False)
    setup.readers[KVHOST] = agent.reader(plan, name)
    setup.readers[BATCH] = Batched(setup.readers[KVHOST])
    for bound in args.bounds:
        setup.readers[bound_name(bound)] = agent.reader(plan, name, max_descriptor_bytes=bound)
    return setup


def span_name(size: int) -> str:
    if size == 0:
        return "span/layer"
    return f"span/{size >> 20}MiB" if size >= 1 << 20 else f"span/{size >> 10}KiB"


def repost(nixl: Any, handle: Any) -> Callable[[], None]:
    """Post a NIXL request made once, and wait for it."""

    def post() -> None:
        transfer = NixlTransfer(nixl, handle, nixl.transfer(handle))
        deadline = time.monotonic() + TIMEOUT_S
        while not transfer.poll():
            if time.monotonic() > deadline:
                raise RuntimeError(f"a transfer did not finish within {TIMEOUT_S:g} s")
            time.sleep(2e-4)

    return post


def bound_name(bound: int) -> str:
    if bound >= 1 << 30:
        return f"{KVHOST}<=any"
    return f"{KVHOST}<={bound >> 20}MiB" if bound >= 1 << 20 else f"{KVHOST}<={bound >> 10}KiB"


def verify(setup: Setup, inflight: int) -> None:
    """Every way lands the same bytes, and after ``kvhost.receive`` every request's blocks hold
    the sender's tokens, bit for bit; blocks no request names keep the sentinel."""
    axes = setup.batch.setting.axes
    local_set = CacheSet(setup.local, axes)
    ways = [setup.transfer(name, inflight) for name in (PER_PIECE, PREPPED, UNMERGED, KVHOST, BATCH)]
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
    for way in ways:
        fill_sentinel(local)
        way()
        landed = [raw(tensor).clone() for tensor in local.values()]
        if first is None:
            first = landed
        elif not all(torch.equal(a, b) for a, b in zip(first, landed)):
            raise AssertionError("per-piece and merged descriptors landed different bytes")


def fill_sentinel(local: Mapping[str, torch.Tensor]) -> None:
    """Every byte of the receiver's caches set to ``SENTINEL``, before a way lands its bytes."""
    for tensor in local.values():
        raw(tensor).view(torch.uint8).fill_(SENTINEL)


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


def layered_descriptors(reader: Reader, batch: Batch) -> int:
    """Descriptors the layer-by-layer hand-off posts, every layer together."""
    return sum(rows.shape[0] for rows, _ in reader.layer_descriptors(batch.pairs()).values())


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Connect, verify, measure; the section of the results (``"transfer"``) for this setting."""
    load_before = os.getloadavg()[0]
    setup = connect(args)
    try:
        verify(setup, args.inflight)
        nbytes = setup.plan.bytes_for(sum(len(r) for r in setup.batch.remote_ids))
        device = BothSides(args.cache, setup.peer)
        space = Workspace(device)
        axes = setup.batch.setting.axes
        host = kvhost.KVHost(setup.local, axes=axes)
        parts: dict[str, list[float]] = {"transfer": [], "receive": [], "tail": []}
        merged = setup.transfer(BATCH, args.inflight)

        def handoff() -> None:
            started = time.perf_counter()
            merged()
            landed = time.perf_counter()
            post_process(setup, host)
            parts["transfer"].append(landed - started)
            parts["receive"].append(time.perf_counter() - landed)

        transfers = [PER_PIECE, PREPPED, UNMERGED, KVHOST, BATCH, *(bound_name(b) for b in args.bounds)]
        methods: dict[str, Callable[[], object]] = {ROOFLINE: space.memcpy(nbytes, device.device, device.device)}
        if args.huge_pages == "on":  # the roofline's memory as the caches'
            ring = space.memcpy_ranges(nbytes, device.device, device.device)
            back_with_huge_pages([(int(address), int(length)) for address, length in ring])
        methods |= {name: setup.transfer(name, args.inflight) for name in transfers}
        methods[HANDOFF] = handoff
        methods[LAYERED] = layered(setup, host, parts["tail"])
        methods |= {f"build {name}": setup.build(name) for name in (PER_PIECE, PREPPED, UNMERGED, KVHOST, BATCH)}
        methods |= {f"plan {name}": setup.plan_only(name) for name in (PER_PIECE, PREPPED, KVHOST, BATCH)}
        spans = {span_name(size): setup.span(size, nbytes) for size in args.sweep}
        setup.handles += [handle for handle, _ in spans.values()]
        methods |= {name: repost(setup.agent.nixl, handle) for name, (handle, _) in spans.items()}
        ids = np.array(sorted({b for r in setup.batch.local_ids for b in r}), dtype=np.int64)
        touched = np.concatenate(
            [block_ranges(setup.local, axes, ids), space.memcpy_ranges(nbytes, device.device, device.device)]
        )
        preset = replace(PRESETS["quick" if args.quick else "full"], seconds_per_point=args.seconds)
        measured = measure(methods, device, preset, args.rounds, random.Random(args.seed), touched)
        counts = {name: count for name, (_, count) in spans.items()}
        return summarise(args, setup, measured, nbytes, transfers, parts, load_before, counts)
    finally:
        for handle in setup.handles:
            handle.release()
        for reader in setup.readers.values():
            reader.close()
        setup.agent.close()
        setup.peer.close()


def summarise(
    args: argparse.Namespace,
    setup: Setup,
    measured: Measured,
    nbytes: int,
    transfers: list[str],
    parts: dict[str, list[float]],
    load_before: float,
    span_descriptors: dict[str, int],
) -> dict[str, Any]:
    samples = measured.used_samples()
    roof = samples[ROOFLINE].median
    # The per-block baseline: the faster way that posts one operation per piece. The
    # prepared way as NIXL merges it is reported beside it ("vs_prepped").
    best = min((PER_PIECE, UNMERGED), key=lambda name: samples[name].median)
    methods: dict[str, Any] = {}
    for name, sample in samples.items():
        entry: dict[str, Any] = {
            "median_s": sample.median,
            "p25_s": sample.quantile(0.25),
            "p75_s": sample.quantile(0.75),
            "rounds": len(sample.seconds),
            "samples_s": measured.samples[name].seconds,
            "used": measured.used[name],
        }
        if not name.startswith(("build ", "plan ")):
            entry["gbps"] = nbytes / sample.median / 1e9
            entry["fraction"] = roof / sample.median
            entry["fraction_rounds_p25_p75"] = per_round(measured, ROOFLINE, name)
        if name in transfers or name in (HANDOFF, LAYERED):
            entry["speedup"] = samples[best].median / sample.median
            entry["speedup_rounds_p25_p75"] = per_round(measured, best, name)
            entry["vs_prepped"] = samples[PREPPED].median / sample.median
        reader_name = name.removeprefix("build ").removeprefix("plan ")
        if reader_name in setup.readers:
            entry["descriptors"] = setup.descriptors(reader_name)
        if name in span_descriptors:
            entry["descriptors"] = span_descriptors[name]
        methods[name] = entry
    methods[HANDOFF]["transfer_median_s"] = float(np.median(parts["transfer"]))
    methods[HANDOFF]["receive_median_s"] = float(np.median(parts["receive"]))
    methods[LAYERED]["tail_median_s"] = float(np.median(parts["tail"]))
    methods[LAYERED]["descriptors"] = layered_descriptors(setup.readers[KVHOST], setup.batch)
    where = "two network namespaces over TCP" if args.peer_netns else "same host"
    speedup = methods[BATCH]["speedup"]
    checks = [check(where, "kvhost-batch / per-piece (best)", speedup, ">=", 2.0 if args.peer_netns else 3.0)]
    if not args.peer_netns:
        checks.append(check(where, "kvhost-batch / memcpy", methods[BATCH]["fraction"], ">=", 0.7))
        checks.append(check(where, "hand-off / memcpy", methods[HANDOFF]["fraction"], ">=", 0.5))
    c = setup.batch.setting
    m, w = c.model, c.workload
    return {
        "where": where,
        "command": " ".join(["kvhost bench", *args.argv]),
        "demo": args.demo,
        "model": f"{m.layers} layers x {'K/V x ' if m.kv == 2 else ''}{m.heads} heads x {m.head_dim} channels, "
        f"{m.dtype_name}",
        "sender": f"{c.prefill.layout} blocks of {c.prefill.block_size} tokens{c.prefill.layers_note}",
        "receiver": f"{c.decode.layout} blocks of {c.decode.block_size} tokens{c.decode.layers_note}",
        "cross_layer": c.prefill.cross_layer,
        "requests": len(setup.batch.remote_ids),
        "block_ids": f"{w.block_ids}" + (f" of 1..{w.max_run}" if w.block_ids == "runs" else ""),
        "bytes": nbytes,
        "pieces": setup.descriptors(PER_PIECE),
        "piece_bytes": setup.plan.chunk_bytes,
        "max_descriptor_bytes": MAX_DESCRIPTOR_BYTES,
        "inflight": args.inflight,
        "progress": args.progress,
        "threads": args.threads,
        "huge_pages": {
            "asked": args.huge_pages,
            "sender": setup.peer.huge_pages,
            "receiver": setup.agent.huge_pages.describe(),
        },
        "ucx": {k: v for k, v in os.environ.items() if k.startswith("UCX_")},
        "peer_netns": args.peer_netns,
        "peer_env": list(args.peer_env),
        "cache": args.cache,
        "load_average": [load_before, os.getloadavg()[0]],
        "machine": machine(),
        "rounds_run": len(next(iter(measured.samples.values())).seconds),
        "baseline_best": best,
        "methods": methods,
        "targets": {"checks": checks, "passed": all(c["passed"] for c in checks)},
    }


def table(result: dict[str, Any]) -> str:
    """One line per method: descriptors, time, GB/s, fraction of memcpy (with its spread over
    rounds), speedup over the faster per-piece way."""
    lines = [["method", "descriptors", "median ms", "GB/s", "x memcpy", "rounds p25-p75", "x per-piece", "x prepped"]]
    for name, m in result["methods"].items():
        spread = m.get("fraction_rounds_p25_p75") or []
        lines.append(
            [
                name,
                f"{m['descriptors']:,}" if "descriptors" in m else "-",
                f"{m['median_s'] * 1e3:.1f}",
                f"{m['gbps']:.2f}" if "gbps" in m else "-",
                f"{m['fraction']:.2f}" if "fraction" in m else "-",
                f"{spread[0]:.2f}-{spread[1]:.2f}" if spread else "-",
                f"{m['speedup']:.1f}x" if "speedup" in m else "-",
                f"{m['vs_prepped']:.2f}x" if "vs_prepped" in m else "-",
            ]
        )
    h = result["methods"][HANDOFF]
    head = (
        f"transfer ({result['where']}): {result['requests']} requests, {result['bytes'] / 1e6:,.1f} MB, "
        f"{result['model']}, {result['sender']} -> {result['receiver']}, block ids {result['block_ids']}; "
        f"{result['pieces']:,} pieces of {result['piece_bytes']:,} bytes; load {result['load_average'][0]:.1f}"
    )
    tail = (
        f"hand-off = transfer {h['transfer_median_s'] * 1e3:.1f} ms + receive {h['receive_median_s'] * 1e3:.1f} ms "
        f"(medians); hand-off-layered: receive after the last layer landed "
        f"{result['methods'][LAYERED]['tail_median_s'] * 1e3:.1f} ms; build: creating every request's NIXL "
        f"transfer, unposted; plan: its descriptors (rows, or indices into prepared lists) alone, without "
        f"NIXL; x per-piece: against the faster way of one operation per piece ({result['baseline_best']}); "
        f"x prepped: against {PREPPED}, whose neighbouring descriptors NIXL joins itself"
    )
    verdicts = [
        f"{c['what']} {c['value']:.2f} {c['op']} {c['limit']}: {'PASS' if c['passed'] else 'FAIL'}"
        for c in result["targets"]["checks"]
    ]
    return "\n".join([head, format_table(lines), tail, *verdicts])


if __name__ == "__main__":
    raise SystemExit(peer_main(sys.argv[1:]))
