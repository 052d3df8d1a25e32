"""A prefill engine frozen past decode's deadline, over TCP: does it survive waking up?

Over TCP UCX has no remote read of its own: a decode's READ is a request message to the
prefill engine's UCX, which sends the bytes back from its own worker thread (UCX's
software RMA). This stops prefill (SIGSTOP) once decode has 3 requests, long enough for
decode to fail its transfers at ``--timeout`` and exit, then lets prefill run again
(SIGCONT) with the read requests decode sent before it gave up still waiting in its
socket. Prefill's UCX answers them into a connection whose other end is gone; the send
fails and UCX 1.23 (nixl-cu12 1.5.1) aborts the process::

    ucp_request.inl:356  Fatal: unexpected error: Endpoint timeout

(``ucp_progress_get_reply`` returns the failed send's status to ``ucp_request_try_send``,
which takes anything but "done", "in progress" or "no resource" as fatal.) A decode killed
mid-transfer, or a link set down and up again, did not do it here: prefill had few or no
read requests queued when the connection went.

Needs root (two network namespaces joined by a veth, as ``tests/test_netns.py`` makes)::

    sudo .venv/bin/python experiments/ucx_tcp_freeze.py [--stop 15] [--timeout 3] [--runs 1]

It prints, per run, decode's exit status and how prefill ended (``survived`` when it
served a second decode engine afterwards, or the signal that ended it).
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from kvhost.nixl.peers import write_secret_file

BATCH = ["--layers", "2", "--heads", "4", "--head-dim", "64", "--requests", "24"]
BATCH += ["--min-tokens", "16", "--max-tokens", "2048"]


def ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, timeout=30)


def engine(ns: str, role: str, argv: list[str], out: Path) -> subprocess.Popen:
    env = dict(os.environ, UCX_TLS="tcp")
    command = ["ip", "netns", "exec", ns, sys.executable, "-m", "kvhost_tools.cli", role, *argv]
    with open(out, "w") as file:
        return subprocess.Popen(command, stdout=file, stderr=subprocess.STDOUT, env=env)


def one_run(folder: Path, stop: float, timeout: float) -> str:
    tag = str(os.getpid() % 10000)
    prefill_ns, decode_ns, prefill_if, decode_if = f"kvfp{tag}", f"kvfd{tag}", f"kvfp{tag}", f"kvfd{tag}"
    prefill_ip, decode_ip = "10.79.0.1", "10.79.0.2"
    try:
        ip("netns", "add", prefill_ns)
        ip("netns", "add", decode_ns)
        ip("link", "add", prefill_if, "type", "veth", "peer", "name", decode_if)
        for ns, interface, address in ((prefill_ns, prefill_if, prefill_ip), (decode_ns, decode_if, decode_ip)):
            ip("link", "set", interface, "netns", ns)
            ip("-n", ns, "addr", "add", f"{address}/24", "dev", interface)
            ip("-n", ns, "link", "set", interface, "up")
            ip("-n", ns, "link", "set", "lo", "up")
        secret = folder / "secret"
        write_secret_file(str(secret))
        address = f"{prefill_ip}:7600"
        common = [*BATCH, "--secret-file", str(secret)]
        prefill = engine(
            prefill_ns,
            "prefill",
            [*common, "--listen", address, "--serve", "0", "--peer-timeout", "5", "--idle-timeout", "60"],
            folder / "prefill.out",
        )
        # The fault command runs in decode's shell and must not hold its output open.
        fault = f"kill -STOP {prefill.pid}; (sleep {stop:g}; kill -CONT {prefill.pid}) >/dev/null 2>&1 &"
        decode_argv = [*common, "--prefill", address, "--connect-timeout", "120", "--no-progress"]
        decode_argv += ["--inflight", "2", "--timeout", f"{timeout:g}"]
        frozen = engine(
            decode_ns, "decode", [*decode_argv, "--fault-after", "3", "--fault-command", fault], folder / "decode1.out"
        )
        first = frozen.wait(timeout=300)
        time.sleep(stop + 10)  # prefill runs again and answers what was queued
        if prefill.poll() is None:
            second = engine(decode_ns, "decode", decode_argv, folder / "decode2.out").wait(timeout=300)
            prefill.send_signal(signal.SIGTERM)
            prefill.wait(timeout=60)
            return f"decode exit {first}; prefill survived (a second decode engine exited {second})"
        code = prefill.returncode
        how = signal.Signals(-code).name if code < 0 else f"exit {code}"
        fatal = [line for line in (folder / "prefill.out").read_text().splitlines() if "Fatal" in line]
        return f"decode exit {first}; prefill ended by {how}: {fatal[0] if fatal else 'no UCX message'}"
    finally:
        for ns in (prefill_ns, decode_ns):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=30)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--stop", type=float, default=15.0, help="seconds prefill stays stopped")
    parser.add_argument("--timeout", type=float, default=3.0, help="decode's --timeout")
    parser.add_argument("--runs", type=int, default=1)
    args = parser.parse_args()
    for run in range(args.runs):
        with tempfile.TemporaryDirectory(prefix="kvhost-freeze-") as folder:
            print(f"run {run + 1}: {one_run(Path(folder), args.stop, args.timeout)}", flush=True)


if __name__ == "__main__":
    main()
