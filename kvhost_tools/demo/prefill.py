"""``kvhost prefill``: a prefill engine that serves its KV blocks to decode engines over NIXL.

It fills its cache with the requests it holds (``--share I/N``: those whose number is I
mod N), every tensor-parallel rank (``--tp``) its own cache and its own NIXL agent, and
listens on ``--listen``. Every decode engine that proves the shared secret
(``--secret-file``, created here if missing: copy it to the decode hosts) and can be
served is offered the requests it asks for (``kvhost.nixl.server``): per rank a block
table and agent metadata. What the engines must agree on is checked when they connect;
a pair that cannot work together is refused then, in one line naming the field and both
values.

The registered memory stays while a decode engine reads it, and is let go as soon as it
says done, closes its connection, or stops beating for ``--peer-timeout`` seconds (its
host or the link gone). After ``--serve`` decode engines (0: no limit), or
``--idle-timeout`` seconds without one, it deregisters everything and exits: 0 when every
decode engine said done and all was well, 1 when one went away or failed, 2 for anything
else. A SIGTERM drains (a rolling restart): no new decode engine is taken, and those it
holds finish their reads, for ``--drain-timeout`` seconds at most; then it exits as
stopped (143). A second SIGTERM, Ctrl-C or SIGHUP stops it at once.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import secrets
import socket
import sys
import time
import traceback
from collections.abc import Sequence

from kvhost_tools.demo import netenv
from kvhost_tools.demo.config import (
    EXIT_ERROR,
    EXIT_FAILED,
    EXIT_OK,
    DemoError,
    allocate_blocks,
    blocks_for,
    memory_refusal,
    os_reason,
    pool_for,
    prefill_memory,
)
from kvhost_tools.demo.options import (
    DEFAULT_PORT,
    HelpFormatter,
    Parser,
    add_engine,
    add_model,
    add_network,
    add_workload,
    model_of,
    peer_timeout_refusal,
    seconds,
    shape_of,
    share_refusal,
    workload_of,
)
from kvhost_tools.demo.stopping import Stopped, StopSignals, stop_on_sigterm, stopped_by


def parser() -> Parser:
    p = Parser(prog="kvhost prefill", description=__doc__, formatter_class=HelpFormatter)
    p.add_argument("--listen", default=f"127.0.0.1:{DEFAULT_PORT}", metavar="ADDR:PORT", help="the control port")
    p.add_argument("--listen-fd", type=int, help=argparse.SUPPRESS)  # a socket kvhost demo bound
    p.add_argument("--serve", type=int, default=1, metavar="D", help="decode engines to serve, then exit (0: no limit)")
    p.add_argument("--peer-timeout", type=seconds, default=5.0, help="seconds without a beat before a decode is gone")
    p.add_argument("--idle-timeout", type=seconds, default=600.0, help="seconds without any decode engine: exit")
    p.add_argument(
        "--drain-timeout", type=seconds, default=10.0, help="after a SIGTERM, seconds held decodes have to finish"
    )
    add_model(p)
    add_workload(p)
    add_engine(p, "HND", 16)
    add_network(p)
    return p


def say(line: str) -> None:
    try:
        print(f"prefill: {line}", flush=True)
    except OSError:  # stdout's reader is gone (a `grep -m1` that saw its line): serving goes on, unheard
        with contextlib.suppress(OSError):
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())


def main(argv: Sequence[str] | None = None) -> int:
    p = parser()
    args = p.parse_args(sys.argv[1:] if argv is None else argv)
    from kvhost_tools.demo.config import model_refusal
    from kvhost_tools.demo.options import default_layout

    model, workload = model_of(args), workload_of(args)
    shape = shape_of(args, "HND")
    problem = model_refusal(model, workload, [("", shape)])
    if problem is None and args.serve < 0:
        problem = f"--serve must be at least 0, got {args.serve}"
    problem = problem or netenv.advertise_refusal(args.advertise)
    problem = problem or share_refusal(workload, args.share)  # every decode engine would be refused
    if problem is None:  # before the cache is allocated and filled: an OOM kill says nothing
        problem = memory_refusal(prefill_memory(model, workload, shape, args.share), model, workload)
    problem = problem or peer_timeout_refusal(args.peer_timeout)  # before a cache is filled and registered
    if problem is None and (args.cache == "mla") != (default_layout(args.cache, args.layout, "HND") == "MLA"):
        problem = "--layout MLA goes with --cache mla"
    try:
        from kvhost.nixl.peers import parse_address

        host, port = parse_address(args.listen)
    except ValueError as err:
        problem = problem or f"--listen: {err}"
        host, port = "", 0
    if problem:
        p.error(problem)
    # Quiet before NIXL loads (it reads its log level then); UCX's devices once bound (serve).
    netenv.set_defaults(os.environ, [])
    with stop_on_sigterm() as stops:
        try:
            return serve(args, host, port, stops)
        except KeyboardInterrupt as err:  # Ctrl-C, SIGTERM or SIGHUP: serve's own cleanup has run
            stops.quiet()
            name, status = stopped_by(err)
            print(f"prefill: stopped by {name}", file=sys.stderr)
            return status
        except DemoError as err:
            print(f"prefill: {err}", file=sys.stderr)
        except MemoryError:
            print(f"prefill: out of memory: {memory_options(args)}", file=sys.stderr)
        except Exception as err:
            from kvhost.errors import KVHostError, first_line

            if isinstance(err, RuntimeError) and "allocate" in str(err):  # torch's allocator
                print(f"prefill: out of memory: {memory_options(args)}: {first_line(err)}", file=sys.stderr)
            elif isinstance(err, (KVHostError, OSError)):
                print(f"prefill: {err}", file=sys.stderr)
            else:  # a bug: say where, with the status of an error (1 means requests failed)
                traceback.print_exc()
    return EXIT_ERROR


LISTEN_LOOKUP_SECONDS = 30.0  # a --listen host name's lookup, at most


def memory_options(args: argparse.Namespace) -> str:
    """The options that size the cache, as given."""
    return (
        f"--layers {args.layers} x --heads {args.heads} x --head-dim {args.head_dim} x --dtype {args.dtype}, "
        f"--requests {args.requests} of --min-tokens {args.min_tokens} to --max-tokens {args.max_tokens}, "
        f"--block-size {args.block_size}"
    )


def serve(args: argparse.Namespace, host: str, port: int, stops: StopSignals) -> int:
    """Fill, register, serve, let go; the exit status."""
    from kvhost.caches import CacheSet
    from kvhost.nixl import Agent, HugePages, Offer, PeerHello, PeerRecord, ProtocolError, RemoteRequest, Server
    from kvhost.nixl.agent import load_nixl

    load_nixl()  # before anything is bound, filled or written: without NIXL nothing can be served
    from kvhost.nixl.peers import _resolve, read_secret_file, write_secret_file
    from kvhost.testing import raw
    from kvhost_tools.demo.values import layer_views, token_values, write_tokens

    model, workload = model_of(args), workload_of(args)
    shape, share = shape_of(args, "HND"), args.share
    spec = model.spec(shape)
    if args.listen_fd is not None:
        listener = socket.socket(fileno=args.listen_fd)
    else:  # bound first: a port in use leaves no new secret file behind
        try:
            # A name that does not resolve, in the resolver's words; looked up on a thread, by a
            # deadline (getaddrinfo has none) that a SIGTERM does not wait for.
            family, _, _, _, where = _resolve((host, port), time.monotonic() + LISTEN_LOOKUP_SECONDS)[0]
            listener = socket.create_server(where[:2], family=family)  # the address found: no second lookup
        except socket.gaierror as err:
            raise DemoError(f"--listen {args.listen}: {err.strerror}") from None
        except TimeoutError:
            raise DemoError(f"--listen {args.listen}: not resolved within {LISTEN_LOOKUP_SECONDS:g} s") from None
        except OSError as err:
            raise DemoError(f"--listen {args.listen}: {os_reason(err)}") from None
    host, port = listener.getsockname()[:2]
    # UCX kept on the interface of the address bound (a host name given is resolved by now),
    # before any NIXL agent starts.
    netenv.set_defaults(os.environ, [args.advertise or host])
    with contextlib.ExitStack() as held_open:  # whatever fails, each agent and the listener are closed
        held_open.callback(listener.close)
        if args.secret_file != "-" and not os.path.exists(args.secret_file):
            secret = write_secret_file(args.secret_file)
            say(f"wrote a new secret to {args.secret_file} (mode 600): copy it to the decode hosts")
        else:
            secret = read_secret_file(args.secret_file, timeout=args.connect_timeout)

        started = time.perf_counter()
        lengths = workload.lengths()
        numbers = workload.numbers(share)
        counts = [blocks_for(lengths[n], shape.block_size) for n in numbers]
        pool = pool_for(counts)
        ids, _ = allocate_blocks(pool, counts, workload, stream=100 + share.index)
        per_rank = model.heads // shape.tp
        rank_caches = [model.caches(shape, pool) for _ in range(shape.tp)]
        axes = model.axes_for(shape)
        cache_sets = [CacheSet(caches, axes) for caches in rank_caches]
        for cache_set in cache_sets:
            for member in cache_set.members:
                raw(member.tensor).zero_()
        rank_layers = [layer_views(cache_set) for cache_set in cache_sets]
        held = []
        for number, block_ids in zip(numbers, ids):
            tokens = lengths[number]
            held.append(RemoteRequest(f"req-{number:03d}", number, tokens, block_ids))
            for layer in range(model.layers):
                whole = token_values(
                    workload.seed, number, layer, tokens, model.heads, model.head_dim, model.itemsize, kv=model.kv
                )
                for rank, layers in enumerate(rank_layers):
                    values = whole.narrow(2, rank * per_rank, per_rank) if model.kind == "mha" else whole
                    _, tensor, layer_axes = layers[layer]
                    write_tokens(tensor, layer_axes, block_ids, values)
        fill_seconds = time.perf_counter() - started

        tag = f"{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(2)}"
        agents = [held_open.enter_context(Agent(f"prefill-{tag}-r{rank}")) for rank in range(shape.tp)]
        tables = [agent.register(caches, axes) for agent, caches in zip(agents, rank_caches)]
        metadata = [agent.metadata() for agent in agents]

        def offer(peer: PeerHello) -> Offer:
            for agent in agents:
                agent.check_memory()  # what the peer will read is still where the tables say
            wanted = peer.fields.fields("share")
            index = wanted.integer("index", maximum=1 << 14)
            count = wanted.integer("count", minimum=index + 1, maximum=1 << 14)
            requests = [r for r in held if r.number % count == index]
            if not requests:
                raise ProtocolError(f"this prefill engine ({share}) holds none of the requests {index}/{count}")
            extra = {"pid": os.getpid(), "fill_seconds": fill_seconds, "share": str(share)}
            return Offer(spec, tables, metadata, requests, extra=extra)

        last_release = [time.monotonic()]

        def release(record: PeerRecord) -> None:
            last_release[0] = time.monotonic()

        say(
            f"listening {host}:{port} ({netenv.describe_network()}): {spec.describe()}; "
            f"{len(held)} requests ({share}), filled in {fill_seconds:.2f} s; "
            f"{sum((agent.huge_pages for agent in agents), HugePages()).describe()}"
        )
        server = Server(listener, secret, spec, offer, release=release, peer_timeout=args.peer_timeout, log=say)
        stops.drain = lambda: server.drain(args.drain_timeout)
        server.serve(peers=args.serve or None, idle_timeout=args.idle_timeout)
    let_go = time.monotonic() - last_release[0]
    say(
        f"deregistered the cache {let_go:.2f} s after the last decode engine let go; "
        f"{server.served} served, {server.ended['refused']} refused, {server.dropped} stray connection(s)"
    )
    if stops.drained_by is not None:
        raise Stopped(stops.drained_by)  # drained, and stopped all the same (128 + the signal)
    if not server.served:
        return EXIT_ERROR
    return EXIT_OK if server.done_ok == server.served else EXIT_FAILED
