#!/usr/bin/env bash
# Second command of the README: set up, lint, and run the whole test suite on the real models (fp32 exactness).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/ruff check castspec tests
exec .venv/bin/python -m pytest -q -p no:cacheprovider --durations=15 "$@"
