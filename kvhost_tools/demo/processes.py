"""The engine processes ``kvhost demo`` starts, and what they print.

Each engine is ``python -m kvhost_tools.demo prefill|decode ...``, its secret on stdin.
Its stdout is kept for the report; its stderr is read line by line: kvhost's own lines
are shown, and what the transports print (UCX and NIXL can print a thousand lines when a
peer goes away) is counted and summed up in one line instead. A progress bar goes to a
descriptor of its own (decode's ``--progress-fd``), the terminal. Nothing here imports
kvhost or torch.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field

from kvhost_tools.demo.stopping import PARENT_ENV

# Lines of the transports' own logs: UCX's (``[1712345678.123456] [host:123:0] sock.c:355  UCX  ERROR ...``,
# on stdout or stderr), NIXL's C++ (``E1130 16:25:44.574383  29594 nixl_agent.cpp:1198] ...``) and
# Python (``2026-11-30 16:20:47 NIXL INFO ...``) loggers.
STOP_SECONDS = 3.0  # an engine asked to stop (SIGTERM) has this long to let go of what it holds
TRANSPORT = re.compile(r"^\[\d+\.\d+\] \[|^[EWIF]\d{4} \d\d:\d\d:\d\d|^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d NIXL |^\s*$")
UCX_LINE = re.compile(r"^\[\d+\.\d+\] \[[^]]*\] .* UCX ")


@dataclass
class Output:
    """What one engine process printed: its stdout, its own stderr lines, and the transports' count."""

    name: str
    stdout: list[str] = field(default_factory=list)
    shown: list[str] = field(default_factory=list)
    noise: int = 0
    first_noise: str = ""

    def summary(self) -> str | None:
        if not self.noise:
            return None
        return (
            f"{self.name}: {self.noise:,} line(s) from UCX/NIXL on stderr not shown "
            f"(the first: {self.first_noise[:140]})"
        )


class Engine:
    """One engine process and the threads that read its output."""

    def __init__(
        self,
        name: str,
        role: str,
        argv: Sequence[str],
        secret_hex: str,
        *,
        pass_fds: Sequence[int] = (),
        env: dict[str, str] | None = None,
    ) -> None:
        self.name = name
        self.output = Output(name)
        command = [sys.executable, "-m", "kvhost_tools.demo", role, *argv]
        self.process = subprocess.Popen(
            command,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            pass_fds=tuple(pass_fds),
            env={**(os.environ if env is None else env), PARENT_ENV: str(os.getpid())},  # it ends with us
        )
        try:
            assert self.process.stdin is not None
            with contextlib.suppress(OSError):  # it died at once: its exit status says so
                self.process.stdin.write(secret_hex.encode() + b"\n")  # 65 bytes: a pipe never blocks on them
                self.process.stdin.close()
            self._threads = [
                threading.Thread(target=self._read_stdout, daemon=True),
                threading.Thread(target=self._read_stderr, daemon=True),
            ]
            for thread in self._threads:
                thread.start()
        except BaseException:  # a stop (Ctrl-C, SIGTERM) before the caller holds this engine
            self.process.kill()
            raise

    @property
    def pid(self) -> int:
        return self.process.pid

    def _read_stdout(self) -> None:
        """The engine's own lines; UCX writes its log lines to stdout, and they are noise."""
        assert self.process.stdout is not None
        for raw in self.process.stdout:
            line = raw.decode(errors="replace").rstrip("\n")
            if UCX_LINE.search(line):
                self._noise(line)
            else:
                self.output.stdout.append(line)

    def _noise(self, line: str) -> None:
        if line.strip():
            self.output.noise += 1
            self.output.first_noise = self.output.first_noise or line.strip()

    def _read_stderr(self) -> None:
        assert self.process.stderr is not None
        for raw in self.process.stderr:
            line = raw.decode(errors="replace").rstrip("\n")
            if TRANSPORT.search(line):
                self._noise(line)
            else:
                self.output.shown.append(line)

    def wait(self, timeout: float | None = None) -> int:
        code = self.process.wait(timeout=timeout)
        for thread in self._threads:
            thread.join(timeout=5)
        return code

    def stop(self, patience: float) -> int:
        """Let it exit on its own within ``patience`` seconds; then ask it to stop (SIGTERM, and
        SIGCONT for a stopped process), so that it closes its agents and deregisters its memory
        as it does on its own, and kill it if it lingers ``STOP_SECONDS`` after."""
        try:
            return self.wait(timeout=patience)
        except subprocess.TimeoutExpired:
            pass
        with contextlib.suppress(ProcessLookupError):
            self.process.terminate()
            os.kill(self.process.pid, signal.SIGCONT)
        try:
            return self.wait(timeout=STOP_SECONDS)
        except subprocess.TimeoutExpired:
            self.process.kill()
            with contextlib.suppress(subprocess.TimeoutExpired):  # stuck in the kernel: leave it
                return self.wait(timeout=10)
            return -9
