#!/usr/bin/env bash
# Issues #25's and #36's GPU checks as one call on a lent GPU machine (no package index, no model hub there):
# bench/gpu_shapes.py on the 1.7B and 8B shapes with random weights (SHAPES=135M,1.7B,8B for all three):
# sampling eager vs CUDA graphs on the same worker, the LoRA update, transformers' static-cache generate and
# plain peft as baselines, and an 8B RL step under a 24 GiB cap.
# peft travels as a wheel in .whl/ when the machine's own differs; results go to $OUT (default runs/gpu).
set -u
source "$(dirname "$0")/gpu_env.sh"
# Issue #36's figures (device decode vs one-step, its fp32 exactness on 128 rows with stops, batch 256, first vs
# steady calls, 4 mixed adapters, the whole RL step) run on the 1.7B shape first (EXTRAS), within one 8-minute call.
timeout "${SHAPES_TIMEOUT:-460}" python3 bench/gpu_shapes.py --shapes "${SHAPES:-1.7B,8B}" --extras "${EXTRAS:-1.7B}" \
  --out "$OUT/gpu_shapes.jsonl" ${EXTRA:-} 2>&1 | grep -v "Loading weights\|Writing model" | tee "$OUT/gpu_shapes.log" | tail -40
