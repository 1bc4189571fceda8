"""Ablation of the speed features: each switched off in turn from one base policy.

    python -m bench.features.ablation [--model M] [--base offloaded|resident] [--prompt-len 128]
        [--gen-len 16] [--num-prompts 12] [--only "slots,overlap"]

`offloaded` (the default): weights on disk (the I/O-bound case offloading is for), KV on
the cpu tier with CPU attention, overlap on, no compression, discrete batching on.
`resident`: everything on the compute device, where the step's hot path decides (paged
attention, inline loads, the step on the loading thread). Each row flips one switch.
"""

from __future__ import annotations

import argparse
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
    "weight slots off (each layer read into fresh memory)": (BASE, {"weight_slots": False}),
}


RESIDENT = Policy(overlap=True)
RESIDENT_VARIANTS: dict[str, Variant] = {
    "base (overlap, paged attention, native kernel, prepacked weights, discrete batching)": (
        RESIDENT
    ),
    "paged attention off": (RESIDENT, {"paged_attention": False}),
    "native kernels off (gather + SDPA, torch's norm/rotary/SiLU)": (
        RESIDENT,
        {"native_kernels": False},
    ),
    "prepacked weights off (F.linear)": (RESIDENT, {"prepack_weights": False}),
    "overlap off": dataclasses.replace(RESIDENT, overlap=False),
    "planning ahead on (step on a worker thread)": (RESIDENT, {"async_scheduling": True}),
    "discrete batching off": (RESIDENT, {"discrete_batching": False}),
}


def _base_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--base", choices=("offloaded", "resident"), default="offloaded")
    parser.add_argument(
        "--only",
        default="",
        help="comma-separated words: only the base and the variants whose name holds one",
    )


def chosen(variants: dict[str, Variant], only: str) -> dict[str, Variant]:
    """The base (the first variant) and those named by `only` (all when empty)."""
    words = [w.strip() for w in only.split(",") if w.strip()]
    base = next(iter(variants))
    return {
        name: v
        for name, v in variants.items()
        if not words or name == base or any(w in name for w in words)
    }


def main() -> int:
    args = parse_args(__doc__ or "", _base_flag)
    variants = RESIDENT_VARIANTS if args.base == "resident" else VARIANTS
    rows = run_policies(chosen(variants, args.only), args)
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
