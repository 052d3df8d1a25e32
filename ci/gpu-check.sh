#!/usr/bin/env bash
# One-shot GPU check, for a machine with a CUDA GPU and no network (e.g. the H200 a session
# can borrow): the cuda-marked conformance suite, then `python -m kvhost_cuda.gpucheck`
# (staging bandwidth against a plain pinned copy_, Triton kernels against the torch path
# and memcpy). Under 8 minutes. Nothing is installed: it uses the machine's python (PYTHON,
# default python3) with its torch, triton, pytest and numpy, and makes kvhost's backend entry
# points visible through a generated dist-info on PYTHONPATH.
#
#   bash ci/gpu-check.sh            # results also land in $OUT (or /tmp/kvhost-gpu-check)
#   GPU_CHECK_QUICK=1 bash ci/gpu-check.sh   # small sizes for the figures
#
# Exit status: non-zero if the device is missing, a conformance test fails, or the
# figures could not be taken.
set -uo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
out=${OUT:-/tmp/kvhost-gpu-check}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
started=$SECONDS

if ! "$PYTHON" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)'; then
    echo "gpu-check: FAIL: $PYTHON's torch sees no CUDA device" >&2
    exit 1
fi

# kvhost without installing it: the sources on PYTHONPATH, entry points from pyproject.toml.
meta=$(mktemp -d)
"$PYTHON" - "$meta" <<'PY'
import pathlib, sys, tomllib

project = tomllib.loads(pathlib.Path("pyproject.toml").read_text())["project"]
info = pathlib.Path(sys.argv[1]) / f"kvhost-{project['version']}.dist-info"
info.mkdir()
(info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: kvhost\nVersion: {project['version']}\n")
lines = []
for group, points in project["entry-points"].items():
    lines.append(f"[{group}]")
    lines += [f"{name} = {value}" for name, value in points.items()]
lines += ["[console_scripts]"] + [f"{name} = {value}" for name, value in project.get("scripts", {}).items()]
(info / "entry_points.txt").write_text("\n".join(lines) + "\n")
PY
export PYTHONPATH="$PWD:$PWD/backends:$meta${PYTHONPATH:+:$PYTHONPATH}"

"$PYTHON" - <<'PY' 2>&1 | tee "$out/machine.txt"
import torch, triton, kvhost
from kvhost_tools.cli import main
print(f"{torch.cuda.get_device_name(0)}: torch {torch.__version__}, triton {triton.__version__}")
main(["info"])
PY

# The suite: every module that runs the conformance targets or the backends' device tests.
# xdist spreads Triton's first compiles (one per transform shape) over the cores.
mapfile -t modules < <(grep -l -E "def test_[a-z0-9_]+\(target" tests/test_*.py; echo tests/test_cuda_backend.py)
parallel=()
"$PYTHON" -c 'import xdist' 2>/dev/null && parallel=(-n 8)
timeout 330 "$PYTHON" -m pytest -q -rs -m cuda -p no:cacheprovider "${parallel[@]}" "${modules[@]}" 2>&1 |
    tee "$out/conformance.txt"
suite=${PIPESTATUS[0]}

quick=()
[[ -n "${GPU_CHECK_QUICK:-}" ]] && quick=(--quick)
timeout 200 "$PYTHON" -m kvhost_cuda.gpucheck --device cuda "${quick[@]}" --json "$out/gpucheck.json" 2>&1 |
    tee "$out/gpucheck.txt"
figures=${PIPESTATUS[0]}

echo "gpu-check: conformance exit $suite, figures exit $figures, $((SECONDS - started)) s; results in $out"
[[ $suite -eq 0 && $figures -eq 0 ]]
