"""Loaded at start-up by the processes a test starts, while ci/mutation.py records which
tests run which lines: it notes the lines of the mutated modules this process runs.

Much of the handshake runs in a peer the test starts (a prefill engine, a stray client),
where the test's own tracer does not see it; without this, a mutant there would be judged
by no test at all. Each process appends ``line path`` once per line to a file of its own
in ``KVHOST_MUTATION_CHILD_LINES``, as it goes, so a peer the test kills has still told.
"""

from __future__ import annotations

import os
import sys
import threading
from typing import Any

_DIR = os.environ.get("KVHOST_MUTATION_CHILD_LINES")
_FILES = set(os.environ.get("KVHOST_MUTATION_FILES", "").split(os.pathsep)) - {""}

if _DIR and _FILES:
    _seen: set[tuple[str, int]] = set()
    _out = open(os.path.join(_DIR, f"{os.getpid()}.lines"), "a", buffering=1)  # noqa: SIM115 (open for the process's life)

    def _note(frame: Any) -> None:
        key = (frame.f_code.co_filename, frame.f_lineno)
        if key not in _seen:
            _seen.add(key)
            _out.write(f"{key[1]} {key[0]}\n")

    def _trace_lines(frame: Any, event: str, arg: Any) -> Any:
        if event == "line":
            _note(frame)
        return _trace_lines

    def _trace_calls(frame: Any, event: str, arg: Any) -> Any:
        if frame.f_code.co_filename in _FILES:
            _note(frame)
            return _trace_lines
        return None

    sys.settrace(_trace_calls)
    threading.settrace(_trace_calls)
