"""A supervisor's stop (SIGTERM, or SIGHUP: a closed terminal or ssh session) ends a command
as Ctrl-C (SIGINT) does: as an exception in the main thread, so that every ``finally`` runs
(sessions closed, memory deregistered, engines stopped, the decode's JSON written), and the
command says what stopped it in one line and exits 128 + the signal's number, as a shell
reports it. A stop raises once: later ones are said and otherwise left alone, so that the
way out, each of whose waits has a deadline, runs whole (a supervisor that will not wait
sends SIGKILL)."""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import threading
from collections.abc import Callable, Iterator

# Set by ``kvhost demo`` for its engines: the demo's pid. An engine whose demo is gone (killed,
# or stopped while it was starting this one) is stopped too, never left running alone.
PARENT_ENV = "KVHOST_DEMO_PARENT"
PR_SET_PDEATHSIG = 1  # linux/prctl.h
STOP_SIGNALS = (signal.SIGTERM, signal.SIGHUP)  # stop as SIGINT does; Stopped says which


class Stopped(KeyboardInterrupt):
    """SIGTERM or SIGHUP (``signum``): handled wherever a KeyboardInterrupt is."""

    def __init__(self, signum: int = signal.SIGTERM) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signal.Signals(signum)


class StopSignals:
    """The stop signals a command handles while it runs, and where it stands with them."""

    def __init__(self, handled: tuple[int, ...]) -> None:
        self.handled = handled
        self.stopping = False  # a stop was raised (or the command said it is finishing)
        # What a first SIGTERM does instead of raising, where the command says (prefill
        # drains: its held decodes finish); a second stop then raises.
        self.drain: Callable[[], None] | None = None
        self.drained_by: signal.Signals | None = None

    def first(self, signum: int, frame: object) -> None:
        if signum == signal.SIGTERM and self.drain is not None and self.drained_by is None:
            self.drained_by = signal.Signals(signum)
            self.drain()
            return
        self.quiet()
        if signum == signal.SIGINT:
            raise KeyboardInterrupt
        raise Stopped(signum)

    def quiet(self) -> None:
        """From now on a stop is said, not raised: the command is on its way out."""
        self.stopping = True
        for signum in self.handled:
            signal.signal(signum, _said)


def _said(signum: int, frame: object) -> None:
    with contextlib.suppress(OSError):  # stderr gone: nothing to say it on
        os.write(2, f"{signal.Signals(signum).name}: already stopping\n".encode())


@contextlib.contextmanager
def stop_on_sigterm() -> Iterator[StopSignals]:
    """While the block runs, the first SIGTERM or SIGHUP raises ``Stopped`` and the first
    SIGINT ``KeyboardInterrupt``; later ones, and any once ``StopSignals.quiet`` was called,
    are said on stderr and left alone. SIGINT is left as it was where it came ignored (a
    non-interactive shell starts its background jobs so, that Ctrl-C not reach them).
    Main thread only: a signal handler cannot be set from another thread, nor is one
    needed there. The handlers before are back once the block ends."""
    if threading.current_thread() is not threading.main_thread():
        yield StopSignals(())
        return
    interrupt = (signal.SIGINT,) if signal.getsignal(signal.SIGINT) is signal.default_int_handler else ()
    stops = StopSignals((*STOP_SIGNALS, *interrupt))
    previous = {signum: signal.signal(signum, stops.first) for signum in stops.handled}
    try:
        _stop_with_parent()
        yield stops
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


def _stop_with_parent() -> None:
    """Where ``PARENT_ENV`` names the parent: SIGTERM once it ends (Linux), and at once if it
    already has."""
    parent = os.environ.pop(PARENT_ENV, None)  # not handed on to what this engine runs (a fault command)
    if not parent:
        return
    with contextlib.suppress(OSError, AttributeError):  # not Linux: the demo stops its engines itself
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
    if str(os.getppid()) != parent:
        raise Stopped


def stopped_by(err: KeyboardInterrupt) -> tuple[str, int]:
    """The signal that stopped a command, and its exit status."""
    number = err.signum if isinstance(err, Stopped) else signal.SIGINT
    return number.name, 128 + number
