#!/usr/bin/env bash
# CPU job: lint, types and the whole suite on the host backends (cpu, torch).
set -euo pipefail
cd "$(dirname "$0")/.."
make lint
make test
