"""The decode process: start prefill, pull its batch with NIXL, post-process it, verify it, report.

Decode listens on 127.0.0.1 only, starts prefill (``kvhost_tools.demo.prefill``) as its
own process, hands it a secret on its stdin, and accepts the connection that proves it
(``kvhost.nixl.accept_hello``). It allocates its blocks, reads every request with up to
``--inflight`` transfers in flight, each bounded by ``--timeout``, post-processes the
whole batch with one ``kvhost.receive`` per rank (``--via-host``: ``kvhost.copy_blocks``
from a registered host buffer first), and verifies every token (``verify``).
``--kill-prefill-after`` and ``--freeze-prefill-after`` kill or stop prefill mid-batch.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import signal
import socket
import subprocess
import sys
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

import kvhost
from kvhost.errors import KVHostError
from kvhost.nixl import (
    Agent,
    Hello,
    ProtocolError,
    Reader,
    Transfer,
    TransferError,
    TransferPlan,
    accept_hello,
    plan_transfer,
)
from kvhost.nixl.handshake import SECRET_BYTES, send_done
from kvhost.testing import raw
from kvhost_tools.demo.config import (
    AXES,
    EXIT_ERROR,
    EXIT_FAILED,
    EXIT_OK,
    Config,
    DemoError,
    blocks_for,
    memory_options,
    pool_for,
)
from kvhost_tools.demo.report import Outcome, ProgressBar, describe_setup, memcpy_gbps, print_report, write_json
from kvhost_tools.demo.values import SENTINEL_BYTE
from kvhost_tools.demo.verify import verify


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


def fill_seconds(hello: Hello) -> float:
    """How long prefill took to fill its cache: the demo's own field of the hello, checked."""
    return hello.fields.seconds("fill_seconds", default=0.0)


class Transfers:
    """One request's reads, one per decode rank: arrived when every one has."""

    def __init__(self, readers: Sequence[Reader], local_ids: list[int], remote_ids: Sequence[int] | np.ndarray) -> None:
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


def run_decode(config: Config, argv: Sequence[str]) -> int:
    """Start prefill (with ``argv``, this command's options), pull the batch, post-process it,
    verify it, report."""
    begun = time.perf_counter()
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
                blocks_for(
                    blocks_for(t, config.prefill_block_size) * config.prefill_block_size, config.decode_block_size
                )
                for t in config.lengths()
            ]
            pool = pool_for(local_blocks)
            heads = config.heads // config.decode_ranks
            rank_caches = [
                config.caches(config.decode_layout, pool, config.decode_block_size, heads)
                for _ in range(config.decode_ranks)
            ]
            for caches in rank_caches:
                for tensor in caches.values():
                    raw(tensor).view(torch.uint8).fill_(SENTINEL_BYTE)
            agent = Agent(f"decode-{os.getpid()}")
            sock, hello, dropped = accept_hello(
                listener, secret, config.connect_timeout, watch=running(prefill), peer="prefill"
            )
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
        handoff(config, agent, peer, hello, rank_caches, pool, started, outcome)
        with contextlib.suppress(ProtocolError):  # a prefill that was killed cannot be told
            send_done(sock, ok=outcome.ok, timeout=config.timeout)
    except KVHostError as err:
        outcome.error = f"{type(err).__name__}: {err}"
    except MemoryError:
        outcome.error = f"out of memory: {memory_options(config)} need more memory than this machine has free"
    except RuntimeError as err:
        if "allocate" not in str(err):  # torch's allocator: "DefaultCPUAllocator: can't allocate memory"
            raise
        outcome.error = f"out of memory: {memory_options(config)}: {str(err).splitlines()[0]}"
    finally:
        if sock is not None:
            sock.close()
        if agent is not None:
            agent.close()
        if prefill is not None:
            frozen = config.freeze_prefill_after is not None and "fault_after" in outcome.figures
            # After ``done`` prefill exits on its own; frozen, or never told, it is killed.
            stop_prefill(prefill, patience=0.1 if frozen or outcome.error else 10)
    print_report(outcome, sys.stdout)
    if config.json_path:
        write_json(config.json_path, outcome)
    if outcome.error:
        return EXIT_ERROR
    return EXIT_OK if outcome.ok else EXIT_FAILED


def handoff(
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
        if config.via_host:
            # The host buffer is shaped like the cache, so NIXL lands the same wire bytes in
            # it, one descriptor per sender region, as it would in the cache itself;
            # copy_blocks then loads the blocks and receive rearranges them where they are read.
            staging = config.caches(config.decode_layout, pool, config.decode_block_size, heads)
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
    describe_setup(config, plan, hello, outcome)

    pull(config, readers, requests, prefill, outcome)
    arrived = [r for r in requests if r.arrived]
    outcome.failed = {r.name: r.failure or "did not arrive" for r in requests if not r.arrived}
    if arrived:
        post_process(config, ranks, plan, arrived, outcome)
    outcome.figures["memcpy_gbps"] = memcpy_gbps(outcome.figures.get("transfer_bytes", 0))
    verify(config, ranks, arrived, free, outcome)


def pull(
    config: Config,
    readers: list[Reader],
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
    bar = ProgressBar("transfer", len(requests), sys.stderr, config.progress and sys.stderr.isatty())
    started = time.perf_counter()
    done = 0

    fault_after = config.fault_after
    faulted = False

    def fault_if_due() -> None:
        """Kill (SIGKILL) or freeze (SIGSTOP) prefill once ``fault_after`` requests have arrived."""
        nonlocal faulted
        if fault_after is None or faulted or done < fault_after or prefill.poll() is not None:
            return
        faulted = True
        if config.kill_prefill_after is not None:
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
        while pending and len(inflight) < config.inflight and peer_lost is None:
            request = pending.popleft()
            try:
                local_ids = request.staging_ids if config.via_host else request.local_ids
                request.transfer = Transfers(readers, local_ids, request.remote_ids)
            except TransferError as err:
                request.failure = peer_lost = str(err)
                break
            request.deadline = time.monotonic() + config.timeout
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
                    raise TransferError(f"no completion within {config.timeout:g} s", timed_out=True)
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
            target, requests, axes=AXES, remote_order=order, remote_block_size=size, backend=config.backend
        )

    first = plan.local_blocks_for(1)
    heads = ranks[0].heads
    scratch = config.caches(config.decode_layout, first, config.decode_block_size, heads)
    scratch_ids = list(range(first))
    started = time.perf_counter()
    if config.via_host:
        warm_source = config.caches(config.decode_layout, first, config.decode_block_size, heads)
        kvhost.copy_blocks(warm_source, scratch, scratch_ids, scratch_ids, axes=AXES, backend=config.backend).wait()
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
                backend=config.backend,
            ).wait()
            loaded_bytes, runs = loaded_bytes + loaded.bytes_moved, loaded.runs
        stats = receive(rank.caches, {r.name: r.local_ids for r in arrived})
        moved, groups, backend = moved + stats.bytes_moved, stats.groups, stats.backend
    what = f"kvhost.copy_blocks from the host buffer ({runs} runs), then " if config.via_host else ""
    what += f"kvhost.receive, {groups} group(s)" if moved else "kvhost.receive: identity, nothing to move"
    if len(ranks) > 1:
        what += f", on each of {len(ranks)} ranks"
    nbytes = loaded_bytes + moved
    seconds = time.perf_counter() - started
    outcome.received = [r.name for r in arrived]
    outcome.figures.update(
        post_bytes=nbytes, post_seconds=seconds, backend=backend, post_what=what, warm_up_seconds=warm_up
    )


# --- the prefill process ------------------------------------------------------------


def start_prefill(port: int, argv: Sequence[str], secret: bytes) -> subprocess.Popen[bytes]:
    """Run prefill as its own OS process, with this command's options and the socket's port;
    the secret it proves itself with goes on its stdin (argv is readable by anyone in /proc)."""
    env = dict(os.environ)
    env.setdefault("NIXL_LOG_LEVEL", "WARN")
    command = [sys.executable, "-m", "kvhost_tools.demo", *argv, "--role", "prefill", "--port", str(port)]
    prefill = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, env=env)
    assert prefill.stdin is not None
    try:
        prefill.stdin.write(secret.hex().encode() + b"\n")  # 65 bytes: a pipe never blocks on them
        prefill.stdin.close()
    except OSError as err:  # it died at once
        stop_prefill(prefill, patience=0.1)
        raise DemoError(f"could not hand prefill its secret: {err}") from None
    return prefill


def running(prefill: subprocess.Popen[bytes] | None) -> Callable[[], None]:
    """What ``accept_hello`` watches while it waits: prefill dying first is a DemoError."""

    def check() -> None:
        if prefill is not None and prefill.poll() is not None:
            raise DemoError(f"prefill exited with code {prefill.returncode} before it connected")

    return check


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
