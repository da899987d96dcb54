#!/usr/bin/env bash
# Drive `tinkerless serve`'s /inference/v1/generate with verifiers 0.4 itself, on this machine: its training
# client alone, then whole episodes of an environment defined in verifiers_check.py, played by verifiers' own loop
# (env, interception server, the `null` chat harness in a subprocess runtime, its rubric).
#
# verifiers 0.4 pins openai>=2.54 and mcp==2.0.0, which the tinkerless venv does not take, so it gets its own
# environment (.venv-verifiers, git-ignored), as a harness user's machine would, with `uv`: verifiers prepares its
# harness program as a uv script (its dependencies come from PyPI the first time). The server runs from the
# tinkerless venv ($TINKERLESS_PYTHON, default .venv/bin/python; run scripts/install.sh first). Usage:
#   bash scripts/verifiers_check.sh [NUM_TASKS]     # episodes to play, default 6 (half of them two turns)
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${TINKERLESS_PYTHON:-.venv/bin/python}"
TL="$(dirname "$PY")/tinkerless"
if [ ! -x .venv-verifiers/bin/python ]; then
  python3 -m venv .venv-verifiers
  .venv-verifiers/bin/pip install --quiet "verifiers==0.4.0"
fi
[ -x .venv-verifiers/bin/uv ] || .venv-verifiers/bin/pip install --quiet "uv==0.13.9"
export PATH="$PWD/.venv-verifiers/bin:$PATH"  # the subprocess runtime finds `uv` on PATH
WORK="$(mktemp -d)"
PORT="${PORT:-8766}"
KEY="$("$TL" keys create --tenant verifiers --storage "$WORK/server" 2>/dev/null)"
MODEL="$("$PY" -c 'from tinkerless.functions.models import resolve_model; print(resolve_model("smollm2"))')"
"$TL" serve --model smollm2 --storage "$WORK/server" --port "$PORT" > "$WORK/server.log" 2>&1 &
SERVER=$!
trap 'kill $SERVER 2>/dev/null || true' EXIT
for _ in $(seq 180); do curl -sf "http://127.0.0.1:$PORT/healthz" > /dev/null && break; sleep 1; done
TINKERLESS_API_KEY="$KEY" HF_HUB_OFFLINE=1 .venv-verifiers/bin/python scripts/verifiers_check.py \
  "http://127.0.0.1:$PORT/v1" "$MODEL" "${1:-6}"
echo "server log: $WORK/server.log"
