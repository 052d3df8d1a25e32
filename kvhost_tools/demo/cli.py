"""``kvhost demo``: prefill engines hand a batch of requests to decode engines over real NIXL, on this host.

The one-command run of ``kvhost prefill`` and ``kvhost decode`` (the same code, see their
``--help``): every engine is its own OS process with its own NIXL agents over UCX on
loopback (UCX_NET_DEVICES=lo unless you set it). Prefill engines listen on 127.0.0.1;
each decode engine connects to all of them, proves a secret this command made (handed to
every engine on its stdin), pulls its requests with NIXL, post-processes what arrived in
steps (one ``kvhost.receive`` per rank per step, whatever the senders' layouts), and
checks every token bit for bit against values both sides compute from the options.

One prefill engine per value of ``--prefill-layout``, ``--prefill-block-size`` and
``--prefill-tp`` (comma lists; a single value serves every engine): request n is held by
prefill engine n mod P. ``--decodes D`` decode engines share the prefill engines,
decode engine j taking the requests j mod D. ``--decode-tp T`` splits each decode engine
into T ranks, each reading its heads from the prefill ranks that hold them (either TP
may be the larger); an MLA cache (``--cache mla``) is read once per rank, whole.

``--via-host`` lands the bytes in a registered host buffer shaped like the decode cache
(the same descriptors); ``kvhost.copy_blocks`` loads them, ``kvhost.receive`` rearranges
them. ``--kill-prefill-after N`` kills the first prefill engine once N requests have
arrived at the first decode engine: decode reports the requests that failed,
post-processes and verifies those that arrived, and exits 1 (a request counts as arrived
once its prefill engine confirms it held the blocks until it landed: the answer to a beat
decode sends as each lands).
``--freeze-prefill-after N`` stops it (SIGSTOP) instead: where the transport needs the
peer to answer (UCX over TCP alone), transfers hang and the per-request ``--timeout``
ends them. ``--freeze-decode-after N`` stops the first decode engine for a second longer
than the prefill engines' ``--peer-timeout``: they hear no beat, let go of its blocks
(they could reuse them), and decode fails every request they had not confirmed before,
however its bytes look.

The demo waits for its decode engines ``--run-timeout`` seconds at most (then kills
them); prefill engines are stopped once the decode engines are done. A prefill engine that
fails while they run (it died as it started, or crashed) leaves them ``--timeout`` + 5 s to
see it, then they are stopped (one still connecting to it would retry until
``--connect-timeout``).

Exit status: 0 when every request verified, 1 only when requests failed (did not arrive,
or did not verify), 2 for anything else (impossible options, a hand-off that could not run).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Sequence

from kvhost_tools.demo import netenv
from kvhost_tools.demo.config import (
    EXIT_ERROR,
    EXIT_FAILED,
    EXIT_OK,
    LAYOUTS,
    EngineShape,
    Model,
    Workload,
    memory_needed,
    memory_refusal,
    model_refusal,
    os_reason,
)
from kvhost_tools.demo.options import (
    MAX_WAIT_SECONDS,
    HelpFormatter,
    Parser,
    add_model,
    add_output,
    add_workload,
    backend_refusal,
    broadcast,
    default_layout,
    listed,
    model_of,
    peer_timeout_refusal,
    seconds,
    workload_of,
    write_json_file,
)
from kvhost_tools.demo.processes import Engine
from kvhost_tools.demo.stopping import stop_on_sigterm, stopped_by

# What the engines of the demo pass on unchanged.
SHARED = (
    "cache",
    "layers",
    "heads",
    "head_dim",
    "dtype",
    "requests",
    "min_tokens",
    "max_tokens",
    "seed",
    "block_ids",
    "max_run",
)
DECODE_ONLY = ("backend", "inflight", "timeout", "step")


def parser() -> Parser:
    p = Parser(prog="kvhost demo", description=__doc__, formatter_class=HelpFormatter)
    add_model(p)
    add_workload(p)
    group = p.add_argument_group("prefill engines (one per value of a comma list)")
    group.add_argument("--prefill-layout", type=listed(str, "LAYOUT"), default=None, help="HND, NHD (MLA)")
    group.add_argument("--prefill-block-size", type=listed(int, "N"), default=[16], help="tokens per block")
    group.add_argument("--prefill-tp", type=listed(int, "T"), default=[1], help="tensor-parallel ranks")
    group = p.add_argument_group("decode engines")
    group.add_argument("--decodes", type=int, default=1, metavar="D", help="decode engines sharing the prefill ones")
    group.add_argument("--decode-layout", choices=sorted(LAYOUTS), default=None, help="HND, NHD (MLA)")
    group.add_argument("--decode-block-size", type=int, default=64, metavar="N", help="tokens per decode block")
    group.add_argument("--decode-tp", "--decode-ranks", type=int, default=1, metavar="T", help="decode TP ranks")
    group.add_argument("--via-host", action="store_true", help="land bytes in a host buffer, then copy_blocks")
    group.add_argument("--backend", default=None, help="kvhost backend for the post-process (None: by device)")
    group.add_argument("--inflight", type=int, default=8, help="requests in flight at once, per decode engine")
    group.add_argument("--timeout", type=seconds, default=10.0, help="seconds one request's transfers may take")
    group.add_argument("--step", type=seconds, default=0.05, help="seconds between post-process steps")
    group = p.add_argument_group("every engine")
    group.add_argument(
        "--cross-layer", action="store_true", help="one cache tensor per rank, a block's layers back to back"
    )
    faults = p.add_mutually_exclusive_group()
    faults.add_argument("--kill-prefill-after", type=int, metavar="N", help="kill prefill 0 after N requests arrived")
    faults.add_argument("--freeze-prefill-after", type=int, metavar="N", help="stop prefill 0 after N arrived")
    faults.add_argument(
        "--freeze-decode-after", type=int, metavar="N", help="stop decode 0 past --peer-timeout after N arrived"
    )
    p.add_argument(
        "--peer-timeout", type=seconds, default=5.0, help="seconds without a beat before a prefill lets a decode go"
    )
    p.add_argument("--connect-timeout", type=seconds, default=60.0, help="seconds for the engines to start and connect")
    p.add_argument(
        "--run-timeout", type=seconds, default=3600.0, help="seconds the decode engines may take in all: then killed"
    )
    add_output(p)
    return p


def engines_of(args: argparse.Namespace) -> tuple[list[EngineShape], EngineShape]:
    """The prefill engines (comma lists zipped, single values broadcast) and the decode engine's shape."""
    layouts: list[str] = args.prefill_layout or [default_layout(args.cache, None, "HND")]
    sizes: list[int] = args.prefill_block_size
    tps: list[int] = args.prefill_tp
    count = broadcast({"--prefill-layout": layouts, "--prefill-block-size": sizes, "--prefill-tp": tps})
    for layout in layouts:
        if layout not in LAYOUTS:
            raise ValueError(f"--prefill-layout: {layout!r} is not one of {sorted(LAYOUTS)}")
    prefills = [
        EngineShape(
            layouts[min(i, len(layouts) - 1)],
            sizes[min(i, len(sizes) - 1)],
            tps[min(i, len(tps) - 1)],
            cross_layer=args.cross_layer,
        )
        for i in range(count)
    ]
    decode_layout = default_layout(args.cache, args.decode_layout, "NHD")
    decode = EngineShape(decode_layout, args.decode_block_size, args.decode_tp, cross_layer=args.cross_layer)
    return prefills, decode


def refusal(args: argparse.Namespace, prefills: list[EngineShape], decode: EngineShape) -> str | None:
    """Why the options are impossible (one line naming the option), or None."""
    model, workload = model_of(args), workload_of(args)
    shapes = [("prefill-", shape) for shape in prefills] + [("decode-", decode)]
    problem = model_refusal(model, workload, shapes)
    if problem:
        return problem
    for shape in prefills:
        big, small = sorted((shape.block_size, decode.block_size), reverse=True)
        if big % small:
            return f"block sizes {shape.block_size} and {decode.block_size} must divide one another"
    for name, value, most in (
        ("--decodes", args.decodes, 64),
        ("--inflight", args.inflight, 1 << 14),
        ("--kill-prefill-after", args.kill_prefill_after, 1 << 14),
        ("--freeze-prefill-after", args.freeze_prefill_after, 1 << 14),
        ("--freeze-decode-after", args.freeze_decode_after, 1 << 14),
    ):
        least = 0 if "after" in name else 1
        if value is not None and not least <= value <= most:
            return f"{name} must be in [{least}, {most}], got {value}"
    taken = len(range(0, workload.requests, args.decodes))  # decode 0's requests (--decodes checked above)
    for name, value in (
        ("--kill-prefill-after", args.kill_prefill_after),
        ("--freeze-prefill-after", args.freeze_prefill_after),
        ("--freeze-decode-after", args.freeze_decode_after),
    ):
        if value is not None and value > taken:  # the fault would never run, and the run pass as if it had
            return f"{name} {value}: the first decode engine takes {taken} requests, so the fault would never run"
    problem = peer_timeout_refusal(args.peer_timeout)
    if problem:
        return problem
    if len(prefills) > 16:
        return f"at most 16 prefill engines, got {len(prefills)}"
    # Every engine must hold some of the requests: an idle prefill exits at once (its decodes
    # would retry it until --connect-timeout), an idle decode has nothing to pull.
    for engines, what in ((len(prefills), "prefill engines"), (args.decodes, "decode engines (--decodes)")):
        if workload.requests < engines:
            return f"--requests {workload.requests} leaves some of the {engines} {what} with none: ask for {engines}+"
    if args.backend is not None:  # before any engine starts: decode would fail only after the handshake
        problem = backend_refusal(args.backend)
        if problem:
            return problem
    needed = sum(memory_needed(model, workload, shape, decode, staging=args.via_host) for shape in prefills)
    engines = [*prefills, *[decode] * args.decodes]
    return memory_refusal(needed, model, workload, engines=engines) or offer_refusal(args, model, workload, prefills)


def offer_refusal(
    args: argparse.Namespace, model: Model, workload: Workload, prefills: list[EngineShape]
) -> str | None:
    """Why a prefill engine's offer to a decode engine could not be sent (one line), or None:
    more cache streams (layers x K/V x TP) than an offer may carry, or the requests' block
    ids (32-bit) past a message's arrays, with room left for the tables. Found before any
    engine fills its cache, not as every decode refused after."""
    import numpy as np

    from kvhost.nixl.fields import MAX_ARRAY_BYTES
    from kvhost.nixl.tables import MAX_STREAMS

    lengths = np.array(workload.lengths(), dtype=np.int64)
    numbers = np.arange(workload.requests)
    for index, shape in enumerate(prefills):
        streams = model.layers * model.kv * shape.tp
        if not shape.cross_layer and streams > MAX_STREAMS:
            tp = f"--prefill-tp {shape.tp}"
            return f"--layers {model.layers} x K/V x {tp}: {streams} cache streams, past {MAX_STREAMS}"
        held = numbers % len(prefills) == index  # this prefill's requests, each offered to one decode
        decodes = numbers[held] % args.decodes
        ids = np.bincount(decodes, weights=-(-lengths[held] // shape.block_size), minlength=args.decodes)
        sizes = 4 * ids + 8 * np.bincount(decodes, minlength=args.decodes)
        worst = int(np.argmax(sizes))
        if sizes[worst] > MAX_ARRAY_BYTES // 2:
            name = f"prefill {index}" if len(prefills) > 1 else "prefill"
            return (
                f"{name} would offer decode {worst} {int(ids[worst]):,} block ids, past what one message carries "
                f"({MAX_ARRAY_BYTES // 8:,}): ask for fewer or shorter requests, or larger --prefill-block-size"
            )
    return None


def main(argv: Sequence[str] | None = None) -> int:
    """``kvhost demo``: start the engines, wait for them, print what they said."""
    p = parser()
    args = p.parse_args(sys.argv[1:] if argv is None else argv)
    try:
        prefills, decode = engines_of(args)
    except ValueError as err:
        p.error(str(err))
    problem = refusal(args, prefills, decode)
    if problem:
        p.error(problem)
    from kvhost.nixl.agent import load_nixl
    from kvhost.nixl.errors import NixlUnavailableError

    try:
        load_nixl()  # every engine needs it: said once, before any starts
    except NixlUnavailableError as err:
        print(f"kvhost demo: {err}", file=sys.stderr)
        return EXIT_ERROR
    with stop_on_sigterm() as stops:
        try:
            return run(args, prefills, decode)
        except KeyboardInterrupt as err:  # Ctrl-C, SIGTERM or SIGHUP: the engines were stopped on the way out
            stops.quiet()
            name, status = stopped_by(err)
            print(f"kvhost demo: stopped by {name}", file=sys.stderr)
            return status
        except Exception:  # a bug: say where, but never exit 1, which means only that requests failed
            traceback.print_exc()
            return EXIT_ERROR


def prefill_patience(decode_codes: Sequence[int], faulted: bool) -> float:
    """Seconds a prefill engine is given to exit on its own once every decode engine has ended.

    It exits once each decode engine has said done or closed its connection, which those
    that ran to the end (exit 0, or 1: requests failed) have. One that failed otherwise may
    never have connected, and one killed said nothing: the prefill would wait for it until
    its idle timeout, so it is asked to stop at once (as the engine a fault was put into is).
    """
    ran = all(code in (EXIT_OK, EXIT_FAILED) for code in decode_codes)
    return 15.0 if ran and not faulted else 0.5


def passed(args: argparse.Namespace, names: Sequence[str]) -> list[str]:
    """These options as the engines take them."""
    out = []
    for name in names:
        value = getattr(args, name)
        if value is not None:
            out += [f"--{name.replace('_', '-')}", str(value)]
    return out


def run(args: argparse.Namespace, prefills: list[EngineShape], decode: EngineShape) -> int:
    env = dict(os.environ)
    netenv.set_defaults(env, ["127.0.0.1"])
    secret = os.urandom(32).hex()
    common = passed(args, SHARED)
    prefill_engines: list[Engine] = []
    decode_engines: list[Engine] = []
    addresses = []
    progress_fd = os.dup(2) if sys.stderr.isatty() and not args.no_progress else None
    idle = min(args.connect_timeout + 60, MAX_WAIT_SECONDS)  # a prefill's wait for its decodes, within the cap
    with tempfile.TemporaryDirectory(prefix="kvhost-demo-") as scratch:
        try:
            for index, shape in enumerate(prefills):
                with socket.create_server(("127.0.0.1", 0)) as listener:
                    port = listener.getsockname()[1]
                    argv = [
                        *common,
                        *["--layout", shape.layout, "--block-size", str(shape.block_size), "--tp", str(shape.tp)],
                        *(["--cross-layer"] if shape.cross_layer else []),
                        *["--share", f"{index}/{len(prefills)}", "--serve", str(args.decodes)],
                        *["--listen", f"127.0.0.1:{port}", "--listen-fd", str(listener.fileno())],
                        *["--secret-file", "-", "--idle-timeout", str(idle)],
                        *["--peer-timeout", str(args.peer_timeout)],
                    ]
                    prefill_engines.append(
                        Engine(f"prefill {index}", "prefill", argv, secret, pass_fds=[listener.fileno()], env=env)
                    )
                addresses.append(f"127.0.0.1:{port}")
            for index in range(args.decodes):
                argv = [
                    *common,
                    *passed(args, DECODE_ONLY),
                    *["--layout", decode.layout, "--block-size", str(decode.block_size), "--tp", str(decode.tp)],
                    *(["--cross-layer"] if decode.cross_layer else []),
                    *["--share", f"{index}/{args.decodes}", "--prefill", ",".join(addresses)],
                    *["--secret-file", "-", "--connect-timeout", str(args.connect_timeout)],
                    *["--json", os.path.join(scratch, f"decode-{index}.json")],
                    *(["--via-host"] if args.via_host else []),
                    *(["--no-progress"] if progress_fd is None else ["--progress-fd", str(progress_fd)]),
                    *(fault_options(args, prefill_engines[0]) if index == 0 else []),
                ]
                fds = [progress_fd] if progress_fd is not None else []
                decode_engines.append(Engine(f"decode {index}", "decode", argv, secret, pass_fds=fds, env=env))
            faulted = args.kill_prefill_after is not None or args.freeze_prefill_after is not None
            codes = finish(decode_engines, prefill_engines[1:] if faulted else prefill_engines, args)
            prefill_codes = [
                e.stop(patience=prefill_patience(codes, faulted and i == 0)) for i, e in enumerate(prefill_engines)
            ]
        finally:
            for engine in [*decode_engines, *prefill_engines]:
                if engine.process.poll() is None:
                    engine.stop(patience=0)
            if progress_fd is not None:
                os.close(progress_fd)
        outcomes = [read_json(os.path.join(scratch, f"decode-{i}.json")) for i in range(len(decode_engines))]
    if not report(args, prefill_engines, decode_engines, codes, prefill_codes, outcomes):
        return EXIT_ERROR
    return max(codes) if all(c in (0, 1, 2) for c in codes) else EXIT_ERROR


def finish(decodes: Sequence[Engine], prefills: Sequence[Engine], args: argparse.Namespace) -> list[int]:
    """The decode engines' exit statuses, within ``--run-timeout``: then they are killed (and
    said so: a status of their own, never 1).

    A prefill engine that exits with a failure while they run (it died as it started, or
    crashed) is watched for: the decode engines get ``--timeout`` and 5 s more to see it
    themselves (a lost peer fails their requests) and are then stopped, since one still
    connecting to it would retry until ``--connect-timeout``.
    """
    deadline = time.monotonic() + args.run_timeout
    lost: str | None = None  # why the decode engines are stopped early, once a prefill engine failed
    while any(engine.process.poll() is None for engine in decodes) and time.monotonic() < deadline:
        if lost is None:
            gone = next(((e, code) for e in prefills if (code := e.process.poll()) not in (None, 0)), None)
            if gone is not None:
                engine, code = gone
                grace = args.timeout + 5
                lost = f"{engine.name} exited ({code}) before this engine ended: stopped {grace:g} s later"
                deadline = min(deadline, time.monotonic() + grace)
        time.sleep(0.05)
    codes = []
    for engine in decodes:
        try:
            codes.append(engine.wait(timeout=max(deadline - time.monotonic(), 0.01)))
        except subprocess.TimeoutExpired:
            engine.output.shown.append(lost or f"did not finish within --run-timeout {args.run_timeout:g} s: killed")
            code = engine.stop(patience=0)
            codes.append(code if lost else -9)
    return codes


def until_state(pid: int, state: str) -> str:
    """A shell loop that ends once process ``pid`` shows ``state`` in /proc (T stopped, Z a
    zombie), or is gone."""
    status = f"/proc/{pid}/status"
    return f'while [ -r {status} ] && ! grep -qs "^State:.{state}" {status}; do sleep 0.01; done'


def fault_options(args: argparse.Namespace, prefill: Engine) -> list[str]:
    pid = prefill.pid
    if args.kill_prefill_after is not None:
        # Decode goes on once the process is gone (a zombie, or reaped): until its memory is
        # torn down, reads already posted, and new ones, may still be answered (a loaded
        # machine took long enough for every request to land).
        gone = until_state(pid, "Z")
        after, command, label = args.kill_prefill_after, f"kill -KILL {pid} && {gone}", "killed"
    elif args.freeze_prefill_after is not None:
        # A stop takes effect once every thread of the process has stopped; decode goes on
        # only then (where /proc shows it), or its next transfers may still be answered.
        wait = until_state(pid, "T")
        # Resumed once this demo is gone, whatever ends it: a stopped process never acts on the
        # SIGTERM its parent's death sends it, and would be left stopped, holding its memory.
        watch = f"(while kill -0 {os.getpid()} 2>/dev/null; do sleep 0.5; done; kill -CONT {pid}) >/dev/null 2>&1 &"
        command = f"{watch} kill -STOP {pid} && {wait}"
        after, label = args.freeze_prefill_after, "froze (SIGSTOP)"
    elif args.freeze_decode_after is not None:
        # Decode (the shell's parent) stops itself; a child the stop does not reach wakes it.
        resume = args.peer_timeout + 1
        after, command = args.freeze_decode_after, f"(sleep {resume:g}; kill -CONT $PPID) & kill -STOP $PPID"
        return [
            *["--fault-after", str(after), "--fault-command", command],
            *["--fault-label", f"froze (SIGSTOP) decode 0 for {resume:g} s"],
            # The command's deadline runs on while decode is stopped: it ends once decode resumes.
            *["--fault-timeout", f"{min(resume + 10, MAX_WAIT_SECONDS):g}"],
        ]
    else:
        return []
    return [
        *["--fault-after", str(after), "--fault-command", command],
        *["--fault-label", f"{label} prefill 0 (pid {pid})"],
    ]


def read_json(path: str) -> dict[str, object] | None:
    with contextlib.suppress(OSError, ValueError), open(path) as source:
        data: dict[str, object] = json.load(source)
        return data
    return None


def report(
    args: argparse.Namespace,
    prefills: list[Engine],
    decodes: list[Engine],
    codes: list[int],
    prefill_codes: list[int],
    outcomes: list[dict[str, object] | None],
) -> bool:
    """Each decode engine's report as it printed it, what the prefill engines said, the noise
    summed up; False where ``--json`` could not be written (said in one line)."""
    out = sys.stdout
    for engine, code, outcome in zip(decodes, codes, outcomes):
        if len(decodes) > 1:
            out.write(f"--- {engine.name} (pid {engine.pid}, exit {code})\n")
        for line in engine.output.stdout:
            out.write(line + "\n")
        said = f"decode: {outcome['error']}" if outcome and outcome.get("error") else None
        for line in engine.output.shown:
            if line != said:  # its report above has the error already
                out.write(f"  {engine.name}: {line}\n")
    for engine, code in zip(prefills, prefill_codes):
        for line in engine.output.stdout[1:]:  # the first says where it listens
            out.write(f"  {engine.name}: {line.removeprefix('prefill: ')}\n")
        for line in engine.output.shown:
            out.write(f"  {engine.name}: {line}\n")
        if code not in (0, 1):
            out.write(f"  {engine.name}: exit {code}\n")
    for engine in [*prefills, *decodes]:
        summary = engine.output.summary()
        if summary:
            out.write(f"  noise     {summary}\n")
    if len(decodes) > 1:
        verdict = "OK" if all(c == EXIT_OK for c in codes) else "FAILED"
        out.write(f"demo      {len(decodes)} decode engines: {verdict} (exit {', '.join(map(str, codes))})\n")
    out.flush()
    if args.json:
        prefill_info = [{"pid": e.pid, "exit": c, "said": e.output.stdout} for e, c in zip(prefills, prefill_codes)]
        data: dict[str, object]
        if len(decodes) == 1 and outcomes[0] is not None:
            data = {**outcomes[0], "prefills": prefill_info}
        else:
            data = {"ok": all(c == EXIT_OK for c in codes), "decodes": outcomes, "prefills": prefill_info}
        try:
            write_json_file(args.json, data)
        except OSError as err:
            print(f"kvhost demo: --json {args.json}: {os_reason(err)}", file=sys.stderr)
            return False
    return True
