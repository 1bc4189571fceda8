"""nanoflex on one named workload (bench.workloads), timed as bench/vllm_run.py times vLLM.

Child entry point (what `bench.vs_vllm` starts, one fresh process per run):

    python -m bench.workload_run --model M --workload mixed [--dtype float32|bfloat16]
        [--policy auto|FILE] [--json OUT]

The engine is built with its defaults (the searched policy for this machine), one warm-up
`generate` of four short prompts runs, then ONE timed `generate` of every prompt as token
ids, greedy with EOS ignored: the same calls vLLM's child makes, so both time the same work.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Any

from bench.workloads import build, child_main, record

SYSTEM = "nanoflex"


def run(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    from engine import LLM, SamplingParams

    setup = time.perf_counter()
    llm = LLM(args.model, policy=args.policy, dtype=args.dtype)
    workload = build(args.workload, llm.executor.config.vocab_size)
    warmup = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    llm.generate([ids[:16] for ids, _ in workload[:4]], warmup)
    setup_s = time.perf_counter() - setup

    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for _, n in workload]
    load_before = os.getloadavg()[0]
    start = time.perf_counter()
    outputs = llm.generate([ids for ids, _ in workload], params)
    seconds = time.perf_counter() - start
    llm.close()

    generated = sum(len(o.outputs[0].token_ids) for o in outputs)
    return record(
        SYSTEM,
        args.workload,
        workload,
        generated,
        seconds,
        dtype=str(llm.executor.dtype).removeprefix("torch."),
        setup_seconds=setup_s,
        load_average_before=load_before,
        settings={"policy": llm.policy.to_dict(), "torch_threads": torch.get_num_threads()},
    )


def arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None, help="default: SmolLM2-135M-Instruct")
    parser.add_argument("--dtype", default=None, choices=("float32", "bfloat16"))
    parser.add_argument("--policy", default="auto", help="'auto' or a policy JSON file")


def main(argv: list[str] | None = None) -> int:
    return child_main(__doc__, run, arguments, argv)


if __name__ == "__main__":
    sys.exit(main())
