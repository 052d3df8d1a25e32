"""The test side of ci/mutation.py: a fork server per worker, and the pytest plugin it loads.

Server. ``python ci/mutation_server.py`` (in a worker's copy of the tree, with that copy
first on PYTHONPATH) imports what no mutant changes (torch, numpy, numba, pytest,
hypothesis) once, then reads one JSON request per line: pytest arguments, a log file and
a numba cache directory. Each request runs in a fresh fork, which imports kvhost from the
copy as it is now (a mutant, or the original); the server answers the child's pid, then
its exit status. A child that runs too long is killed by its process group.

Plugin (``-p mutation_server``). Hypothesis runs the same examples on every run and keeps
no database, so a mutant is judged by the examples that judged the original; the tree the
tests import is checked to be the copy. With ``KVHOST_MUTATION_COVERAGE`` set it also
records, per test, the lines of the mutated modules it runs (``sys.settrace``, and in the
processes it starts ``ci/mutation_child/sitecustomize.py``), with the
caches of the planner cleared before every test so that what a test runs does not hang on
the tests before it, and the lines run before the first test (imports) under ``<import>``;
ci/mutation.py picks each mutant's tests from this.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import os
import shutil
import sys
import threading
import time
from collections.abc import Generator
from typing import Any

import pytest

# --- plugin --------------------------------------------------------------------------


def pytest_configure(config: pytest.Config) -> None:
    from hypothesis import settings

    settings.register_profile("mutation", database=None, derandomize=True)
    settings.load_profile("mutation")
    tree = os.environ.get("KVHOST_MUTATION_TREE")
    if tree and _COVERAGE:  # every mutated module's import-time lines, traced before any test
        for path in sorted(_FILES):
            relative = os.path.relpath(path, tree).removeprefix("backends" + os.sep)
            importlib.import_module(relative.removesuffix(".py").replace(os.sep, "."))
    if tree:
        import kvhost_cpu

        import kvhost

        for module in (kvhost, kvhost_cpu):
            if not os.path.realpath(module.__file__ or "").startswith(os.path.realpath(tree) + os.sep):
                raise pytest.UsageError(f"{module.__name__} comes from {module.__file__}, not from the copy {tree}")


_COVERAGE = os.environ.get("KVHOST_MUTATION_COVERAGE")  # where to write it; unset: not recorded
_FILES = set(os.environ.get("KVHOST_MUTATION_FILES", "").split(os.pathsep)) - {""}
_lines: set[tuple[str, int]] = set()
_per_test: dict[str, dict[str, Any]] = {}


def _trace_lines(frame: Any, event: str, arg: Any) -> Any:
    if event == "line":
        _lines.add((frame.f_code.co_filename, frame.f_lineno))
    return _trace_lines


def _trace_calls(frame: Any, event: str, arg: Any) -> Any:
    if frame.f_code.co_filename in _FILES:
        _lines.add((frame.f_code.co_filename, frame.f_lineno))
        return _trace_lines
    return None


def _clear_caches() -> None:
    """Empty every cache of the mutated modules: each test then runs the code it needs."""
    for module in list(sys.modules.values()):
        path = getattr(module, "__file__", None)
        if not path or path not in _FILES:
            continue
        for value in list(vars(module).values()):
            if callable(getattr(value, "cache_clear", None)):
                value.cache_clear()
            elif type(value).__name__ == "LRU" and callable(getattr(value, "clear", None)):
                value.clear()


IMPORT = "<import>"  # the lines run before the first test: imports, module bodies, collection
_CHILDREN = _COVERAGE + ".children" if _COVERAGE else None  # lines the processes a test starts ran
_children_read: dict[str, int] = {}  # bytes of each child's file already counted
if _COVERAGE:
    sys.settrace(_trace_calls)
    assert _CHILDREN is not None
    shutil.rmtree(_CHILDREN, ignore_errors=True)  # a run before this one's
    os.makedirs(_CHILDREN)
    os.environ["KVHOST_MUTATION_CHILD_LINES"] = _CHILDREN
    _here = os.path.join(os.path.dirname(os.path.abspath(__file__)), "mutation_child")  # its sitecustomize
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (_here, os.environ.get("PYTHONPATH")) if p)


def _read_children() -> None:
    """Add what the processes started since the last look have run (each file read on
    from where it was left: a child may still be writing)."""
    assert _CHILDREN is not None
    for name in sorted(os.listdir(_CHILDREN)):
        path = os.path.join(_CHILDREN, name)
        with open(path, "rb") as f:
            f.seek(_children_read.get(path, 0))
            text = f.read()
        complete = text[: text.rfind(b"\n") + 1]  # a line still being written is read next time
        _children_read[path] = _children_read.get(path, 0) + len(complete)
        for entry in complete.decode().splitlines():
            line, filename = entry.split(" ", 1)
            _lines.add((filename, int(line)))


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Generator[None, None, None]:
    if not _COVERAGE:
        yield
        return
    if IMPORT not in _per_test:
        sys.settrace(None)
        _per_test[IMPORT] = {"seconds": 0.0, "lines": _by_path()}
    _clear_caches()
    _lines.clear()
    start = time.perf_counter()
    threading.settrace(_trace_calls)
    sys.settrace(_trace_calls)
    try:
        yield
    finally:
        sys.settrace(None)
        threading.settrace(None)  # type: ignore[arg-type]
    _read_children()
    _per_test[item.nodeid] = {"seconds": time.perf_counter() - start, "lines": _by_path()}


def _by_path() -> dict[str, list[int]]:
    lines: dict[str, list[int]] = {}
    for path, line in _lines:
        lines.setdefault(path, []).append(line)
    return {path: sorted(found) for path, found in lines.items()}


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    if _COVERAGE:
        with open(_COVERAGE, "w") as f:
            json.dump(_per_test, f)


# --- server --------------------------------------------------------------------------


def serve() -> None:
    import hypothesis  # noqa: F401
    import numba  # noqa: F401
    import numpy  # noqa: F401
    import torch  # noqa: F401

    if importlib.util.find_spec("vllm") is not None:
        import vllm  # noqa: F401  (5 s a run otherwise; it imports no kvhost)
    if importlib.util.find_spec("torch_xla") is not None:
        # Imported before any test builds an XLA tensor (torch learns the device from this
        # import, as ci/tpu.sh's `-p torch_xla` does); no device is made here, so each fork
        # starts its own runtime. An XLA device on the CPU unless told otherwise.
        os.environ.setdefault("PJRT_DEVICE", "CPU")
        import torch_xla  # noqa: F401

    for line in sys.stdin:
        request = json.loads(line)
        pid = os.fork()
        if pid == 0:
            _child(request)
        print(json.dumps({"pid": pid}), flush=True)
        _, status = os.waitpid(pid, 0)
        print(json.dumps({"rc": os.waitstatus_to_exitcode(status)}), flush=True)


def _child(request: dict[str, Any]) -> None:
    code = 3
    try:
        os.setsid()  # its own process group: a timeout kills it and whatever it started
        log = os.open(request["log"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        os.dup2(log, 1)
        os.dup2(log, 2)
        os.environ.update(request["env"])
        from numba.core import config

        config.reload_config()  # NUMBA_CACHE_DIR, read when numba was imported
        code = int(pytest.main(request["args"]))
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


if __name__ == "__main__":
    serve()
