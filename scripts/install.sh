#!/usr/bin/env bash
# Installs megatron-zeppelin (editable) and its dependencies.  torch is left alone
# when one is already installed (never replace a user's CUDA build); on a fresh
# CPU machine torch 2.13.0 is installed first so pip does not pull CUDA wheels.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if ! "$PY" -c "import torch" 2>/dev/null; then
  "$PY" -m pip install -q "torch==2.13.0"
fi
"$PY" -m pip install -q -e ".[test,plot]"
