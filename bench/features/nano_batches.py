"""Nano-batch ablation (NanoFlow 4.3, its Fig. 13): 1 vs 2 vs 4 nano-batches, each count both
overlapped and split only ("nano-batch-only": the same pieces run one after another, which
isolates the cost of cutting from the gain of overlapping).

    python -m bench.features.nano_batches [--model M] [--prompt-len 512] [--gen-len 32]
        [--device cpu] [--gpu-batch-size 16] [--repeat 3] [--json OUT]

The cost model's column uses the cached hardware profile (`nanoflex profile`, which measures
the overlap shares the nano-batch term needs); "-" where it has none.

Two cases, the two places nano-batching is for, one GPU batch of `--gpu-batch-size` each:
- KV cache offloaded to host memory with CPU attention: decode attention on the CPU beside
  the device's dense ops (on a CPU thread); the weights stay on the device, so that both
  sides have work (with weights crossing PCIe every step the copies would bind instead);
- resident: everything on the compute device, the attention of one nano-batch beside the
  dense ops of another (on a second CUDA stream; a second thread where the device is a CPU).
"""

from __future__ import annotations

import argparse
import dataclasses
import sys

from bench.common import Table, Variant, parse_args, run_policies, write_json
from policy import Policy


def cases(gpu_batch_size: int) -> dict[str, Policy]:
    return {
        "KV offloaded, CPU attention": Policy(
            gpu_batch_size=gpu_batch_size, kv_frac=(0.0, 1.0, 0.0), cpu_attention=True
        ),
        "resident": Policy(gpu_batch_size=gpu_batch_size),
    }


def variants(gpu_batch_size: int) -> dict[str, Variant]:
    """Per case: one nano-batch, then 2 and 4, each split only and overlapped."""
    out: dict[str, Variant] = {}
    for case, policy in cases(gpu_batch_size).items():
        out[f"{case}|1|-"] = policy
        for n in (2, 4):
            cut = dataclasses.replace(policy, num_nano_batches=n)
            out[f"{case}|{n}|split only"] = (cut, {"nano_batch_overlap": False})
            out[f"{case}|{n}|overlapped"] = cut
    return out


def _flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--gpu-batch-size", type=int, default=16)


def main() -> int:
    args = parse_args(__doc__ or "", _flags)
    rows = run_policies(variants(args.gpu_batch_size), args, median_of="decode_throughput")
    header = [
        "case",
        "nano-batches",
        "mode",
        "decode tok/s",
        "decode vs 1",
        "cost model: decode vs 1",
        "generation tok/s",
    ]
    table = Table(header)
    base: dict[str, tuple[float, float | None]] = {}
    for row in rows:
        case, count, mode = row["name"].split("|")
        measured, predicted = row["measured"], row["predicted"]
        decode = measured["decode_throughput"]
        model = None if predicted is None else predicted["decode_throughput"]
        base.setdefault(case, (decode, model))
        model_ratio = "-"  # split only is an ablation, not a policy the model prices
        if mode != "split only" and model is not None and base[case][1]:
            model_ratio = f"{model / base[case][1]:.2f}"
        table.rows.append(
            [
                case,
                count,
                mode,
                f"{decode:.1f}",
                f"{decode / base[case][0]:.2f}",
                model_ratio,
                f"{measured['generation_throughput']:.1f}",
            ]
        )
    print(table.markdown("lllrrrr"))
    write_json(args.json, rows, table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
