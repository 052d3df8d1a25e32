"""Many prefill engines, many decode engines, tensor parallelism either way: real NIXL between processes.

Each run is ``kvhost demo`` (through ``kvhost_tools.cli``), which starts every engine as
its own process with its own NIXL agents; decode checks every token of every request bit
for bit against the values the prefill engines wrote. The runs start together (most of
their time is Python and torch starting); every test waits for its own, bounded. A pair
of engines that cannot work together is refused at the handshake, in one line naming
the field and both values (``kvhost prefill`` and ``kvhost decode`` run apart).
"""

from __future__ import annotations

import subprocess
import sys
import time

import pytest
from test_demo import DemoRun
from test_nixl import needs_nixl

from kvhost.nixl.peers import write_secret_file
from kvhost_tools.demo.config import Workload, blocks_for

SMALL = [
    *["--layers", "2", "--heads", "4", "--head-dim", "16", "--min-tokens", "5", "--max-tokens", "300"],
    *["--connect-timeout", "240", "--no-progress"],
]
THREE = ["--prefill-layout", "HND,NHD,HND", "--prefill-block-size", "16,32,128"]
RUNS = {
    # Three senders, three block sizes and two layouts, into one NHD 64 receiver; --step
    # long enough that one step post-processes everything from every engine at once.
    "three": [*SMALL, *THREE, "--requests", "9", "--step", "60"],
    # The same three prefill engines shared by two decode engines.
    "shared": [*SMALL, *THREE, "--requests", "12", "--decodes", "2"],
    # Decode TP smaller: one decode rank gathers its heads from 4 (r = 4) and 2 (g = 2) prefill ranks.
    "tp-down": [
        *[*SMALL, "--requests", "8", "--prefill-tp", "4,2", "--prefill-layout", "HND,NHD"],
        *["--prefill-block-size", "16,128", "--decode-tp", "1"],
    ],
    # Decode TP larger: four decode ranks each read a share of one prefill rank's heads.
    "tp-up": [*SMALL, "--requests", "8", "--prefill-tp", "1,2", "--prefill-block-size", "16,128", "--decode-tp", "4"],
    # MLA: the latent is not split by heads; every decode rank reads it once, from one prefill rank.
    "mla": [
        *[*SMALL, "--cache", "mla", "--requests", "8", "--prefill-tp", "2,4"],
        *["--prefill-block-size", "16,128", "--decode-tp", "4"],
    ],
}
RUN_SECONDS = 540


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    directory = tmp_path_factory.mktemp("xpyd")
    started = {name: DemoRun(name, RUNS[name], directory, RUN_SECONDS) for name in RUNS}
    yield started
    for run in started.values():
        if run.process.poll() is None:
            run.process.kill()
            run.process.wait()


def sender_bytes(requests, block_sizes, token_bytes):
    """The bytes of every block the prefill engines hold (request n on engine n mod P)."""
    lengths = Workload(requests, 5, 300, 0).lengths()
    total = 0
    for number, tokens in enumerate(lengths):
        size = block_sizes[number % len(block_sizes)]
        total += blocks_for(tokens, size) * size * token_bytes
    return total


def check_verified(outcome, numbers):
    """Every request of this decode engine arrived and verified, by name, and nothing else was written."""
    names = [f"req-{n:03d}" for n in numbers]
    assert outcome["ok"] and outcome["error"] is None
    assert outcome["received"] == outcome["verified"] == names
    assert outcome["failed"] == {} and outcome["mismatched"] == {}
    figures = outcome["figures"]
    assert figures["spare_untouched"] and figures["requests"] == len(names)
    assert sum(figures["post_step_sizes"]) == len(names)  # each request post-processed in exactly one step


@needs_nixl
@pytest.mark.timeout(RUN_SECONDS + 30)
def test_three_prefill_engines_of_different_shapes_feed_one_decode_step(runs):
    code, outcome, text = runs["three"].result()
    assert code == 0, text
    check_verified(outcome, range(9))
    figures = outcome["figures"]
    assert len(figures["prefill_pids"]) == 3
    for shape, ratio in (
        ("HND (memory KBHNC), block 16 tokens", "r = 4"),
        ("NHD (memory KBNHC), block 32 tokens", "r = 2"),
        ("HND (memory KBHNC), block 128 tokens", "g = 2"),
    ):
        assert any(shape in line and ratio in line for line in text.splitlines()), (shape, text)
    assert "decode    pid" in text and "NHD (memory KBNHC), block 64 tokens" in text
    # One step, one kvhost.receive, for the requests of all three engines.
    assert figures["post_steps"] == 1 and figures["post_step_engines"] == [3], figures
    assert "each one call per rank for what had arrived" in text
    said = [line for p in outcome["prefills"] for line in p["said"]]
    assert sum("deregistered the cache" in line and "1 served" in line for line in said) == 3


@needs_nixl
@pytest.mark.timeout(RUN_SECONDS + 30)
def test_two_decode_engines_share_the_prefill_engines(runs):
    code, outcome, text = runs["shared"].result()
    assert code == 0, text
    assert outcome["ok"] and len(outcome["decodes"]) == 2
    for index, decode in enumerate(outcome["decodes"]):
        check_verified(decode, range(index, 12, 2))
        assert len(decode["figures"]["prefill_pids"]) == 3
    assert outcome["decodes"][0]["figures"]["prefill_pids"] == outcome["decodes"][1]["figures"]["prefill_pids"]
    for prefill in outcome["prefills"]:
        assert prefill["exit"] == 0
        assert any("2 served, 0 refused" in line for line in prefill["said"]), prefill["said"]
    assert "demo      2 decode engines: OK (exit 0, 0)" in text


@needs_nixl
@pytest.mark.timeout(RUN_SECONDS + 30)
def test_one_decode_rank_gathers_its_heads_from_several_prefill_ranks(runs):
    code, outcome, text = runs["tp-down"].result()
    assert code == 0, text
    check_verified(outcome, range(8))
    assert "TP 4; " in text and "r = 4, ranks [0, 1, 2, 3] read" in text
    assert "TP 2; " in text and "g = 2, ranks [0, 1] read" in text
    # Every prefill byte read once: 2 layers x K/V x 4 heads x 16 channels x 2 bytes per token.
    figures = outcome["figures"]
    assert figures["transfer_bytes"] == sender_bytes(8, [16, 128], 2 * 2 * 4 * 16 * 2)
    assert figures["decode_ranks"] == 1


@needs_nixl
@pytest.mark.timeout(RUN_SECONDS + 30)
def test_decode_ranks_more_than_prefill_ranks_each_read_their_share(runs):
    code, outcome, text = runs["tp-up"].result()
    assert code == 0, text
    check_verified(outcome, range(8))
    assert "4 ranks of 1 heads each" in text and "on each of 4 ranks" in outcome["figures"]["post_what"]


@needs_nixl
@pytest.mark.timeout(RUN_SECONDS + 30)
def test_an_mla_latent_is_read_whole_once_per_decode_rank(runs):
    code, outcome, text = runs["mla"].result()
    assert code == 0, text
    check_verified(outcome, range(8))
    figures = outcome["figures"]
    assert "4 ranks of the latent each" in text
    assert "tokens x 2 layers (one latent a token) bit for bit" in text
    # Not split by heads: each of the 4 decode ranks read every prefill block's whole latent
    # (2 layers x 16 channels x 2 bytes per token) once, from one prefill rank.
    assert figures["transfer_bytes"] == 4 * sender_bytes(8, [16, 128], 2 * 16 * 2)


# --- refused at the handshake ------------------------------------------------------------------


ENGINE = ["--requests", "2", "--layers", "2", "--heads", "4", "--head-dim", "8", "--max-tokens", "64"]


@needs_nixl
@pytest.mark.timeout(300)
def test_a_pair_that_cannot_work_is_refused_in_one_line_naming_the_field_and_both_values(tmp_path):
    """Each refusal is one line on both sides; refusals do not use up ``--serve``, so the
    decode engine that agrees afterwards is the one prefill serves before it exits 0."""
    secret = str(tmp_path / "secret")
    write_secret_file(secret)
    prefill_argv = [*ENGINE, "--dtype", "float16", "--listen", "127.0.0.1:0", "--secret-file", secret]
    prefill_argv += ["--idle-timeout", "240", "--serve", "1"]  # refusals do not count towards --serve
    server = subprocess.Popen(
        [sys.executable, "-m", "kvhost_tools.cli", "prefill", *prefill_argv], stdout=subprocess.PIPE, text=True
    )
    try:
        assert server.stdout is not None
        first = server.stdout.readline()  # "prefill: listening ADDR:PORT (NETWORK): ..."
        assert "listening 127.0.0.1:" in first, first
        address = first.split("listening ")[1].split(" ")[0]
        cases = [
            (["--dtype", "bfloat16"], "dtype: decode bfloat16, prefill float16 (must agree)"),
            (["--dtype", "float16", "--layers", "3"], "layers: decode 3, prefill 2"),
        ]

        def decode(extra: list[str]) -> subprocess.CompletedProcess[str]:
            argv = [*ENGINE, *extra, "--prefill", address, "--secret-file", secret, "--no-progress"]
            return subprocess.run(
                [sys.executable, "-m", "kvhost_tools.cli", "decode", *argv, "--connect-timeout", "200"],
                capture_output=True,
                text=True,
                timeout=280,
            )

        for extra, why in cases:
            started = time.monotonic()
            done = decode(extra)
            assert done.returncode == 2, done.stdout + done.stderr
            errors = [line for line in done.stdout.splitlines() if line.startswith("  error")]
            assert len(errors) == 1 and f"prefill at {address} refused: {why}" in errors[0], done.stdout
            assert time.monotonic() - started < 250
            refused = server.stdout.readline()
            assert "refused: " + why in refused, refused
        # A decode engine that agrees is still served, and it is the one --serve 1 waited for.
        done = decode(["--dtype", "float16"])
        assert done.returncode == 0, done.stdout + done.stderr
        said, _ = server.communicate(timeout=120)
        assert server.returncode == 0, said
        assert "1 served, 2 refused" in said, said
    finally:
        server.kill()
        server.wait()


@pytest.mark.timeout(300)
def test_the_demo_kills_decode_engines_that_run_past_the_run_timeout():
    """The demo's own wait has a deadline too: a decode engine still starting after
    --run-timeout is killed, said so in one line, and the demo exits 2 (not 1)."""
    started = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-m", "kvhost_tools.cli", "demo", *ENGINE, "--run-timeout", "0.5", "--no-progress"],
        capture_output=True,
        text=True,
        timeout=280,
    )
    assert done.returncode == 2, done.stdout + done.stderr
    assert "decode 0: did not finish within --run-timeout 0.5 s: killed" in done.stdout
    assert time.monotonic() - started < 120
