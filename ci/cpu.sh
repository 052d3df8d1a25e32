#!/usr/bin/env bash
# CPU job: lint, types and the whole suite on the host backends (cpu, torch).
set -euo pipefail
cd "$(dirname "$0")/.."
make lint
make test
# The suites that drive the numba kernels again, under a strict glibc malloc: memory used after
# it was freed faults or shows as wrong bytes (ci/memcheck.sh; --valgrind there for the slow check).
bash ci/memcheck.sh
# The CUDA/XPU Triton kernels on the CPU in Triton's interpreter: the conformance suite's
# triton-interpret target and the kernel tests (the plain run above skips them).
TRITON_INTERPRET=1 .venv/bin/python -m pytest -q -k "triton-interpret or test_triton_kernels or test_cuda_backend"
