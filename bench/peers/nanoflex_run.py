"""nanoflex timed as its peers are, in a child process of its own: one GPU comparison case
(`case`, timed by `nanoflex bench`'s `run_bench`) or one named workload (`workload`, timed as
bench/peers/vllm_run.py times vLLM).

    python -m bench.peers.nanoflex_run case --model opt-30b [--variant auto] [--prompt-len 512]
        [--gen-len 32] [--gpu-mem BYTES] [--cpu-mem BYTES] [--device cuda]
        [--flexgen-policy JSON] [--json OUT]
    python -m bench.peers.nanoflex_run workload --model M --workload mixed
        [--dtype float32|bfloat16] [--policy auto|FILE] [--json OUT]

`case` is what `bench.gpu.compare` starts, under a hard timeout. Variants
(bench.gpu.cases.VARIANTS): `auto` is the searched policy; `overlap-off` the same with overlap
off; `cpu-attention-off` and `compression-off` the best policy the search finds without that
feature; `flexgen-policy` FlexGen's hand-picked one; `piecewise-graphs-off` the searched policy
with mixed and prefill steps eager (decode steps keep their CUDA graphs:
`--no-piecewise-graphs`). One block of the policy's size is run after a one-request warm-up.

`workload` is what `bench.peers.vs_vllm` and `bench.peers.before_after` start, one fresh
process per run. The engine is built with its defaults (the searched policy for this machine),
one warm-up `generate` of four short prompts runs, then ONE timed `generate` of every prompt as
token ids, greedy with EOS ignored: the same calls vLLM's child makes, so both time the same
work. Stdlib and the engine only: before_after copies this file into an older checkout.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

from bench.peers.workloads import build, child_main, record
from policy import Policy

SYSTEM = "nanoflex"
CASE = "nanoflex on one GPU comparison case and one variant, timed by `run_bench`."
WORKLOAD = "nanoflex on one named workload, timed as vLLM's child times vLLM."


def plan(variant: str, model_dir: Path, args: argparse.Namespace) -> Policy:
    """The policy a variant runs (searched with the same budgets nanoflex's `auto` uses)."""
    if variant == "flexgen-policy":
        if not args.flexgen_policy:
            raise ValueError("the flexgen-policy variant needs --flexgen-policy")
        return Policy.from_json(args.flexgen_policy)
    from engine.core.auto_policy import hardware_profile
    from policy.catalog import resolve_model_spec
    from policy.search import search
    from policy.specs import WorkloadSpec

    result = search(
        resolve_model_spec(str(model_dir)),
        WorkloadSpec(args.prompt_len, args.gen_len),
        hardware_profile(args.device),
        gpu_mem=args.gpu_mem,
        cpu_mem=args.cpu_mem,
        allow_compression=variant != "compression-off",
        allow_cpu_attention=variant != "cpu-attention-off",
    )
    if variant == "overlap-off":
        return dataclasses.replace(result.policy, overlap=False)
    return result.policy


def run_case(args: argparse.Namespace) -> dict[str, Any]:
    from engine import LLM, SamplingParams
    from engine.loading.generated import local_model_dir
    from engine.throughput import run_bench
    from policy.specs import WorkloadSpec

    model_dir = local_model_dir(f"dummy:{args.model}")
    policy = plan(args.variant, model_dir, args)
    setup = time.perf_counter()
    with (
        tempfile.TemporaryDirectory(prefix="nanoflex-gpu-bench-") as offload,
        LLM(
            str(model_dir),
            policy=policy,
            offload_dir=offload,
            device=args.device,
            gpu_mem=args.gpu_mem,
            cpu_mem=args.cpu_mem,
            workload=WorkloadSpec(args.prompt_len, args.gen_len),
            piecewise_graphs=args.variant != "piecewise-graphs-off",
        ) as llm,
    ):
        setup_s = time.perf_counter() - setup
        warmup = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
        llm.generate([[5] * min(16, args.prompt_len)], warmup)
        result = run_bench(llm, args.prompt_len, args.gen_len, llm.policy.block_size)
    metric_keys = (
        "prefill_seconds",
        "decode_seconds",
        "prefill_throughput",
        "decode_throughput",
        "generation_throughput",
        "num_prompts",
        "num_steps",
    )
    return {
        "ok": True,
        "variant": args.variant,
        "policy": policy.to_dict(),
        "setup_seconds": setup_s,
        "metrics": {k: result[k] for k in metric_keys},
        "placement": result["placement"],
        "dtype": result["dtype"],
    }


def run_workload(args: argparse.Namespace) -> dict[str, Any]:
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


def workload_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None, help="default: SmolLM2-135M-Instruct")
    parser.add_argument("--dtype", default=None, choices=("float32", "bfloat16"))
    parser.add_argument("--policy", default="auto", help="'auto' or a policy JSON file")


def case_main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="nanoflex_run case", description=CASE)
    parser.add_argument("--model", required=True, help="built-in shape or config directory")
    parser.add_argument("--variant", default="auto")
    parser.add_argument("--prompt-len", type=int, default=512)
    parser.add_argument("--gen-len", type=int, default=32)
    parser.add_argument("--gpu-mem", type=int, default=None, help="bytes; default whole card")
    parser.add_argument("--cpu-mem", type=int, default=None, help="bytes")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--flexgen-policy", default=None, help="Policy JSON")
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    try:
        record = run_case(args)
    except Exception as e:  # infeasible plans, OOM, budget errors: all are results here
        traceback.print_exc()
        record = {"ok": False, "variant": args.variant, "error": f"{type(e).__name__}: {e}"}
    if args.json:
        Path(args.json).write_text(json.dumps(record, indent=2, default=str) + "\n")
    return 0 if record["ok"] else 1


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["case"]:
        return case_main(argv[1:])
    if argv[:1] == ["workload"]:
        return child_main(WORKLOAD, run_workload, workload_arguments, argv[1:])
    print("usage: python -m bench.peers.nanoflex_run case|workload [FLAGS]", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
