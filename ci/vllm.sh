#!/usr/bin/env bash
# vLLM job: kvhost's connector inside vLLM 0.33.0's own NIXL connector worker, on the CPU.
#
# vLLM pins its own torch and much else, so this job keeps its own virtual environment
# (ci/cached-venv.sh). Extra pytest arguments pass through.
set -euo pipefail
cd "$(dirname "$0")/.."

VLLM_VERSION=0.33.0
# vLLM picks its platform at import: without a GPU it must be told it runs on the CPU.
export VLLM_TARGET_DEVICE=cpu
source ci/cached-venv.sh
cached_venv vllm "vllm$VLLM_VERSION" "vLLM $VLLM_VERSION and the torch it pins; about 9.5 GB" \
    "vllm==$VLLM_VERSION" -- "numba>=0.59" "pytest>=7" "pytest-timeout>=2" "hypothesis>=6"

"$venv/bin/python" - <<'PY'
import torch, vllm
import kvhost
print(f"vllm: vLLM {vllm.__version__}, torch {torch.__version__}, kvhost backend for cpu: "
      f"{kvhost.get_backend(torch.device('cpu')).name}")
PY

# -m vllm: the tests that run vLLM's own connector worker with kvhost's connector.
"$venv/bin/python" -m pytest -q -m vllm -p no:cacheprovider --timeout=600 "$@"
