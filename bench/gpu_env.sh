# Sourced by the GPU session scripts (bench/gpu_session.sh, bench/gpu_shapes.sh) on a lent GPU machine, which
# reaches no package index: installs the wheels carried in .whl/ (peft, TRL, ...) beside the machine's image,
# sets the paths and offline switches, makes $OUT and records the device and versions in $OUT/versions.txt.
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
