#!/usr/bin/env bash
# The GPU pass: named steps run in order on the GPU machine, each under a
# hard timeout, the whole within GPU_PASS_DEADLINE_S seconds; carry: [".whl"] (filled by
# bench/gpu/fetch_wheels.sh flexgen==0.1.8), and a profile directory to reuse one.
#
#   bash bench/gpu/pass.sh 1            = offloaded resident breakdown  (the first call)
#   bash bench/gpu/pass.sh 2            = suite attention profile overlap  (the second call)
#   bash bench/gpu/pass.sh attention offloaded resident suite       (any steps, in order)
#   bash bench/gpu/pass.sh run python3 -m bench.features.nano_batches ...    (any command, one step)
#   GPU_PASS_DRY_RUN=1 bash bench/gpu/pass.sh 1                     (on a CPU: see below)
#
# Steps:
#   suite      the CUDA suite and the Triton kernel tests (the one paged attention kernel
#              among them), -v, every test named in a log
#   attention  bench/gpu/attention.py: the Triton kernels against gather + SDPA
#   profile    `nanoflex profile` (the hardware constants the planner reads)
#   overlap    bench/gpu/overlap.py: a layer's copy beside compute, hardware and engine
#   offloaded  OPT-6.7B 512+32 under 16 GiB: FlexGen 0.1.8 and nanoflex's searched policy
#              (GPU_PASS_OFFLOADED_SYSTEMS, default flexgen,nanoflex), then OPT-30B under
#              16 GiB when its estimate fits what is left (GPU_PASS_OFFLOADED_CASES)
#   resident   Llama-3-8B 512+32 on the whole card: nanoflex's searched policy, then the
#              same with mixed and prefill steps eager (--no-piecewise-graphs; the ablation)
#   breakdown  bench/gpu/breakdown.py: Llama-3-8B resident, prefill and decode under torch's
#              profiler: the device's busy share of the wall and its busiest kernels
#
# What each step writes goes to $OUT as soon as the step ends (logs packed into one
# archive: $OUT takes 8 files), so a call cut short still returns what was done; a short
# report is printed last.
#
# GPU_PASS_DRY_RUN=1 runs every step on the CPU, small and quick (the suite collected, not
# run; the attention kernels interpreted; the cases planned, not run), with $PYTHON: CI
# runs it (tests/bench/test_gpu_pass.py) so the script cannot break unseen before a GPU.
set -uo pipefail
[ $# -gt 0 ] || { echo "usage: bench/gpu/pass.sh 1|2|STEP...|run COMMAND..." >&2; exit 2; }
case "$1" in
  1) set -- offloaded resident breakdown ;;
  2) set -- suite attention profile overlap ;;
esac
[ "$1" = run ] || for step in "$@"; do  # an unknown step is refused before anything runs
  case $step in
    suite|attention|profile|overlap|breakdown|offloaded|resident) ;;
    *) echo "unknown step $step" >&2; exit 2 ;;
  esac
done
PYTHON=${PYTHON:-python3}
dry=${GPU_PASS_DRY_RUN:-}
deadline=$((SECONDS + ${GPU_PASS_DEADLINE_S:-520}))
results=${NANOFLEX_BENCH_RESULTS:-/tmp/gpu-results}
export NANOFLEX_BENCH_RESULTS=$results PYTHONUNBUFFERED=1
mkdir -p "$results/logs"
if [ -z "$dry" ]; then
  if [ -d .whl ] && [ ! -d /tmp/site/fastapi ]; then
    "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
      --upgrade --target /tmp/site .whl/*.whl || exit 1
  fi
  export PYTHONPATH=/tmp/site:$PWD
else
  export PYTHONPATH=$PWD TRITON_INTERPRET=1
fi
profile=${NANOFLEX_CACHE:-$HOME/.cache/nanoflex}/hardware.json
{
  nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.mem,temperature.gpu \
    --format=csv 2>&1
  "$PYTHON" -c 'import torch, triton, transformers; print(torch.__version__, triton.__version__,
    transformers.__version__, torch.cuda.is_available() and torch.cuda.get_device_name())' 2>&1
} > "$results/device.txt"
cat "$results/device.txt"

left() { echo $((deadline - SECONDS)); }
# limit WANTED: the seconds a step may take, WANTED or what is left before the deadline; in the
# dry run neither applies (it checks the steps, not a race against a GPU's limits on a slow box):
# each step gets GPU_PASS_DRY_STEP_S, a guard against a hang only
limit() {
  if [ -n "$dry" ]; then echo "${GPU_PASS_DRY_STEP_S:-900}"; return; fi
  local l; l=$(left); [ "$1" -lt "$l" ] && echo "$1" || echo "$l"
}
publish() {
  cp -f "$profile" "$results/hardware.json" 2>/dev/null
  if [ -n "${OUT:-}" ]; then
    tar czf "$OUT/logs.tgz" -C "$results" . 2>/dev/null
    cp -f "$results"/*.json "$OUT"/ 2>/dev/null
    [ -f "$results/pytest-gpu.log" ] && cp -f "$results/pytest-gpu.log" "$OUT"/
  fi
}
run_step() {  # NAME WANTED_SECONDS COMMAND...: timed, logged to $results/NAME.log
  local name=$1 wanted=$2 t0=$SECONDS s; shift 2
  s=$(limit "$wanted")
  if [ "$s" -lt 10 ]; then echo "$name: skipped, $s s left"; return; fi
  timeout -k 5 "$s" "$@" > "$results/$name.log" 2>&1
  echo "$name: exit $? after $((SECONDS - t0)) s (limit $s s)"
  publish
}

if [ "$1" = run ]; then
  shift
  run_step run "${GPU_PASS_RUN_S:-570}" "$@"
  set --
fi
for step in "$@"; do
  case $step in
    suite)
      collect=(); [ -n "$dry" ] && collect=(--collect-only -q)
      [ -z "$dry" ] && collect=(-n 12)
      run_step pytest-gpu "${GPU_PASS_SUITE_S:-230}" "$PYTHON" -m pytest -v "${collect[@]}" \
        -p no:cacheprovider -m "gpu or not gpu" --timeout 200 --tb=short -rfE --durations=25 \
        tests/engine/executor/test_cuda.py tests/engine/storage/test_quant.py \
        tests/engine/kernels/test_triton_attention.py tests/engine/kernels/test_triton_dense.py \
        tests/engine/kernels/test_triton_paged.py \
        tests/engine/vision/test_vision_cuda.py \
        tests/bench/test_gpu_compare.py::test_smoke_case_on_cuda ;;
    attention)
      run_step attention "${GPU_PASS_ATTENTION_S:-90}" "$PYTHON" -m bench.gpu.attention \
        ${dry:+--small} --json "$results/gpu-attention.json" ;;
    profile)
      if [ -n "$dry" ]; then  # the quick profile of the CPU
        run_step profile 120 "$PYTHON" -m engine.profiling.profiler cpu "$profile"
      else
        run_step profile "${GPU_PASS_PROFILE_S:-150}" "$PYTHON" -m server.cli profile --json
      fi ;;
    overlap)
      small=(); [ -n "$dry" ] && small=(--device cpu --layers 2 --seqs 4 --prompt-len 32 --gen-len 2)
      run_step overlap "${GPU_PASS_OVERLAP_S:-100}" "$PYTHON" -m bench.gpu.overlap \
        "${small[@]}" --json "$results/gpu-overlap.json" ;;
    breakdown)
      small=(); [ -n "$dry" ] && small=(--model nanoflex-demo --prompts 4 --prompt-len 32 --gen-len 2
                                        --policy '{"gpu_batch_size": 4}')
      run_step breakdown "${GPU_PASS_BREAKDOWN_S:-100}" "$PYTHON" -m bench.gpu.breakdown \
        "${small[@]}" --json "$results/gpu-breakdown.json" ;;
    offloaded|resident)
      if [ ! -f "$profile" ]; then  # a fresh machine: a quick profile (seconds), flagged quick
        device=cuda; [ -n "$dry" ] && device=cpu
        "$PYTHON" -m engine.profiling.profiler "$device" "$profile" \
          > "$results/profile-quick.log" 2>&1
      fi
      if [ "$step" = offloaded ]; then
        case_name=${GPU_PASS_OFFLOADED_CASES:-opt-6.7b-p512-16g,opt-30b-p512-16g}
        systems=${GPU_PASS_OFFLOADED_SYSTEMS:-flexgen,nanoflex}
        wanted=${GPU_PASS_OFFLOADED_S:-170}
      else
        case_name=llama-3-8b-p512-full systems=nanoflex wanted=${GPU_PASS_RESIDENT_S:-240}
      fi
      variants=auto  # the resident case also runs its piecewise-graph ablation
      [ "$step" = resident ] && variants=${GPU_PASS_RESIDENT_VARIANTS:-auto,piecewise-graphs-off}
      s=$(limit "$wanted")
      run_step "suite-$step" "$s" "$PYTHON" -m bench.gpu.suite --cases "$case_name" \
        --systems "$systems" --variants "$variants" --budget-s $((s - 5)) ${dry:+--dry-run} ;;
  esac
done

echo "==== report"
if [ -f "$results/pytest-gpu.log" ]; then
  grep -E "^(FAILED|ERROR)" "$results/pytest-gpu.log" | cut -c1-200 | head -30
  grep -cE " PASSED" "$results/pytest-gpu.log" | sed 's/^/passed so far: /'
  tail -n 1 "$results/pytest-gpu.log"
fi
[ -f "$results/attention.log" ] && tail -n 8 "$results/attention.log"
[ -f "$results/breakdown.log" ] && grep -E "^\|" "$results/breakdown.log"
[ -f "$results/overlap.log" ] && grep -E "^(engine|pinned|pageable|host)" "$results/overlap.log"
"$PYTHON" - "$results" <<'PY'
import json, pathlib, sys
results = pathlib.Path(sys.argv[1])
try:
    p = json.loads((results / "hardware.json").read_text())
    keys = ("gpu_flops", "gpu_mem_bw", "ctog_bw", "device_attention_bw",
            "prefill_attention_flops", "layer_overhead_s", "nano_overlap_device", "copy_hidden")
    print("  ".join(f"{k}={p[k]:.4g}" for k in keys if isinstance(p.get(k), (int, float))))
    # the GPU path's targets (issue: the GPU path built right before it runs)
    # gpu_mem_bw is bytes copied per second; HBM moves twice that (read + written)
    targets = (
        ("decode attention / HBM traffic of a copy", "device_attention_bw", "gpu_mem_bw", 2, 0.5, ">="),
        ("prefill attention / GEMM rate", "prefill_attention_flops", "gpu_flops", 1, 0.4, ">="),
        ("host seconds per layer outside kernels", "layer_overhead_s", None, 1, 50e-6, "<="),
        ("share of a layer's copy hidden behind GEMMs", "copy_hidden", None, 1, 0.8, ">="),
    )
    for label, key, over, factor, target, sense in targets:
        if not isinstance(p.get(key), (int, float)) or (over and not p.get(over)):
            print(f"target {label}: not measured")
            continue
        value = p[key] / (factor * p[over]) if over else p[key]
        met = value >= target if sense == ">=" else value <= target
        print(f"target {label}: {value:.3g} ({sense} {target:g}: {'met' if met else 'MISSED'})")
except (OSError, ValueError) as e:
    print(f"no profile: {e}")
for path in sorted(results.glob("gpu-*.json")):
    record = json.loads(path.read_text())
    for name, run in record.get("runs", {}).items():
        m = run.get("metrics") or {}
        status = "ok" if run.get("ok") else f"FAILED {str(run.get('error'))[-160:]}"
        keys = ("generation_throughput", "prefill_throughput", "decode_throughput", "num_prompts")
        print(path.stem, name, status, {k: round(m[k], 1) for k in keys if k in m})
PY
