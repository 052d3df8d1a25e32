"""Two hosts: ``kvhost prefill`` in one network namespace, ``kvhost decode`` in another.

The namespaces are joined by a veth pair (10.77.N.1 <-> 10.77.N.2), so the engines talk
over a real network interface. UCX sees one machine and would read through shared
memory (CMA), so the engines run with ``UCX_TLS=tcp``; ``UCX_NET_DEVICES`` is what the
commands set from the addresses they work on (the veth). That the bytes went over the
wire is checked from the veth's own counters inside the namespaces.

Three hosts on a switch (a bridge in a namespace of its own): one prefill engine on
every interface with ``--advertise``, two decode engines on hosts of their own, each
reading its share.

Faults: the link set down mid-transfer (decode's ``--fault-command``) ends in bounded
time, decode's deadline failing the transfers NIXL/UCX never report on, and prefill
lets go of its memory once decode's beats stop; packets dropped at random by nftables
only slow the transfers down.

Needs root, ``ip`` and network namespaces (skipped with the reason otherwise);
packet loss also needs ``nft``. Every namespace is removed after its test, whatever
happened (deleting a namespace deletes its end of the veth, and so the pair).
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import re
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
from test_nixl import needs_nixl

from kvhost.nixl.peers import write_secret_file

pytestmark = [pytest.mark.netns, needs_nixl]

COMMON = ["--layers", "2", "--heads", "4", "--head-dim", "64", "--min-tokens", "16", "--max-tokens", "1024"]
START_SECONDS = 300  # a loaded 2-core machine can take minutes to start Python and torch
_serial = itertools.count()


def run_ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30, check=check)


def why_no_namespaces() -> str | None:
    if os.geteuid() != 0:
        return "network namespaces need root"
    if shutil.which("ip") is None:
        return "no `ip` command (iproute2)"
    return None


@dataclass
class Host:
    """One engine's namespace, its end of a veth and its address there."""

    ns: str
    interface: str
    ip: str

    def counter(self, name: str) -> int:
        out = run_ip("netns", "exec", self.ns, "cat", f"/sys/class/net/{self.interface}/statistics/{name}")
        return int(out.stdout)

    def command(self, role: str, argv: list[str]) -> list[str]:
        return ["ip", "netns", "exec", self.ns, sys.executable, "-m", "kvhost_tools.cli", role, *argv]


@dataclass
class Pair:
    """Two namespaces joined by a veth pair: prefill's side and decode's side."""

    prefill_ns: str
    decode_ns: str
    prefill_if: str
    decode_if: str
    prefill_ip: str
    decode_ip: str

    def host(self, side: str) -> Host:
        if side == "prefill":
            return Host(self.prefill_ns, self.prefill_if, self.prefill_ip)
        return Host(self.decode_ns, self.decode_if, self.decode_ip)

    def counter(self, side: str, name: str) -> int:
        return self.host(side).counter(name)

    def command(self, side: str, role: str, argv: list[str]) -> list[str]:
        return self.host(side).command(role, argv)


def fresh_names() -> tuple[str, int]:
    """A tag unique per run and test (interface names fit 15 bytes with it), and a /24 to use."""
    serial = next(_serial)
    return f"{os.getpid() % 100000}{serial}", 10 + (os.getpid() + serial) % 240


def add_namespace(ns: str) -> None:
    made = run_ip("netns", "add", ns, check=False)
    if made.returncode:
        pytest.skip(f"cannot make a network namespace here: {made.stderr.strip()}")


def bring_up(ns: str, interface: str, address: str | None) -> None:
    """Move ``interface`` into ``ns``, give it ``address`` (a /24) and bring it and loopback up."""
    run_ip("link", "set", interface, "netns", ns)
    if address is not None:
        run_ip("-n", ns, "addr", "add", f"{address}/24", "dev", interface)
    run_ip("-n", ns, "link", "set", interface, "up")
    run_ip("-n", ns, "link", "set", "lo", "up")


def sweep_leftovers() -> None:
    """Delete the namespaces an earlier run left (a pytest killed before its fixture's
    cleanup): named as these tests name theirs, made over an hour ago, no process in them."""
    for path in Path("/run/netns").glob("kv*"):
        if not re.fullmatch(r"kv(hp|hd|sw|h\d)\d+", path.name):
            continue
        with contextlib.suppress(OSError):
            old = time.time() - path.stat().st_mtime > 3600
            if old and not run_ip("netns", "pids", path.name, check=False).stdout.strip():
                remove([path.name], [])


def remove(namespaces: list[str], interfaces: list[str]) -> None:
    """Delete the namespaces (and with them their veth ends), then any veth that never reached one."""
    for ns in namespaces:
        run_ip("netns", "del", ns, check=False)
    for interface in interfaces:
        run_ip("link", "del", interface, check=False)


@pytest.fixture
def pair():
    reason = why_no_namespaces()
    if reason:
        pytest.skip(reason)
    sweep_leftovers()
    tag, subnet = fresh_names()
    made = Pair(f"kvhp{tag}", f"kvhd{tag}", f"kvp{tag}", f"kvd{tag}", f"10.77.{subnet}.1", f"10.77.{subnet}.2")
    try:
        add_namespace(made.prefill_ns)
        add_namespace(made.decode_ns)
        run_ip("link", "add", made.prefill_if, "type", "veth", "peer", "name", made.decode_if)
        bring_up(made.prefill_ns, made.prefill_if, made.prefill_ip)
        bring_up(made.decode_ns, made.decode_if, made.decode_ip)
        yield made
    finally:
        remove([made.prefill_ns, made.decode_ns], [made.prefill_if])


@pytest.fixture
def star():
    """Three hosts on one switch: a bridge in a namespace of its own, and a veth from it to
    each host's namespace (one /24; the hosts are .1, .2 and .3)."""
    reason = why_no_namespaces()
    if reason:
        pytest.skip(reason)
    sweep_leftovers()
    tag, subnet = fresh_names()
    switch, bridge = f"kvsw{tag}", f"kvbr{tag}"
    hosts = [Host(f"kvh{i}{tag}", f"kve{i}{tag}", f"10.77.{subnet}.{i + 1}") for i in range(3)]
    ports = [f"kvs{i}{tag}" for i in range(3)]
    try:
        add_namespace(switch)
        made = run_ip("-n", switch, "link", "add", bridge, "type", "bridge", check=False)
        if made.returncode:
            pytest.skip(f"cannot make a bridge here: {made.stderr.strip()}")
        run_ip("-n", switch, "link", "set", bridge, "up")
        for host, port in zip(hosts, ports):
            add_namespace(host.ns)
            run_ip("link", "add", host.interface, "type", "veth", "peer", "name", port)
            bring_up(host.ns, host.interface, host.ip)
            bring_up(switch, port, None)
            run_ip("-n", switch, "link", "set", port, "master", bridge)
        yield hosts
    finally:
        remove([switch, *(host.ns for host in hosts)], [host.interface for host in hosts])


def engine_env() -> dict[str, str]:
    """UCX over TCP only: the other namespace is this machine, and UCX would use shared memory."""
    env = dict(os.environ, UCX_TLS="tcp")
    env.pop("UCX_NET_DEVICES", None)  # the commands choose the veth from their addresses
    return env


@dataclass
class Outcome:
    code: int
    data: dict
    text: str
    prefill_code: int
    prefill_text: str
    decode_ended: float  # time.time()
    prefill_ended: float


@dataclass
class Ended:
    code: int
    text: str  # stdout and stderr
    at: float  # time.time()


def run_engines(tmp_path, commands: dict[str, list[str]]) -> dict[str, Ended]:
    """Start each command in turn (prefill engines first) under ``engine_env()``; wait for all
    of them, bounded, and kill what is still running at the deadline or on a failure."""
    env = engine_env()
    processes: dict[str, subprocess.Popen] = {}
    ended: dict[str, float] = {}
    with contextlib.ExitStack() as files:
        outputs = {name: files.enter_context(open(tmp_path / f"{name}.out", "w+")) for name in commands}
        try:
            for name, command in commands.items():
                processes[name] = subprocess.Popen(command, stdout=outputs[name], stderr=subprocess.STDOUT, env=env)
            deadline = time.monotonic() + 2 * START_SECONDS
            while len(ended) < len(processes) and time.monotonic() < deadline:
                for name, process in processes.items():
                    if name not in ended and process.poll() is not None:
                        ended[name] = time.time()
                time.sleep(0.05)
            if len(ended) < len(processes):
                pytest.fail(f"the engines did not finish within {2 * START_SECONDS} s: {sorted(ended)} did")
        finally:
            for process in processes.values():
                if process.poll() is None:
                    process.kill()
                    process.wait()
        for out in outputs.values():
            out.seek(0)
        return {name: Ended(processes[name].returncode, outputs[name].read(), ended[name]) for name in commands}


def hand_off(pair: Pair, tmp_path, *, prefill: list[str] = (), decode: list[str] = (), port: int = 7600) -> Outcome:
    """Start prefill in its namespace, then decode in the other; wait for both (bounded)."""
    secret = str(tmp_path / "secret")
    write_secret_file(secret)
    report = tmp_path / "decode.json"
    prefill_argv = [*COMMON, *prefill, "--listen", f"{pair.prefill_ip}:{port}", "--secret-file", secret]
    prefill_argv += ["--idle-timeout", str(START_SECONDS + 120)]
    decode_argv = [*COMMON, *decode, "--prefill", f"{pair.prefill_ip}:{port}", "--secret-file", secret]
    decode_argv += ["--connect-timeout", str(START_SECONDS), "--no-progress", "--json", str(report)]
    ended = run_engines(
        tmp_path,
        {
            "prefill": pair.command("prefill", "prefill", prefill_argv),
            "decode": pair.command("decode", "decode", decode_argv),
        },
    )
    server, client = ended["prefill"], ended["decode"]
    assert report.exists(), f"decode wrote no JSON:\n{client.text}\n--- prefill:\n{server.text}"
    data = json.loads(report.read_text())
    return Outcome(client.code, data, client.text, server.code, server.text, client.at, server.at)


def show(what: str, **figures: object) -> None:
    """The figures docs/two-hosts.md reports (pytest -s shows them)."""
    print(f"\n[netns] {what}: " + ", ".join(f"{k}={v}" for k, v in figures.items()))


@pytest.mark.timeout(2 * START_SECONDS + 120)
def test_prefill_and_decode_in_two_namespaces_verify_every_byte_over_the_veth(pair, tmp_path):
    """Prefill (TP 2, head-major blocks of 16) in one namespace, decode (TP 1, token-major
    blocks of 64) in the other: every request verified, and the veth carried the bytes."""
    before = {side: pair.counter(side, name) for side, name in (("decode", "rx_bytes"), ("prefill", "tx_bytes"))}
    out = hand_off(
        pair,
        tmp_path,
        prefill=["--requests", "12", "--tp", "2", "--layout", "HND", "--block-size", "16"],
        decode=["--requests", "12", "--layout", "NHD", "--block-size", "64"],
    )
    assert out.code == 0, out.text
    assert out.prefill_code == 0, out.prefill_text
    figures = out.data["figures"]
    assert out.data["verified"] == out.data["received"] == [f"req-{i:03d}" for i in range(12)]
    assert "result    OK: every byte of every request verified" in out.text
    assert f"UCX_NET_DEVICES={pair.decode_if}, UCX_TLS=tcp" in figures["network"]
    assert f"prefill   0 at {pair.prefill_ip}:7600" in out.text and "ranks [0, 1] read" in out.text
    assert f"decode at {pair.decode_ip}:" in out.prefill_text
    received = pair.counter("decode", "rx_bytes") - before["decode"]
    sent = pair.counter("prefill", "tx_bytes") - before["prefill"]
    # Every byte NIXL read crossed the veth (plus TCP/IP headers and the control connection).
    assert received >= figures["transfer_bytes"] > 0 and sent >= figures["transfer_bytes"]
    show(
        "two namespaces",
        transfer_bytes=figures["transfer_bytes"],
        veth_rx_bytes=received,
        transfer_seconds=round(figures["transfer_seconds"], 3),
        descriptors=figures["descriptors"],
    )


@pytest.mark.timeout(2 * START_SECONDS + 120)
def test_a_link_set_down_mid_transfer_ends_every_request_within_the_deadline(pair, tmp_path):
    """Decode takes its veth down once 3 requests arrived: NIXL/UCX say nothing for minutes,
    so decode's --timeout fails the transfers in flight, the rest fail at once naming the
    prefill engine; prefill hears no beat and lets go within --peer-timeout, so what arrived
    counts only where prefill confirmed it before; UCX's noise stays out of the output."""
    timeout, peer_timeout = 8.0, 5.0
    workload = ["--requests", "24", "--max-tokens", "2048"]
    out = hand_off(
        pair,
        tmp_path,
        prefill=[*workload, "--peer-timeout", str(peer_timeout)],
        decode=[
            *[*workload, "--inflight", "2", "--timeout", str(timeout)],
            *["--fault-after", "3", "--fault-command", f"ip link set {pair.decode_if} down"],
            *["--fault-label", f"took {pair.decode_if} down"],
        ],
    )
    assert out.code == 1, out.text
    data, figures = out.data, out.data["figures"]
    names = [f"req-{i:03d}" for i in range(24)]
    assert sorted([*data["received"], *data["failed"]]) == names  # every request ended one way
    assert not set(data["received"]) & set(data["failed"])  # a failed one is never marked received
    assert data["verified"] == data["received"] and data["mismatched"] == {}
    unconfirmed = [n for n, why in data["failed"].items() if "did not confirm it held the blocks" in why]
    assert 3 <= len(data["received"]) + len(unconfirmed) < 24
    reasons = set(data["failed"].values())
    # A read in flight when its deadline passed is not freed (it may land should the link
    # come back): its failure says so, and the report says what stays held at the end.
    timed_out = f"no completion within {timeout:g} s"
    assert any(why.startswith(timed_out) for why in reasons)
    if any("is still in flight and cannot be cancelled" in why for why in reasons):
        assert "still in flight at the end: their blocks and memory stay held" in out.text, out.text
    assert all(
        why == timed_out
        or why.startswith(f"{timed_out}; READ from ")
        or why.startswith(f"not started: prefill 0 ({pair.prefill_ip}")
        or why.startswith(f"prefill at {pair.prefill_ip}:")
        for why in reasons
    ), reasons
    assert f"took {pair.decode_if} down after 3 requests" in out.text
    fault_at = figures["fault_at"]
    decode_after, prefill_after = out.decode_ended - fault_at, out.prefill_ended - fault_at
    # Bounded: the deadline plus closing up (a loaded machine), not UCX's minutes.
    assert decode_after < timeout + 30, out.text
    assert "silent: no beat for" in out.prefill_text, out.prefill_text
    assert prefill_after < peer_timeout + 30, out.prefill_text
    assert out.prefill_code == 1, out.prefill_text  # a decode engine went away
    transport_lines = [line for line in out.text.splitlines() if " UCX " in line or "nixl_agent" in line]
    assert len(transport_lines) < 5, transport_lines[:5]
    show(
        "link down",
        arrived=len(data["received"]),
        arrived_unconfirmed=len(unconfirmed),
        failed=len(data["failed"]),
        decode_exit_after_fault_s=round(decode_after, 1),
        prefill_exit_after_fault_s=round(prefill_after, 1),
        timeout_s=timeout,
        peer_timeout_s=peer_timeout,
    )


@pytest.mark.timeout(2 * START_SECONDS + 120)
def test_packets_dropped_at_random_only_slow_the_transfers(pair, tmp_path):
    """nftables drops 5% of what reaches decode's side: TCP resends, every byte verifies."""
    if shutil.which("nft") is None:
        pytest.skip("no `nft` command (nftables) to drop packets with")
    table = "kvhost_loss"
    rules = (
        f"table inet {table} {{\n  chain input {{\n    type filter hook input priority 0; policy accept;\n"
        f'    iifname "{pair.decode_if}" numgen random mod 100 < 5 counter drop\n  }}\n}}\n'
    )
    loaded = subprocess.run(
        ["ip", "netns", "exec", pair.decode_ns, "nft", "-f", "-"],
        input=rules,
        capture_output=True,
        text=True,
        timeout=30,
    )
    if loaded.returncode:
        pytest.skip(f"nft cannot load a rule here: {loaded.stderr.strip()}")
    workload = ["--requests", "12"]
    out = hand_off(pair, tmp_path, prefill=workload, decode=[*workload, "--timeout", "60"])
    assert out.code == 0, out.text
    assert out.data["verified"] == [f"req-{i:03d}" for i in range(12)]
    listed = subprocess.run(
        ["ip", "netns", "exec", pair.decode_ns, "nft", "list", "table", "inet", table],
        capture_output=True,
        text=True,
        check=True,
        timeout=30,
    ).stdout
    dropped = int(listed.split("counter packets ")[1].split()[0])
    assert dropped > 0, listed
    figures = out.data["figures"]
    show(
        "5% loss",
        dropped_packets=dropped,
        transfer_bytes=figures["transfer_bytes"],
        transfer_seconds=round(figures["transfer_seconds"], 3),
    )


@needs_nixl
@pytest.mark.timeout(START_SECONDS + 120)
def test_the_transfer_bench_runs_its_sender_across_the_link_over_tcp(pair, tmp_path):
    """``kvhost bench --transfer --peer-netns`` in decode's namespace: UCX is kept on each end
    of the veth over TCP, found from the namespaces (on loopback the sender could not be
    reached), and the measured bytes crossed the veth."""
    results = tmp_path / "bench.json"
    env = {k: v for k, v in os.environ.items() if not k.startswith("UCX_")}
    command = [*pair.command("decode", "bench", ["--transfer", "--peer-netns", pair.prefill_ns])]
    command += ["--seconds", "0.5", "--demo=--requests 4 --layers 2", "--sweep", "0", "--bounds", ""]
    before = pair.counter("decode", "rx_bytes")
    done = subprocess.run(
        [*command, "--json", str(results)], capture_output=True, text=True, env=env, timeout=START_SECONDS
    )
    assert done.returncode in (0, 1), done.stdout + done.stderr  # 1: a target missed, as measured
    section = next(iter(json.loads(results.read_text())["transfer"].values()))
    assert section["ucx"] == {"UCX_DEBUG_SIGNO": "0", "UCX_NET_DEVICES": pair.decode_if, "UCX_TLS": "tcp"}
    assert section["peer_env"] == [f"UCX_NET_DEVICES={pair.prefill_if}", "UCX_TLS=tcp"]
    assert pair.counter("decode", "rx_bytes") - before > 4 * 2 * 2**20  # rounds of the batch's bytes
    refused = subprocess.run(
        [*pair.command("decode", "bench", ["--transfer", "--peer-netns", f"{pair.prefill_ns}x"])],
        capture_output=True,
        text=True,
        timeout=START_SECONDS,
    )
    assert refused.returncode == 2 and f"--peer-netns {pair.prefill_ns}x: " in refused.stderr, refused.stderr


@pytest.mark.timeout(2 * START_SECONDS + 120)
def test_one_prefill_engine_serves_two_decode_hosts_through_a_switch(star, tmp_path):
    """xPyD across hosts: prefill listens on every interface and names with ``--advertise``
    the one NIXL/UCX uses; two decode engines, each on a host of its own, read their halves
    of the requests (one told its address with ``--advertise``, the other finding it from
    its route to prefill). Every byte verifies, and each decode host's veth carried its half."""
    prefill, *decodes = star
    secret = str(tmp_path / "secret")
    write_secret_file(secret)
    port, requests = 7600, ["--requests", "12"]
    commands = {
        "prefill": prefill.command(
            "prefill",
            [
                *[*COMMON, *requests, "--listen", f"0.0.0.0:{port}", "--advertise", prefill.ip, "--serve", "2"],
                *["--secret-file", secret, "--idle-timeout", str(START_SECONDS + 120)],
            ],
        )
    }
    for index, host in enumerate(decodes):
        told = ["--advertise", host.ip] if index == 0 else []
        commands[f"decode{index}"] = host.command(
            "decode",
            [
                *[*COMMON, *requests, *told, "--share", f"{index}/2", "--prefill", f"{prefill.ip}:{port}"],
                *["--secret-file", secret, "--connect-timeout", str(START_SECONDS), "--no-progress"],
                *["--json", str(tmp_path / f"decode{index}.json")],
            ],
        )
    before = [host.counter("rx_bytes") for host in decodes]
    ended = run_engines(tmp_path, commands)
    served = ended["prefill"].text
    for name, end in ended.items():
        assert end.code == 0, f"{name}:\n{end.text}\n--- prefill:\n{served}"
    assert f"listening 0.0.0.0:{port} (UCX_NET_DEVICES={prefill.interface}, UCX_TLS=tcp)" in served, served
    assert "2 served, 0 refused" in served, served
    for index, host in enumerate(decodes):
        data = json.loads((tmp_path / f"decode{index}.json").read_text())
        figures = data["figures"]
        assert data["verified"] == data["received"] == [f"req-{n:03d}" for n in range(index, 12, 2)]
        assert figures["network"] == f"UCX_NET_DEVICES={host.interface}, UCX_TLS=tcp"
        assert f"decode at {host.ip}:" in served
        received = host.counter("rx_bytes") - before[index]
        assert received >= figures["transfer_bytes"] > 0  # this host's half came over its own veth
        show(f"switch, decode {index}", transfer_bytes=figures["transfer_bytes"], veth_rx_bytes=received)
