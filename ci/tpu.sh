#!/usr/bin/env bash
# TPU job: the conformance suite and the TPU backend's own tests on a real XLA device,
# run on the CPU (PJRT_DEVICE=CPU) with torch 2.9.0 + torch_xla 2.9.0.
#
# torch_xla pins its own torch (a CUDA build of torch 2.9.0, several GB), so this job keeps
# its own virtual environment, cached outside the clone and keyed by the versions:
#   ${KVHOST_CACHE:-$HOME/.cache/kvhost}/venv-tpu-torch<T>-xla<X>-py<P>
# The environment is marked complete only after every install succeeded, so an
# interrupted install is redone, never used half-made. Extra pytest arguments pass through.
set -euo pipefail
cd "$(dirname "$0")/.."

TORCH_VERSION=2.9.0
TORCH_XLA_VERSION=2.9.0
PYTHON=${PYTHON:-python3}
py_version=$("$PYTHON" -c 'import sys; print(f"{sys.version_info[0]}.{sys.version_info[1]}")')
cache_root=${KVHOST_CACHE:-$HOME/.cache/kvhost}
venv="$cache_root/venv-tpu-torch$TORCH_VERSION-xla$TORCH_XLA_VERSION-py$py_version"
ready="$venv/.kvhost-ready"

mkdir -p "$cache_root"
log="$cache_root/venv-tpu-install.log"

# pip is chatty (and setuptools warns about this project's metadata); show it only on failure.
quiet() {
    "$@" >"$log" 2>&1 || { cat "$log"; echo "tpu: failed: $*" >&2; return 1; }
}
# One job at a time builds or uses the environment (two clones on one runner share it).
exec 9>"$cache_root/venv-tpu.lock"
flock 9

if [[ ! -f "$ready" ]]; then
    echo "tpu: building $venv (torch $TORCH_VERSION, torch_xla $TORCH_XLA_VERSION; a few GB, once)"
    rm -rf "$venv"
    "$PYTHON" -m venv "$venv"
    quiet "$venv/bin/python" -m pip install --upgrade pip
    quiet "$venv/bin/python" -m pip install "torch==$TORCH_VERSION" "torch_xla==$TORCH_XLA_VERSION"
    quiet "$venv/bin/python" -m pip install numpy "numba>=0.59" "pytest>=7" "pytest-timeout>=2" "hypothesis>=6"
    touch "$ready"
else
    echo "tpu: reusing $venv"
fi

# kvhost itself changes with every clone: point the environment at this one (no deps:
# the torch above must stay).
quiet "$venv/bin/python" -m pip install --no-deps -e .

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
