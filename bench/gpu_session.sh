#!/usr/bin/env bash
# Issue #16's GPU checks, as one script for a lent GPU machine (no package index there):
#   bench/gpu_check.py            the engines' sampling and training speed on a tiny model
#   bench/vs_trl.py --model tiny-qwen   TRL's GRPOTrainer against tinkerless, alternating runs
# TRL and what it needs beyond the machine's image travel as wheels in .whl/ (see BENCHMARKS.md,
# "GPU check"); results go to $OUT (or ./runs/gpu when OUT is unset).
set -u
source "$(dirname "$0")/gpu_env.sh"
timeout 150 python3 bench/gpu_check.py --json "$OUT/gpu_check.json" 2>&1 | tee "$OUT/gpu_check.log" | grep -v "Loading weights"
timeout "${VS_TRL_TIMEOUT:-300}" python3 bench/vs_trl.py --model tiny-qwen --rounds "${ROUNDS:-2}" --steps "${STEPS:-6}" \
  --threads 8 --out "$OUT/vs_trl" 2>&1 | tee "$OUT/vs_trl.log"
