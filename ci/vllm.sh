#!/usr/bin/env bash
# vLLM job: kvhost's connector inside vLLM 0.33.0's own NIXL connector worker, on the CPU.
#
# vLLM pins its own torch and much else (about 9 GB), so this job keeps its own virtual
# environment, cached outside the clone and keyed by the versions:
#   ${KVHOST_CACHE:-$HOME/.cache/kvhost}/venv-vllm<V>-py<P>
# The environment is marked complete only after every install succeeded, so an
# interrupted install is redone, never used half-made. Extra pytest arguments pass through.
set -euo pipefail
cd "$(dirname "$0")/.."

VLLM_VERSION=0.33.0
PYTHON=${PYTHON:-python3}
py_version=$("$PYTHON" -c 'import sys; print(f"{sys.version_info[0]}.{sys.version_info[1]}")')
cache_root=${KVHOST_CACHE:-$HOME/.cache/kvhost}
venv="$cache_root/venv-vllm$VLLM_VERSION-py$py_version"
ready="$venv/.kvhost-ready"

mkdir -p "$cache_root"
log="$cache_root/venv-vllm-install.log"

# pip is chatty; show it only on failure.
quiet() {
    "$@" >"$log" 2>&1 || { cat "$log"; echo "vllm: failed: $*" >&2; return 1; }
}
# One job at a time builds or uses the environment (two clones on one runner share it).
exec 9>"$cache_root/venv-vllm.lock"
flock 9

# vLLM picks its platform at import: without a GPU it must be told it runs on the CPU.
export VLLM_TARGET_DEVICE=cpu

if [[ ! -f "$ready" ]]; then
    echo "vllm: building $venv (vLLM $VLLM_VERSION and the torch it pins; about 9 GB, once)"
    start=$SECONDS
    rm -rf "$venv"
    "$PYTHON" -m venv "$venv"
    quiet "$venv/bin/python" -m pip install --upgrade pip
    quiet "$venv/bin/python" -m pip install "vllm==$VLLM_VERSION"
    quiet "$venv/bin/python" -m pip install "numba>=0.59" "pytest>=7" "pytest-timeout>=2" "hypothesis>=6"
    touch "$ready"
    echo "vllm: built in $((SECONDS - start)) s, $(du -sh "$venv" | cut -f1)"
else
    echo "vllm: reusing $venv"
fi

# kvhost itself changes with every clone: point the environment at this one (no deps:
# vLLM's torch must stay).
quiet "$venv/bin/python" -m pip install --no-deps -e .

"$venv/bin/python" - <<'PY'
import torch, vllm
import kvhost
print(f"vllm: vLLM {vllm.__version__}, torch {torch.__version__}, kvhost backend for cpu: "
      f"{kvhost.get_backend(torch.device('cpu')).name}")
PY

# -m vllm: the tests that run vLLM's own connector worker with kvhost's connector.
"$venv/bin/python" -m pytest -q -m vllm -p no:cacheprovider --timeout=600 "$@"
