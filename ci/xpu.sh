#!/usr/bin/env bash
# XPU job (a self-hosted runner with an Intel GPU): the conformance suite and the backend's
# device tests on the `xpu` target (pytest -m xpu), through torch's native torch.xpu.
# It fails, never skips, when torch sees no XPU device: a misconfigured runner cannot pass.
#
# Environment: its own virtual environment (VENV, default .venv-xpu) with torch from the
# XPU wheel index (XPU_INDEX), which also brings Intel's Triton (pytorch-triton-xpu). The
# test extra's `triton` (PyPI: NVIDIA/AMD only) would overwrite that package's files, so it
# is removed and Intel's put back after the install. Extra pytest arguments pass through.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv-xpu}
XPU_INDEX=${XPU_INDEX:-https://download.pytorch.org/whl/xpu}
PYTHON=${PYTHON:-python3}

if [[ ! -f "$VENV/.installed" ]]; then
    rm -rf "$VENV"
    "$PYTHON" -m venv "$VENV"
    "$VENV/bin/python" -m pip install --quiet --upgrade pip
    "$VENV/bin/python" -m pip install --quiet --index-url "$XPU_INDEX" torch
    "$VENV/bin/python" -m pip install --quiet -e '.[test]'
    "$VENV/bin/python" -m pip uninstall --quiet --yes triton
    "$VENV/bin/python" -m pip install --quiet --force-reinstall --no-deps --index-url "$XPU_INDEX" pytorch-triton-xpu
    touch "$VENV/.installed"
fi

"$VENV/bin/python" - <<'PY'
import sys
import torch

from kvhost_xpu import XpuBackend

reason = XpuBackend.unavailable_reason()  # imports intel-extension-for-pytorch on torch < 2.5, if installed
if reason is not None:
    sys.exit(
        f"ci/xpu.sh: FAIL: {reason} (torch {torch.__version__}); this job must run on a runner with an Intel GPU "
        "and an XPU build of torch"
    )
print(f"ci/xpu.sh: {torch.xpu.device_count()} x {torch.xpu.get_device_name(0)}, torch {torch.__version__}")
PY
"$VENV/bin/kvhost" info
"$VENV/bin/python" -m pytest -q -rs -m xpu "$@"
