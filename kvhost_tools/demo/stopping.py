"""A supervisor's stop (SIGTERM) ends a command as Ctrl-C (SIGINT) does: as an exception in
the main thread, so that every ``finally`` runs (sessions closed, memory deregistered, engines
stopped, the decode's JSON written), and the command says what stopped it in one line and
exits 128 + the signal's number, as a shell reports it."""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator


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
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def stopped_by(err: KeyboardInterrupt) -> tuple[str, int]:
    """The signal that stopped a command, and its exit status."""
    number = signal.SIGTERM if isinstance(err, Stopped) else signal.SIGINT
    return number.name, 128 + number
