"""kvhost bench --transfer: the NIXL hand-off section on tiny shapes, end to end (two processes)."""

from __future__ import annotations

import argparse
import itertools
import json
import os
import signal
import time
from types import SimpleNamespace

import numpy as np
import pytest
from test_bench import running, stop_bench_while_it_runs
from test_nixl import needs_nixl
from test_nixl_agent import _no_stand_in_agent_held  # noqa: F401  (a fixture: stand-ins let go after each test)

from kvhost.errors import KVHostError
from kvhost.nixl import Agent, Transfer, TransferError
from kvhost.nixl.agent import DEFAULT_THREADS, Link
from kvhost_tools.bench import cli, sender, ways
from kvhost_tools.bench.methods import ROOFLINE, ROOFLINE_1T
from kvhost_tools.bench.output import ROUNDING_TOLERANCE


@needs_nixl
@pytest.mark.timeout(300)
def test_transfer_section_measures_every_way_side_by_side(tmp_path, capfd):
    out_json = tmp_path / "bench.json"
    out_json.write_text(json.dumps({"scenarios": ["kept"], "transfer": {"earlier": {"kept": True}}}))
    argv = ["--quick", "--transfer", "--in-process", "--rounds", "3", "--seconds", "1"]
    argv += ["--bounds", "2048", "--sweep", "4096,0", "--json", str(out_json)]
    code = cli.main(argv)
    out, err = capfd.readouterr()
    assert code == 0, err[-3000:]

    result = json.loads(out_json.read_text())
    assert result["scenarios"] == ["kept"] and result["transfer"]["earlier"] == {"kept": True}
    section = result["transfer"]["same host, runs of 1..8"]
    assert section["where"] == "same host" and section["requests"] == 8
    assert section["bytes"] == section["pieces"] * section["piece_bytes"] > 0
    # Both sides asked for huge pages (the quick model's caches hold no whole one) and said so.
    huge = section["huge_pages"]
    assert section["threads"] == DEFAULT_THREADS
    assert huge["asked"] == "on" and huge["sender"] == huge["receiver"] == "huge pages: 0 of 0 MiB"
    methods = section["methods"]
    assert set(methods) == {
        ROOFLINE,
        ROOFLINE_1T,
        ways.PER_PIECE,
        ways.PREPPED,
        ways.UNMERGED,
        ways.KVHOST,
        ways.BATCH,
        ways.PER_PIECE_BATCH,
        ways.PREPPED_BATCH,
        ways.PACKED,
        "kvhost<=2KiB",
        ways.HANDOFF,
        ways.HANDOFF_PACKED,
        ways.LAYERED,
        *(f"build {name}" for name in (ways.PER_PIECE, ways.PREPPED, ways.UNMERGED, ways.KVHOST)),
        *(f"plan {name}" for name in (ways.PER_PIECE, ways.PREPPED, ways.KVHOST)),
        f"build {ways.BATCH}",
        f"build {ways.PER_PIECE_BATCH}",
        f"build {ways.PREPPED_BATCH}",
        f"plan {ways.BATCH}",
        "span/4KiB",
        "span/layer",
    }
    roof = section["roofline_best"]
    assert methods[roof]["median_s"] == min(methods[name]["median_s"] for name in (ROOFLINE, ROOFLINE_1T))
    assert methods[roof]["fraction"] == pytest.approx(1.0) and section["every_round"] in (True, False)
    # Per piece, both ways post one descriptor per piece; merged posts fewer; the 2 KiB bound
    # (two pieces of 1 KiB) lies between; NIXL joins prepared neighbours without a bound.
    pieces = section["pieces"]
    assert methods[ways.PER_PIECE]["descriptors"] == methods[ways.UNMERGED]["descriptors"] == pieces
    # The batch's control: one transfer, as kvhost-batch, but a descriptor per piece.
    assert methods[ways.PER_PIECE_BATCH]["descriptors"] == methods[f"build {ways.PER_PIECE_BATCH}"]["descriptors"]
    assert methods[ways.PER_PIECE_BATCH]["descriptors"] == pieces
    # vLLM's way batched: NIXL joins the batch's neighbouring indices, across requests too.
    assert methods[ways.PREPPED_BATCH]["descriptors"] <= methods[ways.PREPPED]["descriptors"]
    merged = methods[ways.KVHOST]["descriptors"]
    assert methods[ways.PREPPED]["descriptors"] <= merged
    assert 0 < merged < methods["kvhost<=2KiB"]["descriptors"] < pieces
    assert methods["build kvhost"]["descriptors"] == methods["plan kvhost"]["descriptors"] == merged
    # One transfer for the batch: the same rows, planned at once (no request's ids meet another's).
    assert methods[ways.BATCH]["descriptors"] == methods[f"plan {ways.BATCH}"]["descriptors"] == merged
    # Packed, each request's sender blocks are one run of the sender's pack buffer: only the
    # receiver's runs cut descriptors, one per run of receiver blocks for each layer and K/V.
    local_ids = sender.Batch.of(sender.Setting.parse(sender.QUICK_DEMO)).local_ids
    local_runs = sum(1 + sum(b != a + 1 for a, b in itertools.pairwise(ids)) for ids in local_ids)
    assert methods[ways.PACKED]["descriptors"] == methods[ways.HANDOFF_PACKED]["descriptors"] == 2 * 2 * local_runs
    assert methods[ways.PACKED]["descriptors"] < merged
    packed = methods[ways.HANDOFF_PACKED]
    assert 0 < packed["pack_median_s"] < packed["median_s"] and 0 < packed["read_median_s"] < packed["median_s"]
    assert methods["span/layer"]["descriptors"] == 2  # one per layer of the quick model
    assert methods["span/4KiB"]["descriptors"] == 2 * -(-section["bytes"] // 2 // 4096)
    for name, entry in methods.items():
        used = [t for t, keep in zip(entry["samples_s"], entry["used"]) if keep]
        assert len(used) == entry["rounds"] >= 1 and entry["median_s"] > 0
        assert entry["median_s"] == pytest.approx(float(np.median(used)), rel=ROUNDING_TOLERANCE)
        if not name.startswith(("build ", "plan ")):
            assert entry["fraction"] == pytest.approx(
                methods[roof]["median_s"] / entry["median_s"], rel=ROUNDING_TOLERANCE
            )
            assert entry["gbps"] == pytest.approx(section["bytes"] / entry["median_s"] / 1e9, rel=ROUNDING_TOLERANCE)
    engines = (ways.PER_PIECE, ways.UNMERGED, ways.PREPPED)  # what engines post, vLLM's way among them
    assert section["baseline_best"] == min(engines, key=lambda name: methods[name]["median_s"])
    best = methods[section["baseline_best"]]["median_s"]
    assert methods[ways.KVHOST]["speedup"] == pytest.approx(
        best / methods[ways.KVHOST]["median_s"], rel=ROUNDING_TOLERANCE
    )
    handoff = methods[ways.HANDOFF]
    assert handoff["transfer_median_s"] > 0 and handoff["receive_median_s"] > 0
    layered = methods[ways.LAYERED]
    assert 0 < layered["tail_median_s"] < layered["median_s"]
    # One transfer per layer: each layer's pieces merge as in the batch (no stream spans two layers).
    assert layered["descriptors"] == merged
    checks = section["targets"]["checks"]
    names = ["kvhost-batch / fastest engine way", "kvhost-batch / memcpy", "hand-off / memcpy"]
    assert [c["what"] for c in checks] == names
    assert section["targets"]["passed"] == all(c["passed"] for c in checks)
    assert "transfer (same host): 8 requests" in out and "x engines" in out
    assert "hand-off = transfer" in out and "last layer landed" in out and "hand-off-packed = pack" in out


@needs_nixl
@pytest.mark.timeout(300)
def test_cross_layer_caches_read_a_descriptor_per_sender_block_before_merging(tmp_path, capfd):
    """``--demo "... --cross-layer"``: both caches hold a block's layers back to back, so a
    piece is a whole sender block (every layer, K and V) and the section is kept apart."""
    out_json = tmp_path / "bench.json"
    argv = ["--transfer", "--in-process", "--rounds", "3", "--seconds", "1", "--bounds", "", "--sweep", "0"]
    argv += ["--demo", sender.QUICK_DEMO + " --cross-layer", "--json", str(out_json)]
    code = cli.main(argv)
    out, err = capfd.readouterr()
    assert code == 0, err[-3000:]
    section = json.loads(out_json.read_text())["transfer"]["same host, runs of 1..8, cross-layer caches"]
    batch = sender.Batch.of(sender.Setting.parse(sender.QUICK_DEMO + " --cross-layer"))
    assert section["cross_layer"] is True and section["sender"].endswith("tokens, layers inside blocks")
    blocks = sum(len(ids) for ids in batch.remote_ids)
    assert section["pieces"] == blocks and section["piece_bytes"] * blocks == section["bytes"]
    methods = section["methods"]
    assert 0 < methods[ways.BATCH]["descriptors"] < blocks
    assert methods["span/layer"]["descriptors"] == 1  # every layer in one span
    assert "layers inside blocks" in out


@needs_nixl
@pytest.mark.timeout(120)
def test_the_sender_takes_demo_options_that_are_one_flag():
    """``--demo --cross-layer`` reaches the sender process as the demo's options, not as an
    option of its own (argparse takes a lone ``--flag`` value for an option)."""
    options = argparse.Namespace(
        cache="data", demo="--cross-layer", progress="poll", huge_pages="off", threads=0, peer_netns=None
    )
    peer = sender.Peer(options, {})
    try:
        assert peer.table.order.startswith("L") and len(peer.table.streams) == 1  # every layer in one region
    finally:
        peer.close()
    assert peer.process.returncode == 0


@needs_nixl
@pytest.mark.timeout(120)
def test_a_sender_started_without_pack_says_so_at_once():
    """Asked to pack without ``--pack``, the sender exits at once and the receiver hears it
    then, not at the control message's deadline."""
    options = argparse.Namespace(
        cache="data", demo=sender.QUICK_DEMO, progress="poll", huge_pages="off", threads=0, peer_netns=None
    )
    peer = sender.Peer(options, {})
    assert peer.pack_table is None
    started = time.monotonic()
    try:
        with pytest.raises(KVHostError):
            peer.pack()
        assert time.monotonic() - started < 30
    finally:
        peer.close()
    assert peer.process.returncode != 0


@needs_nixl
@pytest.mark.timeout(240)
def test_a_stopped_transfer_stops_the_sender_too(tmp_path):
    """SIGTERM once left the measuring child and its sender running on, re-parented."""
    out_json = tmp_path / "bench.json"
    argv = ["--quick", "--transfer", "--rounds", "1000000", "--bounds", "", "--sweep", "0", "--json", str(out_json)]
    code, err, below = stop_bench_while_it_runs(argv, signal.SIGTERM, None, processes=2)  # the child, its sender
    assert code == 143, err
    assert f"kvhost bench: stopped by SIGTERM; nothing was written to {out_json}" in err and "Traceback" not in err
    assert len(below) == 2 and not [pid for pid in below if running(pid)]
    assert not list(tmp_path.iterdir())


def test_a_transfer_section_is_kept_under_its_setting():
    section = {"where": "same host", "block_ids": "runs of 1..8", "huge_pages": {"asked": "on"}}
    assert cli.transfer_key({**section, "threads": DEFAULT_THREADS}) == "same host, runs of 1..8"
    assert cli.transfer_key({**section, "threads": 0}) == "same host, runs of 1..8, 0 UCX threads"
    off = {**section, "huge_pages": {"asked": "off"}, "threads": 2}
    assert cli.transfer_key(off) == "same host, runs of 1..8, no huge pages asked, 2 UCX threads"
    crossed = {**section, "threads": 0, "cross_layer": True}
    assert cli.transfer_key(crossed) == "same host, runs of 1..8, cross-layer caches, 0 UCX threads"
    assert cli.transfer_key({**crossed, "cross_layer": False}) == "same host, runs of 1..8, 0 UCX threads"


def test_transfer_options_are_checked(capsys):
    for argv, message in (
        (["--transfer", "--bounds", "x"], "--bounds"),
        (["--transfer", "--sweep", "-1"], "--sweep sizes at least 0"),
        (["--transfer", "--peer-env", "UCX_TLS"], "KEY=VALUE"),
        (["--transfer", "--threads", "-1"], "--threads -1: from 0 to 64"),
    ):
        with pytest.raises(SystemExit):
            cli.parse(argv)
        assert message in capsys.readouterr().err


# --- what the bench lets go of: nothing a read still in flight may use ------------------------


class Landing:
    """A NIXL request whose posts answer from ``states`` in turn (post, then each poll); the
    last state stands once the others are spent."""

    def __init__(self, *states):
        self.states = list(states)
        self.released = 0

    def answer(self):
        return self.states.pop(0) if len(self.states) > 1 else self.states[0]

    def release(self):
        self.released += 1


class StandInNixl:
    def transfer(self, handle):
        return handle.answer()

    check_xfer_state = transfer


def stand_in_agent():
    agent = SimpleNamespace(nixl=StandInNixl(), posted=set(), uncancelled=[])
    agent.in_flight = lambda: Agent.in_flight(agent)  # type: ignore[arg-type]
    return agent


def post(agent, handle):
    return Transfer.post(Link(agent, "prefill"), handle, 4096, "READ", descriptors=1)


def test_a_pull_out_of_time_releases_what_landed_and_keeps_what_may_still_write(monkeypatch):
    monkeypatch.setattr(ways, "TIMEOUT_S", 0.05)
    agent = stand_in_agent()
    handles = [Landing("PROC", "DONE"), Landing("PROC"), Landing("PROC", "DONE"), Landing("PROC")]
    with pytest.raises(TransferError, match=r"transfers did not finish within 0\.05 s") as caught:
        ways.pull(lambda i: post(agent, handles[i]), len(handles), 2)
    assert caught.value.timed_out
    assert "\n".join(caught.value.__notes__).count("is still in flight and cannot be cancelled") == 2
    assert [handle.released for handle in handles] == [1, 0, 1, 0]
    assert sorted(id(t.handle) for t in agent.uncancelled) == sorted(map(id, (handles[1], handles[3])))
    assert set(agent.in_flight()) == set(agent.uncancelled)


def test_a_pull_that_fails_frees_the_failed_transfer_and_keeps_the_one_in_flight(monkeypatch):
    agent = stand_in_agent()
    handles = [Landing("PROC"), Landing("PROC", "ERR")]
    with pytest.raises(TransferError, match="failed: transport state 'ERR'") as caught:
        ways.pull(lambda i: post(agent, handles[i]), len(handles), 2)
    assert "still in flight and cannot be cancelled" in "\n".join(caught.value.__notes__)
    assert [handle.released for handle in handles] == [0, 1]
    assert [t.handle for t in agent.uncancelled] == [handles[0]]


def test_a_request_posted_again_is_freed_only_when_no_post_of_it_may_write(monkeypatch):
    monkeypatch.setattr(ways, "TIMEOUT_S", 0.05)
    agent = stand_in_agent()
    never = ways.Request(agent, "prefill", Landing("DONE"), 4096, 1)
    never.free()
    assert never.handle.released == 1
    handle = Landing("PROC", "DONE", "DONE", "PROC")
    request = ways.Request(agent, "prefill", handle, 4096, 2)
    again = ways.repost(request)
    again()
    again()  # posted again: the first post let go of it, not NIXL's request
    assert handle.released == 0 and agent.posted == set() and request.last.released
    with pytest.raises(TransferError, match="did not finish") as caught:
        again()
    assert "still in flight" in "\n".join(caught.value.__notes__)
    request.free()
    assert handle.released == 0 and agent.uncancelled == [request.last], "freed under a read in flight"
    handle.states = ["DONE"]
    request.last.release()
    request.free()
    assert handle.released == 1 and agent.posted == set()

    class FailsPartway(StandInNixl):  # NIXL posted some pieces, then raised
        def transfer(self, handle):
            raise RuntimeError("NIXL_ERR_BACKEND")

    agent.nixl = FailsPartway()
    failing = ways.Request(agent, "prefill", Landing("PROC"), 4096, 2)
    with pytest.raises(TransferError, match="posting the transfer failed: NIXL_ERR_BACKEND"):
        failing.post()
    failing.free()
    assert failing.handle.released == 0, "freed under the pieces a failed post left in flight"


def test_prepared_lists_are_kept_while_a_transfer_may_use_them():
    agent = stand_in_agent()
    prepared = object.__new__(ways.Prepared)
    prepared.agent, prepared.local, prepared.remote = agent, Landing("DONE"), Landing("DONE")
    in_flight = post(agent, Landing("PROC"))
    prepared.close()
    assert prepared.local.released == prepared.remote.released == 0
    in_flight.handle.states = ["DONE"]
    in_flight.release()
    prepared.close()
    assert prepared.local.released == prepared.remote.released == 1


class Closing:
    def __init__(self, error=None):
        self.error, self.closed = error, 0

    def close(self):
        self.closed += 1
        if self.error is not None:
            raise self.error


@pytest.mark.parametrize("measuring", [None, RuntimeError("the bench failed")])
def test_a_run_closes_the_sender_whatever_closing_the_agent_says(monkeypatch, measuring):
    """The sender is closed last whatever fails before it; the run's own error is what is
    raised, with what closing met as a note; without one, closing's error is raised."""
    from kvhost_tools.bench import transfer

    in_flight = TransferError("agent 'bench': 1 transfer(s) from ['prefill'] still in flight may write")
    setup = transfer.Setup(None, Closing(in_flight), Closing(), {}, None)  # type: ignore[arg-type]
    request = ways.Request(stand_in_agent(), "prefill", Landing("DONE"), 4096, 1)
    setup.requests.append(request)

    def measure_all(args, given, load):
        assert given is setup
        if measuring is not None:
            raise measuring
        return {"measured": True}

    monkeypatch.setattr(transfer, "connect", lambda args: setup)
    monkeypatch.setattr(transfer, "measure_all", measure_all)
    raised = type(measuring) if measuring is not None else TransferError
    with pytest.raises(raised) as caught:
        transfer.run(argparse.Namespace())
    if measuring is not None:
        assert caught.value is measuring
        assert caught.value.__notes__ == [f"closing after it: TransferError: {in_flight}"]
    else:
        assert caught.value is in_flight
    assert setup.agent.closed == setup.peer.closed == 1 and request.handle.released == 1 and setup.requests == []


@needs_nixl
@pytest.mark.timeout(120)
def test_a_bench_request_timed_out_under_a_frozen_sender_is_kept_until_it_lands(tmp_path, monkeypatch):
    """Real NIXL over TCP: the bench's request made once (``Request``), posted while the
    sender is stopped, times out; neither it nor the agent's memory is let go (freeing NIXL's
    request under the read is what corrupted the heap), and once the sender runs again the
    read lands and everything is freed."""
    from test_nixl_agent import frozen_sender_reading

    monkeypatch.setattr(ways, "TIMEOUT_S", 0.5)
    with frozen_sender_reading(tmp_path, monkeypatch, "bench-under-a-read", blocks=1024) as run:
        agent, plan = run.agent, run.plan
        local, remote = plan.descriptor_pairs(range(1024), range(1024))
        nixl = agent.nixl
        descs = [nixl.get_xfer_descs(rows, plan.local.memory) for rows in (local, remote)]
        request = ways.Request(agent, "frozen-sender", nixl.initialize_xfer("READ", *descs, "frozen-sender"), 1, 1)
        with pytest.raises(TransferError, match=r"did not finish within 0\.5 s") as caught:
            ways.repost(request)()
        assert "'frozen-sender' is still in flight" in "\n".join(caught.value.__notes__)
        request.free()
        assert agent.uncancelled == [request.last] and not request.last.released
        with pytest.raises(TransferError, match="still in flight may write"):
            agent.close()
        os.kill(run.sender.pid, signal.SIGCONT)
        for transfer in (request.last, run.transfer):
            transfer.wait(60)  # NIXL still knows the request: it was not freed
            transfer.release()
        request.free()
        agent.close()
        assert agent.posted == set() and agent.uncancelled == []


def test_nixl_s_merge_of_prepared_neighbours_is_counted_pair_by_pair():
    """A pair joins the one before it only where both sides continue it, each in one domain
    (a negative label joins nothing): the count the bench reports for NIXL's merge."""
    local = np.array([[0, 4, 0], [4, 4, 0], [8, 4, 0], [20, 4, 0], [24, 4, 0], [28, 4, 0]], dtype=np.uint64)
    remote = np.array([[100, 4, 0], [104, 4, 0], [200, 4, 0], [204, 4, 0], [208, 4, 0], [212, 4, 0]], dtype=np.uint64)
    same = np.zeros(6, dtype=np.int64)
    # Joins: 0-1 (both continue); 1-2 local only; 2-3 remote only; 3-4 and 4-5 both.
    assert ways.neighbours_joined(local, remote, same, same) == 3
    assert ways.neighbours_joined(local, remote, np.array([0, 0, 0, 0, 1, 1]), same) == 4
    assert ways.neighbours_joined(local, remote, same, np.array([0, -1, 0, 0, 0, 0])) == 4
    assert ways.neighbours_joined(local, remote, -np.ones(6, dtype=np.int64), same) == 6
    assert ways.neighbours_joined(local[:1], remote[:1], same[:1], same[:1]) == 1
    assert ways.neighbours_joined(local[:0], remote[:0], same[:0], same[:0]) == 0
