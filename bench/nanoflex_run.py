"""nanoflex on one case and one variant, timed by `nanoflex bench`'s `run_bench`.

Child entry point (what `bench.gpu_compare` starts, under a hard timeout):

    python -m bench.nanoflex_run --model opt-30b [--variant auto] [--prompt-len 512]
        [--gen-len 32] [--gpu-mem BYTES] [--cpu-mem BYTES] [--device cuda]
        [--flexgen-policy JSON] [--json OUT]

Variants (bench.gpu_cases.VARIANTS): `auto` is the searched policy; `overlap-off` the
same with overlap off; `cpu-attention-off` and `compression-off` the best policy the
search finds without that feature; `flexgen-policy` FlexGen's hand-picked one;
`piecewise-graphs-off` the searched policy with mixed and prefill steps eager (decode steps
keep their CUDA graphs: `--no-piecewise-graphs`). One block of the policy's size is run
after a one-request warm-up.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

from policy import Policy


def plan(variant: str, model_dir: Path, args: argparse.Namespace) -> Policy:
    """The policy a variant runs (searched with the same budgets nanoflex's `auto` uses)."""
    if variant == "flexgen-policy":
        if not args.flexgen_policy:
            raise ValueError("the flexgen-policy variant needs --flexgen-policy")
        return Policy.from_json(args.flexgen_policy)
    from engine.core.planning import hardware_profile
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


def run(args: argparse.Namespace) -> dict[str, Any]:
    from engine import LLM, SamplingParams
    from engine.bench import run_bench
    from engine.loading.generated import local_model_dir
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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
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
        record = run(args)
    except Exception as e:  # infeasible plans, OOM, budget errors: all are results here
        traceback.print_exc()
        record = {"ok": False, "variant": args.variant, "error": f"{type(e).__name__}: {e}"}
    if args.json:
        Path(args.json).write_text(json.dumps(record, indent=2, default=str) + "\n")
    return 0 if record["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
