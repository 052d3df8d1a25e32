"""``kvhost demo``: a prefill engine hands a batch of requests to a decode engine over real NIXL.

Two OS processes, each with its own NIXL agent over UCX on loopback (UCX_NET_DEVICES=lo
unless you set it). Decode (this process) listens on 127.0.0.1 only, starts prefill, hands it
a secret on its stdin, and receives its agent metadata, block table and requests over that
socket (``kvhost.nixl.framing``); a connection that does not prove the secret first is
dropped. Prefill fills its KV cache with values that are a seeded function of (request,
layer, K/V, token, head, channel). Decode allocates blocks, pulls every request with NIXL
(``kvhost.nixl``), post-processes the whole batch in one ``kvhost.receive`` call, and
checks every token bit for bit against the same function.

``--via-host`` lands the bytes in a registered host buffer shaped like the decode cache
instead (the same descriptors), ``kvhost.copy_blocks`` loads them into the cache and
``kvhost.receive`` rearranges them there: the path of decode engines whose memory NIXL
cannot reach. ``--decode-ranks R`` splits decode into R ranks of heads/R heads, each
reading only its share of the sender's heads (heterogeneous tensor parallelism).
``--kill-prefill-after N`` kills prefill once N requests have arrived: decode reports the
requests that failed, post-processes and verifies only those that arrived whole, and
exits 1. ``--freeze-prefill-after N`` stops it (SIGSTOP) instead: where the transport
needs the peer to answer (UCX over TCP alone), the transfers hang and decode's
per-transfer timeout ends them.

Exit status: 0 when every request verified, 1 only when requests failed (did not arrive,
or did not verify), 2 for anything else (impossible options, a hand-off that could not run).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import secrets
import select
import signal
import socket
import subprocess
import sys
import time
import traceback
import zlib
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, NoReturn, TextIO

import numpy as np
import torch

import kvhost
from kvhost.caches import CacheSet
from kvhost.errors import KVHostError
from kvhost.layout import Layout
from kvhost.nixl import (
    MAX_STREAMS,
    MAX_WAIT_SECONDS,
    Agent,
    Hello,
    InvalidTimeoutError,
    ProtocolError,
    RemoteRequest,
    Transfer,
    TransferError,
    TransferPlan,
    accept_hello,
    check_seconds,
    plan_transfer,
    prove,
    send_hello,
)
from kvhost.nixl.handshake import MAX_REQUESTS, MAX_TOKENS, SECRET_BYTES, send_done, wait_done
from kvhost.testing import make_cache, raw

AXES = "KBNHC"  # shape order of every cache here; the layout name sets the memory order
LAYOUTS = {"NHD": "KBNHC", "HND": "KBHNC"}  # token-major, head-major
DTYPES = {
    name: getattr(torch, name)
    for name in ("bfloat16", "float16", "float32", "float8_e4m3fn", "float8_e5m2", "int8", "uint8")
}
SENTINEL_BYTE = 0xA5  # what every decode block holds before anything lands in it
# 0: every request verified; 1: only that requests failed (did not arrive, or mismatched);
# 2: anything else (bad options, the hand-off could not run).
EXIT_OK, EXIT_FAILED, EXIT_ERROR = 0, 1, 2
# Where the NIXL/UCX agents of both processes listen, unless the user set it: loopback.
LOOPBACK_UCX = {"UCX_NET_DEVICES": "lo"}


class DemoError(KVHostError, RuntimeError):
    """The hand-off could not run: prefill failed to start, or a pool is too small."""


# --- what both processes agree on ----------------------------------------------------


@dataclass(frozen=True)
class Config:
    """The batch and the model, from the command line; both processes derive the same values."""

    requests: int
    min_tokens: int
    max_tokens: int
    layers: int
    heads: int
    head_dim: int
    dtype: torch.dtype
    seed: int

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> Config:
        return cls(
            args.requests,
            args.min_tokens,
            args.max_tokens,
            args.layers,
            args.heads,
            args.head_dim,
            DTYPES[args.dtype],
            args.seed,
        )

    def lengths(self) -> list[int]:
        """Token counts of the requests: log-uniform in [min_tokens, max_tokens], seeded."""
        rng = np.random.default_rng([self.seed, 1])
        logs = rng.uniform(math.log(self.min_tokens), math.log(self.max_tokens + 1), self.requests)
        return [min(int(math.exp(x)), self.max_tokens) for x in logs]

    def caches(
        self, layout: str, num_blocks: int, block_size: int, heads: int | None = None
    ) -> dict[str, torch.Tensor]:
        """Every layer's cache; ``heads`` less than the model's for one decode rank's share."""
        sizes = dict(K=2, B=num_blocks, N=block_size, H=heads or self.heads, C=self.head_dim)
        return {f"layer{i}": make_cache(AXES, LAYOUTS[layout], sizes, self.dtype) for i in range(self.layers)}


def token_values(
    seed: int, request: int, layer: int, tokens: int, heads: int, head_dim: int, itemsize: int
) -> torch.Tensor:
    """Raw ``[tokens, K, H, C]`` values of one request's layer: a hash of every index, seeded.

    Each element is a bijective 32-bit mix of its flat index and a key from (seed, request,
    layer), so no two elements of a request's layer agree in 32 bits and a misplaced byte
    shows; the low ``itemsize`` bytes are kept.
    """
    key = np.uint32(zlib.crc32(f"{seed}/{request}/{layer}".encode()))
    x = np.arange(tokens * 2 * heads * head_dim, dtype=np.uint32)
    x *= np.uint32(0x9E3779B1)
    x += key
    for shift, multiplier in ((16, 0x85EBCA6B), (13, 0xC2B2AE35)):
        x ^= x >> np.uint32(shift)
        x *= np.uint32(multiplier)
    x ^= x >> np.uint32(16)
    kept = {1: (np.uint8, np.uint8), 2: (np.uint16, np.int16), 4: (np.uint32, np.int32)}[itemsize]
    values = x.astype(kept[0]).view(kept[1]) if itemsize < 4 else x.view(np.int32)
    return torch.from_numpy(values).reshape(tokens, 2, heads, head_dim)


def blocks_for(tokens: int, block_size: int) -> int:
    return -(-tokens // block_size)


# --- prefill ------------------------------------------------------------------------


def run_prefill(args: argparse.Namespace) -> int:
    """Fill the cache, register it, prove who it is and send the hello, then hold the memory
    until decode is done."""
    secret = read_secret(sys.stdin.buffer, args.connect_timeout)
    config = Config.from_args(args)
    block_size = args.prefill_block_size
    lengths = config.lengths()
    needed = [blocks_for(t, block_size) for t in lengths]
    pool = sum(needed) + max(4, sum(needed) // 8)
    free = np.random.default_rng([config.seed, 2]).permutation(pool).tolist()
    caches = config.caches(args.prefill_layout, pool, block_size)
    started = time.perf_counter()
    cache_set = CacheSet(caches, AXES)
    for member in cache_set.members:
        raw(member.tensor).zero_()
    requests = []
    for number, (tokens, count) in enumerate(zip(lengths, needed)):
        ids, free = free[:count], free[count:]
        requests.append(RemoteRequest(f"req-{number:03d}", number, tokens, ids))
        for layer, member in enumerate(cache_set.members):
            values = token_values(
                config.seed, number, layer, tokens, config.heads, config.head_dim, member.layout.itemsize
            )
            write_tokens(member.tensor, AXES, ids, values)
    fill_seconds = time.perf_counter() - started

    with Agent(f"prefill-{os.getpid()}") as agent:
        table = agent.register(caches, AXES)
        with socket.create_connection(("127.0.0.1", args.port), timeout=args.connect_timeout) as sock:
            prove(sock, secret, timeout=args.connect_timeout)
            extra = {"fill_seconds": fill_seconds}
            send_hello(
                sock, table, requests, agent.metadata(), pid=os.getpid(), timeout=args.connect_timeout, extra=extra
            )
            # The memory must stay registered until decode has read it all.
            try:
                wait_done(sock, timeout=args.hold_timeout)
            except ProtocolError as err:
                print(f"prefill: decode went away: {err}", file=sys.stderr)
                return EXIT_ERROR
    return EXIT_OK


def read_secret(stream: Any, timeout: float) -> bytes:
    """The secret decode writes on prefill's stdin (hex, one line), within ``timeout`` seconds.

    Not argv, not the environment: any local user can read a process's command line in /proc.
    """
    ready, _, _ = select.select([stream], [], [], timeout)
    line = stream.readline(200) if ready else b""
    try:
        secret = bytes.fromhex(line.decode("ascii").strip())
    except (UnicodeDecodeError, ValueError):
        secret = b""
    if len(secret) != SECRET_BYTES:
        raise DemoError("no secret on stdin within the connect timeout: prefill is started by kvhost demo")
    return secret


def write_tokens(tensor: torch.Tensor, axes: str, block_ids: Sequence[int], values: torch.Tensor) -> None:
    """Store raw ``[tokens, K, H, C]`` values in ``block_ids`` (the last block may be partly used)."""
    memory, letters = memory_order(tensor, axes)
    block_size = memory.shape[letters.index("N")]
    padded = torch.zeros((len(block_ids) * block_size, *values.shape[1:]), dtype=values.dtype)
    padded[: values.shape[0]] = values
    blocks = padded.reshape(len(block_ids), block_size, *values.shape[1:])  # B N K H C
    source = blocks.permute(["BNKHC".index(a) for a in letters])
    memory.index_copy_(letters.index("B"), torch.as_tensor(block_ids), source)


def read_tokens_fast(tensor: torch.Tensor, axes: str, block_ids: Sequence[int]) -> torch.Tensor:
    """Raw ``[tokens, K, H, C]`` of ``block_ids``, gathered in memory order (fast for any layout)."""
    memory, letters = memory_order(tensor, axes)
    picked = memory.index_select(letters.index("B"), torch.as_tensor(block_ids))
    tokens = picked.permute([letters.index(a) for a in "BNKHC"])
    return tokens.reshape(-1, *tokens.shape[2:])


def memory_order(tensor: torch.Tensor, axes: str) -> tuple[torch.Tensor, str]:
    """The raw bytes of ``tensor`` with its dims in memory order, and their letters."""
    letters = Layout.of(tensor, axes).physical
    return raw(tensor).permute([axes.index(a) for a in letters]), letters


# --- decode -------------------------------------------------------------------------


@dataclass
class Request:
    """One request as prefill announced it, and what became of it here."""

    name: str
    number: int
    tokens: int
    remote_ids: Sequence[int] | np.ndarray
    local_ids: list[int] = field(default_factory=list)
    staging_ids: list[int] = field(default_factory=list)
    transfer: Transfers | None = None
    deadline: float = 0.0
    arrived: bool = False
    failure: str | None = None


def running(prefill: subprocess.Popen[bytes] | None) -> Callable[[], None]:
    """What ``accept_hello`` watches while it waits: prefill dying first is a DemoError."""

    def check() -> None:
        if prefill is not None and prefill.poll() is not None:
            raise DemoError(f"prefill exited with code {prefill.returncode} before it connected")

    return check


def fill_seconds(hello: Hello) -> float:
    """How long prefill took to fill its cache: the demo's own field of the hello, checked."""
    return hello.fields.seconds("fill_seconds", default=0.0)


class Transfers:
    """One request's reads, one per decode rank: arrived when every one has."""

    def __init__(
        self, readers: Sequence[kvhost.nixl.Reader], local_ids: list[int], remote_ids: Sequence[int] | np.ndarray
    ) -> None:
        self.parts: list[Transfer] = []
        try:
            for reader in readers:
                self.parts.append(reader.read(local_ids, remote_ids))
        except TransferError:
            self.release()
            raise

    @property
    def nbytes(self) -> int:
        return sum(part.nbytes for part in self.parts)

    def poll(self) -> bool:
        return all([part.poll() for part in self.parts])  # a list: every part reports its failure

    def release(self) -> None:
        for part in self.parts:
            part.release()


@dataclass(eq=False)
class Rank:
    """One decode rank: its caches, holding ``heads`` of the model's heads from
    ``first_head``, and the host buffer it lands bytes in (``--via-host``)."""

    caches: dict[str, torch.Tensor]
    heads: int
    first_head: int = 0
    staging: dict[str, torch.Tensor] | None = None


class ProgressBar:
    """``label [#####-----] done/total detail`` on one terminal line; silent when not on a terminal."""

    def __init__(self, label: str, total: int, stream: TextIO, enabled: bool) -> None:
        self.label, self.total, self.stream, self.enabled = label, max(total, 1), stream, enabled
        self.shown = 0.0

    def update(self, done: int, detail: str = "", *, force: bool = False) -> None:
        now = time.monotonic()
        if not self.enabled or (not force and now - self.shown < 0.05):
            return
        self.shown = now
        filled = round(24 * done / self.total)
        self.stream.write(f"\r{self.label:<9} [{'#' * filled}{'-' * (24 - filled)}] {done}/{self.total} {detail}\x1b[K")
        self.stream.flush()

    def close(self, done: int, detail: str = "") -> None:
        if self.enabled:
            self.update(done, detail, force=True)
            self.stream.write("\n")
            self.stream.flush()


@dataclass
class Outcome:
    """What the decode side measured and found: the report prints it, ``--json`` saves it."""

    figures: dict[str, Any] = field(default_factory=dict)
    failed: dict[str, str] = field(default_factory=dict)
    received: list[str] = field(default_factory=list)
    verified: list[str] = field(default_factory=list)
    mismatched: dict[str, str] = field(default_factory=dict)
    lines: list[str] = field(default_factory=list)
    error: str | None = None

    @property
    def ok(self) -> bool:
        return not (self.failed or self.mismatched or self.error) and len(self.verified) == self.figures.get("requests")


def run_decode(args: argparse.Namespace, argv: Sequence[str]) -> int:
    """Start prefill, pull the batch, post-process it, verify it, report."""
    begun = time.perf_counter()
    config = Config.from_args(args)
    outcome = Outcome()
    outcome.figures["ucx_net_devices"] = os.environ.get("UCX_NET_DEVICES", "all")
    prefill: subprocess.Popen[bytes] | None = None
    sock: socket.socket | None = None
    agent: Agent | None = None
    secret = secrets.token_bytes(SECRET_BYTES)
    try:
        with socket.create_server(("127.0.0.1", 0)) as listener:
            prefill = started = start_prefill(listener.getsockname()[1], argv, secret)
            local_blocks = [
                blocks_for(blocks_for(t, args.prefill_block_size) * args.prefill_block_size, args.decode_block_size)
                for t in config.lengths()
            ]
            pool = sum(local_blocks) + max(4, sum(local_blocks) // 8)
            heads = config.heads // args.decode_ranks
            rank_caches = [
                config.caches(args.decode_layout, pool, args.decode_block_size, heads) for _ in range(args.decode_ranks)
            ]
            for caches in rank_caches:
                for tensor in caches.values():
                    raw(tensor).view(torch.uint8).fill_(SENTINEL_BYTE)
            agent = Agent(f"decode-{os.getpid()}")
            sock, hello, dropped = accept_hello(listener, secret, args.connect_timeout, watch=running(prefill))
            outcome.figures.update(
                hello_seconds=time.perf_counter() - begun,
                dropped_connections=dropped,
                fill_seconds=fill_seconds(hello),
            )
            if dropped:
                outcome.lines.append(
                    f"control   {dropped} other connection(s) to the control port dropped: they did not prove "
                    "they were prefill"
                )
        peer = agent.add_peer(hello.metadata)
        handoff(args, config, agent, peer, hello, rank_caches, pool, started, outcome)
        with contextlib.suppress(ProtocolError):  # a prefill that was killed cannot be told
            send_done(sock, ok=outcome.ok, timeout=args.timeout)
    except KVHostError as err:
        outcome.error = f"{type(err).__name__}: {err}"
    except MemoryError:
        outcome.error = f"out of memory: {memory_options(args)} need more memory than this machine has free"
    except RuntimeError as err:
        if "allocate" not in str(err):  # torch's allocator: "DefaultCPUAllocator: can't allocate memory"
            raise
        outcome.error = f"out of memory: {memory_options(args)}: {str(err).splitlines()[0]}"
    finally:
        if sock is not None:
            sock.close()
        if agent is not None:
            agent.close()
        if prefill is not None:
            frozen = args.freeze_prefill_after is not None and "fault_after" in outcome.figures
            # After ``done`` prefill exits on its own; frozen, or never told, it is killed.
            stop_prefill(prefill, patience=0.1 if frozen or outcome.error else 10)
    print_report(outcome, sys.stdout)
    if args.json:
        write_json(args.json, outcome)
    if outcome.error:
        return EXIT_ERROR
    return EXIT_OK if outcome.ok else EXIT_FAILED


def handoff(
    args: argparse.Namespace,
    config: Config,
    agent: Agent,
    peer: str,
    hello: Hello,
    rank_caches: list[dict[str, torch.Tensor]],
    pool: int,
    prefill: subprocess.Popen[bytes],
    outcome: Outcome,
) -> None:
    """Plan, allocate, pull, post-process, verify: the decode side of one batch."""
    remote = hello.table
    heads = config.heads // len(rank_caches)
    ranks, readers = [], []
    for index, caches in enumerate(rank_caches):
        # With several ranks each reads its share of the sender's heads (RegionTable.heads).
        share = remote.heads(index * heads, heads) if len(rank_caches) > 1 else remote
        staging = None
        if args.via_host:
            # The host buffer is shaped like the cache, so NIXL lands the same wire bytes in
            # it, one descriptor per sender region, as it would in the cache itself;
            # copy_blocks then loads the blocks and receive rearranges them where they are read.
            staging = config.caches(args.decode_layout, pool, args.decode_block_size, heads)
        plan = plan_transfer(agent.register(staging or caches, AXES), share)  # alike for every rank
        ranks.append(Rank(caches, heads, index * heads, staging))
        readers.append(agent.reader(plan, peer))

    free = np.random.default_rng([config.seed, 3]).permutation(pool).tolist()
    next_staging = 0
    requests = [Request(r.name, r.number, r.tokens, r.remote_ids) for r in hello.requests]
    for request in requests:
        count = plan.local_blocks_for(len(request.remote_ids))
        if count > len(free):
            raise DemoError(f"request {request.name!r} needs {count} decode blocks, only {len(free)} are free")
        request.local_ids, free = free[:count], free[count:]
        request.staging_ids = list(range(next_staging, next_staging + count))
        next_staging += count

    figures = outcome.figures
    figures.update(
        requests=len(requests),
        tokens=sum(r.tokens for r in requests),
        prefill_blocks=sum(len(r.remote_ids) for r in requests),
        decode_blocks=sum(len(r.local_ids) for r in requests),
        decode_ranks=len(ranks),
        spare_blocks=len(free),
        pool=pool,
        descriptors=len(ranks) * sum(plan.bytes_for(len(r.remote_ids)) for r in requests) // plan.chunk_bytes,
        prefill_pid=hello.pid,
    )
    describe_setup(args, config, plan, hello, outcome)

    pull(args, readers, requests, prefill, outcome)
    arrived = [r for r in requests if r.arrived]
    outcome.failed = {r.name: r.failure or "did not arrive" for r in requests if not r.arrived}
    if arrived:
        post_process(args, config, ranks, plan, arrived, outcome)
    outcome.figures["memcpy_gbps"] = memcpy_gbps(outcome.figures.get("transfer_bytes", 0))
    verify(args, config, ranks, arrived, free, outcome)


def memcpy_gbps(nbytes: int, repeats: int = 5) -> float:
    """This machine's copy rate right now (median of a few): the yardstick for the figures above."""
    size = min(max(nbytes, 1 << 20), 64 << 20)
    source, target = torch.ones(size, dtype=torch.uint8), torch.empty(size, dtype=torch.uint8)
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        target.copy_(source)
        times.append(time.perf_counter() - started)
    return size / sorted(times)[repeats // 2] / 1e9


def pull(
    args: argparse.Namespace,
    readers: list[kvhost.nixl.Reader],
    requests: list[Request],
    prefill: subprocess.Popen[bytes],
    outcome: Outcome,
) -> None:
    """Read every request (one read per rank) with up to ``--inflight`` requests in flight,
    each bounded by ``--timeout``.

    Once the peer fails, nothing new is started: transfers already posted finish or fail
    (each within its deadline), and the requests never started fail with the cause.
    """
    pending = deque(requests)
    inflight: list[Request] = []
    peer_lost: str | None = None
    arrived_bytes = 0
    bar = ProgressBar("transfer", len(requests), sys.stderr, not args.no_progress and sys.stderr.isatty())
    started = time.perf_counter()
    done = 0

    fault_after = args.kill_prefill_after if args.kill_prefill_after is not None else args.freeze_prefill_after
    faulted = False

    def fault_if_due() -> None:
        """Kill (SIGKILL) or freeze (SIGSTOP) prefill once ``fault_after`` requests have arrived."""
        nonlocal faulted
        if fault_after is None or faulted or done < fault_after or prefill.poll() is not None:
            return
        faulted = True
        if args.kill_prefill_after is not None:
            prefill.send_signal(signal.SIGKILL)
            with contextlib.suppress(subprocess.TimeoutExpired):
                prefill.wait(timeout=10)
            what = "killed"
        else:
            prefill.send_signal(signal.SIGSTOP)
            wait_until_stopped(prefill.pid)
            what = "froze (SIGSTOP)"
        outcome.figures["fault_after"] = done
        outcome.lines.append(f"fault     {what} prefill (pid {prefill.pid}) after {done} requests had arrived")

    fault_if_due()
    while pending or inflight:
        while pending and len(inflight) < args.inflight and peer_lost is None:
            request = pending.popleft()
            try:
                local_ids = request.staging_ids if args.via_host else request.local_ids
                request.transfer = Transfers(readers, local_ids, request.remote_ids)
            except TransferError as err:
                request.failure = peer_lost = str(err)
                break
            request.deadline = time.monotonic() + args.timeout
            inflight.append(request)
        progressed = False
        for request in list(inflight):
            transfer = request.transfer
            assert transfer is not None
            try:
                if transfer.poll():
                    request.arrived, progressed = True, True
                    arrived_bytes += transfer.nbytes
                    done += 1
                elif time.monotonic() > request.deadline:
                    raise TransferError(f"no completion within {args.timeout:g} s", timed_out=True)
                else:
                    continue
            except TransferError as err:
                request.failure = str(err)
                peer_lost = peer_lost or str(err)
                progressed = True
            transfer.release()
            inflight.remove(request)
            fault_if_due()
        if peer_lost is not None:
            for request in pending:
                request.failure = "not started: the peer had failed"
            pending.clear()
        elapsed = time.perf_counter() - started
        bar.update(done, f"{arrived_bytes / 1e6:,.0f} MB {arrived_bytes / max(elapsed, 1e-9) / 1e9:.2f} GB/s")
        if not progressed:
            time.sleep(5e-4)
    seconds = time.perf_counter() - started
    bar.close(done, f"{arrived_bytes / 1e6:,.0f} MB in {seconds:.2f} s")
    outcome.figures.update(transfer_bytes=arrived_bytes, transfer_seconds=seconds)


def post_process(
    args: argparse.Namespace,
    config: Config,
    ranks: list[Rank],
    plan: TransferPlan,
    arrived: list[Request],
    outcome: Outcome,
) -> None:
    """One receive per rank for the whole batch, in place; via the host buffer, one
    copy_blocks first.

    First calls on a few scratch blocks come before, so the figure measures the work and
    not the backend's one-time start (kernel compilation); that time is reported apart.
    """

    def receive(target: dict[str, torch.Tensor], requests: dict[str, list[int]]) -> kvhost.ReceiveStats:
        order, size = plan.remote_order, plan.remote_block_size
        return kvhost.receive(
            target, requests, axes=AXES, remote_order=order, remote_block_size=size, backend=args.backend
        )

    first = plan.local_blocks_for(1)
    heads = ranks[0].heads
    scratch = config.caches(args.decode_layout, first, args.decode_block_size, heads)
    scratch_ids = list(range(first))
    started = time.perf_counter()
    if args.via_host:
        warm_source = config.caches(args.decode_layout, first, args.decode_block_size, heads)
        kvhost.copy_blocks(warm_source, scratch, scratch_ids, scratch_ids, axes=AXES, backend=args.backend).wait()
    receive(scratch, {"warm-up": scratch_ids})
    warm_up = time.perf_counter() - started
    started = time.perf_counter()
    loaded_bytes, runs, moved, groups, backend = 0, 0, 0, 0, ""
    for rank in ranks:
        if rank.staging is not None:
            loaded = kvhost.copy_blocks(
                rank.staging,
                rank.caches,
                [i for r in arrived for i in r.staging_ids],
                [i for r in arrived for i in r.local_ids],
                axes=AXES,
                backend=args.backend,
            ).wait()
            loaded_bytes, runs = loaded_bytes + loaded.bytes_moved, loaded.runs
        stats = receive(rank.caches, {r.name: r.local_ids for r in arrived})
        moved, groups, backend = moved + stats.bytes_moved, stats.groups, stats.backend
    what = f"kvhost.copy_blocks from the host buffer ({runs} runs), then " if args.via_host else ""
    what += f"kvhost.receive, {groups} group(s)" if moved else "kvhost.receive: identity, nothing to move"
    if len(ranks) > 1:
        what += f", on each of {len(ranks)} ranks"
    nbytes = loaded_bytes + moved
    seconds = time.perf_counter() - started
    outcome.received = [r.name for r in arrived]
    outcome.figures.update(
        post_bytes=nbytes, post_seconds=seconds, backend=backend, post_what=what, warm_up_seconds=warm_up
    )


def verify(
    args: argparse.Namespace,
    config: Config,
    ranks: list[Rank],
    arrived: list[Request],
    spare: list[int],
    outcome: Outcome,
) -> None:
    """Every token of every arrived request on every rank (its heads), bit for bit; spare
    blocks must hold the sentinel."""
    started = time.perf_counter()
    cache_sets = [CacheSet(rank.caches, AXES) for rank in ranks]
    bar = ProgressBar("verify", len(arrived), sys.stderr, not args.no_progress and sys.stderr.isatty())
    for done, request in enumerate(arrived, 1):
        problem = None
        for layer in range(len(cache_sets[0].members)):
            whole = token_values(
                config.seed,
                request.number,
                layer,
                request.tokens,
                config.heads,
                config.head_dim,
                cache_sets[0].members[layer].layout.itemsize,
            )
            for number, (rank, cache_set) in enumerate(zip(ranks, cache_sets)):
                member = cache_set.members[layer]
                got = read_tokens_fast(member.tensor, AXES, request.local_ids)[: request.tokens]
                want = whole.narrow(2, rank.first_head, rank.heads)  # [tokens, K, H, C]
                if not torch.equal(got, want):
                    bad = (got != want).nonzero()[0].tolist()
                    where = f"rank {number} " if len(ranks) > 1 else ""
                    problem = (
                        f"{where}{member.layer} token {bad[0]} K/V {bad[1]} "
                        f"head {rank.first_head + bad[2]} channel {bad[3]} differs"
                    )
                    break
            if problem is not None:
                break
        if problem is None:
            outcome.verified.append(request.name)
        else:
            outcome.mismatched[request.name] = problem
        bar.update(done)
    bar.close(len(arrived))
    untouched = True
    if spare:
        index = torch.as_tensor(spare)
        for member in (m for cache_set in cache_sets for m in cache_set.members):
            blocks = raw(member.tensor).index_select(AXES.index("B"), index).contiguous().view(torch.uint8)
            untouched &= bool((blocks == SENTINEL_BYTE).all())
    if not untouched:
        outcome.mismatched["spare blocks"] = "a block no request owns was written"
    outcome.figures.update(
        verify_seconds=time.perf_counter() - started,
        spare_untouched=untouched,
        verified_tokens=sum(r.tokens for r in arrived if r.name in outcome.verified),
        layers=config.layers,
    )


# --- process management and output --------------------------------------------------


def start_prefill(port: int, argv: Sequence[str], secret: bytes) -> subprocess.Popen[bytes]:
    """Run prefill as its own OS process, with this command's options and the socket's port;
    the secret it proves itself with goes on its stdin (argv is readable by anyone in /proc)."""
    env = dict(os.environ)
    env.setdefault("NIXL_LOG_LEVEL", "WARN")
    command = [sys.executable, "-m", "kvhost.demo", *argv, "--role", "prefill", "--port", str(port)]
    prefill = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, env=env)
    assert prefill.stdin is not None
    try:
        prefill.stdin.write(secret.hex().encode() + b"\n")  # 65 bytes: a pipe never blocks on them
        prefill.stdin.close()
    except OSError as err:  # it died at once
        stop_prefill(prefill, patience=0.1)
        raise DemoError(f"could not hand prefill its secret: {err}") from None
    return prefill


def stop_prefill(prefill: subprocess.Popen[bytes], patience: float) -> None:
    """Let prefill exit on its own within ``patience`` seconds; kill it if it lingers."""
    try:
        prefill.wait(timeout=patience)
    except subprocess.TimeoutExpired:
        prefill.kill()
        with contextlib.suppress(subprocess.TimeoutExpired):  # a process stuck in the kernel: leave it
            prefill.wait(timeout=10)


def wait_until_stopped(pid: int, timeout: float = 2.0) -> None:
    """Return once ``pid`` shows as stopped (Linux /proc), or after ``timeout``."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with open(f"/proc/{pid}/stat") as stat:
                if stat.read().rsplit(")", 1)[1].split()[0] in "Tt":
                    return
        except OSError:
            return
        time.sleep(0.005)


def describe_setup(
    args: argparse.Namespace, config: Config, plan: TransferPlan, hello: Hello, outcome: Outcome
) -> None:
    f = outcome.figures
    lengths = [r.tokens for r in hello.requests]
    local, remote = plan.local, plan.remote
    ratio = local.block_size / remote.block_size
    if ratio > 1:
        relation = f"r = {int(ratio)} sender blocks per decode block"
    elif ratio < 1:
        relation = f"g = {round(1 / ratio)} decode blocks per sender block"
    else:
        relation = "same block size"
    mode = "into a host buffer shaped like the cache" if args.via_host else "straight into the decode cache"
    outcome.lines += [
        f"prefill   pid {hello.pid}: {args.prefill_layout} (memory {LAYOUTS[args.prefill_layout]}), "
        f"block {remote.block_size} tokens, {remote.num_blocks} blocks; filled in {f['fill_seconds']:.2f} s, "
        f"said hello {f['hello_seconds']:.2f} s after the start",
        f"decode    pid {os.getpid()}: {args.decode_layout} (memory {LAYOUTS[args.decode_layout]}), "
        f"block {args.decode_block_size} tokens, {f['pool']} blocks"
        + (
            f"; {f['decode_ranks']} ranks of {config.heads // f['decode_ranks']} heads each"
            if f["decode_ranks"] > 1
            else ""
        ),
        f"model     {config.layers} layers x K/V x {config.heads} heads x {config.head_dim} channels, "
        f"{str(config.dtype).removeprefix('torch.')}",
        f"requests  {f['requests']} ({min(lengths)}..{max(lengths)} tokens, {f['tokens']:,} in all)",
        f"blocks    {f['prefill_blocks']:,} prefill -> {f['decode_blocks']:,} decode ({relation}); "
        f"{f['descriptors']:,} descriptors of {plan.chunk_bytes:,} bytes, {mode}",
    ]


def print_report(outcome: Outcome, stream: TextIO) -> None:
    f = outcome.figures
    devices = f.get("ucx_net_devices", "lo")
    where = "127.0.0.1" if devices == "lo" else f"UCX_NET_DEVICES={devices}"
    stream.write(f"kvhost demo: prefill -> decode over NIXL (UCX, {where}), two processes\n")
    for line in outcome.lines:
        stream.write(f"  {line}\n")
    if "transfer_seconds" in f:
        stream.write(
            f"  transfer  {_gb(f['transfer_bytes'])} in {f['transfer_seconds']:.3f} s = "
            f"{_rate(f['transfer_bytes'], f['transfer_seconds'])}{_ratio(f, 'transfer')} (NIXL READ)\n"
        )
    if "post_seconds" in f:
        stream.write(
            f"  post      {f['post_what']}, backend {f['backend']}: {_gb(f['post_bytes'])} in "
            f"{f['post_seconds']:.3f} s = {_rate(f['post_bytes'], f['post_seconds'])}{_ratio(f, 'post')} "
            f"(first call on scratch blocks before it: {f['warm_up_seconds']:.2f} s)\n"
        )
    if "memcpy_gbps" in f:
        stream.write(f"  memcpy    {f['memcpy_gbps']:.2f} GB/s on this machine now (median of 5 copies)\n")
    if "verify_seconds" in f:
        spare = "untouched" if f["spare_untouched"] else "CHANGED"
        stream.write(
            f"  verify    {len(outcome.verified)}/{f['requests']} requests, {f['verified_tokens']:,} tokens x "
            f"{f['layers']} layers x K/V bit for bit in {f['verify_seconds']:.2f} s; "
            f"{f['spare_blocks']} spare blocks {spare}\n"
        )
    causes: dict[str, list[str]] = {}
    for name, why in outcome.failed.items():
        causes.setdefault(why, []).append(name)
    for why, names in causes.items():
        stream.write(f"  failed    {_names(names)}: {why}\n")
    for name, why in outcome.mismatched.items():
        stream.write(f"  MISMATCH  {name}: {why}\n")
    if outcome.error:
        stream.write(f"  error     {outcome.error}\n")
        stream.write("  result    FAILED: the hand-off did not run\n")
    elif outcome.ok:
        stream.write("  result    OK: every byte of every request verified\n")
    else:
        stream.write(
            f"  result    FAILED: {len(outcome.failed)} of {f.get('requests')} requests did not arrive "
            f"(not marked received); {len(outcome.verified)} of the {len(outcome.received)} that arrived "
            f"verified bit for bit, {len(outcome.mismatched)} mismatched\n"
        )
    stream.flush()


def write_json(path: str, outcome: Outcome) -> None:
    data = {
        "ok": outcome.ok,
        "error": outcome.error,
        "figures": outcome.figures,
        "received": outcome.received,
        "verified": outcome.verified,
        "failed": outcome.failed,
        "mismatched": outcome.mismatched,
    }
    with open(path, "w") as out:
        json.dump(data, out, indent=1)


def _names(names: list[str]) -> str:
    shown = ", ".join(names) if len(names) <= 4 else f"{', '.join(names[:2])} ... {names[-1]}"
    return f"{shown} ({len(names)} request{'s' if len(names) > 1 else ''})"


def _ratio(f: dict[str, Any], what: str) -> str:
    """`` = 0.12 x memcpy``: a rate as a share of this run's own copy rate."""
    if not f.get("memcpy_gbps") or not f[f"{what}_seconds"]:
        return ""
    return f" = {f[f'{what}_bytes'] / f[f'{what}_seconds'] / 1e9 / f['memcpy_gbps']:.2f} x memcpy"


def _gb(nbytes: int) -> str:
    return f"{nbytes / 1e6:,.1f} MB"


def _rate(nbytes: int, seconds: float) -> str:
    return f"{nbytes / max(seconds, 1e-9) / 1e9:.2f} GB/s"


# --- command line -------------------------------------------------------------------


class _HelpFormatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """The module docstring as written, and every option's default."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        """One line on stderr naming the option, and exit 2 (``--help`` lists the options)."""
        self.exit(EXIT_ERROR, f"{self.prog}: error: {message}\n")


def _seconds(text: str) -> float:
    """An option's seconds: a finite number above 0, at most a week (never NaN or infinite)."""
    try:
        return check_seconds(float(text), "", positive=True)
    except (ValueError, InvalidTimeoutError):
        raise argparse.ArgumentTypeError(
            f"expected a number of seconds in (0, {MAX_WAIT_SECONDS:g}], got {text!r}"
        ) from None


def parser() -> argparse.ArgumentParser:
    p = _Parser(prog="kvhost demo", description=__doc__, formatter_class=_HelpFormatter)
    p.add_argument("--prefill-block-size", type=int, default=16, metavar="N", help="tokens per prefill block")
    p.add_argument("--decode-block-size", type=int, default=64, metavar="N", help="tokens per decode block")
    p.add_argument("--prefill-layout", choices=sorted(LAYOUTS), default="HND", help="prefill cache layout")
    p.add_argument("--decode-layout", choices=sorted(LAYOUTS), default="NHD", help="decode cache layout")
    p.add_argument("--layers", type=int, default=4, help="layers, each a [2, blocks, N, heads, head_dim] cache")
    p.add_argument("--heads", type=int, default=8, help="KV heads")
    p.add_argument("--head-dim", type=int, default=64, help="channels per head")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bfloat16", help="cache dtype")
    p.add_argument("--requests", type=int, default=40, help=f"requests in the batch (at most {MAX_REQUESTS})")
    p.add_argument("--min-tokens", type=int, default=16, help="shortest request")
    p.add_argument("--max-tokens", type=int, default=2048, help="longest request (lengths are log-uniform)")
    p.add_argument("--seed", type=int, default=0, help="seed of lengths, block ids and values")
    p.add_argument("--backend", default=None, help="kvhost backend for the post-process (None: chosen by device)")
    p.add_argument("--via-host", action="store_true", help="land bytes in a host buffer, then copy_blocks")
    p.add_argument(
        "--decode-ranks",
        type=int,
        default=1,
        metavar="R",
        help="decode ranks per prefill rank (heterogeneous TP): each holds and reads heads/R heads",
    )
    faults = p.add_mutually_exclusive_group()
    faults.add_argument("--kill-prefill-after", type=int, metavar="N", help="kill prefill after N requests arrived")
    faults.add_argument("--freeze-prefill-after", type=int, metavar="N", help="stop prefill (SIGSTOP) after N arrived")
    p.add_argument("--inflight", type=int, default=8, help="transfers in flight at once")
    p.add_argument("--timeout", type=_seconds, default=10.0, help="seconds one transfer may take")
    p.add_argument("--connect-timeout", type=_seconds, default=60.0, help="seconds for prefill to start and say hello")
    p.add_argument("--json", metavar="PATH", help="also write the outcome as JSON")
    p.add_argument("--no-progress", action="store_true", help="no progress bar (it shows only on a terminal)")
    # Set by decode when it starts prefill; not for people.
    p.add_argument("--role", choices=["decode", "prefill"], default="decode", help=argparse.SUPPRESS)
    p.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--hold-timeout", type=_seconds, default=600.0, help=argparse.SUPPRESS)
    return p


# Option: (least, most). The most are what the hello can carry (requests, tokens, streams
# of layers x K/V, sizes in a block table), so decode never refuses its own prefill's hello.
OPTION_RANGES = {
    "prefill_block_size": (1, MAX_TOKENS),
    "decode_block_size": (1, MAX_TOKENS),
    "layers": (1, MAX_STREAMS // 2),
    "heads": (1, 1 << 24),
    "head_dim": (1, 1 << 24),
    "requests": (1, MAX_REQUESTS),
    "min_tokens": (1, MAX_TOKENS),
    "max_tokens": (1, MAX_TOKENS),
    "seed": (0, (1 << 63) - 1),
    "inflight": (1, MAX_REQUESTS),
    "decode_ranks": (1, 1 << 24),
    "kill_prefill_after": (0, MAX_REQUESTS),
    "freeze_prefill_after": (0, MAX_REQUESTS),
    "port": (0, 65535),
}


def check_args(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Refuse impossible options (exit 2, one line naming the option) before anything starts."""
    for name, (least, most) in OPTION_RANGES.items():
        value = getattr(args, name)
        if value is not None and not least <= value <= most:
            p.error(f"--{name.replace('_', '-')} must be in [{least}, {most}], got {value}")
    big, small = sorted((args.prefill_block_size, args.decode_block_size), reverse=True)
    if big % small:
        p.error(f"block sizes {args.prefill_block_size} and {args.decode_block_size} must divide one another")
    if args.heads % args.decode_ranks:
        p.error(f"--heads {args.heads} cannot be shared out evenly to {args.decode_ranks} decode ranks")
    if args.decode_ranks > 1 and args.prefill_layout != "HND":
        p.error(
            "--decode-ranks needs --prefill-layout HND: a token-major sender scatters a share of heads over every token"
        )
    if args.max_tokens < args.min_tokens:
        p.error(f"--max-tokens {args.max_tokens} is below --min-tokens {args.min_tokens}")
    if args.role == "prefill":
        if args.port < 1:
            p.error(f"--port must be in [1, 65535] for prefill, got {args.port}")
        return  # decode checked the memory before starting it, and holds some of it by now
    needed, available = memory_needed(args), memory_available()
    if available is not None and needed > available:
        p.error(
            f"{memory_options(args)} need {needed / 1e9:,.1f} GB for the caches of both processes, "
            f"more than the {available / 1e9:,.1f} GB of memory available"
        )


def memory_options(args: argparse.Namespace) -> str:
    """The options that size the caches, as given."""
    text = (
        f"--layers {args.layers} x --heads {args.heads} x --head-dim {args.head_dim} x --dtype {args.dtype}, "
        f"--requests {args.requests} of --min-tokens {args.min_tokens} to --max-tokens {args.max_tokens}, "
        f"--prefill-block-size {args.prefill_block_size}, --decode-block-size {args.decode_block_size}"
    )
    return text + (", --via-host" if args.via_host else "")


def memory_needed(args: argparse.Namespace) -> int:
    """Bytes both processes allocate, estimated before anything is: prefill's cache, decode's
    (twice with ``--via-host``: the host buffer is shaped like it), and working memory for
    the largest request (its values as 32-bit words, a few times over)."""
    config = Config.from_args(args)
    itemsize = int(torch.empty(0, dtype=config.dtype).element_size())
    per_token = config.layers * 2 * config.heads * config.head_dim * itemsize
    lengths = config.lengths()
    prefill = [blocks_for(t, args.prefill_block_size) for t in lengths]
    decode = [blocks_for(n * args.prefill_block_size, args.decode_block_size) for n in prefill]
    pools = [sum(blocks) + max(4, sum(blocks) // 8) for blocks in (prefill, decode)]
    caches = per_token * (
        pools[0] * args.prefill_block_size + pools[1] * args.decode_block_size * (2 if args.via_host else 1)
    )
    largest = max(prefill) * args.prefill_block_size
    working = largest * 2 * config.heads * config.head_dim * 4 * 8
    return int(caches + working)


def memory_available() -> int | None:
    """Memory this process may still take: MemAvailable, less where a cgroup limit is lower."""
    available = None
    with contextlib.suppress(OSError, ValueError, IndexError), open("/proc/meminfo") as meminfo:
        for line in meminfo:
            if line.startswith("MemAvailable:"):
                available = int(line.split()[1]) * 1024
    if available is None:
        with contextlib.suppress(OSError, ValueError, AttributeError):
            available = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    with (
        contextlib.suppress(OSError, ValueError),
        open("/sys/fs/cgroup/memory.max") as limit,
        open("/sys/fs/cgroup/memory.current") as current,
    ):
        text = limit.read().strip()
        if text != "max":
            left = int(text) - int(current.read())
            available = left if available is None else min(available, left)
    return available


@contextlib.contextmanager
def loopback_ucx() -> Iterator[None]:
    """UCX of this process and the prefill it starts on loopback only (``LOOPBACK_UCX``),
    where the user did not say otherwise; the environment is restored afterwards."""
    added = [key for key in LOOPBACK_UCX if key not in os.environ]
    os.environ.update({key: LOOPBACK_UCX[key] for key in added})
    try:
        yield
    finally:
        for key in added:
            os.environ.pop(key, None)


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    p = parser()
    args = p.parse_args(argv)
    check_args(p, args)
    os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")
    try:
        with loopback_ucx():
            if args.role == "prefill":
                return _prefill_main(args)
            return run_decode(args, argv)
    except Exception:  # a bug: say where, but never exit 1, which means only that requests failed
        traceback.print_exc()
        return EXIT_ERROR


def _prefill_main(args: argparse.Namespace) -> int:
    try:
        return run_prefill(args)
    except (KVHostError, OSError) as err:  # OSError: decode's socket was gone
        print(f"prefill: {type(err).__name__}: {err}", file=sys.stderr)
    except MemoryError:
        print(f"prefill: out of memory: {memory_options(args)}", file=sys.stderr)
    except RuntimeError as err:
        if "allocate" not in str(err):
            raise
        print(f"prefill: out of memory: {memory_options(args)}: {str(err).splitlines()[0]}", file=sys.stderr)
    return EXIT_ERROR


if __name__ == "__main__":
    # Prefill runs as ``python -m kvhost.demo``. Its agent is closed by now; skipping the
    # interpreter's teardown (a second with torch loaded) lets decode finish sooner.
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
