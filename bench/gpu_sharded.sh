#!/usr/bin/env bash
# Issue #27's GPU check as one call on a lent GPU machine: the sharded code path at world size 1 against the
# unsharded Worker, the same batch, on the 1.7B and 8B shapes (random weights, bf16, LoRA r16). Target: >= 0.95x.
# SHARDED_ARGS=--interleave alternates the two configurations' steps (both loaded at once: fits an H200).
# Rows go to $OUT/sharded-gpu.jsonl as each is measured, so a run cut short keeps what it measured.
#   run(command="bash bench/gpu_sharded.sh", carry=[".whl"], timeout_s=540)
set -u
source "$(dirname "$0")/gpu_env.sh"
timeout "${SHARDED_TIMEOUT:-480}" python3 bench/sharded_update.py --device cuda --shape "${SHAPES:-1.7B,8B}" \
  --world-size 1 --steps "${STEPS:-3}" ${SHARDED_ARGS:-} --out "$OUT/sharded-gpu.jsonl" 2>&1 \
  | grep -v "Loading weights\|Writing model" | tee "$OUT/sharded-gpu.log" | tail -30
