#!/usr/bin/env bash
# One command for a machine with one CUDA GPU (< 10 minutes): GPU tests, kernel
# calibration -> cluster preset, engine overhead, stream concurrency, tiny and
# ~125M GPT (zeppelin vs reference).  Writes docs/results/gpu-<gpu name>.md.
#
#   bash scripts/gpu_check.sh [--cluster h100-8x400g] [--skip training] [--out FILE]
#
# Installs only prebuilt wheels (building flash-attn or TransformerEngine from
# source takes longer than the whole check): flash-attn where PyPI has a wheel
# for this torch/CUDA/Python, TransformerEngine's transformer-engine[pytorch]
# likewise; without them the check runs on the PyTorch kernels and says so.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}

if ! "$PY" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null; then
  echo "gpu_check: no CUDA GPU here (torch.cuda.is_available() is False); nothing to check"
  exit 0
fi

"$PY" -m pip install -q -e ".[test]"
for pkg in flash-attn "transformer-engine[pytorch]"; do
  if "$PY" -m pip install -q --only-binary=:all: "$pkg"; then
    echo "gpu_check: installed $pkg (prebuilt wheel)"
  else
    echo "gpu_check: no prebuilt wheel of $pkg for this torch/CUDA/Python; running without it"
  fi
done
exec "$PY" benchmarks/gpu_check.py "$@"
