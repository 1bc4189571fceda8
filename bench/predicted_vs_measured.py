"""Cost-model prediction against `nanoflex bench` measurement, for several policies, one sitting.

    python -m bench.predicted_vs_measured [--model M] [--prompt-len 128] [--gen-len 16]
        [--num-prompts 12] [--device cpu] [--json OUT.json]

Prints a Markdown table (the one in docs/policy.md). Uses the cached hardware
profile (`nanoflex profile`) for the predictions.
"""

from __future__ import annotations

import sys

from bench.common import Table, Variant, parse_args, run_policies, write_json
from policy import Policy

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


def main() -> int:
    args = parse_args(__doc__ or "")
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


if __name__ == "__main__":
    sys.exit(main())
