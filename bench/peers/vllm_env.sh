#!/usr/bin/env bash
# Run a command in the environment vLLM's CPU build wants on this 2-core box (bench/peers/vllm_run.py):
# tcmalloc and the venv's Intel OpenMP preloaded (they must be loaded before Python starts),
# every core for the model's OpenMP threads, the engine in-process, 2 GiB of KV cache.
#
#   bash bench/peers/vllm_env.sh /opt/venvs/vllm/bin/python -m bench.peers.vllm_run --model DIR --workload mixed
set -euo pipefail
venv=${VLLM_VENV:-/opt/venvs/vllm}
last_cpu=$(($(nproc) - 1))
# awk reads to the end: an early exit would SIGPIPE ldconfig and fail the pipeline.
tcmalloc=$(ldconfig -p | awk '/libtcmalloc_minimal\.so\.4 / && !found {print $NF; found = 1}')
[ -n "$tcmalloc" ] || { echo "libtcmalloc-minimal4 missing: bash bench/peers/setup_vllm_venv.sh" >&2; exit 1; }
export LD_PRELOAD="$tcmalloc:$venv/lib/libiomp5.so${LD_PRELOAD:+:$LD_PRELOAD}"
export VLLM_CPU_OMP_THREADS_BIND=${VLLM_CPU_OMP_THREADS_BIND:-0-$last_cpu}
export VLLM_CPU_NUM_OF_RESERVED_CPU=${VLLM_CPU_NUM_OF_RESERVED_CPU:-0}
export VLLM_ENABLE_V1_MULTIPROCESSING=${VLLM_ENABLE_V1_MULTIPROCESSING:-0}
export VLLM_CPU_KVCACHE_SPACE=${VLLM_CPU_KVCACHE_SPACE:-2}
exec "$@"
