#!/usr/bin/env bash
# Second command of the README: set up, lint, and run the whole test suite on the real models (fp32 exactness).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/ruff check castspec tests
# Two pytest-xdist workers by default (CASTSPEC_TEST_WORKERS to change; 0 runs in this process), each file whole on
# one worker so that its module fixtures (the Qwen pair, live servers, Ray) start once. Each worker keeps torch's
# threads, with OpenMP's idle threads sleeping instead of spinning (OMP_WAIT_POLICY=PASSIVE): measured here, two
# workers of two such threads on two cores ran the exactness tests 16% faster than two workers of one thread.
export OMP_WAIT_POLICY="${OMP_WAIT_POLICY:-PASSIVE}"
exec .venv/bin/python -m pytest -q -p no:cacheprovider --durations=15 -n "${CASTSPEC_TEST_WORKERS:-2}" \
    --dist loadfile "$@"
