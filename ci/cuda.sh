#!/usr/bin/env bash
# CUDA job (a self-hosted runner with an NVIDIA GPU, or an AMD one: torch calls ROCm `cuda`):
# the conformance suite and the backend's device tests on the `cuda` target (pytest -m cuda).
# It fails, never skips, when torch sees no CUDA device: a misconfigured runner cannot pass.
#
# Environment: its own virtual environment (VENV, default .venv-cuda) with a GPU build of
# torch (TORCH, default `torch`, which is a CUDA build on Linux x86-64; for ROCm point pip
# at PyTorch's ROCm wheel index with PIP_INDEX_URL, keeping the default index as
# PIP_EXTRA_INDEX_URL for the rest). Extra pytest arguments pass through.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv-cuda}
make setup VENV="$VENV" TORCH="${TORCH:-torch}"

"$VENV/bin/python" - <<'PY'
import sys
import torch

if not torch.cuda.is_available():
    sys.exit(
        f"ci/cuda.sh: FAIL: torch {torch.__version__} (CUDA {torch.version.cuda}, HIP {torch.version.hip}) "
        "sees no CUDA device; this job must run on a runner with a GPU and a GPU build of torch"
    )
print(f"ci/cuda.sh: {torch.cuda.device_count()} x {torch.cuda.get_device_name(0)}, torch {torch.__version__}")
PY
"$VENV/bin/kvhost" info
"$VENV/bin/python" -m pytest -q -rs -m cuda "$@"
