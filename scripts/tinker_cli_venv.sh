#!/usr/bin/env bash
# Make .venv-tinker-cli: where the tinker SDK's own CLI (`tinker checkpoint list|download|delete`,
# `tinker run list`) runs as a test client of `tinkerless serve` (tests/test_tinker_rest.py).
#
# Why a venv of its own: the tinker 0.38 CLI needs click >= 8.2 (`checkpoint delete` passes
# progressbar(hidden=...)), and skypilot pins click < 8.2 in .venv. This venv holds only a newer
# click; it sees every other package, the same tinker SDK included, from .venv through a .pth file
# (appended to sys.path after its own site-packages, so its click wins). Seconds to make, ~1 MB.
# Idempotent. Usage: bash scripts/tinker_cli_venv.sh [PYTHON of the main venv, default .venv/bin/python]
set -euo pipefail
cd "$(dirname "$0")/.."
MAIN_PYTHON="${1:-.venv/bin/python}"
CLI_VENV=.venv-tinker-cli
if [ ! -x "$CLI_VENV/bin/python" ]; then
  "$MAIN_PYTHON" -m venv --without-pip "$CLI_VENV"
fi
purelib() { "$1" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])'; }
MAIN_SITE="$(purelib "$MAIN_PYTHON")"
CLI_SITE="$(purelib "$CLI_VENV/bin/python")"
echo "$MAIN_SITE" > "$CLI_SITE/tinkerless-main-venv.pth"
if ! "$CLI_VENV/bin/python" -c 'import importlib.metadata as m, sys; sys.exit(tuple(map(int, m.version("click").split(".")[:2])) < (8, 2))'; then
  # pip from the main venv installs into this one (--target): no second copy of pip.
  "$MAIN_PYTHON" -m pip install --quiet --disable-pip-version-check --upgrade --no-deps \
    --target "$CLI_SITE" "click>=8.2,<9"
fi
"$CLI_VENV/bin/python" - <<'EOF'
import importlib.metadata as metadata

click = tuple(int(part) for part in metadata.version("click").split(".")[:2])
assert click >= (8, 2), f"click {click} is too old for the tinker CLI"
print(f"tinker CLI ready in .venv-tinker-cli (tinker {metadata.version('tinker')}, click {metadata.version('click')})")
EOF
