#!/usr/bin/env bash
# CPU job: lint, types and the whole suite on the host backends (cpu, torch).
set -euo pipefail
cd "$(dirname "$0")/.."
# The packet-loss test of tests/test_netns.py drops packets with nftables: install it where
# this is a root shell with apt (Debian); without it that test skips, saying why.
if ! command -v nft >/dev/null && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    timeout 300 apt-get install -y --no-install-recommends nftables >/dev/null 2>&1 ||
        echo "ci/cpu.sh: could not install nftables; the packet-loss test will skip"
fi
make lint
make test
# The suites that drive the numba kernels again, under a strict glibc malloc: memory used after
# it was freed faults or shows as wrong bytes (ci/memcheck.sh; --valgrind there for the slow check).
bash ci/memcheck.sh
# The CUDA/XPU Triton kernels on the CPU in Triton's interpreter: the conformance suite's
# triton-interpret target and the kernel tests (the plain run above skips them).
TRITON_INTERPRET=1 .venv/bin/python -m pytest -q -k "triton-interpret or test_triton_kernels or test_cuda_backend"
