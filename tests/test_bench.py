"""kvhost bench: the quick preset end to end, its verdicts, and the baseline as a correct implementation."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

import kvhost
from kvhost.testing import ReceiveCase, fill_random, make_cache, raw
from kvhost_tools.bench import cli, footprint, machine, output, targets, timing, workloads
from kvhost_tools.bench.baseline import PerRequestReceiver, PerRequestStager, wire_view
from kvhost_tools.bench.methods import BASELINE, IN_PLACE, IN_PLACE_1T, KVHOST, KVHOST_FN, ROOFLINE, ROOFLINE_1T
from kvhost_tools.bench.output import ROUNDING_TOLERANCE

TARGET_SCENARIOS = {"receive-r4", "receive-g4", "stage-runs", "stage-scattered", "identity", "front-end"}


@pytest.mark.timeout(240)
def test_quick_bench_writes_json_png_and_table(tmp_path, capfd):
    out_json, out_png = tmp_path / "bench.json", tmp_path / "bench.png"
    code = cli.main(["--quick", "--json", str(out_json), "--png", str(out_png)])
    out, err = capfd.readouterr()
    assert code == 0, err[-2000:]

    result = json.loads(out_json.read_text())
    assert result["preset"] == "quick" and result["device"] == "cpu" and result["cache"] in ("data", "all")
    assert result["verified"] is True
    assert {s["name"] for s in result["scenarios"]} >= TARGET_SCENARIOS
    assert {t["scenario"] for t in result["targets"]} == TARGET_SCENARIOS
    assert all(isinstance(t["passed"], bool) and t["checks"] for t in result["targets"])

    roofline_rows = [r for r in result["points"] if ROOFLINE in r["methods"]]
    assert roofline_rows
    for row in roofline_rows:
        methods = row["methods"]
        assert {ROOFLINE, BASELINE, KVHOST, KVHOST_FN} <= set(methods)
        block_bytes = workloads.Geometry(**{**row["geometry"]}).block_bytes
        assert row["bytes"] == row["blocks"] * block_bytes > 0
        roof = methods[row["roofline_best"]]
        assert roof["median_s"] == min(methods[name]["median_s"] for name in (ROOFLINE, ROOFLINE_1T))
        assert roof["fraction"] == pytest.approx(1.0) and methods[ROOFLINE]["fraction"] <= 1.0
        assert methods[KVHOST]["fraction"] == pytest.approx(roof["median_s"] / methods[KVHOST]["median_s"], rel=1e-3)
        # A receive is also held to its own floor: its bytes rewritten where they lie.
        receive = row["kind"] == "receive"
        assert (IN_PLACE in methods) is receive and ("in_place" in methods[KVHOST]) is receive
        if receive:
            floor = min(methods[name]["median_s"] for name in (IN_PLACE, IN_PLACE_1T))
            assert methods[row["in_place_best"]]["median_s"] == floor
            assert methods[KVHOST]["in_place"] == pytest.approx(floor / methods[KVHOST]["median_s"], rel=1e-3)
        for entry in methods.values():
            assert len(entry["samples_s"]) == len(entry["run_queue_wait_s"]) == len(entry["used"]) == row["rounds_run"]
            used = [t for t, keep in zip(entry["samples_s"], entry["used"]) if keep]
            assert len(used) == entry["rounds"] >= 3
            assert entry["median_s"] == pytest.approx(float(np.median(used)), rel=ROUNDING_TOLERANCE)
            assert entry["min_s"] <= entry["median_s"] <= entry["max_s"]
            assert entry["gbps"] == pytest.approx(row["bytes"] / entry["median_s"] / 1e9, rel=ROUNDING_TOLERANCE)
        best = methods[row["baseline_best"]]["median_s"]
        assert methods[KVHOST]["speedup"] == pytest.approx(best / methods[KVHOST]["median_s"], rel=ROUNDING_TOLERANCE)
    # Every point was checked against the baseline, bit for bit.
    assert all(row["verified_against_baseline"] is True for row in roofline_rows)
    identity = [r for r in result["points"] if r["kind"] == "identity"]
    assert identity and all(r["bytes"] == 0 for r in identity)

    assert out_png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    import matplotlib.image

    height, width = matplotlib.image.imread(str(out_png)).shape[:2]
    assert width > 600 and height > 300

    header = next(line for line in out.splitlines() if line.startswith("scenario "))
    assert all(column in header for column in output.TABLE_COLUMNS)
    assert result["table"].splitlines()[0] == header
    assert "[  1/" in err  # progress while it runs


@pytest.mark.parametrize(("order", "moves"), [("NHC", False), ("HNC", True)])
def test_the_identity_points_bytes_are_what_its_call_moved(order, moves):
    """The identity target holds a point to moving nothing: its bytes are what the call said
    it moved (a sender of another layout moves them), not a constant that always passes."""
    from dataclasses import replace

    from kvhost_tools.bench.methods import Workspace, prepare

    point = next(
        p for s in workloads.scenarios(workloads.PRESETS["quick"], (2,)) for p in s.points if p.kind == "identity"
    )
    point = replace(point, remote_order=order, remote_block_size=point.geometry.block_size)
    prepared = prepare(point, Workspace(machine.Device("cpu")), (), point.blocks + 4, seed=1)
    assert (prepared.nbytes > 0) is moves


def test_bench_reports_a_baseline_that_disagrees(tmp_path, monkeypatch, capfd):
    """The bench's own check can fail: a baseline that leaves the wire bytes is caught."""
    monkeypatch.setattr(PerRequestReceiver, "receive", lambda self, requests, **kw: 0)
    argv = ["--quick", "--in-process", "--only", "receive-r4", "--requests", "1", "--rounds", "1"]
    code = cli.main([*argv, "--json", str(tmp_path / "b.json"), "--png", str(tmp_path / "b.png")])
    assert code == 2
    assert "MISMATCH" in capfd.readouterr().err
    assert json.loads((tmp_path / "b.json").read_text())["verified"] is False


def test_bench_without_matplotlib_still_writes_its_figures(tmp_path, monkeypatch, capfd):
    def no_matplotlib(result, path):
        raise ImportError("No module named 'matplotlib'")

    monkeypatch.setattr(cli, "plot", no_matplotlib)
    out_json, out_png = tmp_path / "b.json", tmp_path / "b.png"
    argv = ["--quick", "--in-process", "--only", "front-end", "--rounds", "1", "--xla-scaling"]
    assert cli.main([*argv, "--json", str(out_json), "--png", str(out_png)]) == 0
    result = json.loads(out_json.read_text())
    assert not out_png.exists() and "no plot" in capfd.readouterr().err
    assert result["points"][0]["kind"] == "frontend" and result["points"][0]["front_end_share"] > 0
    assert set(result["xla_scaling"]) <= {"rows", "skipped"} and result["xla_scaling"]


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--requests", "1,x"], "--requests '1,x'"),
        (["--requests", "0"], "--requests '0'"),
        (["--only", "nope"], "--only 'nope' matches no scenario"),
        (["--device", "nodev"], "--device 'nodev'"),
        (["--rounds", "0"], "--rounds 0"),
        (["--transfer", "--seconds", "nan"], "argument --seconds: expected a number of seconds in (0, "),
        *[(["--device", "cuda"], "--device 'cuda': torch sees no cuda device here")][: not torch.cuda.is_available()],
    ],
)
def test_bad_options_are_named(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(argv)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def _refusal(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    """The one line ``kvhost bench argv`` is refused with, before anything runs (status 2)."""
    with pytest.raises(SystemExit) as exit_info:
        cli.parse(argv)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("kvhost bench: error: ") and err.count("\n") == 1, err
    assert "Traceback" not in err and "Error(" not in err and "Error:" not in err.removeprefix("kvhost bench: error:")
    return err


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--backend", "nosuch"], "--backend 'nosuch': backend 'nosuch' is not registered (registered: "),
        (["--device", "meta"], "--device 'meta': torch's meta device holds shapes, not bytes"),
        (["--seed", "-5"], "--seed -5: give a seed of 0 or more"),
        (["--transfer", "--demo", "--layers 0"], "--demo '--layers 0': --layers must be in [1, "),
        (["--demo", "--bogus x"], "--demo '--bogus x': unrecognized arguments: --bogus x"),
        (["--transfer", "--demo", "--prefill-block-size 24"], "--decode-block-size 64 must divide one another"),
        (["--quick", "--check"], "--check holds the full shapes to their targets, which --quick's tiny ones"),
        (["--png", "plot"], "--png plot: the plot is a PNG file: give a name ending in .png, such as plot.png"),
        *[(["--backend", "cuda"], "--backend 'cuda': backend 'cuda' cannot run here")][: not torch.cuda.is_available()],
    ],
)
def test_options_the_run_could_not_carry_out_are_refused_up_front(argv, message, capsys):
    """Each of these once measured (or started to) and ended with a traceback and status 1,
    the status ``--check`` gives a failed target."""
    assert message in _refusal(argv, capsys)


@pytest.mark.parametrize("option", ["--json", "--png"])
def test_an_output_path_that_is_a_folder_is_refused_before_the_run(option, tmp_path, capsys):
    """``--png /tmp`` once wrote ``/tmp.png`` (matplotlib adds the suffix) and ``--json /tmp``
    failed after the whole run."""
    name = "bench.json" if option == "--json" else "bench.png"
    assert f"{option} {tmp_path} is a folder: give a file name, such as {tmp_path / name}" in _refusal(
        [option, str(tmp_path)], capsys
    )
    blocked = tmp_path / "file"
    blocked.write_text("")
    assert f"{blocked} is a file, not a folder" in _refusal([option, str(blocked / "sub" / name)], capsys)
    # A folder that takes no new file (root's access() says yes to /proc): tried, as the demo's --json is.
    assert f"{option} /proc/{name}: cannot write in '/proc'" in _refusal([option, f"/proc/{name}"], capsys)


def test_a_batch_larger_than_the_memory_left_is_refused(monkeypatch, capsys):
    """Said before anything is allocated, with what it would take, not by the allocator partway."""
    monkeypatch.setattr(footprint, "memory_available", lambda: 16 * 10**9)
    err = _refusal(["--quick", "--requests", "1000000"], capsys)
    assert "this run needs about 1," in err and "more than the 16.0 GB available here" in err
    assert "receive-r4 at 1000000 requests x 4 blocks" in err and "--requests" in err
    # What the defaults take fits such a machine: the estimate does not refuse them.
    assert cli.parse(["--quick"]).footprint.host < cli.parse([]).footprint.host < 16 * 10**9


def test_the_estimate_holds_what_the_largest_point_allocates():
    quick = workloads.PRESETS["quick"]
    chosen = [s for s in workloads.scenarios(quick, (1000,)) if s.name == "receive-r4"]
    cache = 4000 * quick.geometry.block_bytes  # 1000 requests of 4 blocks
    estimate = footprint.scenarios_footprint(chosen, torch.device("cpu"), "warm")
    assert (
        cache + footprint.VERIFY_COPIES * cache
        < estimate.host
        < 1.5 * (1 + footprint.VERIFY_COPIES) * cache + (2 << 30)
    )
    assert estimate.device == 0 and "receive-r4 at 1000 requests x 4 blocks" in estimate.largest


def test_transfer_without_nixl_says_so_and_how_to_install_it(monkeypatch, capsys):
    """It once ended with a closed connection (the sender died without NIXL) and a traceback."""
    from kvhost.nixl import agent as nixl_agent

    monkeypatch.setattr(nixl_agent, "NIXL_MODULES", ("no_such_nixl._api",))
    nixl_agent.load_nixl.cache_clear()
    try:
        err = _refusal(["--transfer"], capsys)
    finally:
        nixl_agent.load_nixl.cache_clear()
    assert "--transfer reads the batch over NIXL: NIXL is not installed" in err
    assert "pip install 'kvhost[nixl]'" in err


def test_a_file_written_whole_is_never_left_half_written(tmp_path):
    """A run stopped while it writes leaves the results file as it was, and no partial file."""
    path = tmp_path / "bench.json"
    path.write_text("before")

    def stopped(partial: Path) -> None:
        partial.write_text("half")
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        output.write_whole(path, stopped)
    assert path.read_text() == "before" and sorted(tmp_path.iterdir()) == [path]
    output.write_text_whole(path, "after")
    assert path.read_text() == "after" and sorted(tmp_path.iterdir()) == [path]


def descendants(pid: int) -> list[int]:
    """Every process below ``pid`` (Linux /proc)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                parent = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(parent, []).append(int(entry.name))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def running(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def stop_bench_while_it_runs(
    argv: list[str], number: int, started: str | None, processes: int = 1
) -> tuple[int, str, list[int]]:
    """Start ``kvhost bench argv``, wait for ``started`` on its stderr (where given) and for
    ``processes`` processes below it, send it signal ``number``; its status, the rest of its
    stderr, and the processes that were below it."""
    env = dict(os.environ)
    env.pop("OMP_WAIT_POLICY", None)  # the bench measures in a child process
    bench = subprocess.Popen(
        [sys.executable, "-m", "kvhost_tools.bench", *argv],
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),  # a shell may have it ignored
    )
    try:
        assert bench.stderr is not None
        for line in bench.stderr if started else ():
            if started in line:
                break
        below = descendants(bench.pid)
        while len(below) < processes and bench.poll() is None:
            time.sleep(0.1)
            below = descendants(bench.pid)
        bench.send_signal(number)
        _, err = bench.communicate(timeout=120)
    finally:
        if bench.poll() is None:
            for pid in descendants(bench.pid):
                os.kill(pid, signal.SIGKILL)
            bench.kill()
    return bench.returncode, err, below


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="processes are found in /proc")
@pytest.mark.timeout(240)
@pytest.mark.parametrize(("number", "status"), [(signal.SIGTERM, 143), (signal.SIGINT, 130)], ids=["SIGTERM", "SIGINT"])
def test_a_stopped_bench_stops_its_measuring_child_and_writes_nothing(tmp_path, number, status):
    """SIGTERM once left the measuring child running to the end (and writing the results);
    Ctrl-C printed a traceback from each process."""
    out_json, out_png = tmp_path / "b.json", tmp_path / "b.png"
    # Rounds enough to run for many minutes: it is still measuring when stopped.
    argv = ["--quick", "--only", "receive-r4", "--requests", "1", "--rounds", "1000000"]
    argv += ["--json", str(out_json), "--png", str(out_png)]
    code, err, below = stop_bench_while_it_runs(argv, number, "points, device")
    assert code == status, err
    assert err.strip() == f"kvhost bench: stopped by {signal.Signals(number).name}; nothing was written to {out_json}"
    assert below and not [pid for pid in below if running(pid)]
    assert not out_json.exists() and not out_png.exists() and not list(tmp_path.iterdir())


def _rows(fraction: float, speedup: float) -> list[dict]:
    return [
        {"requests": n, "methods": {KVHOST: {"fraction": f, "speedup": s}}}
        for n, f, s in ((1, 0.95, 9.0), (256, fraction, speedup))
    ]


def test_targets_pass_and_fail_on_the_figures():
    target = workloads.Target("t", min_fraction=0.8, min_speedup=4.0)
    scenario = workloads.Scenario("s", "s", (), target)
    assert targets.evaluate(scenario, _rows(0.85, 5.0))["passed"] is True
    failed = targets.evaluate(scenario, _rows(0.79, 5.0))
    assert failed["passed"] is False
    assert [(c["point"], c["what"]) for c in failed["checks"] if not c["passed"]] == [("256 requests", "kvhost/memcpy")]
    assert targets.evaluate(scenario, _rows(0.9, 3.9))["passed"] is False

    front = workloads.Scenario("f", "f", (), workloads.Target("f", max_front_share=0.05))
    rows = [{"requests": 1024, "methods": {"front end": {"median_s": 0.004}, "transform": {"median_s": 0.1}}}]
    assert targets.evaluate(front, rows)["passed"] is True
    rows[0]["methods"]["front end"]["median_s"] = 0.006
    assert targets.evaluate(front, rows)["passed"] is False

    identity = workloads.Scenario("i", "i", (), workloads.Target("i", identity=True))

    def identity_row(moved: int, extra: float) -> list[dict]:
        spread = {"p25_s": 1e-5, "p75_s": 2e-5}
        methods = {
            "empty": {"median_s": 1.5e-5, **spread},
            "visit": {"median_s": 2e-6, **spread},
            KVHOST: {"median_s": 1.5e-5 + extra, **spread},
        }
        return [{"requests": 4, "bytes": moved, "methods": methods}]

    assert targets.evaluate(identity, identity_row(0, 5e-6))["passed"] is True
    assert targets.evaluate(identity, identity_row(0, 1.1e-5))["passed"] is True  # noise 10 us + visit 2 us
    assert targets.evaluate(identity, identity_row(0, 1.3e-5))["passed"] is False
    assert targets.evaluate(identity, identity_row(0, 5e-5))["passed"] is False
    assert targets.evaluate(identity, identity_row(64, 0.0))["passed"] is False


def test_worst_check_is_the_one_with_least_headroom():
    checks = [
        targets.check("1", "fraction", 0.9, ">=", 0.8),  # 12% above
        targets.check("2", "fraction", 0.84, ">=", 0.8),  # 5% above: the worst
        targets.check("3", "bytes moved", 0, "<=", 0),  # exact, holds: nothing to report
        targets.check("4", "extra us", -0.5, "<=", 0.3),  # 267% below
    ]
    assert targets.worst(checks)["point"] == "2"
    assert targets.worst(checks[2:])["point"] == "4"


def test_a_parts_median_is_over_the_calls_its_wholes_median_uses():
    """A method timing its parts records one per call, warm-up calls first: only the rounds
    its own median uses count (the hand-off's transfer + receive then add up to it)."""
    sample = timing.Sample([1.0, 2.0, 3.0, 4.0], [0.0, 0.5, 0.0, 0.0])
    measured = timing.Measured({"m": sample}, {"m": [True, False, True, True]})
    parts = [90.0, 91.0, 10.0, 20.0, 30.0, 40.0]  # two warm-up calls, then the four rounds
    assert measured.used_parts("m", parts) == [10.0, 30.0, 40.0]
    with pytest.raises(ValueError):  # a part not timed on every round is a bug, not a median
        measured.used_parts("m", [10.0, 20.0, 30.0])


def test_calls_that_waited_for_a_core_are_marked_and_left_out():
    # b waited 4 ms for a core in round 2 (a scheduler time slice); its usual wake-up wait is 0.2 ms.
    a = timing.Sample([1e-3, 1.1e-3, 1e-3, 1e-3], [0.0, 1e-4, 0.0, 0.0])
    b = timing.Sample([2e-3, 2e-3, 6e-3, 2.1e-3], [2e-4, 2e-4, 4.2e-3, 3e-4])
    assert timing.disturbed(a) == [False] * 4
    assert timing.disturbed(b) == [False, False, True, False]
    measured = timing.Measured({"a": a, "b": b}, {"a": [True] * 4, "b": [not d for d in timing.disturbed(b)]})
    assert measured.used_samples()["b"].seconds == [2e-3, 2e-3, 2.1e-3]
    assert measured.used_samples()["a"].seconds == a.seconds

    ticks = iter(range(1000))
    methods = {"x": lambda: next(ticks), "y": lambda: None}
    device = machine.Device("cpu", "warm")
    result = timing.measure(methods, device, workloads.PRESETS["quick"], 5, random.Random(0))
    for name, sample in result.samples.items():
        assert len(sample.seconds) == len(sample.waits) == len(result.used[name]) >= 5
        assert sum(result.used[name]) >= 3


def test_when_one_method_has_too_few_undisturbed_calls_every_method_counts_every_round(monkeypatch):
    """Otherwise one method's clean calls would be set against another's disturbed ones. In
    this process "y" waits 10 ms for a core on 2 calls of 3 and takes 20 ms, so the
    quick preset's time runs out (3 x 0.05 s) with fewer clean calls of it than half the
    rounds planned (9)."""
    waited = [0.0]
    calls = {"y": 0}

    def y() -> None:
        calls["y"] += 1
        waited[0] += 0.01 * (calls["y"] % 3 != 0)
        time.sleep(0.02)

    monkeypatch.setattr(timing, "run_queue_wait", lambda: waited[0])
    methods = {"x": lambda: None, "y": y}
    device = machine.Device("cpu", "warm")
    result = timing.measure(methods, device, workloads.PRESETS["quick"], 9, random.Random(0))
    assert sum(not flag for flag in timing.disturbed(result.samples["y"])) < 4
    assert not any(timing.disturbed(result.samples["x"]))  # x alone has enough clean calls
    assert result.every_round and all(all(used) for used in result.used.values())
    monkeypatch.setattr(timing, "run_queue_wait", lambda: 0.0)
    result = timing.measure(methods, device, workloads.PRESETS["quick"], 9, random.Random(0))
    assert not result.every_round and all(all(used) for used in result.used.values())


def test_allocator_ids():
    rng = np.random.default_rng(1)
    runs = workloads.allocator_ids(1000, 600, "runs", rng)
    scattered = workloads.allocator_ids(1000, 600, "scattered", rng)
    for ids in (runs, scattered):
        assert ids.size == 600 and np.unique(ids).size == 600 and ids.min() >= 0 and ids.max() < 1000
    assert np.mean(np.diff(runs) == 1) > 0.5  # mostly runs of consecutive ids
    assert np.mean(np.diff(scattered) == 1) < 0.02


# --- the baseline is a correct implementation ------------------------------------------------

LAYOUTS = [
    ("KBNHC", "KBNHC", dict(K=2, B=12, N=8, H=2, C=4), "HNC"),
    ("KBNHC", "KBHNC", dict(K=2, B=12, N=8, H=2, C=4), "NHC"),
    ("BKNHC", "BKNHC", dict(K=2, B=12, N=8, H=2, C=4), "HKNC"),
    ("BHNC", "HBNC", dict(B=12, N=8, H=3, C=4), "NC"),
    ("LBHNC", "BLHNC", dict(L=3, B=12, N=8, H=2, C=4), "HNLC"),
]
RATIOS = [("r", 1), ("r", 2), ("r", 8), ("g", 2), ("g", 4)]


def _clone(caches: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    out = {}
    for name, tensor in caches.items():
        copy = torch.empty_strided(tensor.shape, tensor.stride(), dtype=tensor.dtype)
        raw(copy).copy_(raw(tensor))
        out[name] = copy
    return out


@pytest.mark.parametrize(("kind", "k"), RATIOS, ids=[f"{kind}{k}" for kind, k in RATIOS])
@pytest.mark.parametrize(("axes", "physical", "sizes", "order"), LAYOUTS, ids=[f"{a}/{p}" for a, p, *_ in LAYOUTS])
def test_baseline_receive_matches_the_sender_and_kvhost_bit_for_bit(axes, physical, sizes, order, kind, k):
    remote = sizes["N"] // k if kind == "r" else sizes["N"] * k
    g = k if kind == "g" else 1
    caches = {f"l{i}": make_cache(axes, physical, sizes) for i in range(2)}
    case = ReceiveCase(caches, axes, seed=k)
    requests = {"a": [9, 2, 7, 0][:g], "b": [11, 4, 5, 10, 1, 3, 6, 8][: 2 * g]}
    for name, ids in requests.items():
        case.send(name, ids, order, remote)
    with_kvhost = _clone(caches)

    moved = PerRequestReceiver(caches, axes).receive(requests, remote_order=order, remote_block_size=remote)
    stats = kvhost.receive(with_kvhost, requests, axes=axes, remote_order=order, remote_block_size=remote)

    case.check()  # the baseline leaves what the sender sent, in the local layout
    assert all(torch.equal(raw(caches[n]), raw(with_kvhost[n])) for n in caches)
    if stats.bytes_moved:
        assert moved == stats.bytes_moved


def test_baseline_takes_each_request_s_own_sender():
    sizes = dict(K=2, B=16, N=8, H=2, C=4)
    caches = {"l": make_cache("KBNHC", "KBNHC", sizes)}
    case = ReceiveCase(caches, "KBNHC", seed=4)
    specs = {"x": ([3, 1], "HNC", 2), "y": ([5, 6], "HNC", 16), "z": ([9], "NHC", 4)}
    for name, (ids, order, size) in specs.items():
        case.send(name, ids, order, size)
    PerRequestReceiver(caches, "KBNHC").receive({n: kvhost.Incoming(*spec) for n, spec in specs.items()})
    case.check()


@pytest.mark.parametrize(
    ("src_physical", "dst_physical"), [("KBNHC", "KBNHC"), ("KBNHC", "KBHNC"), ("KBHNC", "BKNHC")], ids=str
)
def test_baseline_staging_matches_copy_blocks(src_physical, dst_physical):
    sizes = dict(K=2, B=10, N=8, H=2, C=4)
    src = {f"l{i}": fill_random(make_cache("KBNHC", src_physical, sizes), i) for i in range(2)}
    dst = {f"l{i}": fill_random(make_cache("KBNHC", dst_physical, sizes), 9 + i) for i in range(2)}
    expected = _clone(dst)
    requests = [([3, 4], [0, 1]), ([7], [5]), ([9, 0, 1], [2, 8, 9])]
    moved = PerRequestStager(src, dst, axes="KBNHC").copy(requests)
    src_ids = [i for s, _ in requests for i in s]
    dst_ids = [i for _, d in requests for i in d]
    result = kvhost.copy_blocks(src, expected, src_ids, dst_ids, axes="KBNHC")
    assert all(torch.equal(raw(dst[n]), raw(expected[n])) for n in dst)
    assert moved == result.bytes_moved
    assert torch.equal(dst["l1"][:, 8], src["l1"][:, 0])


def test_baseline_staging_between_a_k_axis_and_k_v_tuples():
    sizes = dict(K=2, B=6, N=4, H=2, C=4)
    src = {"l": fill_random(make_cache("KBNHC", "KBNHC", sizes), 1)}
    dst = {"l": (torch.zeros(6, 4, 2, 4, dtype=torch.bfloat16), torch.zeros(6, 4, 2, 4, dtype=torch.bfloat16))}
    PerRequestStager(src, dst, axes="KBNHC").copy([([2, 3], [0, 5])])
    assert torch.equal(dst["l"][1][5], src["l"][1, 3]) and torch.equal(dst["l"][0][0], src["l"][0, 2])


def test_wire_view_rejects_what_it_cannot_mean():
    with pytest.raises(kvhost.RequestError, match="'HNLC'"):
        wire_view("NHC", dict(N=8, H=2, C=4), "HNLC", 4)
    with pytest.raises(kvhost.RequestError, match="remote block size 3"):
        wire_view("NHC", dict(N=8, H=2, C=4), "HNC", 3)
    view = wire_view("NHC", dict(N=8, H=2, C=4), "HNC", 2)
    assert (view.wire_shape, view.perm, view.parts) == ((4, 2, 2, 4), (0, 2, 1, 3), 1)


def test_block_ranges_are_the_regions_of_the_blocks():
    sizes = dict(K=2, B=6, N=4, H=2, C=8)
    caches = {"a": make_cache("KBNHC", "KBHNC", sizes), "b": make_cache("KBNHC", "KBHNC", sizes)}
    ranges = machine.block_ranges(caches, "KBNHC", np.array([4, 1]))
    expected = {(t[k, block].data_ptr(), 4 * 2 * 8 * 2) for t in caches.values() for k in range(2) for block in (4, 1)}
    assert {tuple(row) for row in ranges.tolist()} == expected


def test_data_eviction_flushes_ranges_or_falls_back():
    device = machine.Device("cpu", "data")
    buffer = torch.ones(1 << 16, dtype=torch.uint8)
    device.flush(np.array([[buffer.data_ptr() + 3, 5000]], dtype=np.int64))  # unaligned start: whole lines
    assert buffer.sum().item() == 1 << 16  # eviction writes back, never loses bytes
    assert device.cache in ("data", "all")
    assert machine.Device("cpu", "warm").cache == "warm" and not machine.Device("cpu", "warm").cold


def test_the_line_evictor_is_compiled_once_per_machine_not_per_process():
    """Decode times a memcpy yardstick with it: compiled as a closure it cost every decode
    process a quarter of a second; a module-level function numba caches on disk does not."""
    evictor = machine.line_evictor()
    if evictor is None:
        pytest.skip("no x86 clflush here")
    from numba.core.caching import NullCache

    from kvhost_tools.bench.evict import evict_lines

    assert evictor is evict_lines and not isinstance(evict_lines._cache, NullCache)


def test_a_ratio_spread_comes_only_from_enough_rounds_both_calls_count_in():
    """Quartiles of ``top / bottom`` over the rounds where both calls count, and none at all
    from fewer than MIN_PAIRED_ROUNDS: one shared round printed as a spread beside a median
    it did not contain."""

    def measured(used_top: list[bool]) -> timing.Measured:
        top = timing.Sample([1.0, 2.0, 3.0, 4.0, 5.0, 6.0], [0.0] * 6)
        bottom = timing.Sample([2.0] * 6, [0.0] * 6)
        return timing.Measured({"top": top, "bottom": bottom}, {"top": used_top, "bottom": [True] * 5 + [False]})

    spread = timing.per_round(measured([True] * 6), "top", "bottom")  # rounds 1-5 shared: 0.5, 1, 1.5, 2, 2.5
    assert spread == [1.0, 2.0]
    assert timing.MIN_PAIRED_ROUNDS == 4
    four = measured([True, False, True, True, True, True])  # 0.5, 1.5, 2, 2.5
    assert timing.per_round(four, "top", "bottom") == [1.25, 2.125]
    assert timing.per_round(measured([False, False, True, True, True, True]), "top", "bottom") == []  # 3 shared


def test_a_full_run_writes_the_committed_results_only_in_the_repository(tmp_path, monkeypatch):
    """Run from an installed kvhost (no docs/bench.json where it runs), a full run writes to
    bench-results/, as a quick one does, not into a docs/ it makes there."""
    from pathlib import Path

    from kvhost_tools.bench import cli

    monkeypatch.chdir(tmp_path)
    args = cli.parse([])
    assert (args.json, args.png) == (Path("bench-results/bench.json"), Path("bench-results/bench.png"))
    (tmp_path / "docs").mkdir()
    for others in ("{}", '{"results": 1}', "not json", "[1]"):  # another project's docs/bench.json: left alone
        (tmp_path / "docs" / "bench.json").write_text(others)
        assert cli.parse([]).json == Path("bench-results/bench.json")
    (tmp_path / "docs" / "bench.json").write_text('{"kvhost_bench": 1}')
    args = cli.parse([])
    assert (args.json, args.png) == (Path("docs/bench.json"), Path("docs/bench.png"))
    assert cli.parse(["--quick"]).json == Path("bench-results/bench-quick.json")


def test_a_measuring_process_that_hangs_is_stopped_at_the_deadline(monkeypatch, tmp_path, capsys):
    """The parent's wait for its measuring process has a deadline: past it, the process and
    what it started are killed and the bench exits 124, saying so."""
    monkeypatch.setattr(cli, "CHILD_DEADLINE_S", 3.0)  # time to start python and the sleeper, busy or not
    pid_file = tmp_path / "sleeper"
    script = (
        "import pathlib, subprocess, sys, time; sleeper = subprocess.Popen(['sleep', '60']); "
        "pathlib.Path(sys.argv[1]).write_text(str(sleeper.pid)); time.sleep(60)"
    )
    started = time.monotonic()
    status = cli.measure_in_child([sys.executable, "-c", script, str(pid_file)], dict(os.environ), tmp_path / "r.json")
    assert status == 124 and time.monotonic() - started < 30
    assert "kvhost bench: stopped the measuring process after" in capsys.readouterr().err
    sleeper = int(pid_file.read_text())
    for _ in range(100):  # killed with its session; reaped by init once its parent is gone
        try:
            os.kill(sleeper, 0)
        except ProcessLookupError:
            break
        time.sleep(0.05)
    else:
        raise AssertionError(f"the measuring process's own child {sleeper} outlived it")
