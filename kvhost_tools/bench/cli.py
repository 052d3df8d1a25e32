"""``kvhost bench``: memcpy (the roofline), the per-request baseline and kvhost, side by side.

The measuring runs in a child process with ``OMP_WAIT_POLICY=PASSIVE`` unless the
variable is set: torch and numba each bring an OpenMP runtime whose idle workers spin,
and on a shared two-core machine a spinning worker turns every parallel region into a
wait for a scheduler time slice (8-16 ms per call measured here under load).

Options the run could not carry out are refused before it starts (status 2, one line):
a backend that cannot run here, a device without memory to time, a batch larger than
the memory left, a results path that is a folder. SIGTERM or Ctrl-C stops a run (status
143 or 130, one line): the measuring child and its sender stop with it, and the results
file is left as it was.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

import torch

import kvhost
from kvhost.errors import BackendError
from kvhost.nixl.agent import DEFAULT_THREADS, MAX_THREADS, load_nixl
from kvhost.nixl.errors import NixlUnavailableError
from kvhost_tools.bench.footprint import device_refusal, host_refusal, scenarios_footprint, transfer_bytes
from kvhost_tools.bench.machine import Device, machine
from kvhost_tools.bench.methods import KVHOST, METHODS, ROOFLINE, Workspace, prepare
from kvhost_tools.bench.output import other_tables, plot, table, target_table, to_json, write_text_whole
from kvhost_tools.bench.sender import HUGE_PAGES, PROGRESS, QUICK_DEMO, Setting
from kvhost_tools.bench.targets import evaluate, front_end_share
from kvhost_tools.bench.timing import measure, summarise
from kvhost_tools.bench.ways import BOUNDS, SWEEP
from kvhost_tools.bench.workloads import PRESETS, Geometry, Preset, Scenario, scenarios
from kvhost_tools.bench.xla_scaling import measure_xla_scaling, xla_table
from kvhost_tools.demo import netenv
from kvhost_tools.demo.config import memory_refusal
from kvhost_tools.demo.options import Parser, backend_refusal, folder_refusal, seconds
from kvhost_tools.demo.stopping import PARENT_ENV, stop_on_sigterm, stopped_by

# Device types whose tensors hold no bytes: nothing there to copy, evict or time.
NO_MEMORY = {"meta": "torch's meta device holds shapes, not bytes"}
BACKENDS_HINT = "`kvhost info` lists the backends and whether each can run here"
# What stops a run: the measuring child is sent SIGTERM, and the bench exits 128 + the signal.
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


def _kvhost_results(path: Path) -> bool:
    """Whether ``path`` holds a ``kvhost bench`` run's results (a JSON object it wrote)."""
    try:
        with path.open() as f:
            data = json.load(f)
    except (OSError, ValueError):
        return False
    return isinstance(data, dict) and "kvhost_bench" in data


def parse(argv: Sequence[str]) -> argparse.Namespace:
    parser = Parser(prog="kvhost bench", description=__doc__ and __doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="tiny shapes and few rounds, for CI (a few seconds)")
    parser.add_argument("--device", default="cpu", help="torch device of the caches (default cpu)")
    parser.add_argument("--requests", help="batch sizes to sweep, comma-separated (default 1..256 doubling)")
    parser.add_argument("--only", action="append", default=[], help="run scenarios whose name starts with this")
    parser.add_argument("--rounds", type=int, help="rounds per point (default: adaptive, odd, 7 to 31)")
    parser.add_argument("--backend", action="append", default=[], help="also time KVHost with this backend")
    parser.add_argument(
        "--cache",
        choices=("data", "all", "warm"),
        default="data",
        help="what to evict before each timed call: the bytes the methods touch (default), everything, or nothing",
    )
    parser.add_argument("--no-sweeps", action="store_true", help="only the target scenarios")
    quick = "with --quick bench-results/bench-quick"
    inside = "docs/bench.{} in the repository, else bench-results/bench.{}"
    parser.add_argument(
        "--json", type=Path, help=f"where to write the results (default {inside.format('json', 'json')}; {quick}.json)"
    )
    parser.add_argument(
        "--png", type=Path, help=f"where to write the plot (default {inside.format('png', 'png')}; {quick}.png)"
    )
    parser.add_argument("--check", action="store_true", help="exit 1 when a target fails")
    parser.add_argument(
        "--xla-scaling",
        action="store_true",
        help="also run kvhost_tools.device_checks.xla_scaling.measure_scaling() where torch_xla runs",
    )
    parser.add_argument("--seed", type=int, default=0)
    transfer = parser.add_argument_group(
        "transfer", "a NIXL hand-off of the demo's batch, side by side (kvhost_tools/bench/transfer.py)"
    )
    transfer.add_argument("--transfer", action="store_true", help="measure the transfer section only")
    transfer.add_argument("--demo", default=None, help="kvhost demo options of the batch (default: the demo's own)")
    transfer.add_argument("--inflight", type=int, default=8, help="transfers in flight at once (as the demo)")
    transfer.add_argument(
        "--progress",
        choices=PROGRESS,
        default="poll",
        help="how both sides drive NIXL: poll (no progress thread) or NIXL's progress thread",
    )
    transfer.add_argument(
        "--huge-pages",
        choices=HUGE_PAGES,
        default="on",
        help="both sides ask for huge pages under their registered caches (Agent.register's default) or not",
    )
    transfer.add_argument(
        "--threads",
        type=int,
        default=DEFAULT_THREADS,
        help=f"UCX worker threads of both sides' agents (NIXL num_threads; default {DEFAULT_THREADS}, as vLLM's)",
    )
    transfer.add_argument("--peer-netns", help="run the sender under ip netns exec in this network namespace")
    transfer.add_argument(
        "--peer-env", action="append", default=[], metavar="KEY=VALUE", help="environment of the sender only"
    )
    transfer.add_argument(
        "--bounds",
        default=",".join(str(b) for b in BOUNDS),
        help="other merge bounds to time, bytes, comma-separated (empty: none)",
    )
    transfer.add_argument(
        "--sweep",
        default=",".join(str(b) for b in SWEEP),
        help="descriptor sizes of the transport sweep, bytes, comma-separated (0: one per layer; empty: none)",
    )
    transfer.add_argument("--seconds", type=seconds, default=30.0, help="seconds of rounds to aim for (default 30)")
    parser.add_argument("--in-process", action="store_true", help="measure in this process (see module docstring)")
    args = parser.parse_args(argv)
    if args.requests is not None:
        given = args.requests
        try:
            args.requests = tuple(int(n) for n in given.split(","))
        except ValueError:
            parser.error(f"--requests {given!r}: give batch sizes as integers separated by commas")
        if min(args.requests) < 1:
            parser.error(f"--requests {given!r}: batch sizes must be at least 1")
    if args.check and args.quick:  # a check that --quick's shapes would fail every time tells nothing
        parser.error("--check holds the full shapes to their targets, which --quick's tiny ones are not set for")
    if args.rounds is not None and args.rounds < 1:
        parser.error(f"--rounds {args.rounds}: at least one round")
    if args.seed < 0:  # numpy's generators take none below 0
        parser.error(f"--seed {args.seed}: give a seed of 0 or more")
    try:
        device = torch.device(args.device)
    except RuntimeError:
        parser.error(f"--device {args.device!r} is not a torch device")
    module = getattr(torch, device.type, None) if device.type != "cpu" else None
    if module is not None and hasattr(module, "is_available") and not module.is_available():
        parser.error(f"--device {args.device!r}: torch sees no {device.type} device here")
    if device.type in NO_MEMORY:
        why = NO_MEMORY[device.type]
        parser.error(f"--device {args.device!r}: {why}, so there is nothing to time: give cpu or an accelerator")
    problem = backends_refusal(device, args.backend)
    if problem:
        parser.error(problem)
    names = sorted(s.name for s in scenarios(PRESETS["full"], (1,)))
    for prefix in args.only:
        if not any(name.startswith(prefix) for name in names):
            parser.error(f"--only {prefix!r} matches no scenario ({', '.join(names)})")
    for name in ("bounds", "sweep"):
        given = getattr(args, name)
        try:
            setattr(args, name, tuple(int(b) for b in given.split(",") if b.strip()))
        except ValueError:
            parser.error(f"--{name} {given!r}: give byte counts as integers separated by commas")
    if not 0 <= args.threads <= MAX_THREADS:
        parser.error(f"--threads {args.threads}: from 0 to {MAX_THREADS}")
    if any(b < 1 for b in args.bounds) or any(b < 0 for b in args.sweep) or args.inflight < 1:
        parser.error("--bounds and --inflight must be at least 1, --sweep sizes at least 0")
    if any("=" not in item for item in args.peer_env):
        parser.error(f"--peer-env {args.peer_env!r}: give KEY=VALUE")
    args.ucx = {"UCX_NET_DEVICES": "lo"}  # where the transfer runs, as the demo: on loopback
    if args.peer_netns:
        # Over TCP on the link between the namespaces: they are one host to UCX, whose shared
        # memory would reach across; the sender gets its end of the link, unless told otherwise.
        try:
            ours, theirs = netenv.namespace_link(args.peer_netns)
        except ValueError as err:
            parser.error(f"--peer-netns {args.peer_netns}: {err}")
        args.ucx = {"UCX_NET_DEVICES": ours, "UCX_TLS": "tcp"}
        given = {item.split("=", 1)[0] for item in args.peer_env}
        sender = {"UCX_NET_DEVICES": theirs, "UCX_TLS": os.environ.get("UCX_TLS", "tcp")}
        args.peer_env = [*args.peer_env, *(f"{key}={value}" for key, value in sender.items() if key not in given)]
    demo_given = args.demo is not None
    if args.demo is None:
        args.demo = QUICK_DEMO if args.quick else ""
    args.argv = [a for a in argv if a != "--in-process"]
    # A full run updates the committed results where it runs in the repository (a
    # docs/bench.json of kvhost's own); elsewhere (an installed kvhost, another project's
    # docs/) it writes next to the quick run's, never over a file that is not kvhost's.
    committed = Path("docs") / "bench.json"
    default_dir = Path("docs") if not args.quick and _kvhost_results(committed) else Path("bench-results")
    stem = "bench-quick" if args.quick else "bench"
    args.json = args.json or default_dir / f"{stem}.json"
    args.png = args.png or default_dir / f"{stem}.png"
    problem = file_refusal("--json", args.json, "bench.json")
    if problem:
        parser.error(problem)
    if args.transfer or demo_given:
        problem = demo_refusal(args.demo)
        if problem:
            parser.error(problem)
    if args.transfer:
        try:
            load_nixl()  # the sender and this process both need it: said here, not as a closed connection later
        except NixlUnavailableError as err:
            parser.error(f"--transfer reads the batch over NIXL: {err}")
        return args
    problem = file_refusal("--png", args.png, "bench.png")
    if problem:
        parser.error(problem)
    if args.png.suffix.lower() != ".png":  # matplotlib would add ".png": the plot would land elsewhere
        example = args.png.with_name(args.png.name + ".png")
        parser.error(f"--png {args.png}: the plot is a PNG file: give a name ending in .png, such as {example}")
    args.footprint = scenarios_footprint(chosen_scenarios(args)[1], device, args.cache)
    problem = host_refusal(args.footprint, memory_remedy(args))
    if problem:
        parser.error(problem)
    return args


def backends_refusal(device: torch.device, names: Sequence[str]) -> str | None:
    """Why kvhost cannot run on ``device``, or with one of the backends ``names`` (one line), or None."""
    try:
        kvhost.get_backend(device)
    except BackendError as err:
        return f"--device {str(device)!r}: {err}; {BACKENDS_HINT}"
    for name in names:
        problem = backend_refusal(name, str(device))
        if problem:
            return f"{problem}; {BACKENDS_HINT}"
    return None


def file_refusal(option: str, path: Path, example: str) -> str | None:
    """Why ``path`` cannot be written as a file at the end of the run (one line), or None: said
    before the run, not after it. Folders that do not exist yet are made then."""
    if path.is_dir():
        return f"{option} {path} is a folder: give a file name, such as {path / example}"
    if path.exists():
        if not os.access(path, os.W_OK):
            return f"{option} {path}: no permission to write it"
        if not path.is_file():  # /dev/stdout: written as it is
            return None
    folder = Path(os.path.realpath(path)).parent  # where ``write_whole`` makes its partial file
    while not folder.exists():
        folder = folder.parent
    if not folder.is_dir():
        return f"{option} {path}: {folder} is a file, not a folder"
    problem = folder_refusal(str(folder))
    return f"{option} {path}: {problem}" if problem else None


def demo_refusal(text: str) -> str | None:
    """Why the demo would refuse ``--demo``'s options, or this machine cannot hold their batch
    in both processes (one line naming the option), or None."""
    try:
        setting = Setting.read(text)
    except ValueError as err:
        return f"--demo {text!r}: {err}"
    problem = setting.refusal()
    if problem:
        return f"--demo {text!r}: {problem}"
    problem = memory_refusal(transfer_bytes(setting), setting.model, setting.workload)
    if problem:
        return f"--demo {text!r}: {problem}: ask for fewer or shorter requests, or a smaller model"
    return None


def memory_remedy(args: argparse.Namespace) -> str:
    quick = "" if args.quick else ", or the quick shapes (--quick)"
    return f"ask for smaller batches (--requests) or fewer scenarios (--only){quick}"


def chosen_scenarios(args: argparse.Namespace) -> tuple[Preset, list[Scenario]]:
    """The preset and the scenarios the options choose, in the order they are reported."""
    preset = PRESETS["quick" if args.quick else "full"]
    if args.no_sweeps:
        preset = replace(preset, sweeps=False)
    requests = args.requests or preset.requests
    chosen = [s for s in scenarios(preset, requests) if not args.only or any(s.name.startswith(o) for o in args.only)]
    return preset, chosen


def allocation_order(chosen: list[Scenario]) -> list[Scenario]:
    """Scenarios that start on the same cache geometry run one after another: fewer large allocations."""
    first_seen: dict[Geometry, int] = {}
    for scenario in chosen:
        first_seen.setdefault(scenario.points[0].geometry, len(first_seen))
    return sorted(chosen, key=lambda s: first_seen[s.points[0].geometry])


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse(argv)
    if not args.in_process and "OMP_WAIT_POLICY" not in os.environ:
        env = dict(os.environ, OMP_WAIT_POLICY="PASSIVE")
        command = [sys.executable, "-m", "kvhost_tools.bench", *argv, "--in-process"]
        return measure_in_child(command, env, args.json)
    parent_reports = PARENT_ENV in os.environ  # a bench that started this one says how it stopped
    before = file_state(args.json)
    try:
        with stop_on_sigterm():  # also stops this process where the bench that started it is gone
            return run(args, argv)
    except KeyboardInterrupt as err:  # Ctrl-C, or SIGTERM: the sender (--transfer) was stopped on the way out
        name, status = stopped_by(err)
        if not parent_reports:
            print(stop_line(name, args.json, before), file=sys.stderr)
        return status


CHILD_DEADLINE_S = 12 * 3600.0  # the longest a measuring process may run (a full bench: about half an hour)
STOP_WAIT_S = 30.0  # for a process killed to be gone


def measure_in_child(command: list[str], env: dict[str, str], results: Path) -> int:
    """Run ``command`` (the bench, ``--in-process``) and wait for it; its exit status.

    SIGTERM or SIGINT here stops it: the child is sent SIGTERM, stops its sender and writes
    nothing, and this process says so in one line and exits 128 + the signal. A second
    signal kills the child and what it started at once. The child has a session of its own,
    so a terminal's Ctrl-C reaches this process alone, and the child is stopped once, by it.
    """
    before = file_state(results)
    received: list[int] = []
    child: subprocess.Popen[bytes] | None = None

    def stop_child(signum: int, frame: object) -> None:
        received.append(signum)
        if child is None:
            return  # not started yet: stopped as soon as it is
        if len(received) == 1:
            child.send_signal(signal.SIGTERM)
        else:
            kill_session(child.pid)

    previous = {}
    if threading.current_thread() is threading.main_thread():  # handlers can be set there only
        for number in STOP_SIGNALS:
            if signal.getsignal(number) is not signal.SIG_IGN:  # a signal ignored (nohup, &) stays so
                previous[number] = signal.signal(number, stop_child)
    try:
        # Where this process dies without stopping it (SIGKILL), the child stops itself (stopping.py).
        child = subprocess.Popen(command, env={**env, PARENT_ENV: str(os.getpid())}, start_new_session=True)
        if received:
            child.send_signal(signal.SIGTERM)
        try:
            returncode = child.wait(timeout=CHILD_DEADLINE_S)
        except subprocess.TimeoutExpired:  # hung: the full bench takes tens of minutes, not this
            kill_session(child.pid)
            child.wait(timeout=STOP_WAIT_S)
            print(f"kvhost bench: stopped the measuring process after {CHILD_DEADLINE_S / 3600:g} h", file=sys.stderr)
            return 124
    finally:
        for number, handler in previous.items():
            signal.signal(number, handler)
    if not received:
        return returncode
    kill_session(child.pid)  # what the child started and could not stop (its sender) goes too
    print(stop_line(signal.Signals(received[0]).name, results, before), file=sys.stderr)
    return 128 + received[0]


def kill_session(leader: int) -> None:
    """SIGKILL to every process left in the process group ``leader`` leads (none left: nothing happens)."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(leader, signal.SIGKILL)


def file_state(path: Path) -> tuple[int, int, int] | None:
    """What tells whether ``path`` was written since: its inode, modification time and size (None: absent)."""
    try:
        stat = path.stat()
    except OSError:
        return None
    return stat.st_ino, stat.st_mtime_ns, stat.st_size


def stop_line(signal_name: str, results: Path, before: tuple[int, int, int] | None) -> str:
    """The one line a stopped run ends with: what stopped it, and whether the results were written."""
    if file_state(results) == before:
        return f"kvhost bench: stopped by {signal_name}; nothing was written to {results}"
    return f"kvhost bench: stopped by {signal_name}, after writing {results}"


def run(args: argparse.Namespace, argv: Sequence[str]) -> int:
    if args.transfer:
        return run_transfer(args)
    preset, chosen = chosen_scenarios(args)
    problem = device_refusal(args.footprint, torch.device(args.device), memory_remedy(args))
    if problem:  # said by the device's runtime, which only the measuring process starts
        print(f"kvhost bench: error: {problem}", file=sys.stderr)
        return 2
    device = Device(args.device, args.cache)
    space = Workspace(device)
    rng = random.Random(args.seed)
    total = sum(len(s.points) for s in chosen)
    print(
        f"kvhost bench ({preset.name}): {total} points, device {args.device}, "
        f"cache {device.cache}, backend {kvhost.get_backend(device.device).name}",
        file=sys.stderr,
    )
    by_scenario: dict[str, list[dict[str, Any]]] = {}
    done = 0
    began = time.perf_counter()
    for scenario in allocation_order(chosen):
        num_blocks = max(p.blocks for p in scenario.points)
        scenario_rows = []
        for i, point in enumerate(scenario.points):
            done += 1
            started = time.perf_counter()
            prepared = prepare(point, space, args.backend, num_blocks, seed=args.seed + i)
            verified = prepared.verify() if prepared.verify is not None else None  # every point, before timing
            measured = measure(prepared.methods, device, preset, args.rounds, rng, prepared.touched)
            row = summarise(point, prepared, measured)
            row["verified_against_baseline"] = verified
            scenario_rows.append(row)
            print(f"[{done:>3}/{total}] {_progress(row)} ({time.perf_counter() - started:.1f} s)", file=sys.stderr)
            if verified is False:
                print("    MISMATCH: the baseline and kvhost left different bytes", file=sys.stderr)
            del prepared, measured  # free this point's caches before the next allocates
        by_scenario[scenario.name] = scenario_rows
        gc.collect()
    rows = [row for s in chosen for row in by_scenario[s.name]]
    targets = [t for s in chosen if (t := evaluate(s, by_scenario[s.name])) is not None]
    xla_scaling = measure_xla_scaling() if args.xla_scaling else None
    result = {
        "kvhost_bench": 1,
        "command": " ".join(["kvhost bench", *(a for a in argv if a != "--in-process")]),
        "preset": preset.name,
        "device": args.device,
        "cache": device.cache,
        "backend": kvhost.get_backend(device.device).name,
        "backend_detail": kvhost.get_backend(device.device).describe(),
        "machine": machine(),
        "seconds": time.perf_counter() - began,
        "methods": METHODS,
        "scenarios": [
            {
                "name": s.name,
                "title": s.title,
                "cache": s.points[0].geometry.describe(),
                "plot": s.plot,
                "target": asdict(s.target) if s.target else None,
                "points": len(s.points),
            }
            for s in chosen
        ],
        "points": rows,
        "targets": targets,
        "targets_apply": preset.name == "full",
        "xla_scaling": xla_scaling,
        "verified": all(r["verified_against_baseline"] is not False for r in rows),
        "table": table(rows, [f"kvhost[{b}]" for b in args.backend]),
    }
    result["transfer"] = _previous(args.json).get("transfer", {})  # measured by --transfer runs
    write_text_whole(args.json, to_json(result) + "\n")
    try:
        plot(result, args.png)
        wrote = f"{args.json} and {args.png}"
    except ImportError as err:  # matplotlib is the bench extra; the figures stand without the plot
        wrote = f"{args.json} (no plot: {err}; pip install 'kvhost[bench]')"
    print(result["table"])
    extra = other_tables(rows)
    if extra:
        print()
        print(extra)
    if xla_scaling is not None:
        print()
        print(xla_table(xla_scaling))
    if targets:
        print()
        print(target_table(targets))
        if preset.name != "full":
            print(f"({preset.name} shapes: the targets are set for the full preset's shapes)")
    print(f"\nwrote {wrote} in {result['seconds']:.0f} s", file=sys.stderr)
    if not result["verified"]:
        return 2
    return 1 if args.check and not all(t["passed"] for t in targets) else 0


def transfer_key(section: dict[str, Any]) -> str:
    """Where a transfer section is kept in the results: the setting (cross-layer caches among
    it), and what differs from the defaults of an Agent (huge pages, UCX threads)."""
    parts = [section["where"], section["block_ids"]]
    if section.get("cross_layer"):  # sections before the option have no such key
        parts.append("cross-layer caches")
    if section["huge_pages"]["asked"] != "on":
        parts.append("no huge pages asked")
    if section["threads"] != DEFAULT_THREADS:
        parts.append(f"{section['threads']} UCX threads")
    return ", ".join(parts)


def run_transfer(args: argparse.Namespace) -> int:
    """The transfer section (``transfer.py``): measured, printed, and kept in the results file
    under ``"transfer"``, one entry per setting, beside what the other scenarios measured."""
    from kvhost_tools.bench import transfer, transfer_report

    with _ucx_defaults(args.ucx):
        section = transfer.run(args)
    print(transfer_report.table(section))
    previous = _previous(args.json)
    key = transfer_key(section)
    previous["transfer"] = {**previous.get("transfer", {}), key: section}
    write_text_whole(args.json, to_json(previous) + "\n")
    print(f"\nwrote the transfer section {key!r} into {args.json}", file=sys.stderr)
    return 1 if args.check and not section["targets"]["passed"] else 0


def _previous(path: Path) -> dict[str, Any]:
    """The results file as it stands (empty when there is none, or it is not ours)."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


@contextlib.contextmanager
def _ucx_defaults(settings: dict[str, str]) -> Iterator[None]:
    """UCX's ``settings`` (``--peer-netns``'s, or loopback's), each where the caller chose none."""
    added = {key: value for key, value in settings.items() if key not in os.environ}
    os.environ.update(added)
    try:
        yield
    finally:
        for key in added:
            os.environ.pop(key, None)


def _progress(row: dict[str, Any]) -> str:
    methods = row["methods"]
    head = f"{row['scenario']} {row['label']}, {row['requests']} x {row['blocks_per_request']} blocks"
    if ROOFLINE in methods:
        k = methods[KVHOST]
        return f"{head}: kvhost {k['fraction']:.2f} of memcpy, {k['speedup']:.1f}x baseline"
    if row["kind"] == "identity":
        same, empty = methods[KVHOST]["median_s"], methods["empty"]["median_s"]
        return f"{head}: {same * 1e6:.0f} us vs an empty call's {empty * 1e6:.0f} us"
    return f"{head}: front end {front_end_share(methods):.2%} of the transform"


if __name__ == "__main__":
    raise SystemExit(main())
