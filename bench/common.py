"""Shared by the bench scripts: run `nanoflex bench`'s measurement under several policies."""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from typing import Any

from engine import LLM
from engine.bench import run_bench
from engine.core.planning import predict
from policy import Policy
from policy.specs import WorkloadSpec


def parse_args(doc: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("--model", default=None, help="default: smollm2-135m-instruct")
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--gen-len", type=int, default=16)
    parser.add_argument(
        "--num-prompts", type=int, default=0, help="default: one full block of each policy"
    )
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--repeat", type=int, default=3, help="runs per policy (median kept)")
    parser.add_argument("--json", default=None, help="also write the raw results here")
    return parser.parse_args()


def run_policies(
    policies: dict[str, Policy | str], args: argparse.Namespace
) -> list[dict[str, Any]]:
    """One row per policy: the median (by generation throughput) of `args.repeat` bench runs,
    interleaved across policies so slow drift of a shared machine hits them alike, and the
    cost model's prediction."""
    workload = WorkloadSpec(args.prompt_len, args.gen_len)
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in policies}
    predicted: dict[str, dict[str, Any] | None] = {}
    for _ in range(args.repeat):
        for name, policy in policies.items():
            with (
                tempfile.TemporaryDirectory(prefix="nanoflex-bench-") as offload,
                LLM(
                    args.model,
                    policy=policy,
                    offload_dir=offload,
                    device=args.device,
                    workload=workload,
                    max_step_tokens=None,
                ) as llm,
            ):
                num_prompts = args.num_prompts or llm.policy.block_size
                runs[name].append(run_bench(llm, args.prompt_len, args.gen_len, num_prompts))
                predicted[name] = predict(llm.policy, llm.executor.model_dir, workload)
            print(f"{name}: run {len(runs[name])}/{args.repeat}", file=sys.stderr)
    rows = []
    for name, results in runs.items():
        ranked = sorted(results, key=lambda r: r["generation_throughput"])
        rows.append(
            {
                "name": name,
                "measured": ranked[len(ranked) // 2],
                "runs": results,
                "predicted": predicted[name],
            }
        )
    return rows


def write_json(path: str | None, rows: list[dict[str, Any]]) -> None:
    """--json: the raw rows, for bench/results/ and plots."""
    if path:
        with open(path, "w") as f:
            json.dump(rows, f, indent=2, default=str)
