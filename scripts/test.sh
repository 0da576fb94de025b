#!/usr/bin/env bash
# Second command of the README: set up, lint, and run the whole test suite on the real models (fp32 exactness).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/ruff check castspec tests
# Two workers by default (CASTSPEC_TEST_WORKERS to change; 0 runs in this process): most tests are small-model
# decoding, server and CLI processes that gain little from a second core, so two test files run at once.
# A whole file goes to one worker, so that its module fixtures (the Qwen pair, live servers, Ray) start once.
exec .venv/bin/python -m pytest -q -p no:cacheprovider --durations=15 -n "${CASTSPEC_TEST_WORKERS:-2}" \
    --dist loadfile "$@"
