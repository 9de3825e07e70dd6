#!/usr/bin/env bash
# ctest wrapper for the tests that need the real model (and, with --python, the Python venv):
#   run_with_model.sh [--python PY] MODEL -- command...
# Exits 77 (ctest: skipped) with a message when MODEL or PY is missing, unless KVC_REQUIRE_MODEL=1
# (CI sets it after fetch_model.sh), in which case a missing file is a failure.
set -euo pipefail
py=""
if [[ "${1:-}" == "--python" ]]; then py="$2"; shift 2; fi
model="$1"; shift
[[ "${1:-}" == "--" ]] && shift
missing=""
[[ -f "$model" ]] || missing="model $model"
[[ -z "$py" || -x "$py" ]] || missing="${missing:+$missing and }python venv $py"
if [[ -n "$missing" ]]; then
  echo "missing $missing: run examples/llama/fetch_model.sh first"
  if [[ "${KVC_REQUIRE_MODEL:-0}" == "1" ]]; then exit 1; fi
  exit 77
fi
exec "$@"
