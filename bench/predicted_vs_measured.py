"""Cost-model prediction against `nanoflex bench` measurement, for several policies, one sitting.

    python bench/predicted_vs_measured.py [--model M] [--prompt-len 128] [--gen-len 16]
        [--num-prompts 12] [--device cpu] [--json OUT.json]

Prints a Markdown table (the one in docs/policy.md). Uses the cached hardware
profile (`nanoflex profile`) for the predictions.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile

from engine import LLM
from engine.cli import run_bench
from engine.planning import Workload, predict
from policy import Policy

POLICIES: dict[str, Policy | str] = {
    "auto (searched)": "auto",
    "all on compute device": Policy(gpu_batch_size=12),
    "weights on disk": Policy(gpu_batch_size=12, weights_frac=(0.0, 0.0, 1.0)),
    "weights cpu, KV cpu + CPU attention": Policy(
        gpu_batch_size=12,
        weights_frac=(0.0, 1.0, 0.0),
        kv_frac=(0.0, 1.0, 0.0),
        cpu_attention=True,
    ),
    "4-bit weights on cpu": Policy(
        gpu_batch_size=12, weights_frac=(0.0, 1.0, 0.0), compress_weights=True
    ),
    "KV and activations on disk": Policy(
        gpu_batch_size=12, kv_frac=(0.0, 0.0, 1.0), act_frac=(0.0, 0.0, 1.0)
    ),
}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--gen-len", type=int, default=16)
    parser.add_argument("--num-prompts", type=int, default=12)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--json", default=None, help="also write the raw results here")
    args = parser.parse_args()
    workload = Workload(args.prompt_len, args.gen_len)
    rows = []
    for name, policy in POLICIES.items():
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
            measured = run_bench(llm, args.prompt_len, args.gen_len, args.num_prompts)
            predicted = predict(llm.policy, llm.executor.model_dir, workload)
        rows.append({"name": name, "measured": measured, "predicted": predicted})
        print(f"{name}: done", file=sys.stderr)
    print(
        "| policy | measured gen tok/s | predicted gen tok/s | ratio | measured decode | "
        "predicted decode | predicted bottleneck |"
    )
    print("| --- | ---: | ---: | ---: | ---: | ---: | --- |")
    for row in rows:
        m, p = row["measured"], row["predicted"] or {}
        gen_p = p.get("generation_throughput", float("nan"))
        print(
            f"| {row['name']} | {m['generation_throughput']:.1f} | {gen_p:.1f} | "
            f"{m['generation_throughput'] / gen_p:.2f} | {m['decode_throughput']:.1f} | "
            f"{p.get('decode_throughput', float('nan')):.1f} | {p.get('bottleneck', '-')} |"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2, default=str)
    return 0


if __name__ == "__main__":
    sys.exit(main())
