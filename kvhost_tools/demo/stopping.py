"""A supervisor's stop (SIGTERM) ends a command as Ctrl-C (SIGINT) does: as an exception in
the main thread, so that every ``finally`` runs (sessions closed, memory deregistered, engines
stopped, the decode's JSON written), and the command says what stopped it in one line and
exits 128 + the signal's number, as a shell reports it."""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import threading
from collections.abc import Iterator

# Set by ``kvhost demo`` for its engines: the demo's pid. An engine whose demo is gone (killed,
# or stopped while it was starting this one) is stopped too, never left running alone.
PARENT_ENV = "KVHOST_DEMO_PARENT"
PR_SET_PDEATHSIG = 1  # linux/prctl.h


class Stopped(KeyboardInterrupt):
    """SIGTERM: handled wherever a KeyboardInterrupt is."""


def _raise_stopped(signum: int, frame: object) -> None:
    raise Stopped


@contextlib.contextmanager
def stop_on_sigterm() -> Iterator[None]:
    """SIGTERM raises ``Stopped`` while the block runs (main thread only: a signal handler
    cannot be set from another thread, and is not needed there)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGTERM, _raise_stopped)
    try:
        _stop_with_parent()
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


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
    number = signal.SIGTERM if isinstance(err, Stopped) else signal.SIGINT
    return number.name, 128 + number
