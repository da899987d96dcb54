#!/usr/bin/env bash
# Issue #25's GPU checks as one call on a lent GPU machine (no package index, no model hub there):
# bench/gpu_shapes.py on the 135M, 1.7B and 8B shapes with random weights: the graphed decoder against the eager
# one in fp32 (exactness), sampling eager vs CUDA graphs on the same worker, the LoRA update, transformers'
# static-cache generate and plain peft as baselines, and an 8B RL step under a 24 GiB cap.
# peft travels as a wheel in .whl/ when the machine's own differs; results go to $OUT (default runs/gpu).
set -u
source "$(dirname "$0")/gpu_env.sh"
timeout "${SHAPES_TIMEOUT:-540}" python3 bench/gpu_shapes.py --shapes "${SHAPES:-135M,1.7B,8B}" \
  --out "$OUT/gpu_shapes.jsonl" ${EXTRA:-} 2>&1 | grep -v "Loading weights\|Writing model" | tee "$OUT/gpu_shapes.log" | tail -40
