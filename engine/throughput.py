"""`nanoflex bench`: FlexGen's throughput metrics for one model, policy and workload."""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from typing import Any

import torch

from base.errors import UserError
from engine.core.auto_policy import predict, realized_policy
from engine.core.engine_args import EngineArgs
from engine.core.sampling_params import SamplingParams
from engine.core.sequence import Request
from engine.llm import LLM
from policy.plan import add_length_args
from policy.specs import WorkloadSpec
from policy.units import format_bytes


def add_arguments(parser: argparse.ArgumentParser) -> None:
    EngineArgs.add_cli_args(parser)
    add_length_args(parser)
    parser.add_argument("--num-prompts", type=int, default=8, help="requests, all run together")
    parser.add_argument("--json", action="store_true", help="print one JSON object, not a table")
    parser.add_argument(
        "--trace",
        default=None,
        metavar="FILE",
        help="write a Chrome trace-event JSON of every load, store and compute (Perfetto)",
    )


def main(args: argparse.Namespace) -> int:
    if min(args.prompt_len, args.gen_len, args.num_prompts) < 1:
        raise UserError("--input-len, --output-len and --num-prompts must be at least 1")
    engine_args = EngineArgs.from_cli_args(
        args,
        show_progress=True,
        workload=WorkloadSpec(args.prompt_len, args.gen_len),
        trace=args.trace,
    )
    with LLM.from_engine_args(engine_args) as llm:
        result = run_bench(llm, args.prompt_len, args.gen_len, args.num_prompts)
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        print_bench(result)
    warning = prediction_warning(result)
    if warning:
        print(warning, file=sys.stderr)
    return 0


def run_bench(
    llm: LLM, prompt_len: int, gen_len: int, num_prompts: int, progress: bool = True
) -> dict[str, Any]:
    """FlexGen's metrics (docs/benchmarks.md) over prompts of exactly prompt_len random tokens,
    gen_len tokens each, EOS ignored. Prefill time runs until every prompt has its first token.
    `progress`: a line on stderr each step."""
    vocab = llm.executor.config.vocab_size
    generator = torch.Generator().manual_seed(0)
    params = SamplingParams(max_tokens=gen_len, temperature=0.0, ignore_eos=True)
    for i in range(num_prompts):
        prompt = torch.randint(3, vocab, (prompt_len,), generator=generator).tolist()
        llm.step_loop.add_request(Request(f"bench-{i}", prompt, params))
    started: set[str] = set()
    start = time.perf_counter()
    prefill_done = None
    steps = 0
    while llm.step_loop.has_unfinished():
        for delta in llm.step_loop.step():
            if delta.new_token_ids:
                started.add(delta.request_id)
        steps += 1
        if prefill_done is None and len(started) == num_prompts:
            prefill_done = time.perf_counter()
        if progress:
            print(
                f"\rbench: step {steps}, {len(started)}/{num_prompts} prefilled",
                end="",
                file=sys.stderr,
            )
    if progress:
        print(file=sys.stderr)
    end = time.perf_counter()
    prefill_s = (prefill_done or end) - start
    decode_s = end - (prefill_done or end)
    placement = llm.placement()
    warmed = llm.executor.warmed
    result = {
        "model": str(llm.executor.model_dir),
        "device": placement.device,
        "dtype": placement.dtype,
        "prompt_len": prompt_len,
        "gen_len": gen_len,
        "num_prompts": num_prompts,
        "policy": llm.policy.to_dict(),
        "prefill_seconds": prefill_s,
        "decode_seconds": decode_s,
        "prefill_throughput": num_prompts * prompt_len / prefill_s,
        "decode_throughput": num_prompts * (gen_len - 1) / decode_s if decode_s > 0 else 0.0,
        "generation_throughput": num_prompts * gen_len / (prefill_s + decode_s),
        "num_steps": steps,
        "placement": dataclasses.asdict(placement),
        # start-up's warm-up (CUDA graphs captured, Triton kernels compiled), before the timing
        "warm_up": None if warmed is None else dataclasses.asdict(warmed),
        # for the block these prompts actually ran in (a plan is made for a full block)
        "predicted": predict(
            realized_policy(llm.policy, num_prompts),
            llm.executor.model_dir,
            WorkloadSpec(prompt_len, gen_len),
            dtype=placement.dtype,
        ),
    }
    result["table"] = figure_table(result)
    return result


OFF_BY = 2.0
"""`nanoflex bench` warns when measured and predicted generation throughput differ by more."""


def prediction_warning(r: dict[str, Any]) -> str | None:
    """One line when the cost model is off by more than OFF_BY on generation throughput."""
    predicted = r["predicted"]
    if not predicted or not predicted["generation_throughput"]:
        return None
    ratio = r["generation_throughput"] / predicted["generation_throughput"]
    if 1 / OFF_BY <= ratio <= OFF_BY:
        return None
    return (
        f"nanoflex bench: warning: measured {ratio:.2f}x the predicted generation throughput "
        f"(more than {OFF_BY:g}x off): the plan rests on a wrong profile; run `nanoflex "
        "profile` on an idle machine, or pass --policy"
    )


def figure_table(r: dict[str, Any]) -> dict[str, Any]:
    """Measured next to predicted throughput, as the docs show it (`--json` carries it)."""
    predicted = r["predicted"] or {}
    rows = [
        [
            f"{stage} throughput",
            f"{r[f'{stage}_throughput']:.1f}",
            f"{predicted[f'{stage}_throughput']:.1f}" if predicted else "-",
        ]
        for stage in ("prefill", "decode", "generation")
    ]
    header = ["metric (FlexGen's definitions)", "measured tok/s", "cost model tok/s"]
    return {"header": header, "rows": rows}


def print_bench(r: dict[str, Any]) -> None:
    p = r["placement"]
    print(f"model        {r['model']} on {r['device']} ({r['dtype']})")
    print(f"workload     {r['num_prompts']} prompts x {r['prompt_len']} tokens, gen {r['gen_len']}")
    print(f"policy       {json.dumps(r['policy'])}")
    for kind in ("weights", "kv", "act"):
        tiers = ", ".join(f"{t} {format_bytes(n)}" for t, n in p[f"{kind}_bytes"].items())
        print(f"{kind + ' bytes':12s} {tiers}")
    print(f"prefill      {r['prefill_throughput']:10.1f} tokens/s  ({r['prefill_seconds']:.3f} s)")
    print(f"decode       {r['decode_throughput']:10.1f} tokens/s  ({r['decode_seconds']:.3f} s)")
    print(f"generation   {r['generation_throughput']:10.1f} tokens/s  ({r['num_steps']} steps)")
    if r.get("warm_up"):
        w = r["warm_up"]
        print(
            f"warm-up      {w['seconds']:.1f} s at start: {w['graphs_captured']} CUDA graphs, "
            f"{w['kernels_compiled']} Triton specializations"
        )
    if r["predicted"]:
        predicted = r["predicted"]
        print(
            f"predicted    prefill {predicted['prefill_throughput']:.1f}, decode "
            f"{predicted['decode_throughput']:.1f}, generation "
            f"{predicted['generation_throughput']:.1f} tokens/s (cost model)"
        )
        ratio = r["generation_throughput"] / predicted["generation_throughput"]
        print(f"measured     {ratio:.2f}x the predicted generation throughput")
