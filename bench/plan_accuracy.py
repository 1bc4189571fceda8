"""The searched policy's predicted vs measured throughput, profile and runs in one sitting.

    python -m bench.plan_accuracy [--models nanoflex-demo smollm2-135m-instruct]
        [--prompt-len 512] [--gen-len 32] [--num-prompts 8] [--repeat 3] [--device cpu]
        [--json OUT.json]

Measures a full hardware profile first (what `nanoflex profile` measures, cached where it
caches it), then runs `nanoflex bench`'s measurement with `--policy auto` on each model,
interleaved, and prints a Markdown table (the one in docs/policy.md, "Accuracy of the
searched plan"). The defaults are `nanoflex bench`'s workload.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from bench.common import Table, parse_args, run_policies, write_json
from engine.core.model_files import DEFAULT_MODEL, DEMO_MODEL
from engine.core.planning import realized_policy
from engine.profiling.profiler import profile_hardware
from policy import Policy
from policy.hardware import default_cache_path

TARGET = 0.25
"""The accuracy the docs promise for the searched plan on this CPU: within 25% of measured."""


def _extra(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--models", nargs="+", default=[DEMO_MODEL, DEFAULT_MODEL])
    parser.set_defaults(prompt_len=512, gen_len=32, num_prompts=8)  # nanoflex bench's defaults


def main() -> int:
    args = parse_args(__doc__ or "", _extra)
    print("profiling (about two minutes)...", file=sys.stderr)
    hardware = profile_hardware(args.device)
    hardware.save(default_cache_path())
    rows: list[dict[str, Any]] = []
    for model in args.models:
        per_model = argparse.Namespace(**{**vars(args), "model": model})
        for row in run_policies({"auto": "auto"}, per_model):
            rows.append({**row, "model": model})
    table = Table(
        [
            "model",
            "searched policy",
            "measured gen tok/s",
            "predicted gen tok/s",
            "measured / predicted",
            "measured prefill",
            "predicted prefill",
            "measured decode",
            "predicted decode",
            "within 25%",
        ]
    )
    for row in rows:
        m, p = row["measured"], row["predicted"] or {}
        ratio = m["generation_throughput"] / p["generation_throughput"]
        policy = m["policy"]
        where = (
            "offloaded"
            if min(policy["weights_frac"][0], policy["kv_frac"][0]) < 1
            else ("all on compute device")
        )
        ran = realized_policy(Policy.from_dict(policy), m["num_prompts"])
        shape = (
            f"{policy['gpu_batch_size']}x{policy['num_gpu_batches']}, {where}; "
            f"{m['num_prompts']} prompts ran as {ran.gpu_batch_size}x{ran.num_gpu_batches}"
        )
        table.rows.append(
            [
                row["model"],
                shape,
                f"{m['generation_throughput']:.1f}",
                f"{p['generation_throughput']:.1f}",
                f"{ratio:.2f}",
                f"{m['prefill_throughput']:.1f}",
                f"{p['prefill_throughput']:.1f}",
                f"{m['decode_throughput']:.1f}",
                f"{p['decode_throughput']:.1f}",
                "yes" if abs(ratio - 1) <= TARGET else "no",
            ]
        )
    print(table.markdown("llrrrrrrrl"))
    write_json(args.json, [{"hardware": hardware.to_dict()}, *rows], table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
