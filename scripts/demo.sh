#!/usr/bin/env bash
# The main job on a fresh machine: install, then train a tiny Megatron-Core GPT with
# Zeppelin on 2 simulated nodes x 2 GPUs (CPU, gloo), train the plain data-parallel
# reference on the same global batches, and compare them step by step.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
PY=${PYTHON:-python3}
OUT=${OUT:-runs/demo}
mkdir -p "$OUT"
rm -f "$OUT"/*.jsonl
COMMON=(--nodes 2 --gpus-per-node 2 --model tiny --lengths configs/lengths/tiny-longtail.npy
        --max-seq-len 1024 --tokens-per-gpu 512 --steps "${STEPS:-6}" --seed 1)
echo "== zeppelin: planner + attention engine + routing + remap, 4 CPU processes =="
"$PY" -m megatron_zeppelin.train "${COMMON[@]}" --strategy zeppelin --json-log "$OUT/zeppelin.jsonl" \
    --dump-plans "$OUT/plans"
echo
echo "== reference: plain data parallelism on the same global batches =="
"$PY" -m megatron_zeppelin.train "${COMMON[@]}" --strategy reference --json-log "$OUT/reference.jsonl"
echo
echo "== per step: zeppelin vs reference (plans in $OUT/plans, logs in $OUT) =="
"$PY" -m megatron_zeppelin.train.compare "$OUT/zeppelin.jsonl" "$OUT/reference.jsonl"
