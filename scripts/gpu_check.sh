#!/usr/bin/env bash
# One command for a machine with one CUDA GPU (<= 8 minutes, no network needed):
# GPU tests under the CUDA sanitizer, kernel calibration -> cluster presets, the
# engine on CUDA streams (overhead, concurrency, injected delays, host syncs), and
# tiny / ~125M GPT zeppelin vs reference.  Writes docs/results/gpu-<gpu name>.md and
# exits non-zero when any section fails.
#
#   bash scripts/gpu_check.sh [--cluster h200-8x400g] [--skip training] [--out FILE]
#   bash scripts/gpu_check.sh --dry-run            # every section's own code on the CPU
#
# Installs nothing that already imports and reaches no registry for what it needs:
# wheels carried in .whl/ (megatron-core, highspy, ...; docs/gpu-check.md) are
# installed offline into /tmp/site; the package itself runs from this checkout.
# Never stops early: a missing package fails the sections that need it, with the
# wheel to bring, and the others still run.
cd "$(dirname "$0")/.." || exit 2
PY=${PYTHON:-python3}
SITE=${GPU_CHECK_SITE:-/tmp/site}

dry_run=0
for arg in "$@"; do [ "$arg" = "--dry-run" ] && dry_run=1; done
if [ "$dry_run" = 0 ] && ! "$PY" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null; then
  echo "gpu_check: no CUDA GPU here (torch.cuda.is_available() is False); nothing to check"
  exit 0
fi

export PYTHONPATH="$PWD:$SITE${PYTHONPATH:+:$PYTHONPATH}"
shopt -s nullglob
wheels=(.whl/*.whl)
if [ ${#wheels[@]} -gt 0 ]; then
  if out=$("$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" \
             "${wheels[@]}" 2>&1); then
    echo "gpu_check: installed ${#wheels[@]} carried wheel(s) into $SITE: ${wheels[*]##*/}"
  else
    echo "gpu_check: the carried wheels did not install ($(echo "$out" | grep -m1 -i error || echo "$out" | tail -n1)); going on without them"
  fi
fi

# What the sections import (packaging: megatron-core's one pure-Python dependency): install only
# what does not import, and never wait on a registry.
for mod_pkg in numpy:numpy yaml:pyyaml pytest:pytest hypothesis:hypothesis packaging:packaging; do
  mod=${mod_pkg%%:*} pkg=${mod_pkg#*:}
  "$PY" -c "import $mod" 2>/dev/null && continue
  if PIP_NO_INPUT=1 "$PY" -m pip install -q --disable-pip-version-check --retries 0 --timeout 5 "$pkg" >/dev/null 2>&1; then
    echo "gpu_check: installed $pkg"
  else
    echo "gpu_check: $mod does not import and pip cannot install $pkg (no registry reachable?); bring its wheel in .whl/"
  fi
done
"$PY" - <<'EOF'
import importlib.util
found = {m: importlib.util.find_spec(m.split(".")[0]) is not None and importlib.util.find_spec(m) is not None
         for m in ("megatron.core", "highspy", "flash_attn", "transformer_engine")}
print("gpu_check: optional packages: " + ", ".join(f"{m} {'yes' if ok else 'no'}" for m, ok in found.items()))
EOF

"$PY" benchmarks/gpu_check.py "$@"
