"""``kvhost demo``: real hand-offs between engine processes over NIXL/UCX, and the demo's own checks.

The runs (direct, via the host buffer, decode ranks, prefill killed, prefill frozen) each
start a prefill and a decode engine process; they are started together by one fixture,
since each spends most of its time starting Python and torch (the demo's own process
imports neither). Every test then waits for its own run (bounded) and checks the outcome
the run wrote as JSON. The in-process tests show that the verification itself can fail.
Several prefill engines, several decode engines and tensor parallelism either way are in
test_xpyd.py; two hosts in test_netns.py.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import socket
import subprocess
import sys
import threading
import time
from types import SimpleNamespace

import pytest
import torch
from test_nixl import needs_nixl

from kvhost.caches import CacheSet
from kvhost.errors import RequestError
from kvhost.nixl import TransferError
from kvhost.testing import raw
from kvhost_tools.demo.cli import main
from kvhost_tools.demo.config import EXIT_FAILED, EngineShape, Model, Workload
from kvhost_tools.demo.pull import Engine, Rank, Request, Settings, Steps, pull
from kvhost_tools.demo.report import Outcome, ProgressBar, prefill_pid
from kvhost_tools.demo.values import SENTINEL_BYTE, token_values, write_tokens
from kvhost_tools.demo.verify import verify

# Five runs start at once: on a busy 2-core machine ten Python processes importing torch can
# take minutes, so the runs get room to connect (a hung run still fails at RUN_SECONDS).
SMALL = [
    *["--layers", "2", "--heads", "2", "--head-dim", "16", "--min-tokens", "5", "--max-tokens", "150"],
    *["--connect-timeout", "240"],
]
RUNS = {
    # Head-major blocks of 4 into token-major blocks of 16: r = 4, receive rearranges in place.
    "direct": [*SMALL, "--requests", "8", "--prefill-block-size", "4", "--decode-block-size", "16"],
    # Token-major blocks of 32 into head-major blocks of 8 through the host buffer: g = 4.
    "via-host": [
        *SMALL,
        *[
            "--requests",
            "8",
            "--via-host",
            "--prefill-layout",
            "NHD",
            "--decode-layout",
            "HND",
            "--block-ids",
            "scattered",
        ],
        *["--prefill-block-size", "32", "--decode-block-size", "8", "--backend", "torch"],
    ],
    # Two decode ranks of two heads each read their share of a head-major sender (heterogeneous TP).
    "ranks": [
        *[*SMALL, "--heads", "4", "--requests", "6", "--decode-tp", "2", "--max-run", "1"],
        *["--prefill-block-size", "4", "--decode-block-size", "8"],
    ],
    # Cross-layer caches on both sides (a block's layers back to back in one tensor), r = 4,
    # two decode ranks each reading its share of the heads out of every layer of a block.
    "cross-layer": [
        *[*SMALL, "--heads", "4", "--requests", "8", "--cross-layer", "--decode-tp", "2"],
        *["--prefill-block-size", "4", "--decode-block-size", "16"],
    ],
    # Prefill killed once 3 requests arrived, with 3 transfers in flight at a time.
    "kill": [*SMALL, "--requests", "12", "--inflight", "3", "--kill-prefill-after", "3", "--backend", "torch"],
    # Prefill frozen (SIGSTOP) once 2 arrived; over TCP alone its memory cannot be read, so transfers hang.
    "freeze": [*SMALL, "--requests", "10", "--inflight", "2", "--freeze-prefill-after", "2", "--timeout", "2"],
    # Decode frozen (SIGSTOP) past the prefill's peer timeout once 2 arrived: prefill lets go
    # of the blocks, and decode trusts none it read that prefill did not confirm before.
    "freeze-decode": [
        *SMALL,
        "--requests",
        "10",
        "--inflight",
        "2",
        "--freeze-decode-after",
        "2",
        "--peer-timeout",
        "0.5",
    ],
}
ENV = {"freeze": {"UCX_TLS": "tcp,self"}}
RUN_SECONDS = 420


def process_tree(pid):
    """``pid`` and its descendants (Linux /proc)."""
    found, queue = [], [pid]
    while queue:
        current = queue.pop()
        found.append(current)
        with contextlib.suppress(OSError):
            for task in os.listdir(f"/proc/{current}/task"):
                with open(f"/proc/{current}/task/{task}/children") as children:
                    queue += [int(child) for child in children.read().split()]
    return found


def tcp_address(hex_address):
    """``0100007F:1F90`` (from /proc/net/tcp or tcp6) as ``("127.0.0.1", 8080)``."""
    host, port = hex_address.split(":")
    raw_host = b"".join(bytes.fromhex(host[i : i + 8])[::-1] for i in range(0, len(host), 8))
    family = socket.AF_INET if len(raw_host) == 4 else socket.AF_INET6
    return socket.inet_ntop(family, raw_host), int(port, 16)


def listening_sockets(pids):
    """``{(pid, address, port)}`` of the TCP sockets in LISTEN state that ``pids`` hold open."""
    owners = {}
    for pid in pids:
        with contextlib.suppress(OSError):
            for fd in os.listdir(f"/proc/{pid}/fd"):
                with contextlib.suppress(OSError):
                    link = os.readlink(f"/proc/{pid}/fd/{fd}")
                    if link.startswith("socket:["):
                        owners[link[8:-1]] = pid
    found = set()
    for table in ("tcp", "tcp6"):
        with contextlib.suppress(OSError), open(f"/proc/net/{table}") as lines:
            for line in list(lines)[1:]:
                fields = line.split()
                if fields[3] == "0A" and fields[9] in owners:  # 0A: LISTEN
                    found.add((owners[fields[9]], *tcp_address(fields[1])))
    return found


class DemoRun:
    """One ``kvhost demo`` process, started now; ``result()`` waits for it (at most
    ``seconds``) and reads its exit code, JSON outcome and output once."""

    def __init__(self, name, argv, directory, seconds, env=None):
        self.name = name
        self.seconds = seconds
        self.json = directory / f"{name}.json"
        self.out = open(directory / f"{name}.out", "w+")  # noqa: SIM115 - closed in result()
        command = [sys.executable, "-m", "kvhost_tools.cli", "demo", *argv, "--json", str(self.json)]
        self.process = subprocess.Popen(command, stdout=self.out, stderr=subprocess.STDOUT, env=env)
        self.outcome = None

    def ended(self):
        """Called once the process has ended, before its output is read."""

    def result(self):
        if self.outcome is None:
            try:
                self.process.wait(timeout=self.seconds)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
                pytest.fail(f"kvhost demo ({self.name}) did not finish within {self.seconds} s")
            self.ended()
            self.out.seek(0)
            self.text = self.out.read()
            self.out.close()
            assert self.json.exists(), f"no JSON outcome; output:\n{self.text}"
            self.outcome = json.loads(self.json.read_text())
        return self.process.returncode, self.outcome, self.text


class Run(DemoRun):
    """One of ``RUNS``, with every listening socket of its processes sampled while it runs."""

    def __init__(self, name, directory):
        env = dict(os.environ, **ENV.get(name, {}))
        env.pop("UCX_NET_DEVICES", None)  # the demo's own default is what is tested
        super().__init__(name, RUNS[name], directory, RUN_SECONDS, env)
        self.listening = set()
        self.watcher = threading.Thread(target=self._watch, daemon=True)
        self.watcher.start()

    def _watch(self):
        while self.process.poll() is None:
            self.listening |= listening_sockets(process_tree(self.process.pid))
            time.sleep(0.02)

    def ended(self):
        self.watcher.join(10)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    directory = tmp_path_factory.mktemp("demo")
    started = {name: Run(name, directory) for name in RUNS}
    yield started
    for run in started.values():
        if run.process.poll() is None:
            run.process.kill()
            run.process.wait()


def check_complete(code, outcome, text):
    assert code == 0, text
    figures = outcome["figures"]
    assert outcome["ok"] and outcome["error"] is None
    assert outcome["verified"] == outcome["received"] == [f"req-{i:03d}" for i in range(figures["requests"])]
    assert outcome["failed"] == {} and outcome["mismatched"] == {}
    assert figures["spare_untouched"] and figures["spare_blocks"] > 0
    assert figures["transfer_bytes"] > 0 and figures["post_bytes"] > 0
    assert "result    OK: every byte of every request verified" in text


@needs_nixl
@pytest.mark.timeout(RUN_SECONDS + 30)
def test_direct_handoff_verifies_every_byte(runs):
    code, outcome, text = runs["direct"].result()
    check_complete(code, outcome, text)
    figures = outcome["figures"]
    assert figures["decode_blocks"] * 4 >= figures["prefill_blocks"]  # r = 4
    assert figures["post_what"].startswith("kvhost.receive") and figures["backend"] == "cpu"
    assert "HND (memory KBHNC), block 4 tokens" in text and "NHD (memory KBNHC), block 16 tokens" in text
    assert "tokens x 2 layers x K/V bit for bit" in text
    # Each step post-processed what had arrived, from the one sender, in one call.
    assert sum(figures["post_step_sizes"]) == figures["requests"] == 8
    assert len(figures["post_step_sizes"]) == figures["post_steps"] >= 1
    assert "prefill 0: decode at 127.0.0.1:" in text and ": done" in text
    assert "deregistered the cache" in text


@needs_nixl
@pytest.mark.timeout(RUN_SECONDS + 30)
def test_via_host_handoff_verifies_every_byte(runs):
    code, outcome, text = runs["via-host"].result()
    check_complete(code, outcome, text)
    figures = outcome["figures"]
    assert figures["decode_blocks"] == 4 * figures["prefill_blocks"]  # g = 4: whole groups
    assert figures["post_what"].startswith("kvhost.copy_blocks from the host buffer (")
    assert figures["post_what"].endswith("then kvhost.receive, up to 1 group(s)")
    # Shaped like the cache, the host buffer takes the direct path's descriptors: each
    # sender region (2 layers x K/V) in g = 4 chunks, one per decode block, at most; chunks
    # that continue one another on both sides (runs of ids) go as one descriptor.
    assert 0 < figures["descriptors"] <= figures["prefill_blocks"] * 2 * 2 * 4
    assert figures["backend"] == "torch"


@needs_nixl
@pytest.mark.timeout(RUN_SECONDS + 30)
def test_decode_ranks_each_read_their_share_of_the_heads(runs):
    code, outcome, text = runs["ranks"].result()
    check_complete(code, outcome, text)
    figures = outcome["figures"]
    assert figures["decode_ranks"] == 2
    assert "2 ranks of 2 heads each" in text and "on each of 2 ranks" in figures["post_what"]
    assert "; r = 2, ranks [0] read" in text  # both decode ranks read from the one prefill rank
    # Between them the ranks read every sender block once: 4 tokens x K/V x 4 heads x 16
    # channels x 2 bytes x 2 layers per block.
    assert figures["transfer_bytes"] == figures["prefill_blocks"] * 4 * 2 * 4 * 16 * 2 * 2


@needs_nixl
@pytest.mark.timeout(RUN_SECONDS + 30)
def test_cross_layer_engines_hand_off_every_layer_in_each_block(runs):
    code, outcome, text = runs["cross-layer"].result()
    check_complete(code, outcome, text)
    figures = outcome["figures"]
    assert "HND (memory BLKHNC), block 4 tokens, layers inside blocks" in text
    assert "NHD (memory BLKNHC), block 16 tokens, TP 2, layers inside blocks" in text
    # Each decode rank reads its 2 heads of every layer and K/V of every sender block: a
    # head-major region keeps a head share in one piece per layer and K/V.
    assert figures["descriptors"] == figures["prefill_blocks"] * 2 * 2 * 2
    assert figures["transfer_bytes"] == figures["prefill_blocks"] * 4 * 2 * 4 * 16 * 2 * 2


@needs_nixl
@pytest.mark.timeout(RUN_SECONDS + 30)
@pytest.mark.parametrize("name", ["direct", "freeze"])
def test_every_socket_the_demo_listens_on_is_on_loopback(runs, name):
    """Prefill's control socket and both engines' NIXL/UCX agents listen on 127.0.0.1 (or
    ::1) only: UCX would also listen on every other interface (UCX_NET_DEVICES=lo)."""
    run = runs[name]
    run.result()
    pids = {pid for pid, _, _ in run.listening}
    decode_pid, [prefill_pid] = run.outcome["figures"]["decode_pid"], run.outcome["figures"]["prefill_pids"]
    assert {decode_pid, prefill_pid} <= pids, f"listening sockets seen: {sorted(run.listening)}"
    assert len([s for s in run.listening if s[0] == prefill_pid]) >= 2  # control socket and UCX
    outside = sorted(s for s in run.listening if not (s[1].startswith("127.") or s[1] == "::1"))
    assert not outside, f"listening beyond loopback: {outside}"


def check_partial(code, outcome, text):
    """A failed hand-off: non-zero, failures named, nothing failed marked received, the rest verified."""
    assert code == EXIT_FAILED, text
    failed, received = set(outcome["failed"]), set(outcome["received"])
    assert failed and not failed & received
    assert outcome["verified"] == outcome["received"] and outcome["mismatched"] == {}
    assert len(failed) + len(received) == outcome["figures"]["requests"]
    assert outcome["figures"]["spare_untouched"]
    requests = outcome["figures"]["requests"]
    assert f"FAILED: {len(failed)} of {requests} requests did not arrive (not marked received); " in text
    assert f"{len(received)} of the {len(received)} that arrived verified bit for bit, 0 mismatched" in text
    return failed, received


@needs_nixl
@pytest.mark.timeout(RUN_SECONDS + 30)
def test_killed_prefill_fails_the_rest_and_verifies_what_it_confirmed(runs):
    """What arrived counts once prefill answered a beat sent after it with ``held``; one
    that arrived as it was killed, unconfirmed, fails (it cannot be told from blocks a
    prefill that had let go gave to others)."""
    code, outcome, text = runs["kill"].result()
    _, received = check_partial(code, outcome, text)
    assert outcome["figures"]["fault_after"] == 3
    unconfirmed = [n for n, why in outcome["failed"].items() if "did not confirm it held the blocks" in why]
    assert 3 <= len(received) + len(unconfirmed) <= 6  # those that arrived, and at most the 3 then in flight
    assert any("REMOTE_DISCONNECT" in why or "failed" in why for why in outcome["failed"].values())
    assert any(why.startswith("not started: prefill 0 (127.0.0.1:") for why in outcome["failed"].values())


@needs_nixl
@pytest.mark.timeout(RUN_SECONDS + 30)
def test_decode_frozen_past_the_peer_timeout_trusts_only_what_was_confirmed_before(runs):
    code, outcome, text = runs["freeze-decode"].result()
    _, received = check_partial(code, outcome, text)
    assert len(received) <= 2 and outcome["figures"]["fault_after"] == 2  # confirmed before the freeze, at most
    assert "froze (SIGSTOP) decode 0 for 1.5 s" in text and "silent: no beat for 0.5 s" in text
    # What landed after the freeze (prefill had let go) is confirmed by nothing: it fails, as
    # every read that prefill's end (it lets go, then exits) cut short does.
    kinds = ("did not confirm it held the blocks", "NIXL_ERR", "not started: prefill 0", "no completion within")
    assert all(any(kind in why for kind in kinds) for why in outcome["failed"].values()), outcome["failed"]


@needs_nixl
@pytest.mark.timeout(RUN_SECONDS + 30)
def test_frozen_prefill_times_out_instead_of_hanging(runs):
    code, outcome, text = runs["freeze"].result()
    _, received = check_partial(code, outcome, text)
    unconfirmed = [n for n, why in outcome["failed"].items() if "did not confirm it held the blocks" in why]
    # Arrived: confirmed, or (frozen before its answer came) failed for want of it.
    assert len(received) + len(unconfirmed) >= 2
    assert any("no completion within 2 s" in why for why in outcome["failed"].values())
    # Decode gave up on the hung transfers after the timeout: a bounded run, not a hang.
    assert outcome["figures"]["transfer_seconds"] < 2 + 10
    assert "froze (SIGSTOP) prefill 0" in text


# --- in process --------------------------------------------------------------------------------


MODEL = Model("mha", 2, 2, 16, "bfloat16")


@pytest.mark.parametrize(("layout", "region"), [("HND", "LKHNC"), ("NHD", "LKNHC")])
def test_a_cross_layer_cache_is_one_tensor_whose_block_region_holds_every_layer(layout, region):
    """vLLM's cross-layer layout: a block's layers back to back, so one block region (what NIXL
    moves) holds every layer, and a run of blocks is one span for the whole model."""
    shape = EngineShape(layout, 8, cross_layer=True)
    caches = MODEL.caches(shape, 6)
    assert list(caches) == ["layers"] and MODEL.axes_for(shape) == "LKBNHC" == "L" + MODEL.axes
    tensor = caches["layers"]
    assert tuple(tensor.shape) == (MODEL.layers, 2, 6, 8, MODEL.heads, MODEL.head_dim)
    layout_of = CacheSet(caches, MODEL.axes_for(shape)).members[0].layout
    region_bytes = MODEL.layers * 2 * 8 * MODEL.heads * MODEL.head_dim * 2
    assert layout_of.region_bytes == layout_of.block_stride_bytes == region_bytes
    assert layout_of.physical == "B" + region
    assert "layers inside blocks" in shape.describe() and "layers" not in EngineShape(layout, 8).describe()
    assert list(MODEL.caches(EngineShape(layout, 8), 6)) == ["layer0", "layer1"]


def test_engine_shapes_are_found_from_the_region_order_a_peer_sends():
    for layout in ("HND", "NHD", "MLA"):
        for cross_layer in (False, True):
            shape = EngineShape(layout, 8, 2, cross_layer=cross_layer)
            assert EngineShape.of_order(shape.order, 8, 2) == shape
    assert EngineShape("HND", 8, cross_layer=True).order == "LKHNC"
    assert EngineShape("MLA", 8, cross_layer=True).physical == "BLNC"
    assert EngineShape.of_order("KHNC", 8) is None  # K inside the block: no demo layout


def test_a_cross_layer_cache_is_verified_layer_by_layer():
    shape = EngineShape("NHD", 8, cross_layer=True)
    caches, axes = MODEL.caches(shape, 6), MODEL.axes_for(shape)
    raw(caches["layers"]).view(torch.uint8).fill_(SENTINEL_BYTE)
    request = Request("req-000", 0, 13, None, remote_ids=[], local_ids=[4, 1])
    for layer in range(MODEL.layers):
        values = token_values(0, 0, layer, 13, MODEL.heads, MODEL.head_dim, 2)
        write_tokens(caches["layers"][layer], MODEL.axes, request.local_ids, values)
    outcome = Outcome()
    verify(MODEL, axes, 0, [Rank(caches, MODEL.heads)], [request], [0, 2, 3, 5], outcome)
    assert outcome.verified == ["req-000"] and outcome.mismatched == {}

    raw(caches["layers"])[1, 1, 1, 12 - 8, 1, 3] ^= 1  # layer 1, V, block 1 (tokens 8..15): token 12
    raw(caches["layers"])[0, 0, 3, 0, 0, 0] ^= 1  # a spare block
    outcome = Outcome()
    verify(MODEL, axes, 0, [Rank(caches, MODEL.heads)], [request], [0, 2, 3, 5], outcome)
    assert outcome.mismatched == {
        "req-000": "layers[1] token 12 K/V 1 head 1 channel 3 differs",
        "spare blocks": "a block no request owns was written",
    }


def test_a_report_of_a_run_stopped_midway_says_what_had_arrived():
    """A SIGTERM (or an error) after some requests arrived: the report no longer says the
    hand-off did not run."""
    from kvhost_tools.demo.report import print_report

    for received, ended in (([], "did not run"), (["req-000", "req-001"], "stopped after 2 request(s) arrived")):
        stream = io.StringIO()
        print_report(Outcome(received=received, error="stopped by SIGTERM"), stream)
        assert f"  error     stopped by SIGTERM\n  result    FAILED: the hand-off {ended}\n" in stream.getvalue()


def test_verification_catches_a_flipped_byte_and_a_stray_write():
    caches = MODEL.caches(EngineShape("HND", 8), 6)
    for tensor in caches.values():
        raw(tensor).view(torch.uint8).fill_(SENTINEL_BYTE)
    request = Request("req-000", 0, 13, None, remote_ids=[], local_ids=[4, 1])
    for layer, tensor in enumerate(caches.values()):
        values = token_values(0, 0, layer, 13, MODEL.heads, MODEL.head_dim, 2)
        write_tokens(tensor, MODEL.axes, request.local_ids, values)

    outcome = Outcome()
    verify(MODEL, MODEL.axes, 0, [Rank(caches, MODEL.heads)], [request], [0, 2, 3, 5], outcome)
    assert outcome.verified == ["req-000"] and outcome.mismatched == {}

    layer1 = caches["layer1"]
    raw(layer1)[1, 1, 12 - 8, 1, 3] ^= 1  # V, block 1 holds tokens 8..15: token 12, head 1, channel 3
    raw(caches["layer0"])[0, 5, 0, 0, 0] ^= 1  # a spare block
    outcome = Outcome()
    verify(MODEL, MODEL.axes, 0, [Rank(caches, MODEL.heads)], [request], [0, 2, 3, 5], outcome)
    assert outcome.verified == []
    assert outcome.mismatched["req-000"] == "layer1 token 12 K/V 1 head 1 channel 3 differs"
    assert outcome.mismatched["spare blocks"] == "a block no request owns was written"
    assert outcome.figures["spare_untouched"] is False


def test_each_rank_is_verified_against_its_own_heads():
    shape = EngineShape("NHD", 8, tp=2)  # 2 heads: one per rank
    ranks = [Rank(MODEL.caches(shape, 4), 1, first_head=rank) for rank in range(2)]
    request = Request("req-000", 0, 10, None, remote_ids=[], local_ids=[2, 0])
    for rank in ranks:
        for layer, tensor in enumerate(rank.caches.values()):
            values = token_values(0, 0, layer, 10, MODEL.heads, MODEL.head_dim, 2)
            write_tokens(tensor, MODEL.axes, request.local_ids, values.narrow(2, rank.first_head, 1))
    outcome = Outcome()
    verify(MODEL, MODEL.axes, 0, ranks, [request], [], outcome)
    assert outcome.verified == ["req-000"]

    raw(ranks[1].caches["layer0"])[0, 0, 1, 0, 2] ^= 1  # K, block 0 holds tokens 8..9: token 9
    outcome = Outcome()
    verify(MODEL, MODEL.axes, 0, ranks, [request], [], outcome)
    assert outcome.mismatched == {"req-000": "rank 1 layer0 token 9 K/V 0 head 1 channel 2 differs"}
    # A rank holding another rank's head is caught too.
    raw(ranks[1].caches["layer0"])[0, 0, 1, 0, 2] ^= 1
    ranks[0].first_head, ranks[1].first_head = 1, 0
    outcome = Outcome()
    verify(MODEL, MODEL.axes, 0, ranks, [request], [], outcome)
    assert outcome.mismatched["req-000"].startswith("rank 0 layer0 token 0 K/V 0 head 1")


def test_an_mla_latent_is_verified_whole_on_every_rank():
    model = Model("mla", 2, 1, 12, "float16")
    shape = EngineShape("MLA", 8, tp=2)
    ranks = [Rank(model.caches(shape, 3), 1) for _ in range(2)]
    request = Request("req-001", 1, 11, None, remote_ids=[], local_ids=[2, 0])
    for rank in ranks:
        for layer, tensor in enumerate(rank.caches.values()):
            write_tokens(tensor, "BNC", request.local_ids, token_values(0, 1, layer, 11, 1, 12, 2, kv=1))
    outcome = Outcome()
    verify(model, model.axes, 0, ranks, [request], [1], outcome)
    assert outcome.verified == ["req-001"]
    raw(ranks[1].caches["layer1"])[0, 2, 5] ^= 1  # block 0 holds tokens 8..10: token 10
    outcome = Outcome()
    verify(model, model.axes, 0, ranks, [request], [], outcome)
    assert outcome.mismatched == {"req-001": "rank 1 layer1 token 10 K/V 0 head 0 channel 5 differs"}


def test_values_differ_by_every_index():
    values = token_values(7, 3, 1, 20, 4, 8, 4)  # 32-bit: every element of a request's layer differs
    assert values.shape == (20, 2, 4, 8)
    assert values.unique().numel() == values.numel()
    other_layer = token_values(7, 3, 2, 20, 4, 8, 4)
    other_request = token_values(7, 4, 1, 20, 4, 8, 4)
    other_seed = token_values(8, 3, 1, 20, 4, 8, 4)
    for other in (other_layer, other_request, other_seed):
        assert (other != values).float().mean() > 0.99
    assert torch.equal(values, token_values(7, 3, 1, 20, 4, 8, 4))
    assert token_values(7, 3, 1, 20, 4, 8, 2).dtype == torch.int16


def test_request_lengths_are_mixed_and_seeded():
    workload = Workload(40, 16, 2048, 0)
    lengths = workload.lengths()
    assert len(lengths) == 40 and lengths == workload.lengths()
    assert min(lengths) >= 16 and max(lengths) <= 2048
    assert min(lengths) < 64 and max(lengths) > 512  # short and long requests in one batch


def test_progress_bar_draws_on_a_terminal_only():
    stream = io.StringIO()
    bar = ProgressBar("transfer", 4, stream, enabled=True)
    bar.update(2, "1 MB", force=True)
    bar.close(4, "done")
    assert "transfer  [############------------] 2/4 1 MB" in stream.getvalue()
    assert stream.getvalue().endswith("[########################] 4/4 done\x1b[K\n")
    quiet = io.StringIO()
    ProgressBar("transfer", 4, quiet, enabled=False).close(4)
    assert quiet.getvalue() == ""


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--prefill-block-size", "6", "--decode-block-size", "16"], "must divide one another"),
        (["--layers", "0"], "--layers must be in [1, 32768], got 0"),
        (["--max-tokens", "3", "--min-tokens", "4"], "below --min-tokens"),
        (["--kill-prefill-after", "-1"], "--kill-prefill-after must be in [0, 16384], got -1"),
        (["--kill-prefill-after", "1", "--freeze-prefill-after", "1"], "not allowed with argument"),
        (["--dtype", "float64"], "invalid choice"),
        (["--decode-ranks", "3"], "--heads 8 cannot be shared out evenly to --decode-tp 3 ranks"),
        (["--prefill-tp", "1,2", "--prefill-block-size", "16,32,64"], "list different numbers of engines"),
        (["--prefill-layout", "HND,XYZ"], "--prefill-layout: 'XYZ' is not one of"),
        (["--prefill-tp", "1,3"], "--heads 8 cannot be shared out evenly to --prefill-tp 3 ranks"),
        (["--cache", "mla", "--decode-layout", "NHD"], "--decode-layout NHD does not hold a mla cache"),
        (["--decodes", "0"], "--decodes must be in [1, 64], got 0"),
        (["--max-run", "0"], "--max-run must be in [1, 1048576], got 0"),
        (["--block-ids", "random"], "invalid choice"),
        # Refused before an engine starts: an idle prefill exits, and decode retried it for minutes.
        (["--prefill-layout", "HND,NHD", "--requests", "1"], "--requests 1 leaves some of the 2 prefill engines"),
        (["--decodes", "3", "--requests", "2"], "--requests 2 leaves some of the 3 decode engines (--decodes)"),
        (["--backend", "nosuch"], "--backend 'nosuch': backend 'nosuch' is not registered"),
        (["--peer-timeout", "0.1"], "--peer-timeout must be at least 0.2 s"),
        (["--freeze-decode-after", "1", "--kill-prefill-after", "1"], "not allowed with argument"),
        # Faults that would never run (the run passed as if they had), offers no decode could take.
        (["--requests", "2", "--kill-prefill-after", "3"], "--kill-prefill-after 3: the first decode engine takes 2"),
        (["--requests", "4", "--decodes", "2", "--freeze-decode-after", "3"], "takes 2 requests, so the fault"),
        (
            [
                *["--requests", "16384", "--min-tokens", "2048", "--max-tokens", "2048", "--prefill-block-size", "1"],
                *["--layers", "1", "--heads", "1", "--head-dim", "1", "--dtype", "uint8"],
            ],
            "prefill would offer decode 0 33,554,432 block ids, past what one message carries (8,388,608)",
        ),
        (
            [
                *["--layers", "16385", "--heads", "2", "--head-dim", "1", "--dtype", "uint8", "--prefill-tp", "2"],
                *["--requests", "2", "--min-tokens", "16", "--max-tokens", "16"],
            ],
            "x --prefill-tp 2: 65540 cache streams, past",
        ),
    ],
)
def test_bad_options_are_refused(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def test_prefill_refuses_a_peer_timeout_no_decode_can_beat_within_before_it_listens(capsys):
    """Refused as a bad option (exit 2), not after its cache is filled and its listening line."""
    from kvhost_tools.demo.prefill import main as prefill_main

    with pytest.raises(SystemExit) as exit_info:
        prefill_main(["--peer-timeout", "0.1", "--listen", "127.0.0.1:0", "--secret-file", "-"])
    assert exit_info.value.code == 2
    out, err = capsys.readouterr()
    assert "--peer-timeout must be at least 0.2 s (four of the shortest beats, 0.05 s), got 0.1" in err
    assert "listening" not in out


@pytest.mark.parametrize(
    ("role", "argv", "message"),
    [
        ("prefill", [], "--layers 2000 x --heads 8 x --head-dim 64 x --dtype bfloat16, --requests 40 of"),
        ("decode", [], "for the caches, more than the 1.1 GB of memory available"),
        ("decode", ["--fault-after", "2"], "--fault-after and --fault-command go together"),
        ("prefill", ["--requests", "2", "--share", "3/4"], "--share 3/4 holds none of --requests 2"),
        ("decode", ["--json", "/"], "argument --json: '/' is not a file name"),
        ("prefill", ["--advertise", "203.0.113.9"], "--advertise 203.0.113.9: no interface of this host has that"),
        ("decode", ["--advertise", ""], "--advertise '': not an IP address"),
        ("decode", ["--json", "/no/such/folder/x.json"], "argument --json: '/no/such/folder/x.json': no folder"),
        ("decode", ["--prefill", "127.0.0.1:0"], "--prefill: '127.0.0.1:0': port 0 is no prefill engine's"),
        ("decode", ["--requests", "2", "--share", "3/4"], "--share 3/4 holds none of --requests 2"),
        ("decode", ["--backend", "nosuch"], "--backend 'nosuch': backend 'nosuch' is not registered"),
        ("decode", ["--json", "/proc/version"], "argument --json: '/proc/version': cannot write in '/proc'"),
        ("decode", ["--progress-fd", "99"], "--progress-fd 99: Bad file descriptor"),
    ],
)
def test_an_engine_refuses_what_it_cannot_do_before_it_allocates(role, argv, message, monkeypatch, capsys):
    """Refused as bad options (exit 2), before a cache is allocated: an engine whose options
    need more memory than is left says so, rather than being ended by the kernel."""
    from kvhost_tools.demo import config
    from kvhost_tools.demo.decode import main as decode_main
    from kvhost_tools.demo.prefill import main as prefill_main

    monkeypatch.setattr(config, "memory_available", lambda: 1_100_000_000)
    big = ["--layers", "2000"] if not argv else ["--layers", "2"]
    where = ["--listen", "127.0.0.1:0"] if role == "prefill" else ["--prefill", "127.0.0.1:1"]
    with pytest.raises(SystemExit) as exit_info:
        (prefill_main if role == "prefill" else decode_main)([*big, *where, "--secret-file", "-", *argv])
    assert exit_info.value.code == 2
    out, err = capsys.readouterr()
    assert message in err and err.count("\n") == 1 and not out, err


@pytest.mark.parametrize("role", ["demo", "prefill", "decode"])
def test_without_nixl_each_tool_says_so_at_once_and_starts_nothing(role, tmp_path, monkeypatch, capsys):
    """Every engine needs NIXL: without it the demo says so in one line before it starts
    any (it waited for decode's whole connect timeout, then blamed the connection), prefill
    before it binds or writes a secret, decode before it knocks on a prefill engine."""
    from kvhost.nixl import agent
    from kvhost_tools.demo.cli import main as demo_main
    from kvhost_tools.demo.decode import main as decode_main
    from kvhost_tools.demo.prefill import main as prefill_main

    monkeypatch.setattr(agent, "NIXL_MODULES", ("kvhost_no_such_nixl._api",))
    agent.load_nixl.cache_clear()
    secret = tmp_path / "secret"
    begun = time.monotonic()
    try:
        if role == "demo":
            code = demo_main(["--requests", "2", "--layers", "2"])
        elif role == "prefill":
            code = prefill_main(["--layers", "2", "--listen", "127.0.0.1:0", "--secret-file", str(secret)])
        else:
            with socket.create_server(("127.0.0.1", 0)) as never_knocked:
                port = never_knocked.getsockname()[1]
                code = decode_main(["--layers", "2", "--prefill", f"127.0.0.1:{port}", "--secret-file", str(secret)])
                never_knocked.settimeout(0.1)
                with pytest.raises(TimeoutError):
                    never_knocked.accept()
    finally:
        agent.load_nixl.cache_clear()
    out, err = capsys.readouterr()
    said = {
        "demo": "kvhost demo: ",
        "prefill": "prefill: ",
        "decode": "decode: ",
    }
    assert code == 2 and err.startswith(said[role] + "NIXL is not installed") and err.count("\n") == 1, err
    assert "pip install 'kvhost[nixl]'" in err and time.monotonic() - begun < 20
    assert not secret.exists() and ("listening" not in out)


def test_prefill_says_in_the_resolvers_words_that_its_listen_host_does_not_resolve(tmp_path, capsys):
    from kvhost_tools.demo.prefill import main as prefill_main

    secret = tmp_path / "new.secret"
    code = prefill_main(["--layers", "2", "--listen", "nosuchhost.invalid:7600", "--secret-file", str(secret)])
    _, err = capsys.readouterr()
    assert code == 2 and err.startswith("prefill: --listen nosuchhost.invalid:7600: ") and err.count("\n") == 1
    assert "Unknown error" not in err and "while attempting" not in err, err  # was "Unknown error -2"
    assert not secret.exists()


@needs_nixl
def test_decode_says_in_one_line_that_its_json_cannot_be_written_and_exits_2(tmp_path, capsys):
    """A results file that cannot be written (a full device) after a run that failed to
    connect: one line each, exit 2; it was a traceback and exit 1, the status of failed requests."""
    from kvhost.nixl.peers import write_secret_file
    from kvhost_tools.demo.decode import main as decode_main

    secret = tmp_path / "s"
    write_secret_file(str(secret))
    with socket.create_server(("127.0.0.1", 0)) as closed:
        port = closed.getsockname()[1]  # nothing listens there once closed
    argv = ["--layers", "2", "--prefill", f"127.0.0.1:{port}", "--secret-file", str(secret)]
    code = decode_main([*argv, "--connect-timeout", "1", "--no-progress", "--json", "/dev/full"])
    _, err = capsys.readouterr()
    lines = err.splitlines()
    assert code == 2 and "Traceback" not in err, err
    assert lines[-1] == "decode: --json /dev/full: No space left on device" and lines[-2].startswith("decode: ")


def test_prefill_says_its_port_is_taken_in_one_line_and_leaves_no_secret_file(tmp_path, capsys):
    from kvhost_tools.demo.prefill import main as prefill_main

    secret = tmp_path / "new.secret"
    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        code = prefill_main(["--layers", "2", "--listen", f"127.0.0.1:{port}", "--secret-file", str(secret)])
    out, err = capsys.readouterr()
    assert code == 2 and err == f"prefill: --listen 127.0.0.1:{port}: Address already in use\n", (out, err)
    assert not secret.exists()


def test_the_outcome_is_written_through_a_link_and_to_a_device(tmp_path):
    """Whole or not at all where it is a file (a link's file, the link kept); as it is where it
    is not (``/dev/stdout``, a pipe)."""
    from kvhost_tools.demo.options import json_path
    from kvhost_tools.demo.report import Outcome, write_json

    target, link = tmp_path / "target.json", tmp_path / "link.json"
    link.symlink_to(target)
    write_json(json_path(str(link)), Outcome(error="x"))
    assert link.is_symlink() and json.loads(target.read_text())["error"] == "x"
    assert not list(tmp_path.glob("*.partial"))
    read, write = os.pipe()
    with os.fdopen(read) as reader:
        pipe = f"/proc/self/fd/{write}"
        write_json(json_path(pipe), Outcome(error="y"))
        os.close(write)
        assert json.loads(reader.read())["error"] == "y"


SPY_ON_PARKING = """
import os, sys
import kvhost_tools.demo.netenv as netenv
original = netenv.park_workers
def spy(env):
    print("torch loaded:", "torch" in sys.modules)
    original(env)
netenv.park_workers = spy
from kvhost_tools import cli
try:
    cli.main([sys.argv[1], "--help"])
except SystemExit:
    pass
print("policy:", os.environ.get("OMP_WAIT_POLICY"))
"""


@pytest.mark.parametrize("command", ["demo", "prefill", "decode"])
def test_engines_park_openmp_workers_before_torch_loads_unless_told(command):
    """GNU OpenMP reads its wait policy once, when it loads: the engine commands set it to
    PASSIVE first (spinning workers slowed decode's post-process up to 40x here), and leave
    a policy the user chose alone."""
    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    run = [sys.executable, "-c", SPY_ON_PARKING, command]
    out = subprocess.run(run, env=env, capture_output=True, text=True, check=True).stdout
    assert "torch loaded: False" in out and out.strip().endswith("policy: PASSIVE")
    out = subprocess.run(run, env={**env, "OMP_WAIT_POLICY": "ACTIVE"}, capture_output=True, text=True, check=True)
    assert out.stdout.strip().endswith("policy: ACTIVE")


def test_an_offer_without_a_pid_is_reported_as_pid_0():
    """kvhost's prefill names its pid in its offer for the report; another engine's offer
    that names none (or has no fields of its own) is served and reported as pid 0."""
    from kvhost.nixl.fields import Fields
    from kvhost.nixl.peers import Offer

    def offer(fields):
        return Offer(None, [], [], [], fields=fields)  # type: ignore[arg-type]

    assert prefill_pid(offer(Fields({"pid": 4321}, "offer"))) == 4321
    assert prefill_pid(offer(Fields({"want": "all"}, "offer"))) == 0
    assert prefill_pid(offer(None)) == 0


class StubReader:
    """A decode rank's reader whose read posts a stub transfer, or raises ``error``."""

    def __init__(self, error=None):
        self.error, self.posted = error, []

    def read(self, local_ids, remote_ids):
        if self.error is not None:
            raise self.error
        transfer = StubTransfer()
        self.posted.append(transfer)
        return [transfer]


class StubTransfer:
    nbytes, released = 0, False

    def poll(self):
        return False  # never lands: only the failures below end the requests

    def release(self):
        self.released = True


@pytest.mark.parametrize(
    ("error", "engine_lost"),
    [(TransferError("rank 1's post failed"), True), (RequestError("remote_ids: block id 3 appears twice"), False)],
    ids=["link", "request"],
)
def test_a_request_one_rank_cannot_post_holds_no_transfer_and_fails_alone_unless_the_link_did(error, engine_lost):
    """With two decode ranks, the first rank's read is posted before the second's fails:
    the first is released (never left writing, unreleased, into memory freed at close). A
    link's failure ends its engine's other requests unstarted; a request's own (a remote
    id twice) ends that request alone."""
    first, second = StubReader(), StubReader(error)
    engine = Engine(0, SimpleNamespace(address="127.0.0.1:1"), readers=[first, second])
    requests = [Request(f"req-{i}", i, 16, engine, [i], local_ids=[i]) for i in range(2)]
    settings = Settings(inflight=2, timeout=5.0, step=0.0, axes="KBNHC", backend=None, progress=None)
    pull(settings, requests, [], Outcome(), Steps(), staging=False)
    assert first.posted and all(t.released for t in first.posted)
    assert requests[0].failure == str(error) and requests[0].transfers == []
    assert (engine.lost is not None) is engine_lost
    if engine_lost:
        assert len(first.posted) == 1 and requests[1].failure.startswith("not started: prefill 0")
    else:
        assert len(first.posted) == 2 and requests[1].failure == str(error)


def test_a_request_whose_first_rank_s_read_stays_in_flight_says_so_and_ends_its_engine():
    """The second rank's post fails on the request's own ids, and the first rank's read,
    already posted, cannot be released (still in flight, it may write): the failure says
    so (post_all's note, once dropped), and the engine's other requests are not started."""

    class InFlight(StubTransfer):
        def release(self):
            raise TransferError("READ from 'prefill' is still in flight and cannot be cancelled")

    class Posting(StubReader):
        def read(self, local_ids, remote_ids):
            self.posted.append(InFlight())
            return [self.posted[-1]]

    first, second = Posting(), StubReader(RequestError("remote_ids: block id 9 is past rank 1's table"))
    engine = Engine(0, SimpleNamespace(address="127.0.0.1:1"), readers=[first, second])
    requests = [Request(f"req-{i}", i, 16, engine, [i], local_ids=[i]) for i in range(2)]
    settings = Settings(inflight=2, timeout=5.0, step=0.0, axes="KBNHC", backend=None, progress=None)
    pull(settings, requests, [], Outcome(), Steps(), staging=False)
    assert requests[0].failure == (
        "remote_ids: block id 9 is past rank 1's table; READ from 'prefill' is still in flight and cannot be cancelled"
    )
    assert engine.lost == requests[0].failure and requests[1].failure.startswith("not started: prefill 0")


@needs_nixl
@pytest.mark.timeout(120)
def test_decode_refuses_an_offer_whose_blocks_need_more_memory_than_is_left(tmp_path, monkeypatch, capsys):
    """Decode checks its memory from its own block size before it connects; a prefill's
    blocks of 4,096 tokens take 256 of decode's blocks of 16 each, 64 times what it foresaw
    (a run once allocated 2.19 GB against 0.33 GB foreseen). Checked again from the offer,
    before anything is allocated: one line, and the prefill engine is let go (decode closes)."""
    from kvhost_tools.demo import config
    from kvhost_tools.demo.decode import main as decode_main

    secret = tmp_path / "secret"
    model = ["--layers", "2", "--requests", "2", "--min-tokens", "64", "--max-tokens", "64"]
    command = [sys.executable, "-m", "kvhost_tools.demo", "prefill", *model, "--block-size", "4096"]
    command += ["--secret-file", str(secret), "--listen", "127.0.0.1:0", "--serve", "1", "--idle-timeout", "30"]
    prefill = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        assert prefill.stdout is not None
        listening = next(line for line in iter(prefill.stdout.readline, "") if "listening" in line)
        port = int(listening.split("listening 127.0.0.1:")[1].split()[0])
        asked = []

        def available():  # plenty for what decode foresees, 1 MiB once the offer is in
            asked.append(1)
            return 1 << 40 if len(asked) == 1 else 1 << 20

        monkeypatch.setattr(config, "memory_available", available)
        where = ["--prefill", f"127.0.0.1:{port}", "--secret-file", str(secret)]
        code = decode_main([*model, "--block-size", "16", *where])
        err = capsys.readouterr().err
        assert code == config.EXIT_ERROR
        assert "decode: the offered requests take 576 blocks of 16 tokens here" in err and "more than the" in err, err
        assert prefill.wait(30) == 1  # its one decode engine failed
        said = prefill.stdout.read()
        assert ": closed: the peer closed the connection" in said and "deregistered the cache" in said, said
    finally:
        prefill.kill()
        prefill.communicate()


def test_prefill_goes_on_unheard_once_its_stdout_reader_is_gone(monkeypatch):
    """`kvhost prefill ... | grep -m1 listening`: grep exits, and the next line prefill says
    must not end it (a BrokenPipeError); later lines go nowhere."""
    from kvhost_tools.demo.prefill import say

    read_end, write_end = os.pipe()
    stdout = io.TextIOWrapper(os.fdopen(write_end, "wb"), encoding="utf-8")
    monkeypatch.setattr(sys, "stdout", stdout)
    try:
        say("listening")
        assert os.read(read_end, 100) == b"prefill: listening\n"
        os.close(read_end)  # the reader goes away
        say("offered 2 requests")  # EPIPE: not raised
        say("decode at 127.0.0.1:1: done")
        assert os.readlink(f"/proc/self/fd/{stdout.fileno()}") == os.devnull
    finally:
        monkeypatch.undo()
        with contextlib.suppress(OSError):
            stdout.close()


def test_the_demo_shows_a_decode_engines_error_once(capsys):
    """Decode says its error on stderr too (for an operator running it alone); under the demo
    its report holds it already, so that line is not shown a second time."""
    from kvhost_tools.demo.cli import report
    from kvhost_tools.demo.processes import Output

    output = Output(
        "decode-0", stdout=["  error     KVHostError: x"], shown=["decode: KVHostError: x", "decode: other"]
    )
    engine = SimpleNamespace(name="decode-0", pid=7, output=output)
    report(SimpleNamespace(json=None), [], [engine], [2], [], [{"error": "KVHostError: x"}])
    assert capsys.readouterr().out == "  error     KVHostError: x\n  decode-0: decode: other\n"


@pytest.mark.parametrize(
    ("codes", "faulted", "patience"),
    [
        ([0, 0], False, 15.0),
        ([0, 1], False, 15.0),
        ([0, 2], False, 0.5),  # may have failed before it connected: prefill would wait for it
        ([1, -9], False, 0.5),  # killed at --run-timeout: it said nothing
        ([0, -15], False, 0.5),
        ([0, 0], True, 0.5),
    ],
)
def test_prefill_engines_are_waited_for_only_when_every_decode_engine_ran_to_its_end(codes, faulted, patience):
    """A decode engine that failed before connecting leaves the prefill engines waiting for
    it until their idle timeout: the demo then asks them to stop at once instead of waiting
    15 s for an exit that cannot come."""
    from kvhost_tools.demo.cli import prefill_patience

    assert prefill_patience(codes, faulted) == patience


@needs_nixl
def test_prefill_closes_every_agent_made_and_its_listener_when_a_later_one_fails(tmp_path, monkeypatch, capsys):
    """The agents are made after the cache is filled, one per rank: when the second cannot
    start, the first (its memory registered by then or not) is closed, and so is the listener."""
    import kvhost.nixl
    from kvhost_tools.demo.prefill import main as prefill_main

    made, listeners = [], []
    real_agent, real_create_server = kvhost.nixl.Agent, socket.create_server

    def agent(name):
        if made:
            raise TransferError(f"cannot start agent {name!r}")
        made.append(real_agent(name))
        return made[-1]

    def create_server(*args, **kwargs):
        listeners.append(real_create_server(*args, **kwargs))
        return listeners[-1]

    monkeypatch.setattr(kvhost.nixl, "Agent", agent)
    monkeypatch.setattr(socket, "create_server", create_server)
    argv = ["--layers", "2", "--tp", "2", "--listen", "127.0.0.1:0", "--secret-file", str(tmp_path / "s")]
    assert prefill_main(argv) == 2
    assert "cannot start agent" in capsys.readouterr().err
    assert len(made) == 1 and made[0].closed
    assert len(listeners) == 1 and listeners[0].fileno() == -1


@pytest.mark.parametrize(
    ("command", "limit", "said"), [("sleep 2", 0.3, " (did not finish within 0.3 s)"), ("true", 5, "")]
)
def test_a_fault_command_is_given_its_own_deadline(command, limit, said):
    from kvhost_tools.demo.pull import Fault

    settings = Settings(1, 1.0, 0.05, "NHD", None, None, 1, command, "ran it", limit)
    outcome = Outcome()
    fault = Fault(settings, outcome)
    fault.maybe(0)
    assert outcome.lines == []  # not before --fault-after requests arrived
    fault.maybe(1)
    assert outcome.lines == [f"fault     ran it after 1 requests had landed{said}"]


def test_decode_frozen_past_a_long_peer_timeout_gives_its_fault_command_until_it_resumes():
    """The command stops decode, and its deadline runs on while decode is stopped: with a
    peer timeout of 9 s or more the resume came after the 10 s a fault had, and the report
    said the freeze did not finish."""
    from kvhost_tools.demo.cli import fault_options, parser

    args = parser().parse_args([*SMALL, "--freeze-decode-after", "2", "--peer-timeout", "9.5"])
    options = fault_options(args, SimpleNamespace(pid=1))
    assert options[options.index("--fault-timeout") + 1] == "20.5"
    assert "sleep 10.5;" in options[options.index("--fault-command") + 1]


@needs_nixl
@pytest.mark.timeout(200)
def test_a_prefill_that_dies_as_it_starts_ends_the_run_long_before_the_connect_timeout(tmp_path):
    """Decode retries a prefill it cannot reach until ``--connect-timeout`` (240 s here);
    the demo sees the prefill's exit and stops decode ``--timeout`` + 5 s after it."""
    started = time.monotonic()
    run = DemoRun("dies", [*SMALL, "--requests", "4", "--timeout", "2"], tmp_path, 180)
    prefill = None
    while prefill is None and run.process.poll() is None and time.monotonic() - started < 60:
        for pid in process_tree(run.process.pid):
            with contextlib.suppress(OSError), open(f"/proc/{pid}/cmdline") as cmdline:
                if "prefill" in cmdline.read().split("\0"):
                    prefill = pid
        time.sleep(0.005)
    assert prefill is not None, "no prefill engine started"
    os.kill(prefill, 9)
    code, outcome, text = run.result()
    assert code == 2 and not outcome["ok"], text
    assert "decode 0: prefill 0 exited (-9) before this engine ended: stopped 7 s later" in text
    assert "prefill 0: exit -9" in text
    assert time.monotonic() - started < 120


def test_the_demo_s_modules_load_neither_torch_nor_kvhost_on_import():
    """``kvhost demo --help`` needs neither (its JSON writer had lived beside the report's
    torch yardstick: a second of torch's import); the checks of its options load kvhost, for
    its bounds and NIXL."""
    code = (
        "import sys\n"
        "from kvhost_tools import cli\n"
        "from kvhost_tools.demo import cli as demo\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'kvhost')))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--decodes", "64", "--requests", "64"], "and 27.3 GB for 65 engine processes, more than the 20.0 GB"),
        (["--heads", "512", "--prefill-tp", "512", "--decode-tp", "512"], "and 27.6 GB for 2 engine processes"),
    ],
)
def test_the_demo_counts_each_engine_process_s_own_memory_before_it_starts_one(argv, message, monkeypatch, capsys):
    """Each engine is a process of its own (Python, torch, NIXL, UCX: some 400 MB, and 25 MB
    a further rank): 64 decode engines, or ranks by the hundred, passed the check of the
    caches alone on a machine they would exhaust."""
    from kvhost_tools.demo import config

    monkeypatch.setattr(config, "memory_available", lambda: 20_000_000_000)
    with pytest.raises(SystemExit) as exit_info:
        main([*SMALL, "--head-dim", "8", *argv])
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err
    assert config.engines_memory([EngineShape("HND", 16, 1)] * 2) == 2 * config.ENGINE_BYTES
    assert config.engines_memory([EngineShape("HND", 16, 3)]) == config.ENGINE_BYTES + 2 * config.RANK_BYTES
