"""Plans for the large hybrids on one 80 GB GPU (docs/benchmarks.md, Plans for the hybrids).

    python -m bench.plans.hybrid [--json bench/results/plans-hybrid-h100.json]

Qwen3-Next-80B-A3B, Qwen3.5-397B-A17B, Granite-4.0-H-Small, Nemotron-H-56B, Nemotron 3 Nano
(30B-A3B: its MoE layers) and Falcon-H1-34B (attention and Mamba-2 in every layer) (built-in
shapes, no download), 512-token prompts and 256 generated tokens, on the measured H100 profile
with an 80 GiB GPU, 512 GiB of host memory and a 4 TiB SSD, as `nanoflex plan` does: the
policy, the prediction, and what the states take of each tier. The cost model's predictions,
not measurements. Torch-free.
"""

from __future__ import annotations

import sys
import time
from typing import Any

from bench.common import Table, write_json
from bench.plans.moe import parse_plan_args, throughput_cell
from policy import Policy
from policy.catalog import BUILTIN_MODELS
from policy.hardware import HardwareSpec
from policy.search import search
from policy.specs import WorkloadSpec
from policy.state_cost import state_summary
from policy.units import format_bytes, parse_bytes

WORKLOAD = WorkloadSpec(prompt_len=512, gen_len=256)
BUDGETS = {"gpu_mem": "80GiB", "cpu_mem": "512GiB", "disk_mem": "4TiB"}
MODELS = (
    "qwen3-next-80b-a3b",
    "qwen3.5-397b-a17b",
    "granite-4.0-h-small",
    "nemotron-h-56b",
    "nemotron-3-nano-30b-a3b",
    "falcon-h1-34b",
)


def plan_case(name: str, hardware: HardwareSpec) -> dict[str, Any]:
    model = BUILTIN_MODELS[name]
    start = time.perf_counter()
    gpu, cpu, disk = (parse_bytes(BUDGETS[key]) for key in ("gpu_mem", "cpu_mem", "disk_mem"))
    result = search(model, WORKLOAD, hardware, gpu_mem=gpu, cpu_mem=cpu, disk_mem=disk)
    return {
        "model": name,
        "total_params": model.total_params,
        "active_params": model.active_params,
        "plan": result.policy.to_dict(),
        "predicted": result.predicted,
        "bottleneck": result.bottleneck,
        "peak_bytes": result.estimate.peak_bytes,
        "states": state_summary(model, result.policy, result.estimate.peak_bytes),
        "num_lps": result.num_solved,
        "search_seconds": time.perf_counter() - start,
    }


def _tier_share(r: dict[str, Any], tier: str) -> str:
    states = r["states"]
    return (
        f"{format_bytes(states['state_bytes'][tier])} of {format_bytes(r['peak_bytes'][tier])} "
        f"({100 * states['state_share_of_peak'][tier]:.0f}%)"
    )


def row(r: dict[str, Any]) -> list[str]:
    plan, states, predicted = Policy.from_dict(r["plan"]), r["states"], r["predicted"]
    flags = (("4-bit W", plan.compress_weights), ("4-bit KV", plan.compress_kv))
    formats = ", ".join(name for name, on in flags if on) or "none"
    return [
        r["model"],
        f"{r['total_params'] / 1e9:.1f}B ({r['active_params'] / 1e9:.1f}B)",
        f"{states['num_kv_layers']} of {states['num_layers']}",
        f"{format_bytes(states['state_bytes_per_sequence'])} / "
        f"{format_bytes(states['kv_bytes_per_token'])}",
        f"{plan.gpu_batch_size} x {plan.num_gpu_batches}",
        " / ".join(f"{100 * v:.0f}%" for v in plan.kv_frac),
        formats,
        _tier_share(r, "gpu"),
        _tier_share(r, "cpu"),
        throughput_cell(predicted),
        r["bottleneck"],
    ]


def main(argv: list[str] | None = None) -> int:
    args = parse_plan_args(argv, __doc__)
    hardware = HardwareSpec.load(args.hardware)
    results = [plan_case(name, hardware) for name in MODELS]
    table = Table(
        [
            "model",
            "parameters (active)",
            "attention layers",
            "state per sequence / KV per token",
            "block",
            "KV (and states) gpu / cpu / disk",
            "formats",
            "states on the GPU (of its peak)",
            "states in host memory (of its peak)",
            "predicted prefill / decode / gen tok/s",
            "bottleneck",
        ]
    )
    table.rows = [row(r) for r in results]
    print(table.markdown())
    write_json(args.json, results, table, {"workload": [512, 256], **BUDGETS})
    return 0


if __name__ == "__main__":
    sys.exit(main())
