#!/usr/bin/env bash
# Run a tinker-cookbook recipe, unmodified, against `tinkerless serve` on this machine.
#
# The cookbook pins transformers<=5.5.4 and the tinkerless dev tools a newer one, so the
# cookbook gets its own environment (.venv-cookbook), as a user's laptop would; the
# server runs from .venv (run scripts/install.sh first). Usage:
#   bash scripts/cookbook_check.sh [N_CONVERSATIONS]   # the supervised trainer (sl_basic's)
#   bash scripts/cookbook_check.sh rl [ITERATIONS]     # the RL trainer (rl.train.main), 8 groups x 4
#   bash scripts/cookbook_check.sh rl-async [ITERATIONS]   # the same in the cookbook's async mode (1 step off policy)
#   bash scripts/cookbook_check.sh distill [ITERATIONS]    # on-policy distillation (distillation.train_on_policy),
#       its teacher the final checkpoint of a 2-iteration run of the RL trainer above on the same base model
set -euo pipefail
cd "$(dirname "$0")/.."
MODE=sl
ASYNC=0
if [ "${1:-}" = "rl" ]; then MODE=rl; shift; fi
if [ "${1:-}" = "rl-async" ]; then MODE=rl; ASYNC=1; shift; fi
if [ "${1:-}" = "distill" ]; then MODE=distill; shift; fi
N="${1:-32}"
if [ ! -x .venv-cookbook/bin/python ]; then
  python3 -m venv .venv-cookbook
  .venv-cookbook/bin/pip install --quiet "torch==2.13.0"
  .venv-cookbook/bin/pip install --quiet "tinker==0.38.0" "tinker-cookbook==0.5.8"
fi
WORK="$(mktemp -d)"
PORT="${PORT:-8765}"
KEY="$(.venv/bin/tinkerless keys create --tenant cookbook --storage "$WORK/server" 2>/dev/null)"
MODEL="$(.venv/bin/python -c 'from tinkerless.functions.models import resolve_model; print(resolve_model("smollm2"))')"
.venv/bin/tinkerless serve --model smollm2 --storage "$WORK/server" --port "$PORT" > "$WORK/server.log" 2>&1 &
SERVER=$!
trap 'kill $SERVER 2>/dev/null || true' EXIT
for _ in $(seq 120); do curl -sf "http://127.0.0.1:$PORT/healthz" > /dev/null && break; sleep 1; done
if [ "$MODE" = distill ]; then
  export TINKER_TELEMETRY=0 TINKER_BASE_URL="http://127.0.0.1:$PORT" TINKER_API_KEY="$KEY" HF_HUB_OFFLINE=1
  HUB_ID=HuggingFaceTB/SmolLM2-135M-Instruct
  .venv-cookbook/bin/python examples/tinker_cookbook/rl_arithmetic.py "$HUB_ID" "$WORK/teacher" --iterations 2
  TEACHER="$(.venv-cookbook/bin/python -c 'import json, sys; rows = [json.loads(l) for l in open(sys.argv[1])]
print([r["sampler_path"] for r in rows if r.get("sampler_path")][-1])' "$WORK/teacher/checkpoints.jsonl")"
  echo "teacher: $TEACHER"
  .venv-cookbook/bin/python examples/tinker_cookbook/distill_arithmetic.py "$HUB_ID" "$WORK/run" "$TEACHER" \
    --iterations "${1:-2}"
elif [ "$MODE" = rl ]; then
  # The client names the model by its Hub id and loads the tokenizer from the HF cache (install.sh fills it).
  TINKER_TELEMETRY=0 TINKER_BASE_URL="http://127.0.0.1:$PORT" TINKER_API_KEY="$KEY" HF_HUB_OFFLINE=1 \
    .venv-cookbook/bin/python examples/tinker_cookbook/rl_arithmetic.py HuggingFaceTB/SmolLM2-135M-Instruct \
    "$WORK/run" --iterations "${1:-2}" --async-off-policy "$ASYNC"
else
  TINKER_TELEMETRY=0 TINKER_BASE_URL="http://127.0.0.1:$PORT" TINKER_API_KEY="$KEY" \
    .venv-cookbook/bin/python examples/tinker_cookbook/sl_conversations.py "$MODEL" "$WORK/run" "$N"
fi
echo "cookbook run in $WORK/run (server log: $WORK/server.log)"
