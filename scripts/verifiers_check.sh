#!/usr/bin/env bash
# Drive `tinkerless serve`'s /inference/v1/generate with verifiers 0.4's own training client, on this machine.
#
# verifiers 0.4 pins openai>=2.54 and mcp==2.0.0, which the tinkerless venv does not take, so it gets its own
# environment (.venv-verifiers, git-ignored), as a harness user's machine would; the server runs from the
# tinkerless venv ($TINKERLESS_PYTHON, default .venv/bin/python; run scripts/install.sh first). Usage:
#   bash scripts/verifiers_check.sh
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${TINKERLESS_PYTHON:-.venv/bin/python}"
TL="$(dirname "$PY")/tinkerless"
if [ ! -x .venv-verifiers/bin/python ]; then
  python3 -m venv .venv-verifiers
  .venv-verifiers/bin/pip install --quiet "verifiers==0.4.0"
fi
WORK="$(mktemp -d)"
PORT="${PORT:-8766}"
KEY="$("$TL" keys create --tenant verifiers --storage "$WORK/server" 2>/dev/null)"
MODEL="$("$PY" -c 'from tinkerless.functions.models import resolve_model; print(resolve_model("smollm2"))')"
"$TL" serve --model smollm2 --storage "$WORK/server" --port "$PORT" > "$WORK/server.log" 2>&1 &
SERVER=$!
trap 'kill $SERVER 2>/dev/null || true' EXIT
for _ in $(seq 180); do curl -sf "http://127.0.0.1:$PORT/healthz" > /dev/null && break; sleep 1; done
TINKERLESS_API_KEY="$KEY" HF_HUB_OFFLINE=1 .venv-verifiers/bin/python scripts/verifiers_check.py \
  "http://127.0.0.1:$PORT/v1" "$MODEL"
echo "server log: $WORK/server.log"
