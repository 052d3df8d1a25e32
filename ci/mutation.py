"""Mutation testing of kvhost's core: does the suite notice when the code is wrong?

Each mutant is one small change to one core module (a comparison flipped, an operator
swapped, a constant off by one, a check deleted, ...), made in a copy of the tree. The
module's test selection (MODULES below) runs against the copy; a mutant is *killed* when a
test fails (or the run times out), *survives* when every test passes, and is *invalid*
when numba refuses to compile it (nothing was tested). Mutants that cannot change
behaviour are listed, each with its reason, in ``ci/mutation-equivalent.txt`` and left out
of the rate. Results go to ``.mutation/`` (``report.md``, ``results.jsonl``).

    .venv/bin/python ci/mutation.py                 # every mutant of every module (make mutation)
    .venv/bin/python ci/mutation.py --list          # the mutants, and how many per module
    .venv/bin/python ci/mutation.py --module kvhost/memory.py --survivors   # re-test last survivors

The mutants are the same on every run: every operator at every place it applies, in
source order (``--sample N --seed S`` takes a seeded sample instead). Two workers each own
a copy of the tree, a numba cache and a slot; the worktree itself is never written.

What is not mutated: docstrings, f-strings (messages), decorators (compilation and
caching settings), annotations and ``assert`` statements (for mypy), and, in
``kvhost/nixl/tables.py``, anything outside its planning code (see ``only``).
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import copy
import hashlib
import importlib.util
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from dataclasses import asdict, dataclass
from functools import cache
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
EQUIVALENT_FILE = ROOT / "ci" / "mutation-equivalent.txt"

# --- what is mutated, and which tests judge it ---------------------------------------
# One row per module: its path, the tests that exercise it (fast and sharp first: a run
# stops at the first failure), where only part of a module is core, the functions and
# classes that are (by qualified name; a class includes its methods), and the package its
# tests need that kvhost's own environment lacks (they would all skip there, and every
# mutant survive): such a module is mutated only by an interpreter that has it; as a
# pytest ``-k`` expression, which of its test files' tests are its (a device's backend:
# the conformance files' tests of its target, not the CPU targets', which never run it);
# and the environment variables its tests need.

CONFORMANCE = ["tests/test_receive.py", "tests/test_copy.py", "tests/test_property.py"]
CHECKS = ["tests/test_errors.py", "tests/test_bad_input.py", "tests/test_ownership.py"]
BACKENDS = [*CONFORMANCE, "tests/test_plans.py", "tests/test_backends.py", "tests/test_threads.py"]
NIXL = ["tests/test_nixl_agent.py", "tests/test_nixl.py", "tests/test_ranks.py"]
PROTOCOL = ["tests/test_nixl_protocol.py", "tests/test_peer_limits.py", "tests/test_peers.py"]
ACCELERATOR = [
    "tests/test_cuda_launch.py",
    "tests/test_triton_kernels.py",
    "tests/test_cuda_backend.py",
    "tests/test_triton_compile.py",
]
XLA = [  # the other files with tests of the xla target (and of the triton-interpret one)
    "tests/test_partial_blocks.py",
    "tests/test_large_pieces.py",
    "tests/test_front_end.py",
    "tests/test_backends.py",
    "tests/test_threads.py",
    "tests/test_plans.py",
    "tests/test_registry.py",
]


@dataclass(frozen=True)
class Module:
    path: str
    tests: tuple[str, ...]
    only: tuple[str, ...] = ()
    needs: str | None = None
    keyword: str | None = None
    env: tuple[tuple[str, str], ...] = ()  # set for its tests (before they import anything)
    # Test files run whole, without ``env``, for a mutant the selection lets through: where
    # Triton compiles instead of interpreting, the kernels are read as the compiler builds
    # them (the barriers that order threads, which the interpreter runs one at a time) and
    # the backend takes the path it takes with compiled kernels.
    compiled_tests: tuple[str, ...] = ()

    @property
    def selection(self) -> tuple[str | None, tuple[tuple[str, str], ...]]:
        """What picks and sets up its tests: modules that share it share one coverage record."""
        return self.keyword, self.env

    def runs_here(self) -> bool:
        return self.needs is None or importlib.util.find_spec(self.needs) is not None


MODULES = [
    Module("kvhost/layout.py", ("tests/test_layout.py", "tests/test_layout_rules.py", *CHECKS, *CONFORMANCE)),
    Module("kvhost/memory.py", ("tests/test_layout_rules.py", *CHECKS, "tests/test_cache_sets.py")),
    Module("kvhost/transform.py", ("tests/test_layout.py", "tests/test_plans.py", *CONFORMANCE, *CHECKS)),
    Module(
        "kvhost/caches.py",
        (*CHECKS, "tests/test_cache_sets.py", "tests/test_front_end.py", "tests/test_layout_rules.py", *CONFORMANCE),
    ),
    Module("kvhost/ids.py", ("tests/test_ids.py", "tests/test_errors.py", "tests/test_bad_input.py", *CONFORMANCE)),
    Module("kvhost/batch.py", ("tests/test_front_end.py", "tests/test_partial_blocks.py", *CHECKS, *CONFORMANCE)),
    Module(
        "kvhost/api.py",
        (
            "tests/test_front_end.py",
            "tests/test_cache_sets.py",
            "tests/test_partial_blocks.py",
            "tests/test_threads.py",
            "tests/test_registry.py",  # a plugin's copy that returns no Completion
            *CHECKS,
            *CONFORMANCE,
        ),
    ),
    Module("backends/kvhost_torch/backend.py", (*BACKENDS, "tests/test_torch_backend.py")),
    Module("kvhost/lru.py", ("tests/test_ownership.py", "tests/test_cache_sets.py", "tests/test_threads.py")),
    Module("kvhost/registry.py", ("tests/test_registry.py", "tests/test_plugin_contract.py", "tests/test_backends.py")),
    Module(
        "kvhost/backend.py",
        (*BACKENDS, "tests/test_partial_blocks.py", "tests/test_registry.py", "tests/test_cuda_backend.py"),
    ),
    Module("backends/kvhost_cpu/backend.py", tuple(BACKENDS)),
    Module("backends/kvhost_cpu/kernels.py", tuple(BACKENDS)),
    # Where numba caches the kernels when it finds no place (a read-only install).
    Module("backends/kvhost_cpu/cache_dir.py", ("tests/test_cpu_cache_dir.py",)),
    # How the commands stop: once, a prefill drained first (the commands run as processes).
    Module("kvhost_tools/demo/stopping.py", ("tests/test_peer_limits.py",)),
    Module("kvhost/nixl/plans.py", ("tests/test_nixl.py",)),
    Module("kvhost/nixl/ranks.py", ("tests/test_ranks.py", "tests/test_nixl.py")),
    # What a peer sends is read here first: frames and their fields, every size bounded.
    Module("kvhost/nixl/framing.py", tuple(PROTOCOL)),
    Module("kvhost/nixl/fields.py", tuple(PROTOCOL)),
    # Who a peer is (secrets, proofs, offers) and what its hello may hold: the handshake.
    Module("kvhost/nixl/handshake.py", tuple(PROTOCOL)),
    Module("kvhost/nixl/peers.py", tuple(PROTOCOL)),
    # The prefill side's loop (every wait bounded) and what two engines must agree on.
    Module("kvhost/nixl/server.py", tuple(PROTOCOL)),
    Module("kvhost/nixl/engine.py", tuple(PROTOCOL)),
    # NIXL itself: registration, peers, descriptor lists, transfers and their deadlines.
    Module("kvhost/nixl/agent.py", (*NIXL, *PROTOCOL, "tests/test_hugepages.py")),  # register asks for huge pages
    Module("kvhost/nixl/ucx.py", ("tests/test_nixl_agent.py",)),
    # Huge pages under registered host memory: what the kernel did, read back from smaps.
    Module("kvhost/nixl/hugepages.py", ("tests/test_hugepages.py",)),
    # vLLM's words for caches and layouts, turned into kvhost's (no vLLM needed).
    Module("kvhost/integrations/vllm.py", ("tests/test_vllm_adapter.py",)),
    # The connector itself, inside vLLM's own worker: run by ci/vllm.sh's interpreter, with
    # VLLM_TARGET_DEVICE=cpu (ci/README.md, vllm.sh).
    Module("kvhost/integrations/vllm_connector.py", ("tests/test_vllm_connector.py",), needs="vllm"),
    Module("kvhost/raw.py", ("tests/test_backends.py", "tests/test_nixl.py", *CONFORMANCE)),
    Module("kvhost/stats.py", ("tests/test_front_end.py", "tests/test_nixl.py", *CONFORMANCE)),
    # The TPU backend: its bucket sizes anywhere; the rest on a real XLA device (torch_xla on
    # the CPU: ci/tpu.sh's interpreter, ci/README.md), judged by the xla target's tests.
    Module("backends/kvhost_tpu/buckets.py", ("tests/test_tpu_buckets.py",)),
    Module(
        "backends/kvhost_tpu/backend.py",
        ("tests/test_tpu.py", "tests/test_tpu_buckets.py", *CONFORMANCE, *CHECKS, *XLA),
        needs="torch_xla",
        keyword="xla or tpu",
    ),
    Module(
        "backends/kvhost_tpu/xla.py",
        ("tests/test_tpu.py", "tests/test_tpu_buckets.py", *CONFORMANCE, *XLA),
        needs="torch_xla",
        keyword="xla or tpu",
    ),
    *(
        # The CUDA/XPU backends' shared code, on CPU tensors: the kernels run by Triton's
        # interpreter (the triton-interpret target), as ci/cpu.sh runs them; the kernels
        # also compiled for real GPUs, as make test compiles them.
        Module(
            path,
            (*ACCELERATOR, *CONFORMANCE, *CHECKS, *XLA),
            keyword="triton or cuda",
            env=(("TRITON_INTERPRET", "1"),),
            compiled_tests=compiled_tests,
        )
        for path, compiled_tests in (
            ("backends/kvhost_accelerator/launch.py", ()),
            ("backends/kvhost_accelerator/backend.py", ("tests/test_cuda_backend.py",)),
            ("backends/kvhost_accelerator/kernels.py", ("tests/test_triton_compile.py",)),
            ("backends/kvhost_accelerator/runtime.py", ()),
        )
    ),
    # The ahead-of-time compiles: judged where Triton compiles (no interpreter), as make test runs them.
    Module("backends/kvhost_accelerator/aot.py", ("tests/test_triton_compile.py",)),
    Module(
        "kvhost/nixl/tables.py",
        ("tests/test_nixl.py",),
        only=("Stream", "RegionTable", "region_table", "_canonical"),
    ),
]
NOT_MUTATED = {"kvhost/nixl/tables.py": ("RegionTable.to_dict", "RegionTable.from_dict")}  # the wire protocol's parsing
# Modules whose numba kernels are compiled from the mutated source: a fresh cache per mutant.
COMPILED = {"backends/kvhost_cpu/kernels.py"}

# --- mutants -------------------------------------------------------------------------

COMPARE_SWAP: dict[type, list[type]] = {
    ast.Lt: [ast.LtE],
    ast.LtE: [ast.Lt],
    ast.Gt: [ast.GtE],
    ast.GtE: [ast.Gt],
    ast.Eq: [ast.NotEq],
    ast.NotEq: [ast.Eq],
    ast.Is: [ast.IsNot],
    ast.IsNot: [ast.Is],
    ast.In: [ast.NotIn],
    ast.NotIn: [ast.In],
}
BINOP_SWAP: dict[type, list[type]] = {
    ast.Add: [ast.Sub],
    ast.Sub: [ast.Add],
    ast.Mult: [ast.FloorDiv],
    ast.FloorDiv: [ast.Mult],
    ast.Div: [ast.Mult],
    ast.Mod: [ast.FloorDiv],
    ast.LShift: [ast.RShift],
    ast.RShift: [ast.LShift],
    ast.BitAnd: [ast.BitOr],
    ast.BitOr: [ast.BitAnd],
}
COMPILERS = {"njit", "jit", "intrinsic", "generated_jit", "overload"}  # code numba compiles: not traced
CALL_SWAP = {"min": "max", "max": "min", "minimum": "maximum", "maximum": "minimum"}
OPERATORS = {
    "compare": "comparison flipped: < <=, > >=, == !=, is / is not, in / not in",
    "arith": "arithmetic swapped: + -, * //, / *, % //, << >>, & |  (and their augmented forms)",
    "const": "integer constant + 1 and - 1",
    "bool": "and <-> or",
    "not": "not removed",
    "true-false": "True <-> False",
    "minmax": "min <-> max (builtins, numpy)",
    "return": "returned value replaced by None",
    "if": "if / elif / conditional-expression test replaced by True, and by False",
    "delete": "statement deleted: raise, a call made for its effect, continue/break, "
    "an assignment to an attribute or an item",
    "slice": "slice bound removed (lower, upper)",
}


@dataclass
class Mutant:
    module: str
    line: int
    qualname: str
    op: str
    before: str
    after: str
    start: int  # byte offsets in the module's source
    end: int
    replacement: str
    end_line: int = 0
    when: str = "call"  # when the code runs: "call", "import" (module and class bodies), "compiled" (numba)
    key: str = ""

    def label(self) -> str:
        return f"{self.module}::{self.qualname} [{self.op}] {self.before} => {self.after}"

    def apply(self, source: bytes) -> bytes:
        return source[: self.start] + self.replacement.encode() + source[self.end :]


def _short(node: ast.AST) -> str:
    text = " ".join(ast.unparse(node).split())
    return text if len(text) <= 90 else text[:87] + "..."


class _Collector(ast.NodeVisitor):
    """Every mutation of one module, in source order."""

    def __init__(self, module: str, offsets: list[int], only: tuple[str, ...], skip: tuple[str, ...]) -> None:
        self.module, self.offsets, self.only, self.skip = module, offsets, only, skip
        self.scope: list[str] = []
        self.when = "import"
        self.found: list[Mutant] = []

    # where we are
    def _qualname(self) -> str:
        return ".".join(self.scope) or "<module>"

    def _in_scope(self) -> bool:
        name = self._qualname()

        def under(prefixes: tuple[str, ...]) -> bool:
            return any(name == p or name.startswith(p + ".") for p in prefixes)

        return (not self.only or under(self.only)) and not under(self.skip)

    def _span(self, node: ast.AST) -> tuple[int, int]:
        start = self.offsets[node.lineno - 1] + node.col_offset  # type: ignore[attr-defined]
        end = self.offsets[node.end_lineno - 1] + node.end_col_offset  # type: ignore[attr-defined]
        return start, end

    def _add(
        self,
        node: ast.AST,
        op: str,
        after: ast.AST | str,
        *,
        before: ast.AST | None = None,
        shown: ast.AST | None = None,
        wrap: bool = True,
    ) -> None:
        """Replace ``node`` by ``after``; the label reads ``before => shown`` (default: node => after)."""
        if not self._in_scope():
            return
        start, end = self._span(node)
        if isinstance(after, str):
            text = label = after
        else:
            text = ast.unparse(after)
            label = _short(shown or after)
            if wrap:
                text = f"({text})"
        line, end_line = node.lineno, node.end_lineno  # type: ignore[attr-defined]
        name = self._qualname()
        shown_before = _short(before or node)
        self.found.append(
            Mutant(self.module, line, name, op, shown_before, label, start, end, text, end_line, self.when)
        )

    # scopes and what is never mutated
    def _scoped(self, node: ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef) -> None:
        outer_when = self.when
        if not isinstance(node, ast.ClassDef):
            for default in [*node.args.defaults, *node.args.kw_defaults]:
                if default is not None:
                    self.visit(default)  # evaluated where the function is defined
            # Triton's kernels run as Python under TRITON_INTERPRET=1, where coverage sees their lines.
            compiled = self.module in COMPILED and any(_decorator_name(d) in COMPILERS for d in node.decorator_list)
            self.when = "compiled" if compiled or outer_when == "compiled" else "call"
        self.scope.append(node.name)
        body = node.body
        if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
            body = body[1:]  # the docstring
        for statement in body:
            self.visit(statement)
        self.scope.pop()
        self.when = outer_when

    visit_FunctionDef = visit_AsyncFunctionDef = visit_ClassDef = _scoped

    def visit_Module(self, node: ast.Module) -> None:
        for statement in node.body:
            if isinstance(statement, (ast.Import, ast.ImportFrom)):
                continue
            if isinstance(statement, ast.Expr) and isinstance(statement.value, ast.Constant):
                continue  # the docstring
            self.visit(statement)

    def visit_JoinedStr(self, node: ast.JoinedStr) -> None:
        pass  # messages

    def visit_Assert(self, node: ast.Assert) -> None:
        pass

    def visit_AnnAssign(self, node: ast.AnnAssign) -> None:
        if node.value is not None:  # the annotation is for mypy: never evaluated here
            self.visit(node.value)

    # expressions
    def visit_Compare(self, node: ast.Compare) -> None:
        for i, op in enumerate(node.ops):
            for new in COMPARE_SWAP.get(type(op), []):
                mutated = copy.deepcopy(node)
                mutated.ops[i] = new()
                self._add(node, "compare", mutated)
        self.generic_visit(node)

    def visit_BinOp(self, node: ast.BinOp) -> None:
        for new in BINOP_SWAP.get(type(node.op), []):
            if isinstance(node.op, ast.Add) and _is_text(node):
                continue  # joining strings: - would be a TypeError on every run, not a test of anything
            mutated = copy.deepcopy(node)
            mutated.op = new()
            self._add(node, "arith", mutated)
        self.generic_visit(node)

    def visit_AugAssign(self, node: ast.AugAssign) -> None:
        for new in BINOP_SWAP.get(type(node.op), []):
            mutated = copy.deepcopy(node)
            mutated.op = new()
            self._add(node, "arith", mutated, wrap=False)
        self.generic_visit(node)

    def visit_BoolOp(self, node: ast.BoolOp) -> None:
        mutated = copy.deepcopy(node)
        mutated.op = ast.Or() if isinstance(node.op, ast.And) else ast.And()
        self._add(node, "bool", mutated)
        self.generic_visit(node)

    def visit_UnaryOp(self, node: ast.UnaryOp) -> None:
        if isinstance(node.op, ast.Not):
            self._add(node, "not", node.operand)
        self.generic_visit(node)

    def visit_Constant(self, node: ast.Constant) -> None:
        value = node.value
        # Shown in the expression around it (``count - 1 => count - 2``), so that labels say where.
        around = getattr(node, "parent", None)
        around = around if isinstance(around, ast.expr) else None
        if isinstance(value, bool):
            new_values: list[object] = [not value]
            op = "true-false"
        elif isinstance(value, int):
            new_values = [value + 1, value - 1]
            op = "const"
        else:
            return
        for new in new_values:
            constant = ast.Constant(new)
            shown = copy.deepcopy(around, {id(node): constant}) if around is not None else None
            self._add(node, op, constant, before=around, shown=shown, wrap=op == "const")

    def visit_Call(self, node: ast.Call) -> None:
        func = node.func
        name = func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else None
        is_numpy = isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name) and func.value.id == "np"
        if name in CALL_SWAP and (isinstance(func, ast.Name) or is_numpy) and (name in ("min", "max")) != is_numpy:
            mutated = copy.deepcopy(node)
            if isinstance(mutated.func, ast.Name):
                mutated.func.id = CALL_SWAP[name]
            else:
                mutated.func.attr = CALL_SWAP[name]  # type: ignore[union-attr]
            self._add(node, "minmax", mutated)
        self.generic_visit(node)

    def visit_IfExp(self, node: ast.IfExp) -> None:
        for value in (True, False):
            self._add(node.test, "if", ast.Constant(value), wrap=False)
        self.generic_visit(node)

    def visit_Subscript(self, node: ast.Subscript) -> None:
        if isinstance(node.slice, ast.Slice):
            for bound in ("lower", "upper"):
                if getattr(node.slice, bound) is not None:
                    mutated = copy.deepcopy(node)
                    setattr(mutated.slice, bound, None)
                    self._add(node, "slice", mutated)
        self.generic_visit(node)

    # statements
    def visit_Return(self, node: ast.Return) -> None:
        if node.value is not None and not (isinstance(node.value, ast.Constant) and node.value.value is None):
            self._add(node, "return", "return None")
        self.generic_visit(node)

    def visit_If(self, node: ast.If) -> None:
        only_raises = len(node.body) == 1 and isinstance(node.body[0], ast.Raise)
        self._add(node.test, "if", ast.Constant(True), wrap=False)
        if not only_raises:  # else: the same as deleting the raise
            self._add(node.test, "if", ast.Constant(False), wrap=False)
        self.generic_visit(node)

    def visit_Raise(self, node: ast.Raise) -> None:
        self._add(node, "delete", "pass", before=ast.Raise(exc=_exception_type(node.exc)))
        self.generic_visit(node)

    def visit_Expr(self, node: ast.Expr) -> None:
        if isinstance(node.value, ast.Call):
            self._add(node, "delete", "pass")
        self.generic_visit(node)

    def visit_Continue(self, node: ast.Continue) -> None:
        self._add(node, "delete", "pass")

    visit_Break = visit_Continue

    def visit_Assign(self, node: ast.Assign) -> None:
        if all(isinstance(t, (ast.Attribute, ast.Subscript)) for t in node.targets):
            self._add(node, "delete", "pass")
        self.generic_visit(node)


def _is_text(node: ast.BinOp) -> bool:
    return any(
        isinstance(side, (ast.JoinedStr, ast.Constant)) and isinstance(getattr(side, "value", ""), str)
        for side in (node.left, node.right)
    )


def _decorator_name(decorator: ast.expr) -> str:
    target = decorator.func if isinstance(decorator, ast.Call) else decorator
    return target.attr if isinstance(target, ast.Attribute) else target.id if isinstance(target, ast.Name) else ""


def _exception_type(exc: ast.expr | None) -> ast.expr | None:
    """``raise LayoutError(...)`` shown as ``raise LayoutError``: the message is not the mutant."""
    return exc.func if isinstance(exc, ast.Call) else exc


def module_mutants(module: Module) -> list[Mutant]:
    source = (ROOT / module.path).read_bytes()
    tree = ast.parse(source)
    for parent in ast.walk(tree):
        for child in ast.iter_child_nodes(parent):
            child.parent = parent  # type: ignore[attr-defined]
    offsets = [0]
    for line in source.splitlines(keepends=True):
        offsets.append(offsets[-1] + len(line))
    collector = _Collector(module.path, offsets, module.only, NOT_MUTATED.get(module.path, ()))
    collector.visit(tree)
    original = ast.dump(tree)
    mutants, seen = [], set()
    for mutant in collector.found:
        mutated = ast.dump(ast.parse(mutant.apply(source)))
        if mutated == original or mutated in seen:
            continue  # a no-op or a duplicate (e.g. `if False` over a lone raise)
        seen.add(mutated)
        mutants.append(mutant)
    counts: Counter[str] = Counter()
    for mutant in mutants:
        label = mutant.label()
        counts[label] += 1
        mutant.key = label if counts[label] == 1 else f"{label} #{counts[label]}"
    return mutants


def all_mutants(modules: list[Module]) -> list[Mutant]:
    return [m for module in modules for m in module_mutants(module)]


# --- equivalent mutants --------------------------------------------------------------


def read_equivalent(path: Path = EQUIVALENT_FILE) -> dict[str, str]:
    """``key`` line, then an indented ``why:`` line; ``#`` lines are comments."""
    entries: dict[str, str] = {}
    key = None
    for number, line in enumerate(path.read_text().splitlines(), 1) if path.exists() else []:
        if not line.strip() or line.startswith("#"):
            continue
        if line.startswith(" "):
            why = line.strip().removeprefix("why:").strip()
            if key is None or not why:
                raise SystemExit(f"{path}:{number}: a reason must follow a mutant")
            entries[key] = why
            key = None
        else:
            if key is not None:
                raise SystemExit(f"{path}:{number}: mutant {key!r} has no reason")
            key = line.strip()
    if key is not None:
        raise SystemExit(f"{path}: mutant {key!r} has no reason")
    return entries


# --- running -------------------------------------------------------------------------

SERVER = "ci/mutation_server.py"
NUMBA_ERRORS = re.compile(r"numba\.core\.errors\.(TypingError|LoweringError|UnsupportedError)|NumbaNotImplementedError")
# A mutant of a compiled kernel is reached by the tests that run the Python function every
# caller of that kernel runs (first rule whose text is in the kernel's name).
COMPILED_ENTRY = {
    "backends/kvhost_cpu/kernels.py": [
        ("rearrange", "receive_params"),
        ("copy_span", "copy_params"),
        ("copy_runs", "copy_params"),
        ("split_into_runs", "copy_params"),
        ("", "launcher"),
    ]
}
IMPORT = "<import>"  # coverage's entry for the lines run before any test (ci/mutation_server.py)
COMPILE_SECONDS = 240  # allowance for numba to compile a mutated kernel module from scratch
COMPILED_TESTS_SECONDS = 300  # a module's compiled_tests, whole: Triton compiling every case from scratch
START_SECONDS = 30  # a fork, the imports of kvhost and the test files, collection


@dataclass
class Result:
    key: str
    module: str
    line: int
    op: str
    status: str  # killed, timeout, survived, invalid (numba cannot compile it)
    seconds: float
    tests: int  # tests selected
    detail: str = ""


class Worker:
    """A copy of the tree, its numba cache, and a fork server that runs tests on the copy."""

    def __init__(self, index: int, home: Path, files: list[str]) -> None:
        self.index, self.home = index, home
        self.tree = home / "tree"
        self.numba = home / "numba"
        self.log = home / "pytest.log"
        self.files = files  # the mutated modules, relative to the tree
        self.server: subprocess.Popen[str] | None = None

    def prepare(self) -> None:
        """A fresh copy of the tree, file times kept: numba's cache of unchanged kernels holds."""
        if self.tree.exists():
            shutil.rmtree(self.tree)
        skip = (".git", ".venv*", ".mutation", "__pycache__", "*.egg-info", ".*_cache", ".hypothesis", "build")
        shutil.copytree(ROOT, self.tree, ignore=shutil.ignore_patterns(*skip, "dist", "bench-results"))
        self.numba.mkdir(parents=True, exist_ok=True)
        env = dict(os.environ)
        env.update(
            PYTHONPATH=os.pathsep.join([str(self.tree), str(self.tree / "backends")]),
            PYTHONDONTWRITEBYTECODE="1",  # a mutant of the same size in the same second must not load a stale .pyc
            NUMBA_NUM_THREADS="2",
            OMP_NUM_THREADS="1",
            KVHOST_MUTATION_TREE=str(self.tree),
            KVHOST_MUTATION_FILES=os.pathsep.join(str(self.tree / f) for f in self.files),
        )
        env.pop("KVHOST_BACKEND", None)
        self.server = subprocess.Popen(
            [sys.executable, str(self.tree / SERVER)],
            cwd=self.tree,
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            bufsize=1,
        )

    def stop(self) -> None:
        if self.server is not None:
            assert self.server.stdin is not None
            self.server.stdin.close()
            self.server.wait()
            self.server = None

    def run(
        self, args: list[str], timeout: float, env: dict[str, str] | None = None, *, may_select_none: bool = False
    ) -> tuple[str, float, str]:
        """(passed | failed | timeout, seconds, output) of one pytest run on the copy.

        ``may_select_none``: a ``-k`` selection may leave none of these files' tests."""
        assert self.server is not None and self.server.stdin is not None and self.server.stdout is not None
        base = ["-q", "-p", "no:cacheprovider", "-p", "mutation_server", "--no-header"]
        request = {
            "args": base + args,
            "log": str(self.log),
            "env": {"NUMBA_CACHE_DIR": str(self.numba), **(env or {})},
        }
        start = time.monotonic()
        self.server.stdin.write(json.dumps(request) + "\n")
        pid = json.loads(self.server.stdout.readline())["pid"]
        expired = threading.Event()

        def kill() -> None:
            expired.set()
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pid, signal.SIGKILL)

        timer = threading.Timer(timeout, kill)
        timer.start()
        reply = self.server.stdout.readline()
        timer.cancel()
        seconds = time.monotonic() - start
        if not reply:
            raise SystemExit(f"worker {self.index}'s server died; see {self.log}")
        code = json.loads(reply)["rc"]
        output = self.log.read_text(errors="replace")
        if expired.is_set():
            return "timeout", seconds, output
        if code == 0:
            return "passed", seconds, output
        if code == 5:  # no tests ran: the selection named none, a fault of this script unless -k did
            if may_select_none:
                return "passed", seconds, output
            raise SystemExit(f"worker {self.index}: pytest ran no tests:\n{output[-3000:]}")
        return "failed", seconds, output


def _sources_hash(files: list[str]) -> str:
    """What coverage depends on: the code and the tests."""
    digest = hashlib.sha1()
    paths = sorted(
        {
            *files,
            *(
                str(p.relative_to(ROOT))
                for d in ("kvhost", "backends", "tests", "ci")
                for p in (ROOT / d).rglob("*.py")
            ),
        }
    )
    for path in paths:
        digest.update(path.encode() + b"\0" + (ROOT / path).read_bytes())
    return digest.hexdigest()[:16]


Coverage = dict[str, dict[str, Any]]  # test id -> {"seconds": s, "lines": {module: [line, ...]}}


def record_coverage(workers: list[Worker], modules: list[Module], out: Path) -> Coverage:
    """Every test of these modules' selections (which share one ``selection``) run once on the
    unmutated copies, tracing the lines of the mutated modules it runs; kept while code and
    tests are unchanged, and added to when a later run selects test files not yet recorded."""
    ((keyword, env),) = {m.selection for m in modules}
    interpreter = hashlib.sha1(sys.executable.encode()).hexdigest()[:8]  # another may skip other tests
    selection = f"-{hashlib.sha1(repr((keyword, env)).encode()).hexdigest()[:8]}" if keyword or env else ""
    saved = out / f"coverage-{_sources_hash([m.path for m in MODULES])}-{interpreter}{selection}.json"
    coverage: Coverage = json.loads(saved.read_text()) if saved.exists() else {}
    recorded = {nodeid.split("::")[0] for nodeid in coverage}
    test_files = [
        t for t in dict.fromkeys(t for m in modules for t in m.tests) if (ROOT / t).exists() and t not in recorded
    ]
    if not test_files:
        return coverage
    print(f"recording which tests run which lines: {len(test_files)} test files, unmutated", flush=True)
    shares: list[list[str]] = [[] for _ in workers]
    for i, test_file in enumerate(sorted(test_files, key=lambda f: -(ROOT / f).stat().st_size)):
        shares[i % len(workers)].append(test_file)
    parts: list[Coverage] = [{} for _ in workers]

    def work(worker: Worker, share: list[str], part: Coverage) -> None:
        if not share:
            return
        target = worker.home / "coverage.json"
        selected = ["-k", keyword] if keyword else []
        status, seconds, output = worker.run(
            [*selected, *share],
            7200,
            {**dict(env), "KVHOST_MUTATION_COVERAGE": str(target)},
            may_select_none=bool(keyword),
        )
        if status != "passed":
            print(output[-5000:], file=sys.stderr)
            raise SystemExit(f"the unmutated tree fails {share} in worker {worker.index}")
        prefix = str(worker.tree) + os.sep
        for nodeid, entry in json.loads(target.read_text()).items():
            lines = {p.removeprefix(prefix): v for p, v in entry["lines"].items()}
            part[nodeid] = {"seconds": entry["seconds"], "lines": lines}
        print(f"  worker {worker.index}: {len(share)} files, {len(part)} tests, {seconds:.0f} s", flush=True)

    _in_parallel(work, list(zip(workers, shares, parts)))
    imported: dict[str, set[int]] = {
        path: set(lines) for path, lines in coverage.pop(IMPORT, {}).get("lines", {}).items()
    }
    for part in parts:
        for path, lines in part.pop(IMPORT, {}).get("lines", {}).items():
            imported.setdefault(path, set()).update(lines)
        coverage.update(part)
    coverage[IMPORT] = {"seconds": 0.0, "lines": {path: sorted(lines) for path, lines in imported.items()}}
    saved.write_text(json.dumps(coverage))
    return coverage


def _in_parallel(work: Any, jobs: list[tuple[Any, ...]]) -> None:
    errors: list[BaseException] = []

    def guarded(*args: Any) -> None:
        try:
            work(*args)
        except BaseException as err:  # reported once all threads are done
            errors.append(err)

    threads = [threading.Thread(target=guarded, args=job) for job in jobs]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]


def select_tests(mutant: Mutant, module: Module, coverage: Coverage, full: bool) -> list[str]:
    """The module's tests that run the mutated code, in the module's file order.

    Import-time code (module constants, class attributes, defaults, and whatever they
    call) runs before any test: every test of the module judges it. Compiled kernels are not traced: the tests that run
    the Python function every caller of the kernel runs judge them, with the tests that name the kernel's function.
    """
    order = {f: i for i, f in enumerate(module.tests)}
    candidates = [n for n in coverage if n.split("::")[0] in order]
    candidates.sort(key=lambda n: order[n.split("::")[0]])  # stable: collection order within a file
    lines = set(range(mutant.line, mutant.end_line + 1))
    run_at_import = lines.intersection(coverage.get(IMPORT, {}).get("lines", {}).get(mutant.module, ()))
    if full or mutant.when == "import" or run_at_import:
        return candidates
    if mutant.when == "compiled":
        function = _function_name(mutant.qualname)
        entry = next(e for text, e in COMPILED_ENTRY[mutant.module] if text in function)
        lines = set(_function_lines(mutant.module, entry))
        # Tests may also call a compiled function themselves (a kernel's helpers, checked
        # alone where a wrong answer moves the same bytes): coverage cannot see those calls.
        direct = {t for f in order for t in _tests_naming(f, function)}
        return [
            n
            for n in candidates
            if n.split("[")[0] in direct or lines.intersection(coverage[n]["lines"].get(mutant.module, ()))
        ]
    return [n for n in candidates if lines.intersection(coverage[n]["lines"].get(mutant.module, ()))]


@cache
def _tests_naming(test_file: str, name: str) -> frozenset[str]:
    """Ids (without parameters) of the tests in ``test_file`` whose body, or a function of the
    file that the body calls, names ``name`` (as ``kernels.name`` or a bare name)."""
    tree = ast.parse((ROOT / test_file).read_bytes())
    functions = {n.name: n for n in tree.body if isinstance(n, ast.FunctionDef)}

    def names(node: ast.AST) -> set[str]:
        found = set()
        for sub in ast.walk(node):
            if isinstance(sub, ast.Name):
                found.add(sub.id)
            elif isinstance(sub, ast.Attribute):
                found.add(sub.attr)
        return found

    tests = set()
    for test, node in functions.items():
        if not test.startswith("test_"):
            continue
        seen = names(node)
        seen |= {n for helper in seen & functions.keys() - {test} for n in names(functions[helper])}
        if name in seen:
            tests.add(f"{test_file}::{test}")
    return frozenset(tests)


def _function_name(qualname: str) -> str:
    return qualname.split(".")[0]


@cache
def _function_lines(module: str, name: str) -> range:
    for node in ast.parse((ROOT / module).read_bytes()).body:
        if isinstance(node, ast.FunctionDef) and node.name == name:
            return range(node.lineno, node.end_lineno + 1)  # type: ignore[operator]
    raise SystemExit(f"COMPILED_ENTRY names {module}:{name}, which is not a function there")


def test_mutant(worker: Worker, mutant: Mutant, module: Module, tests: list[str], timeout: float) -> Result:
    """Write the mutant over the copy, run its tests (then the module's ``compiled_tests``
    if those pass), put the original back (with its file time)."""
    if not tests and not module.compiled_tests:
        return Result(mutant.key, mutant.module, mutant.line, mutant.op, "survived", 0.0, 0, "no test runs this code")
    path = worker.tree / mutant.module
    original = ROOT / mutant.module
    path.write_bytes(mutant.apply(original.read_bytes()))
    env = dict(module.env)
    fresh = worker.home / "numba-mutant"
    if mutant.module in COMPILED_ENTRY:
        shutil.rmtree(fresh, ignore_errors=True)
        env["NUMBA_CACHE_DIR"] = str(fresh)  # compiled from the mutated source, and thrown away
        env["NUMBA_BOUNDSCHECK"] = "1"  # as ci/memcheck.sh runs the kernels: an index past an array's end raises
    try:
        status, seconds, output = worker.run(["-x", *tests], timeout, env) if tests else ("passed", 0.0, "")
        if status == "passed" and module.compiled_tests:
            status, compiling, output = worker.run(["-x", *module.compiled_tests], COMPILED_TESTS_SECONDS)
            seconds += compiling
    finally:
        shutil.copy2(original, path)
        shutil.rmtree(fresh, ignore_errors=True)
    if status == "failed":
        status = "invalid" if NUMBA_ERRORS.search(output) else "killed"
    elif status == "passed":
        status = "survived"
    detail = _first_failure(output) if status in ("killed", "invalid") else ""
    return Result(mutant.key, mutant.module, mutant.line, mutant.op, status, round(seconds, 1), len(tests), detail)


def _first_failure(output: str) -> str:
    for line in output.splitlines():
        if line.startswith(("FAILED", "ERROR")):
            return line[:200]
    lines = output.strip().splitlines()
    return lines[-1][:200] if lines else ""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--module", action="append", help="only this module (path as in MODULES); repeatable")
    parser.add_argument("--list", action="store_true", help="list the mutants and their counts, run nothing")
    parser.add_argument("--jobs", type=int, default=2, help="workers in parallel (default 2)")
    parser.add_argument("--sample", type=int, help="test a seeded sample of this many mutants")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--survivors", action="store_true", help="only the mutants that survived the last run")
    parser.add_argument("--untested", action="store_true", help="only the mutants with no result yet")
    parser.add_argument(
        "--match", action="append", help="only mutants whose label contains this text (repeatable: any of them)"
    )
    parser.add_argument("--full", action="store_true", help="every test of the module for every mutant")
    parser.add_argument("--out", type=Path, default=ROOT / ".mutation", help="results and work trees")
    parser.add_argument("--timeout-factor", type=float, default=3.0, help="timeout: this times the tests' clean time")
    args = parser.parse_args(argv)

    modules = [m for m in MODULES if not args.module or m.path in args.module]
    if args.module and len(modules) != len(args.module):
        raise SystemExit(f"unknown module in {args.module}; known: {[m.path for m in MODULES]}")
    left_out = [m for m in modules if not m.runs_here()]
    if args.module and left_out:
        missing = [f"{m.path} needs {m.needs}" for m in left_out]
        raise SystemExit(f"cannot mutate here ({sys.executable}): {'; '.join(missing)}")
    for module in left_out:
        print(f"not mutated here: {module.path} (its tests need {module.needs}, which {sys.executable} lacks)")
    modules = [m for m in modules if m not in left_out]
    mutants = all_mutants(modules)
    equivalent = read_equivalent()
    if args.list:
        for mutant in mutants:
            mark = "  (equivalent)" if mutant.key in equivalent else ""
            print(f"{mutant.module}:{mutant.line}: {mutant.key}{mark}")
        _print_counts(modules, mutants)
        return 0
    known = {m.key for m in all_mutants(MODULES)}
    stale = [k for k in equivalent if k not in known]
    if stale:
        print(f"warning: {len(stale)} entries of {EQUIVALENT_FILE.name} name no mutant:", *stale, sep="\n  ")

    args.out.mkdir(parents=True, exist_ok=True)
    results_path = args.out / "results.jsonl"
    previous = _read_results(results_path)
    todo = [m for m in mutants if m.key not in equivalent]
    if args.survivors:
        todo = [m for m in todo if previous.get(m.key, {}).get("status") == "survived"]
    if args.untested:
        todo = [m for m in todo if m.key not in previous]
    if args.match:
        todo = [m for m in todo if any(text in m.key for text in args.match)]
    if args.sample is not None and args.sample < len(todo):
        todo = sorted(random.Random(args.seed).sample(todo, args.sample), key=mutants.index)
        print(f"testing a seeded sample of {len(todo)} mutants (seed {args.seed})")
    print(
        f"{len(mutants)} mutants in {len(modules)} modules ({sum(m.key in equivalent for m in mutants)} listed as "
        f"equivalent); testing {len(todo)}",
        flush=True,
    )
    started = time.monotonic()
    files = [m.path for m in MODULES if m.runs_here()]  # importable here: traced at import
    workers = [Worker(i, args.out / "work" / f"w{i}", files) for i in range(args.jobs)]
    try:
        for worker in workers:
            worker.prepare()
        by_selection: dict[tuple[str | None, tuple[tuple[str, str], ...]], list[Module]] = {}
        for module in modules:
            by_selection.setdefault(module.selection, []).append(module)
        coverages = {key: record_coverage(workers, group, args.out) for key, group in by_selection.items()}
        by_path = {m.path: m for m in MODULES}
        coverage_of = {m.path: coverages[m.selection] for m in modules}
        queue = [(m, select_tests(m, by_path[m.module], coverage_of[m.module], args.full)) for m in todo]
        lock = threading.Lock()
        done: list[Result] = []

        def work(worker: Worker) -> None:
            while True:
                with lock:
                    if not queue:
                        return
                    mutant, tests = queue.pop(0)
                clean = sum(coverage_of[mutant.module][n]["seconds"] for n in tests)
                timeout = args.timeout_factor * clean + START_SECONDS
                if mutant.module in COMPILED_ENTRY:
                    timeout += COMPILE_SECONDS
                result = test_mutant(worker, mutant, by_path[mutant.module], tests, timeout)
                with lock:
                    done.append(result)
                    previous[result.key] = asdict(result)
                    with results_path.open("a") as f:
                        f.write(json.dumps(asdict(result)) + "\n")
                    mark = {"survived": "SURVIVED"}.get(result.status, result.status)
                    where = f"{mutant.module}:{mutant.line}"
                    print(
                        f"[{len(done)}/{len(todo)}] {mark:8} {result.seconds:5.0f}s {len(tests):4d} tests  {where} "
                        f"{mutant.key.split('::', 1)[1]}",
                        flush=True,
                    )

        _in_parallel(work, [(w,) for w in workers])
    finally:
        for worker in workers:
            worker.stop()
    elapsed = time.monotonic() - started
    report = _report(modules, mutants, equivalent, previous, elapsed)
    (args.out / "report.md").write_text(report)
    print(report)
    return 0


def _read_results(path: Path) -> dict[str, dict[str, Any]]:
    results: dict[str, dict[str, Any]] = {}
    if path.exists():
        for line in path.read_text().splitlines():
            entry = json.loads(line)
            results[entry["key"]] = entry  # the latest run of each mutant
    return results


def _print_counts(modules: list[Module], mutants: list[Mutant]) -> None:
    per_module = Counter(m.module for m in mutants)
    per_op = Counter(m.op for m in mutants)
    print("\nmutants per module:")
    for module in modules:
        print(f"  {per_module[module.path]:5d}  {module.path}")
    print(f"  {len(mutants):5d}  in all\nper operator:")
    for op, count in per_op.most_common():
        print(f"  {count:5d}  {op}: {OPERATORS[op]}")


def _report(
    modules: list[Module],
    mutants: list[Mutant],
    equivalent: dict[str, str],
    results: dict[str, dict[str, Any]],
    elapsed: float,
) -> str:
    """The latest result of every mutant of these modules, by module."""
    lines = [
        "# Mutation testing report",
        "",
        "| module | mutants | equivalent | invalid | killed | survived | untested | kill rate |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    totals: Counter[str] = Counter()
    survivors: list[str] = []
    for module in modules:
        row: Counter[str] = Counter()
        for mutant in (m for m in mutants if m.module == module.path):
            row["mutants"] += 1
            if mutant.key in equivalent:
                row["equivalent"] += 1
                continue
            result = results.get(mutant.key, {})
            status = str(result.get("status", "untested"))
            row["killed" if status == "timeout" else status] += 1
            if status == "survived":
                why = f" ({result['detail']})" if result.get("detail") else ""
                survivors.append(f"- `{module.path}:{mutant.line}` {mutant.key.split('::', 1)[1]}{why}")
        totals.update(row)
        lines.append(_row(module.path, row))
    lines.append(_row("**all**", totals))
    lines += [
        "",
        "Kill rate: killed (timeouts included) / (killed + survived); equivalent mutants and those numba cannot "
        f"compile (invalid) are left out. This run took {elapsed / 60:.0f} min.",
        "",
        f"## Survivors ({len(survivors)})",
        "",
        *survivors,
        "",
    ]
    return "\n".join(lines)


def _row(name: str, row: Counter[str]) -> str:
    judged = row["killed"] + row["survived"]
    rate = f"{100 * row['killed'] / judged:.1f}%" if judged else "-"
    return (
        f"| {name} | {row['mutants']} | {row['equivalent']} | {row['invalid']} | {row['killed']} | "
        f"{row['survived']} | {row['untested']} | {rate} |"
    )


if __name__ == "__main__":
    sys.exit(main())
