"""Where a workload's step time goes: GEMMs, attention, the rest, and Python around them.

    python -m bench.kernels.step_profile [--model M] [--workload mixed] [--dtypes float32,bfloat16]
        [--json bench/results/step-profile-cpu.json]

For each dtype, one process-wide `generate` of the named workload (bench.peers.workloads) runs
under torch's profiler, after a warm-up. Time is split by operator: GEMMs (`aten::mm`,
`aten::addmm`, the dense projections and the head), attention (the SDPA kernels and the KV
gathers and writes that feed them), other operators (norms, rotary, activations, copies),
and the rest of the wall time of the steps (Python, dispatch, scheduling). The GEMMs'
achieved GFLOP/s (2 x rows x in x out per call, from the recorded shapes) is set against
the peak: the best of a few calls of the engine's GEMM (oneDNN over a prepacked weight) on
a (2048 x hidden) by (hidden x intermediate) product on the same box, in the same process.
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile

from bench.common import Table, write_json
from bench.peers.workloads import WORKLOADS, build
from engine import LLM, SamplingParams
from engine.models.base import can_prepack, linear, prepack

GEMM_OPS = ("aten::mm", "aten::addmm", "aten::bmm", "mkldnn::_linear_pointwise")
ATTENTION_OPS = (
    "aten::_scaled_dot_product_flash_attention_for_cpu",
    "aten::_scaled_dot_product_efficient_attention",
    "aten::_scaled_dot_product_flash_attention",
    "aten::index_select",
    "aten::index_copy_",
    "nanoflex::paged_decode",
    "nanoflex::paged_prefill",
)


def gemm_flops(event: Any) -> float:
    """2 x M x K x N of one mm/addmm/prepacked-linear event from its input shapes (0 when
    unknown)."""
    shapes = [s for s in event.input_shapes if len(s) == 2]
    if event.key == "mkldnn::_linear_pointwise" and len(shapes) >= 2:
        (m, k), (n, _) = shapes[0], shapes[1]  # x (M, K), the packed weight (N, K)
    elif event.key == "aten::addmm" and len(shapes) >= 3:
        (m, k), (_, n) = shapes[1], shapes[2]
    elif len(shapes) >= 2:
        (m, k), (_, n) = shapes[0], shapes[1]
    else:
        return 0.0
    return 2.0 * m * k * n


def peak_gflops(hidden: int, intermediate: int, dtype: torch.dtype) -> float:
    """The best GFLOP/s of the engine's own GEMM on a (2048 x hidden) by (hidden x
    intermediate) product: oneDNN over a prepacked weight where the engine prepacks
    (`engine.models.base.linear`), else `F.linear`."""
    x = torch.randn(2048, hidden, dtype=dtype)
    w = {"proj.weight": torch.randn(intermediate, hidden, dtype=dtype)}
    if can_prepack(x.device, dtype):
        w["proj.weight"] = prepack(w["proj.weight"])
    best = float("inf")
    for _ in range(8):
        start = time.perf_counter()
        linear(x, w, "proj")
        best = min(best, time.perf_counter() - start)
    return 2.0 * 2048 * hidden * intermediate / best / 1e9


def profile_one(model: str | None, workload_name: str, dtype: str) -> dict[str, Any]:
    llm = LLM(model, policy="auto", dtype=dtype)
    config = llm.executor.config
    workload = build(workload_name, config.vocab_size)
    warm = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    llm.generate([ids[:16] for ids, _ in workload[:4]], warm)
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for _, n in workload]
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        start = time.perf_counter()
        outputs = llm.generate([ids for ids, _ in workload], params)
        wall = time.perf_counter() - start
    llm.close()
    generated = sum(len(o.outputs[0].token_ids) for o in outputs)
    gemm_s = attention_s = other_s = flops = 0.0
    for event in prof.key_averages(group_by_input_shape=True):
        self_s = event.self_cpu_time_total / 1e6
        if event.key in GEMM_OPS:
            gemm_s += self_s
            flops += gemm_flops(event) * event.count
        elif event.key in ATTENTION_OPS:
            attention_s += self_s
        elif event.key.startswith(("aten::", "nanoflex::")):
            other_s += self_s
    peak = peak_gflops(config.hidden_size, config.intermediate_size, getattr(torch, dtype))
    return {
        "dtype": dtype,
        "workload": workload_name,
        "wall_seconds": wall,
        "throughput": generated / wall,
        "gemm_seconds": gemm_s,
        "attention_seconds": attention_s,
        "other_op_seconds": other_s,
        "outside_op_seconds": max(0.0, wall - gemm_s - attention_s - other_s),
        "gemm_gflops": flops / gemm_s / 1e9 if gemm_s else 0.0,
        "peak_gflops": peak,
        "policy": llm.policy.to_dict(),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="default: smollm2-135m-instruct")
    parser.add_argument("--workload", default="mixed", choices=sorted(WORKLOADS))
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    table = Table(
        ["dtype", "tok/s", "GEMMs", "attention", "other ops", "outside ops", "GEMM GFLOP/s"]
    )
    results = []
    for dtype in args.dtypes.split(","):
        r = profile_one(args.model, args.workload, dtype)
        results.append(r)
        wall = r["wall_seconds"]

        def share(key: str, r: dict[str, Any] = r, wall: float = wall) -> str:
            return f"{100 * r[key] / wall:.0f}%"

        table.rows.append(
            [
                dtype,
                f"{r['throughput']:.1f}",
                share("gemm_seconds"),
                share("attention_seconds"),
                share("other_op_seconds"),
                share("outside_op_seconds"),
                f"{r['gemm_gflops']:.0f} of {r['peak_gflops']:.0f}",
            ]
        )
        print(f"{dtype}: done", file=sys.stderr)
    print(table.markdown("lrrrrrr"))
    write_json(args.json, results, table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
