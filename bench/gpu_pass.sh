#!/usr/bin/env bash
# The GPU pass (issue 39) in two device calls of under 9 minutes each, carry: [".whl"]
# (bench/fetch_gpu_wheels.sh flexgen==0.1.8 fills it):
#
#   bash bench/gpu_pass.sh 1        the CUDA suite (-v, every test named in a log that comes
#                                   back whole), the hardware profile, the copy/compute overlap
#   bash bench/gpu_pass.sh 2 [S]    one offloaded case side by side (OPT-6.7B 512+32 under
#                                   16 GiB: nanoflex's searched policy, FlexGen 0.1.8) and one
#                                   resident case (Llama-3-8B shape, the whole card), in S s
#
# Each stage has hard timeouts inside, copies what it made to $OUT (logs packed into one
# archive: $OUT takes 8 files) and prints a short report last.
set -uo pipefail
stage=${1:?usage: bench/gpu_pass.sh 1|2 [seconds]}
results=${NANOFLEX_BENCH_RESULTS:-/tmp/gpu-results}
export NANOFLEX_BENCH_RESULTS=$results PYTHONUNBUFFERED=1
mkdir -p "$results/logs"
if [ ! -d /tmp/site/flexgen ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
    --upgrade --target /tmp/site .whl/*.whl || exit 1
fi
export PYTHONPATH=/tmp/site:$PWD
profile=${NANOFLEX_CACHE:-$HOME/.cache/nanoflex}/hardware.json
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.mem,temperature.gpu \
  --format=csv > "$results/device.txt" 2>&1
python3 -c 'import torch, triton, transformers; print(torch.__version__, triton.__version__,
  transformers.__version__, torch.cuda.get_device_name())' >> "$results/device.txt" 2>&1
cat "$results/device.txt"

stage1() {
  local t0=$SECONDS
  timeout -k 10 220 python3 -m pytest -v -m gpu -n 8 -p no:cacheprovider --timeout 200 \
    --tb=short -rfE --durations=25 tests/engine/executor/test_cuda.py \
    tests/engine/storage/test_quant.py tests/bench/test_gpu_compare.py \
    > "$results/pytest-gpu.log" 2>&1
  echo "pytest: exit $? after $((SECONDS - t0)) s"
  t0=$SECONDS
  timeout -k 10 150 python3 -m server.cli profile --json > "$results/profile.log" 2>&1
  echo "profile: exit $? after $((SECONDS - t0)) s"
  t0=$SECONDS
  timeout -k 10 100 python3 -m bench.gpu_overlap --json "$results/gpu-overlap.json" \
    > "$results/overlap.log" 2>&1
  echo "overlap: exit $? after $((SECONDS - t0)) s"
}

stage2() {
  local budget=${1:-300} t0=$SECONDS
  if [ ! -f "$profile" ]; then  # a fresh machine: a quick profile (seconds), flagged quick
    python3 -m engine.profiling.profiler cuda "$profile" > "$results/profile-quick.log" 2>&1
  fi
  timeout -k 10 $((budget * 55 / 100)) python3 -m bench.gpu_suite --cases opt-6.7b-p512-16g \
    --systems flexgen,nanoflex --variants auto --budget-s $((budget * 55 / 100 - 5)) \
    > "$results/suite-offloaded.log" 2>&1
  echo "offloaded case: exit $? after $((SECONDS - t0)) s"
  local left=$((budget - (SECONDS - t0) - 5))
  timeout -k 10 $left python3 -m bench.gpu_suite --cases llama-3-8b-p512-full \
    --systems nanoflex --variants auto --budget-s $((left - 5)) \
    > "$results/suite-resident.log" 2>&1
  echo "resident case: exit $? after $((SECONDS - t0)) s"
}

case $stage in
  1) stage1 ;;
  2) stage2 "${2:-300}" ;;
  *) echo "stage must be 1 or 2" >&2; exit 2 ;;
esac
cp -f "$profile" "$results/hardware.json" 2>/dev/null
if [ -n "${OUT:-}" ]; then
  tar czf "$OUT/logs.tgz" -C "$results" . 2>/dev/null
  cp -f "$results"/*.json "$OUT"/ 2>/dev/null
  [ -f "$results/pytest-gpu.log" ] && cp -f "$results/pytest-gpu.log" "$OUT"/
fi
echo "==== report"
if [ "$stage" = 1 ]; then
  grep -E "^(FAILED|ERROR)" "$results/pytest-gpu.log" | cut -c1-200 | head -40
  tail -n 1 "$results/pytest-gpu.log"
  python3 - "$results/hardware.json" <<'PY'
import json, sys
try:
    p = json.load(open(sys.argv[1]))
except Exception as e:
    sys.exit(f"no profile: {e}")
keys = ("gpu_flops", "gpu_mem_bw", "ctog_bw", "gtoc_bw", "device_attention_bw",
        "prefill_attention_flops", "layer_overhead_s", "nano_overlap_device",
        "nano_overlap_host", "nano_batch_overhead_s", "dequant_throughput")
print("  ".join(f"{k}={p.get(k):.4g}" for k in keys if isinstance(p.get(k), (int, float))))
PY
  grep -E "^(hardware|engine)" "$results/overlap.log"
  tail -n 3 "$results/overlap.log" | grep -iE "error|Traceback" || true
else
  grep -hE "estimate|Error|error" "$results"/suite-*.log | tail -n 12
  python3 - "$results" <<'PY'
import json, pathlib, sys
for path in sorted(pathlib.Path(sys.argv[1]).glob("gpu-*.json")):
    if path.name == "gpu-overlap.json":
        continue
    record = json.loads(path.read_text())
    for name, run in record.get("runs", {}).items():
        m = run.get("metrics") or {}
        print(path.stem, name, "ok" if run.get("ok") else f"FAILED {str(run.get('error'))[-160:]}",
              {k: round(v, 1) for k, v in m.items() if isinstance(v, (int, float))})
PY
fi
