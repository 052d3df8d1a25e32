#!/usr/bin/env bash
# One GPU check that cannot come back empty: made for a borrowed machine with a CUDA GPU, the
# repository, a Python with torch, no network, and one command of at most 10 minutes.
#
#   bash ci/gpu-check.sh                   # quick (default): 2.5 minutes on an H200
#   GPU_CHECK_FULL=1 bash ci/gpu-check.sh  # full sizes for the figures, then the suite
#   GPU_CHECK_STEPS=suite GPU_CHECK_K=grown bash ci/gpu-check.sh  # a rerun of some tests only
#
# Steps, each under its own time limit (and all under GPU_CHECK_SECONDS, default 540):
#   machine  (60 s)   device, multiprocessors, L2, versions, which optional packages are here
#   figures  (240 s)  python -m kvhost_tools.device_checks.gpucheck: receive against device memcpy, staging
#                     against a plain pinned copy_, each row with its launches and programs
#                     against the multiprocessors, kvhost beside the engines' per-request
#                     path, and whether each method's bytes equal the torch path's
#   handoff  (150 s)  python -m kvhost_tools.device_checks.handoff: the demo's batch read over NIXL from a
#                     sender process into device memory, per-piece, merged, and packed by
#                     the sender first (its blocks copied into one buffer) descriptors,
#                     then the receive, against a device copy; per-layer caches, then
#                     cross-layer ones; only where NIXL imports
#   suite    (rest)   pytest -m cuda over the conformance modules and the backend's device tests
# Everything lands in $OUT (or /tmp/kvhost-gpu-check) as it happens, at most 8 files:
# summary.txt (one line per step, then the answers), machine.txt, figures.txt,
# figures.jsonl (one JSON row per figure, written as measured), machine.json,
# host-profile.txt (where a one-request receive's host time goes), handoff.txt, suite.txt.
# A step that runs out of time is killed and the next one runs: a time-out still returns
# what was measured. Nothing is installed into the machine's Python: kvhost's sources go on
# PYTHONPATH and its backend entry points come from a generated dist-info; wheels carried
# in .whl/ (NIXL's, which the machine lacks: see docs/backends.md) go into a temporary folder on
# PYTHONPATH. What is missing is skipped, with the reason.
#
# GPU_CHECK_STEPS (default "figures handoff suite") names the steps after machine;
# GPU_CHECK_K, a pytest -k expression, picks the suite's tests (a short rerun on a lease
# nearly spent).
#
# Exit status: 0 when the device is there and each step asked for passed (the suite, and
# the figures taken with every method agreeing); 1 otherwise.
set -uo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
out=${OUT:-/tmp/kvhost-gpu-check}
budget=${GPU_CHECK_SECONDS:-540}
steps=" ${GPU_CHECK_STEPS:-figures handoff suite} "
mkdir -p "$out"
summary="$out/summary.txt"
: >"$summary"
export PYTHONUNBUFFERED=1 TRITON_DEFAULT_FP_FUSION=0
unset TRITON_INTERPRET # inherited, it would make every "triton" figure the torch path's
started=$SECONDS
status=0

note() { echo "gpu-check: $*" | tee -a "$summary"; }

# step NAME LIMIT COMMAND...: run under min(LIMIT, what the budget has left), output to $out/NAME.txt.
step() {
    local name=$1 limit=$2 left rc begun=$SECONDS
    shift 2
    left=$((budget - (SECONDS - started) - 15))
    ((limit > left)) && limit=$left
    if ((limit < 20)); then
        note "$name: skipped, ${left} s of the budget left"
        return 124
    fi
    timeout --kill-after=10 "$limit" "$@" 2>&1 | tee "$out/$name.txt"
    rc=${PIPESTATUS[0]}
    local how="exit $rc"
    ((rc == 124 || rc == 137)) && how="TIMED OUT (limit $limit s)"
    note "$name: $how after $((SECONDS - begun)) s"
    return "$rc"
}

finish() {
    note "done in $((SECONDS - started)) s, exit $status; files in $out"
    exit "$status"
}
trap finish EXIT

if ! command -v "$PYTHON" >/dev/null; then
    note "FAIL: no $PYTHON"
    status=1
    exit
fi

# kvhost without installing it: the sources on PYTHONPATH, entry points from pyproject.toml.
meta=$(mktemp -d)
if ! "$PYTHON" - "$meta" <<'PY'; then
import pathlib, re, sys

text = pathlib.Path("pyproject.toml").read_text()
version = re.search(r'^version = "([^"]+)"', text, re.M).group(1)
info = pathlib.Path(sys.argv[1]) / f"kvhost-{version}.dist-info"
info.mkdir()
(info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: kvhost\nVersion: {version}\n")
lines = []
for section in re.finditer(r'^\[project\.(entry-points\."([^"]+)"|scripts)\]\n((?:[^\[\n].*\n?)*)', text, re.M):
    group = section.group(2) or "console_scripts"
    lines.append(f"[{group}]")
    lines += [line.replace('"', "") for line in section.group(3).splitlines() if "=" in line]
(info / "entry_points.txt").write_text("\n".join(lines) + "\n")
PY
    note "FAIL: could not read pyproject.toml"
    status=1
    exit
fi
export PYTHONPATH="$PWD:$PWD/backends:$meta${PYTHONPATH:+:$PYTHONPATH}"
if compgen -G ".whl/*.whl" >/dev/null; then
    site=$(mktemp -d)
    if "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$site" .whl/*.whl; then
        export PYTHONPATH="$PYTHONPATH:$site"
        note "wheels: $(cd .whl && echo *.whl) on PYTHONPATH"
    else
        note "wheels: pip could not install .whl/*.whl (what needs them is skipped)"
    fi
fi

step machine 60 "$PYTHON" - <<'PY'
import importlib.util, sys

import torch

print(f"python {sys.version.split()[0]}, torch {torch.__version__} (CUDA {torch.version.cuda}, HIP {torch.version.hip})")
if not torch.cuda.is_available():
    print("no CUDA device: torch.cuda.is_available() is False")
    sys.exit(3)
props = torch.cuda.get_device_properties(0)
l2 = getattr(props, "L2_cache_size", 0) >> 20
print(f"{props.name}: {props.multi_processor_count} multiprocessors, {l2} MiB L2, {props.total_memory >> 30} GiB")
versions = {}
for package in ("triton", "numpy", "numba", "pytest", "xdist", "pytest_timeout", "hypothesis"):
    if importlib.util.find_spec(package) is not None:
        versions[package] = getattr(__import__(package), "__version__", "present")
print(", ".join(f"{name} {version}" for name, version in versions.items()))
import os, shutil, sysconfig

compiler = os.environ.get("CC") or shutil.which("gcc") or shutil.which("clang") or shutil.which("cc")
header = os.path.exists(os.path.join(sysconfig.get_paths()["include"], "Python.h"))
print(f"C compiler {compiler or 'MISSING'}, Python.h {'present' if header else 'MISSING'} (Triton builds its launcher with them)")
from kvhost.nixl.agent import NIXL_MODULES  # where kvhost looks for NIXL, in its order

nixl = [name for name in NIXL_MODULES if importlib.util.find_spec(name.split(".")[0]) is not None]
print(f"NIXL: {', '.join(nixl) or 'not installed (the handoff step is skipped)'}")
missing = [p for p in ("triton", "numpy", "pytest", "numba", "xdist", "pytest_timeout") if p not in versions]
if missing:
    print(f"missing: {', '.join(missing)} (what needs them is skipped or slower)")
from kvhost_tools.cli import main

main(["info"])
PY
case $? in
0) ;;
3)
    note "FAIL: $PYTHON's torch sees no CUDA device"
    status=1
    exit
    ;;
*) status=1 ;;
esac
has() { "$PYTHON" -c "import $1" 2>/dev/null; }

quick=(--quick)
[[ -n "${GPU_CHECK_FULL:-}" ]] && quick=()
if [[ $steps != *" figures "* ]]; then
    note "figures: not asked for (GPU_CHECK_STEPS)"
elif has numpy; then
    step figures 240 "$PYTHON" -m kvhost_tools.device_checks.gpucheck --device cuda "${quick[@]}" --out "$out" || status=1
else
    note "figures: skipped, numpy is not installed"
    status=1
fi

if [[ $steps != *" handoff "* ]]; then
    note "handoff: not asked for (GPU_CHECK_STEPS)"
elif "$PYTHON" -c "from kvhost.nixl.agent import load_nixl; load_nixl()" 2>/dev/null; then
    # NIXL's wheel is built for one CUDA major (nixl-cu12, nixl-cu13): another than torch's
    # imports, but UCX's CUDA transports may not load (the figures then say so, slowly).
    cuda=$("$PYTHON" -c "import torch; print((torch.version.cuda or '').split('.')[0])" 2>/dev/null)
    if compgen -G ".whl/nixl*cu*.whl" >/dev/null && ! compgen -G ".whl/nixl*cu${cuda:-none}*.whl" >/dev/null; then
        note "handoff: torch is built for CUDA ${cuda:-?}, the carried NIXL wheel for another: $(cd .whl && echo nixl*.whl)"
    fi
    step handoff 150 "$PYTHON" -m kvhost_tools.device_checks.handoff --device cuda --demo= --demo=--cross-layer || status=1
else
    note "handoff: skipped, NIXL does not import here (carry nixl-cu13's wheel in .whl/)"
fi

if [[ $steps != *" suite "* ]]; then
    note "suite: not asked for (GPU_CHECK_STEPS)"
elif has pytest; then
    # Every module that runs the conformance targets, and the backends' device tests.
    mapfile -t modules < <(grep -l -E "def test_[a-z0-9_]+\(target" tests/test_*.py; echo tests/test_cuda_backend.py)
    options=(-q -rs -m cuda -p no:cacheprovider)
    # xdist spreads Triton's first compiles (one per transform) over the cores.
    workers=$(nproc)
    ((workers > 8)) && workers=8
    has xdist && options+=(-n "$workers")
    has pytest_timeout && options+=(--timeout 120)
    [[ -n "${GPU_CHECK_K:-}" ]] && options+=(-k "$GPU_CHECK_K")
    has xdist || note "suite: serially (pytest-xdist is not installed)"
    step suite 330 "$PYTHON" -m pytest "${options[@]}" "${modules[@]}" || status=1
else
    note "suite: skipped, pytest is not installed"
    status=1
fi

# The answers, from what the steps left.
"$PYTHON" - "$out" <<'PY' | tee -a "$summary"
import json, pathlib, sys

out = pathlib.Path(sys.argv[1])
suite = out / "suite.txt"
lines = [line for line in suite.read_text().splitlines() if line.strip()] if suite.exists() else []
verdict = next((line for line in reversed(lines) if " passed" in line or " failed" in line or " error" in line), None)
if suite.exists():
    print(f"cuda-marked suite: {verdict or 'no result (see suite.txt)'}")
handoff = out / "handoff.txt"
ways = {"batch:", "way", "memcpy", "per-piece", "merged", "receive", "hand-off", "packed", "hand-off-packed"}
ways.add("hand-off-layered")
said = handoff.read_text().splitlines() if handoff.exists() else []
table = [line for line in said if line.split()[:1] and (line.split()[0] in ways or line.startswith("span/"))]
if table:
    print("NIXL hand-off into device memory (x memcpy = device copy time / this time):")
    print("\n".join(f"  {line}" for line in table))
machine = json.loads((out / "machine.json").read_text()) if (out / "machine.json").exists() else {}
if machine:
    print(f"backend: {machine.get('backend')}")  # Triton kernels, or (a failed check) the torch path
sms = machine.get("multiprocessors")
figures = out / "figures.jsonl"
rows = [json.loads(line) for line in figures.read_text().splitlines()] if figures.exists() else []
if not rows:
    sys.exit()
print(f"figures: {len(rows)} rows on {machine.get('name', '?')} ({sms} SMs); x ref = reference time / this time")
for row in rows:
    if row["method"] == "memcpy":
        continue
    used = f", {row['launches']} launch(es) of up to {row['programs']} programs" if row["launches"] else ""
    agrees = f", bytes agree: {row['agrees']}" if row["agrees"] else ""
    host = f", returns in {row['host_seconds'] * 1e3:.3f} ms" if row.get("host_seconds") else ""
    kernel = f", kernels alone x{row['kernel_fraction']:.2f}" if row.get("kernel_fraction") else ""
    print(f"  {row['workload']:49} {row['method']:11} {row['gbps']:7.1f} GB/s  x{row['fraction']:.2f}{kernel}{used}{host}{agrees}")
PY
