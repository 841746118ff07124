#!/usr/bin/env bash
# Creates .venv (if missing) and installs the project with its dev extras. Idempotent.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
.venv/bin/python -m pip install -q --upgrade pip
# torch is pinned in the dev extra to the CPU build this machine kind ships (an unpinned torch pulls a CUDA build).
.venv/bin/python -m pip install -q -e '.[dev]'
