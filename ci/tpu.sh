#!/usr/bin/env bash
# TPU job: the conformance suite and the TPU backend's own tests on a real XLA device,
# run on the CPU (PJRT_DEVICE=CPU) with torch 2.9.0 + torch_xla 2.9.0.
#
# torch_xla pins its own torch (a CUDA build of torch 2.9.0), so this job keeps its own
# virtual environment (ci/cached-venv.sh). Extra pytest arguments pass through.
set -euo pipefail
cd "$(dirname "$0")/.."

TORCH_VERSION=2.9.0
TORCH_XLA_VERSION=2.9.0
source ci/cached-venv.sh
cached_venv tpu "tpu-torch$TORCH_VERSION-xla$TORCH_XLA_VERSION" \
    "torch $TORCH_VERSION, torch_xla $TORCH_XLA_VERSION; about 8 GB" \
    "torch==$TORCH_VERSION" "torch_xla==$TORCH_XLA_VERSION" \
    -- numpy "numba>=0.59" "pytest>=7" "pytest-timeout>=2" "hypothesis>=6"

export PJRT_DEVICE=CPU
"$venv/bin/python" - <<'EOF'
import torch, torch_xla, torch_xla.core.xla_model as xm
import kvhost
device = torch_xla.device()
print(f"tpu: torch {torch.__version__}, torch_xla {torch_xla.__version__}, device {device}, "
      f"backend {kvhost.get_backend(device).name}")
EOF

# -m xla: the conformance suite on the xla target and tests/test_tpu*.py, nothing else.
# `-p torch_xla` imports torch_xla before any test builds an XLA tensor (torch learns the
# device from that import). Bounded per test: a hang fails the job instead of eating CI time.
"$venv/bin/python" -m pytest -q -m xla -p no:cacheprovider -p torch_xla --timeout=300 "$@"
