"""Plans for the two built-in MoE shapes on the measured H100 profile (docs/policy.md,
Mixture-of-experts).

    python -m bench.plans.moe [--json bench/results/plans-moe-h100.json]

Mixtral-8x7B and Qwen3-30B-A3B (built-in shapes, no download), prompt 512, generation 32, on
bench/results/hardware-h100.json with its own GPU memory (an H100 80 GB) and with a 24 GiB
budget (`nanoflex plan --gpu-mem 24GiB`): where the experts live, what a block touches and
loads, whether the CPU computes experts, and the prediction. Torch-free.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

from bench.common import Table, write_json
from policy import Policy
from policy.catalog import BUILTIN_MODELS
from policy.hardware import HardwareSpec
from policy.plan import moe_summary
from policy.search import search
from policy.specs import WorkloadSpec
from policy.units import format_bytes, parse_bytes

PROFILE = Path(__file__).resolve().parents[1] / "results" / "hardware-h100.json"
WORKLOAD = WorkloadSpec(prompt_len=512, gen_len=32)
MODELS = ("mixtral-8x7b", "qwen3-30b-a3b")
GPU_BUDGETS = ("24GiB", None)
"""`--gpu-mem` of each case; None: the profile's own (the H100's 79.2 GiB)."""


def plan_case(name: str, gpu_mem: str | None, hardware: HardwareSpec) -> dict[str, Any]:
    model = BUILTIN_MODELS[name]
    start = time.perf_counter()
    result = search(
        model, WORKLOAD, hardware, gpu_mem=None if gpu_mem is None else parse_bytes(gpu_mem)
    )
    return {
        "model": name,
        "gpu_mem": gpu_mem or format_bytes(hardware.gpu_mem_bytes),
        "plan": result.policy.to_dict(),
        "predicted": result.predicted,
        "bottleneck": result.bottleneck,
        "moe": moe_summary(model, result),
        "num_lps": result.num_solved,
        "search_seconds": time.perf_counter() - start,
    }


def _percent(triple: list[float]) -> str:
    return " / ".join(f"{100 * v:.0f}" for v in triple)


def row(r: dict[str, Any]) -> list[str]:
    plan, moe, predicted = Policy.from_dict(r["plan"]), r["moe"], r["predicted"]
    decode = moe["decode"]
    flags = (
        ("4-bit W", plan.compress_weights),
        ("4-bit KV", plan.compress_kv),
        ("CPU attn", plan.cpu_attention),
    )
    formats = [name for name, on in flags if on]
    experts = moe["experts_per_layer"]
    cpu = "on" if moe["cpu_experts"] else "off"
    return [
        r["model"],
        r["gpu_mem"],
        f"{plan.gpu_batch_size}x{plan.num_gpu_batches}",
        ", ".join(formats) or "none",
        _percent(list(plan.weights_frac)),
        f"{experts['gpu']} / {experts['cpu']} / {experts['disk']}",
        _percent(list(plan.kv_frac)),
        f"{moe['active_params'] / 1e9:.2f}B of {moe['total_params'] / 1e9:.2f}B",
        f"{decode['distinct_experts']:.2f} of {moe['num_experts']}",
        format_bytes(decode["expert_bytes_per_layer"]),
        f"{decode['tokens_per_expert']:.0f}",
        f"{cpu} (break-even {moe['cpu_expert_break_even_tokens']})",
        throughput_cell(predicted),
        r["bottleneck"],
    ]


def throughput_cell(predicted: dict[str, float]) -> str:
    """'prefill / decode / generation' tokens per second of a plan's prediction."""
    return (
        f"{predicted['prefill_throughput']:.0f} / {predicted['decode_throughput']:.0f} / "
        f"{predicted['generation_throughput']:.0f}"
    )


def parse_plan_args(argv: list[str] | None, doc: str | None) -> argparse.Namespace:
    """A plans bench's arguments: --json (where to write) and --hardware (the profile)."""
    parser = argparse.ArgumentParser(description=(doc or "").splitlines()[0])
    parser.add_argument("--json", default=None, help="also write the results here")
    parser.add_argument("--hardware", default=str(PROFILE), help="hardware profile JSON")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_plan_args(argv, __doc__)
    hardware = HardwareSpec.load(args.hardware)
    results = [plan_case(name, gpu_mem, hardware) for name in MODELS for gpu_mem in GPU_BUDGETS]
    table = Table(
        [
            "model",
            "GPU budget",
            "block",
            "formats",
            "other weights % gpu / cpu / disk",
            "experts per layer gpu / cpu / disk",
            "KV % gpu / cpu / disk",
            "active params",
            "distinct experts per decode block",
            "expert bytes per layer per decode block",
            "tokens per expert (decode)",
            "CPU experts",
            "predicted prefill / decode / gen tok/s",
            "bottleneck",
        ]
    )
    table.rows = [row(r) for r in results]
    print(table.markdown())
    write_json(args.json, results, table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
