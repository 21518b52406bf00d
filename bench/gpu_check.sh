#!/usr/bin/env bash
# The GPU acceptance kit as ONE command on a lent device machine (bench/README.md, "GPU acceptance kit"):
#
#   bash bench/gpu_check.sh                 # results under $OUT (results.md, results.json, records.jsonl, logs/)
#   bash bench/gpu_check.sh --parts engine  # extra arguments go to bench/gpu_check.py
#
# Needs bench/gpu_wheels/ (bash bench/gpu_wheels.sh, carried with the working tree); installs them into a
# scratch folder with pip --no-index --no-deps --target and puts them and the project on PYTHONPATH itself.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
exec "$PYTHON" -u bench/gpu_check.py --out "${OUT:-runs/gpu_check}" "$@"
