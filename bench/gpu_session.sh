#!/usr/bin/env bash
# One device command of the GPU benchmark session (docs/benchmarks.md, "Running the GPU
# benchmarks"): install the carried wheels once, measure the hardware profile once, run
# the given command, then copy every result, log and the profile to $OUT.
#
#   bash bench/gpu_session.sh python3 -m bench.gpu_suite --cases opt-6.7b-p512-16g
set -uo pipefail
if [ ! -d /tmp/site/flexgen ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
    --upgrade --target /tmp/site .whl/*.whl || exit 1
fi
export PYTHONPATH=/tmp/site:$PWD
export NANOFLEX_BENCH_RESULTS=${NANOFLEX_BENCH_RESULTS:-/tmp/gpu-results}
mkdir -p "$NANOFLEX_BENCH_RESULTS"
profile=${NANOFLEX_CACHE:-$HOME/.cache/nanoflex}/hardware.json
if [ ! -f "$profile" ]; then
  python3 -m server.cli profile || exit 1
fi
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null || true
"$@"
status=$?
if [ -n "${OUT:-}" ]; then
  cp -r "$NANOFLEX_BENCH_RESULTS"/. "$OUT"/
  cp "$profile" "$OUT"/hardware.json
fi
exit $status
