"""The cost model's predicted throughput against `nanoflex bench`'s measured, one sitting.

    python -m bench.plans.accuracy searched [--models nanoflex-demo smollm2-135m-instruct]
        [--prompt-len 512] [--gen-len 32] [--num-prompts 8] [--repeat 3] [--device cpu]
        [--json OUT.json]
    python -m bench.plans.accuracy policies [--model M] [--prompt-len 128] [--gen-len 16]
        [--num-prompts 12] [--device cpu] [--json OUT.json]

`searched` measures a full hardware profile first (what `nanoflex profile` measures, cached
where it caches it), then runs `nanoflex bench`'s measurement with `--policy auto` on each
model, interleaved, and prints a Markdown table (the one in docs/policy.md, "Accuracy of the
searched plan"). Its defaults are `nanoflex bench`'s workload.

`policies` runs several policies (the searched one and fixed placements), interleaved, and
prints a Markdown table (the one in docs/policy.md). It uses the cached hardware profile
(`nanoflex profile`) for the predictions.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from bench.common import Table, Variant, parse_args, run_policies, write_json
from engine.core.auto_policy import realized_policy
from engine.core.model_files import DEFAULT_MODEL, DEMO_MODEL
from engine.profiling.profiler import profile_hardware
from policy import Policy
from policy.hardware import default_cache_path

SEARCHED = (
    "The searched policy's predicted vs measured throughput, profile and runs in one sitting."
)
POLICIES_DOC = "Cost-model prediction against `nanoflex bench` measurement, for several policies."

TARGET = 0.25
"""The accuracy the docs promise for the searched plan on this CPU: within 25% of measured."""


def _extra(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--models", nargs="+", default=[DEMO_MODEL, DEFAULT_MODEL])
    parser.set_defaults(prompt_len=512, gen_len=32, num_prompts=8)  # nanoflex bench's defaults


def searched(argv: list[str]) -> int:
    """The searched policy on each model, after a fresh full profile."""
    args = parse_args(SEARCHED, _extra, argv)
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


POLICIES: dict[str, Variant] = {
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
    "KV on disk": Policy(gpu_batch_size=12, kv_frac=(0.0, 0.0, 1.0)),
    "KV and activations on disk": Policy(
        gpu_batch_size=12, kv_frac=(0.0, 0.0, 1.0), act_frac=(0.0, 0.0, 1.0)
    ),
}


def policies(argv: list[str]) -> int:
    """Several fixed policies and the searched one, on the cached profile."""
    args = parse_args(POLICIES_DOC, argv=argv)
    rows = run_policies(POLICIES, args)
    table = Table(
        [
            "policy",
            "block",
            "measured gen tok/s",
            "predicted gen tok/s",
            "measured / predicted",
            "measured decode",
            "predicted decode",
            "predicted bottleneck",
        ]
    )
    for row in rows:
        m, p = row["measured"], row["predicted"] or {}
        gen_p = p.get("generation_throughput", float("nan"))
        block = m["policy"]["gpu_batch_size"] * m["policy"]["num_gpu_batches"]
        table.rows.append(
            [
                row["name"],
                str(block),
                f"{m['generation_throughput']:.1f}",
                f"{gen_p:.1f}",
                f"{m['generation_throughput'] / gen_p:.2f}",
                f"{m['decode_throughput']:.1f}",
                f"{p.get('decode_throughput', float('nan')):.1f}",
                str(p.get("bottleneck", "-")),
            ]
        )
    print(table.markdown("lrrrrrrl"))
    write_json(args.json, rows, table)
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    modes = {"searched": searched, "policies": policies}
    if not argv or argv[0] not in modes:
        print("usage: python -m bench.plans.accuracy searched|policies [FLAGS]", file=sys.stderr)
        return 2
    return modes[argv[0]](argv[1:])


if __name__ == "__main__":
    sys.exit(main())
