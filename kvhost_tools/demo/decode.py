"""``kvhost decode``: a decode engine that pulls its requests' KV blocks from prefill engines over NIXL.

It connects to every prefill engine of ``--prefill ADDR:PORT[,ADDR:PORT...]``, each
proving the shared secret (``--secret-file``) both ways, and takes the requests it
holds for this engine (``--share J/D``: those whose number is J mod D). What the engines
must agree on is checked then; a pair that cannot work together ends the run at once,
in one line naming the field and both values (exit 2). Prefill engines may differ in
block size, layout and tensor parallelism, from each other and from this engine.

Every decode rank (``--tp``) has its own cache and NIXL agent, and reads from the
prefill ranks that hold its heads (``kvhost.nixl.plan_ranks``): a share of one rank's
heads, or its heads gathered from several ranks into each block; an MLA latent once,
from one rank. Requests are pulled with up to ``--inflight`` in flight, each bounded by
``--timeout``; what arrived is post-processed in steps, one ``kvhost.receive`` per rank
per step for every engine's requests at once (``kvhost_tools.demo.pull``). Then every
token of every arrived request is checked bit for bit against values computed from the
options, never taken from prefill.

``--fault-after N --fault-command CMD`` runs CMD once N requests have arrived (kill a
prefill, take a link down). Exit status: 0 when every request verified, 1 only when
requests failed (did not arrive, or did not verify), 2 for anything else.
"""

from __future__ import annotations

import argparse
import os
import secrets
import socket
import sys
import time
import traceback
from collections.abc import Sequence
from typing import TextIO

import torch

import kvhost
from kvhost.errors import KVHostError, failure, first_line
from kvhost.nixl import Agent, ProtocolError, RankReader, Session, TransferError, connect, load_nixl, plan_ranks
from kvhost.nixl.peers import parse_address, read_secret_file
from kvhost.testing import raw
from kvhost_tools.demo import netenv
from kvhost_tools.demo.config import (
    EXIT_ERROR,
    EXIT_FAILED,
    EXIT_OK,
    DemoError,
    EngineShape,
    Model,
    Share,
    Workload,
    allocate_blocks,
    decode_memory,
    local_blocks_for,
    memory_refusal,
    model_refusal,
    offer_memory_refusal,
    os_reason,
    pool_for,
)
from kvhost_tools.demo.options import (
    DEFAULT_PORT,
    HelpFormatter,
    Parser,
    add_engine,
    add_model,
    add_network,
    add_output,
    add_workload,
    backend_refusal,
    model_of,
    seconds,
    shape_of,
    share_refusal,
    workload_of,
)
from kvhost_tools.demo.pull import Engine, Rank, Request, Settings, Steps, pull
from kvhost_tools.demo.report import Outcome, Yardstick, describe_decode, prefill_pid, print_report, write_json
from kvhost_tools.demo.stopping import stop_on_sigterm, stopped_by
from kvhost_tools.demo.values import SENTINEL_BYTE
from kvhost_tools.demo.verify import verify


def parser() -> Parser:
    p = Parser(prog="kvhost decode", description=__doc__, formatter_class=HelpFormatter)
    p.add_argument(
        "--prefill", default=f"127.0.0.1:{DEFAULT_PORT}", metavar="ADDR:PORT[,...]", help="the prefill engines"
    )
    p.add_argument("--via-host", action="store_true", help="land bytes in a host buffer, then copy_blocks")
    p.add_argument("--backend", default=None, help="kvhost backend for the post-process (None: chosen by device)")
    p.add_argument("--inflight", type=int, default=8, help="requests in flight at once")
    p.add_argument("--timeout", type=seconds, default=10.0, help="seconds one request's transfers may take")
    p.add_argument("--step", type=seconds, default=0.05, help="seconds between post-process steps")
    p.add_argument("--progress-fd", type=int, help=argparse.SUPPRESS)  # kvhost demo's terminal
    faults = p.add_argument_group("faults (for tests)")
    faults.add_argument("--fault-after", type=int, metavar="N", help="run --fault-command once N requests arrived")
    faults.add_argument("--fault-command", metavar="CMD", help="a shell command (kill a prefill, take a link down)")
    faults.add_argument("--fault-label", metavar="TEXT", help="what the report says the fault was")
    faults.add_argument(
        "--fault-timeout", type=seconds, default=10.0, help="seconds --fault-command may take (wall clock)"
    )
    add_model(p)
    add_workload(p)
    add_engine(p, "NHD", 64)
    add_network(p)
    add_output(p)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    p = parser()
    args = p.parse_args(sys.argv[1:] if argv is None else argv)
    model, workload, shape = model_of(args), workload_of(args), shape_of(args, "NHD")
    problem = model_refusal(model, workload, [("", shape)])
    if problem is None and not 1 <= args.inflight <= 1 << 14:
        problem = f"--inflight must be in [1, 16384], got {args.inflight}"
    if problem is None and args.fault_after is not None and not 0 <= args.fault_after <= 1 << 14:
        problem = f"--fault-after must be in [0, 16384], got {args.fault_after}"
    problem = problem or netenv.advertise_refusal(args.advertise)
    if problem is None and (args.fault_after is None) != (args.fault_command is None):
        problem = "--fault-after and --fault-command go together"
    problem = problem or share_refusal(workload, args.share)  # nothing to pull: as prefill refuses it
    if problem is None and args.backend is not None:  # before any prefill is asked for its blocks
        problem = backend_refusal(args.backend)
    if problem is None:  # before the cache is allocated
        needed = decode_memory(model, workload, shape, args.share, staging=args.via_host)
        problem = memory_refusal(needed, model, workload)
    addresses: list[tuple[str, int]] = []
    for text in args.prefill.split(","):
        try:
            addresses.append(parse_address(text))
        except ValueError as err:
            problem = problem or f"--prefill: {err}"
    if problem is None and any(port == 0 for _, port in addresses):
        problem = f"--prefill: {args.prefill!r}: port 0 is no prefill engine's"
    if problem:
        p.error(problem)
    own = args.advertise or netenv.route_source(*addresses[0])  # None for a host name: set once connected
    netenv.set_defaults(os.environ, [own] if own else [])
    outcome = Outcome()
    progress: TextIO | None = None
    if args.progress_fd is not None:
        try:
            progress = os.fdopen(args.progress_fd, "w")
        except OSError as err:
            p.error(f"--progress-fd {args.progress_fd}: {err.strerror or err}")
    elif not args.no_progress and sys.stderr.isatty():
        progress = sys.stderr
    stopped = 0
    with stop_on_sigterm() as stops:  # over the report and the JSON too: a later stop must not lose them
        try:
            run(args, model, workload, shape, addresses, outcome, progress)
        except KeyboardInterrupt as err:  # Ctrl-C, or SIGTERM: the sessions were closed on the way out
            name, stopped = stopped_by(err)
            outcome.error = f"stopped by {name}"
        except (KVHostError, DemoError) as err:  # each says what is wrong: the class name adds nothing
            outcome.error = str(err)
        except MemoryError:
            outcome.error = "out of memory for the caches"
        except Exception as err:
            if isinstance(err, RuntimeError) and "allocate" in str(err):  # torch's: "can't allocate memory"
                outcome.error = f"out of memory: {first_line(err)}"
            else:  # a bug: say where, but never exit 1, which means only that requests failed
                traceback.print_exc()
                outcome.error = f"failed: {failure(err).splitlines()[0]}"
        stops.quiet()
        print_report(outcome, sys.stdout)
        if outcome.error:  # where an operator looks first, as prefill says its own
            print(f"decode: {outcome.error}", file=sys.stderr, flush=True)
        if args.json:
            try:
                write_json(args.json, outcome)
            except OSError as err:
                print(f"decode: --json {args.json}: {os_reason(err)}", file=sys.stderr)
                return stopped or EXIT_ERROR
    if stopped:
        return stopped
    if outcome.error:
        return EXIT_ERROR
    return EXIT_OK if outcome.ok else EXIT_FAILED


def run(
    args: argparse.Namespace,
    model: Model,
    workload: Workload,
    shape: EngineShape,
    addresses: list[tuple[str, int]],
    outcome: Outcome,
    progress: TextIO | None,
) -> None:
    """Connect, plan, allocate, pull, post-process, verify: one decode engine's batch."""
    load_nixl()  # before a prefill engine is asked to hold memory for us
    begun = time.perf_counter()
    figures = outcome.figures
    figures.update(decode_pid=os.getpid())
    secret = read_secret_file(args.secret_file, timeout=args.connect_timeout)
    spec = model.spec(shape)
    share = args.share
    sessions: list[Session] = []
    agents: list[Agent] = []
    try:
        compile_before_hello(model, shape, args.backend, staging=args.via_host)
        figures["compile_seconds"] = time.perf_counter() - begun
        deadline = time.monotonic() + args.connect_timeout
        for address in addresses:
            extra = {"share": {"index": share.index, "count": share.count}, "pid": os.getpid()}
            left = max(deadline - time.monotonic(), 0.1)
            sessions.append(connect(address, secret, spec, timeout=left, extra=extra))
            sessions[-1].start_beats()  # from now on this prefill holds memory for us: say we are here
        figures["hello_seconds"] = time.perf_counter() - begun
        # UCX on the interface the first connection left from (where no address said it before),
        # set before the agents that read it start.
        netenv.set_defaults(os.environ, [str(sessions[0].sock.getsockname()[0])])
        figures["network"] = netenv.describe_network()
        engines = [Engine(i, session) for i, session in enumerate(sessions)]
        requests = offered(workload, share, engines)
        counts = [
            local_blocks_for(len(r.remote_ids), r.engine.session.offer.spec.block_size, shape.block_size)
            for r in requests
            if r.engine is not None
        ]
        pool = pool_for(counts)
        problem = offer_memory_refusal(model, shape, pool, staging=args.via_host)
        if problem is not None:  # the prefill engines' blocks decide it: checked again before it is allocated
            raise DemoError(problem)
        taken, spare = allocate_blocks(pool, counts, workload, stream=3)
        staged = 0
        for request, ids in zip([r for r in requests if r.engine is not None], taken):
            request.local_ids = ids
            request.staging_ids = list(range(staged, staged + len(ids)))
            staged += len(ids)

        per_rank = model.heads // shape.tp if model.kind == "mha" else 1
        tag = f"{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(2)}"
        ranks = []
        for index in range(shape.tp):
            caches = model.caches(shape, pool)
            for tensor in caches.values():
                raw(tensor).view(torch.uint8).fill_(SENTINEL_BYTE)
            staging = model.caches(shape, pool) if args.via_host else None
            ranks.append(Rank(caches, per_rank, index * per_rank if model.kind == "mha" else 0, staging))
            agents.append(Agent(f"decode-{tag}-r{index}"))
        axes = model.axes_for(shape)
        tables = [agent.register(rank.staging or rank.caches, axes) for agent, rank in zip(agents, ranks)]
        for engine in engines:
            offer = engine.session.offer
            for index, (agent, table) in enumerate(zip(agents, tables)):
                plan = plan_ranks(table, index, shape.tp, offer.tables)
                peers = {s.rank: agent.add_peer(offer.metadata[s.rank]) for s in plan.sources}
                engine.plans.append(plan)
                engine.readers.append(RankReader(agent, plan, peers))
        figures.update(
            requests=len(requests),
            tokens=sum(r.tokens for r in requests),
            prefill_blocks=sum(len(r.remote_ids) for r in requests),
            decode_blocks=sum(counts),
            decode_ranks=shape.tp,
            spare_blocks=len(spare),
            pool=pool,
            prefill_pids=[prefill_pid(e.session.offer) for e in engines],
        )
        describe_decode(model, shape, engines, outcome)

        settings = Settings(
            args.inflight,
            args.timeout,
            args.step,
            axes,
            args.backend,
            progress,
            args.fault_after,
            args.fault_command,
            args.fault_label,
            args.fault_timeout,
        )
        warm_up(settings, model, shape, engines, outcome, staging=args.via_host)
        yardstick = Yardstick(figures["tokens"] * model.token_bytes())  # the batch's size
        yardstick.time()
        steps = Steps()
        try:
            pull(settings, [r for r in requests if r.engine is not None], ranks, outcome, steps, staging=args.via_host)
        finally:  # a stop or an error midway: the report says what had arrived by then
            outcome.received = [r.name for r in requests if r.arrived]
        for engine in engines:  # prefill may let go of its memory now, once it says it held it until here
            try:
                engine.session.done(ok=engine.lost is None, timeout=min(args.timeout, 5.0))
            except ProtocolError as err:  # it may have given the blocks to others while they were read
                for request in requests:
                    held = request.asked is not None and engine.session.confirmed(request.asked)
                    if request.engine is engine and request.arrived and not held:
                        request.arrived, request.failure = False, str(err)
        figures["descriptors"] = sum(reader.descriptors for e in engines for reader in e.readers)
        arrived = [r for r in requests if r.arrived]
        outcome.failed = {r.name: r.failure or "did not arrive" for r in requests if not r.arrived}
        outcome.received = [r.name for r in arrived]
        what = f"kvhost.copy_blocks from the host buffer ({steps.copied_runs} runs), then " if args.via_host else ""
        what += f"kvhost.receive, up to {steps.groups} group(s)" if steps.nbytes else "kvhost.receive: nothing to move"
        figures.update(
            post_bytes=steps.nbytes,
            post_seconds=steps.seconds,
            post_steps=steps.count,
            post_step_sizes=steps.sizes,
            post_step_engines=steps.engines,
            backend=steps.backend,
            post_what=what + (f", on each of {len(ranks)} ranks" if len(ranks) > 1 else ""),
        )
        yardstick.time()
        figures["memcpy_gbps"] = yardstick.gbps()
        verify(model, axes, workload.seed, ranks, arrived, spare, outcome, progress=progress)
    finally:
        for session in sessions:
            session.close()
        for agent in agents:
            try:
                agent.close()
            except TransferError:
                if not agent.uncancelled:  # not reads in flight (posts under way): close itself failed
                    raise
                owed = ", ".join(sorted({repr(t.link.peer) for t in agent.uncancelled}))
                outcome.lines.append(
                    f"kept      {len(agent.uncancelled)} read(s) from {owed} still in flight at the end: "
                    "their blocks and memory stay held until this process exits"
                )


def offered(workload: Workload, share: Share, engines: list[Engine]) -> list[Request]:
    """The requests this engine takes (its share of the workload), from whichever prefill
    offered each; one offered by none, or not as the workload says, fails here."""
    lengths = workload.lengths()
    wanted = {n: f"req-{n:03d}" for n in workload.numbers(share)}
    found: dict[int, Request] = {}
    for engine in engines:
        for remote in engine.session.offer.requests:
            if remote.number not in wanted or remote.name != wanted[remote.number]:
                raise DemoError(f"{engine.name} offered {remote.name!r}, which is not this engine's to take")
            if remote.number in found:
                raise DemoError(f"{remote.name} was offered by two prefill engines")
            request = Request(remote.name, remote.number, remote.tokens, engine, remote.remote_ids)
            if remote.tokens != lengths[remote.number]:
                request.engine = None
                request.failure = f"offered {remote.tokens} tokens, the workload says {lengths[remote.number]}"
            found[remote.number] = request
    for number, name in wanted.items():
        if number not in found:
            found[number] = Request(name, number, lengths[number], None, [], failure="no prefill engine offered it")
    return [found[n] for n in sorted(found)]


def warm_up(
    settings: Settings, model: Model, shape: EngineShape, engines: list[Engine], outcome: Outcome, *, staging: bool
) -> None:
    """One receive per sender layout on scratch blocks, before anything is timed: the
    backend's one-time start (kernel compilation) is reported apart."""
    started = time.perf_counter()
    keys = {(e.plans[0].remote_order, e.plans[0].remote_block_size) for e in engines if e.plans}
    for order, size in sorted(keys):
        receive_on_scratch(model, shape, order, size, backend=settings.backend, staging=staging)
    outcome.figures["warm_up_seconds"] = time.perf_counter() - started


def compile_before_hello(model: Model, shape: EngineShape, backend: str | None, *, staging: bool) -> None:
    """Compile the backend's kernels before any prefill holds memory for this engine.

    A compile can hold the interpreter for seconds (tens on a loaded machine), and the
    beats that tell prefill this engine is alive come from a thread that would wait behind
    it: prefill would take the silence for a dead peer. A latent cache needs nothing:
    token-major on both sides is the identity.
    """
    if model.kind != "mha":
        return
    other = shape.order.translate(str.maketrans("HN", "NH"))  # a sender of the other major order
    sizes = {shape.block_size, shape.block_size * 2, max(shape.block_size // 2, 1)}  # same, g = 2, r = 2
    for size in sorted(sizes):
        receive_on_scratch(model, shape, other, size, backend=backend, staging=staging)


def receive_on_scratch(
    model: Model, shape: EngineShape, order: str, size: int, *, backend: str | None, staging: bool
) -> None:
    """One request from a sender of ``order`` and block ``size`` post-processed on scratch
    caches, ending one token short of its blocks: requests that end inside a block have
    their tails zeroed, which an identity receive does and nothing else warms."""
    count = local_blocks_for(1, size, shape.block_size)
    scratch = model.caches(shape, count)
    ids, axes = list(range(count)), model.axes_for(shape)
    if staging:
        source = model.caches(shape, count)
        kvhost.copy_blocks(source, scratch, ids, ids, axes=axes, backend=backend).wait()
    short = kvhost.Incoming(ids, order, size, tokens=count * shape.block_size - 1)
    kvhost.receive(scratch, {"warm-up": short}, axes=axes, backend=backend)
