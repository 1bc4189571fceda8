"""Ablation of the speed features: each switched off in turn from one offloaded policy.

    python -m bench.ablation [--model M] [--prompt-len 128] [--gen-len 16] [--num-prompts 12]

Base: weights on disk (the I/O-bound case offloading is for), KV on the cpu tier
with CPU attention, overlap on, no compression, discrete batching on. Each row flips
one switch.
"""

from __future__ import annotations

import dataclasses
import sys

from bench.common import Table, Variant, parse_args, run_policies, write_json
from policy import Policy

BASE = Policy(
    gpu_batch_size=8,
    num_gpu_batches=2,
    weights_frac=(0.0, 0.0, 1.0),
    kv_frac=(0.0, 1.0, 0.0),
    cpu_attention=True,
    overlap=True,
)
VARIANTS: dict[str, Variant] = {
    "base (overlap, CPU attention, discrete batching)": BASE,
    "overlap off": dataclasses.replace(BASE, overlap=False),
    "CPU attention off": dataclasses.replace(BASE, cpu_attention=False),
    "4-bit weights on": dataclasses.replace(BASE, compress_weights=True),
    "4-bit KV on": dataclasses.replace(BASE, compress_kv=True),
    "discrete batching off": (BASE, {"discrete_batching": False}),
}


def main() -> int:
    args = parse_args(__doc__ or "")
    rows = run_policies(VARIANTS, args)
    base = rows[0]["measured"]["generation_throughput"]
    table = Table(["variant", "generation tok/s", "decode tok/s", "prefill tok/s", "vs base"])
    for row in rows:
        m = row["measured"]
        table.rows.append(
            [
                row["name"],
                f"{m['generation_throughput']:.1f}",
                f"{m['decode_throughput']:.1f}",
                f"{m['prefill_throughput']:.1f}",
                f"{m['generation_throughput'] / base:.2f}",
            ]
        )
    print(table.markdown("lrrrr"))
    write_json(args.json, rows, table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
