#!/usr/bin/env bash
# Issue #16's GPU checks, as one script for a lent GPU machine (no package index there):
#   bench/gpu_check.py            the engines' sampling and training speed on a tiny model
#   bench/vs_trl.py --model tiny-qwen   TRL's GRPOTrainer against tinkerless, alternating runs
# TRL and what it needs beyond the machine's image travel as wheels in .whl/ (see BENCHMARKS.md,
# "GPU check"); results go to $OUT (or ./runs/gpu when OUT is unset).
set -u
OUT=${OUT:-runs/gpu}
mkdir -p "$OUT"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
{
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  python3 -c "import torch, transformers, peft; print('torch', torch.__version__, 'transformers', transformers.__version__, 'peft', peft.__version__)"
  python3 -c "import vllm; print('vllm', vllm.__version__)" 2>/dev/null || echo "vllm: not installed (its wheel is larger than what can travel to this machine)"
} 2>&1 | tee "$OUT/versions.txt"
timeout 150 python3 bench/gpu_check.py --json "$OUT/gpu_check.json" 2>&1 | tee "$OUT/gpu_check.log" | grep -v "Loading weights"
timeout "${VS_TRL_TIMEOUT:-300}" python3 bench/vs_trl.py --model tiny-qwen --rounds "${ROUNDS:-2}" --steps "${STEPS:-6}" \
  --threads 8 --out "$OUT/vs_trl" 2>&1 | tee "$OUT/vs_trl.log"
