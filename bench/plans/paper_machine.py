"""Our plans next to FlexGen's on the FlexGen paper machine (docs/policy.md section 6).

    python -m bench.plans.paper_machine [--json bench/results/plans-flexgen-t4.json]

For each Table 15 case (prompt 512, gen 32, `FLEXGEN_T4`): FlexGen's policy and its
reported throughput, our cost model evaluated at FlexGen's policy, and the policy our
search picks with its prediction, its bottleneck, the thread counts, how many LPs the
search solved and how long it took. Torch-free: only the policy package runs.
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any

from bench.common import Table, write_json
from policy import Policy
from policy.catalog import BUILTIN_MODELS
from policy.cost_model import estimate
from policy.hardware import FLEXGEN_T4
from policy.paper import FLEXGEN_TABLE15
from policy.search import PlanResult, search
from policy.specs import WorkloadSpec

WORKLOAD = WorkloadSpec(prompt_len=512, gen_len=32)
FLEXGEN_REPORTED = {  # generation tok/s, FlexGen paper Table 15 (arXiv version)
    "opt-30b": 7.32,
    "opt-30b-compressed": 8.70,
    "opt-175b": 0.69,
    "opt-175b-compressed": 1.12,
}


def notation(policy: Policy) -> str:
    """FlexGen's (gbs x #gb, wg, wc, cg, cc, hg, hc) in percent, plus attention and 4-bit."""
    percents = [
        policy.weights_frac[0],
        policy.weights_frac[1],
        policy.kv_frac[0],
        policy.kv_frac[1],
        policy.act_frac[0],
        policy.act_frac[1],
    ]
    parts = [f"{policy.gpu_batch_size}x{policy.num_gpu_batches}"]
    parts += [f"{100 * p:.0f}" for p in percents]
    parts.append("CPU attn" if policy.cpu_attention else "GPU attn")
    packed = [k for k, on in (("W", policy.compress_weights), ("KV", policy.compress_kv)) if on]
    if packed:
        parts.append("4-bit " + "+".join(packed) + (" only" if len(packed) == 1 else ""))
    return ", ".join(parts)


def plan_case(case: str) -> dict[str, Any]:
    model = BUILTIN_MODELS[case.removesuffix("-compressed")]
    paper = FLEXGEN_TABLE15[case]
    on_paper = estimate(paper, model, WORKLOAD, FLEXGEN_T4)
    start = time.perf_counter()
    result: PlanResult = search(
        model, WORKLOAD, FLEXGEN_T4, allow_compression=case.endswith("-compressed")
    )
    seconds = time.perf_counter() - start
    return {
        "case": case,
        "flexgen_policy": paper.to_dict(),
        "flexgen_reported": FLEXGEN_REPORTED[case],
        "model_on_paper_policy": on_paper.generation_throughput,
        "paper_policy_fits": on_paper.fits,
        "paper_policy_gpu_peak_bytes": on_paper.peak_bytes["gpu"],
        "plan": result.policy.to_dict(),
        "predicted": result.predicted,
        "bottleneck": result.bottleneck,
        "num_lps": result.num_solved,
        "search_seconds": seconds,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--json", default=None, help="also write the results here")
    args = parser.parse_args(argv)
    results = [plan_case(case) for case in FLEXGEN_TABLE15]
    table = Table(
        [
            "case",
            "FlexGen policy (Table 15)",
            "FlexGen tok/s",
            "model on paper policy",
            "our plan",
            "our prediction",
            "our bottleneck",
            "threads (intra, load, store, disk)",
            "LPs solved",
            "search s",
        ]
    )
    for r in results:
        plan = Policy.from_dict(r["plan"])
        on_paper = f"{r['model_on_paper_policy']:.2f}"
        if not r["paper_policy_fits"]:
            gib = r["paper_policy_gpu_peak_bytes"] / 2**30
            on_paper += f" (needs {gib:.1f} GiB GPU: does not fit our model)"
        threads = (
            plan.num_cpu_threads,
            plan.num_load_threads,
            plan.num_store_threads,
            plan.num_copy_threads,
        )
        table.rows.append(
            [
                r["case"].upper().replace("-COMPRESSED", " (c)"),
                notation(Policy.from_dict(r["flexgen_policy"])),
                f"{r['flexgen_reported']:.2f}",
                on_paper,
                notation(plan),
                f"{r['predicted']['generation_throughput']:.2f}",
                r["bottleneck"],
                ", ".join(str(t) for t in threads),
                str(r["num_lps"]),
                f"{r['search_seconds']:.2f}",
            ]
        )
    print(table.markdown())
    write_json(args.json, results, table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
