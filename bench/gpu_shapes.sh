#!/usr/bin/env bash
# Issue #25's GPU checks as one call on a lent GPU machine (no package index, no model hub there):
# bench/gpu_shapes.py on the 135M, 1.7B and 8B shapes with random weights: the graphed decoder against the eager
# one in fp32 (exactness), sampling eager vs CUDA graphs on the same worker, the LoRA update, transformers'
# static-cache generate and plain peft as baselines, and an 8B RL step under a 24 GiB cap.
# peft travels as a wheel in .whl/ when the machine's own differs; results go to $OUT (default runs/gpu).
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
} 2>&1 | tee "$OUT/versions.txt"
timeout "${SHAPES_TIMEOUT:-540}" python3 bench/gpu_shapes.py --shapes "${SHAPES:-135M,1.7B,8B}" \
  --out "$OUT/gpu_shapes.jsonl" ${EXTRA:-} 2>&1 | grep -v "Loading weights\|Writing model" | tee "$OUT/gpu_shapes.log" | tail -40
