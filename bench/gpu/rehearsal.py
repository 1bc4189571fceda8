"""The GPU run rehearsed on a machine without one: does the searched plan fit the card?

    python -m bench.gpu.rehearsal --model opt-6.7b --input-len 512 --output-len 32 \\
        --gpu-mem 16GiB [--cpu-mem SIZE] [--hardware bench/results/hardware-h200.json] \\
        [--policy auto|JSON] [--num-prompts N] [--decode-stride N] [--json FILE]

Plans as `nanoflex` does on the GPU machine (the search, from that machine's profile:
`--hardware`, the H200's by default; `--cpu-mem` defaults to its RAM), then runs the engine's
CUDA path for that plan (engine/rehearsal.py): the model's shape with weights that hold no
data, a block of prompts through prefill and every decode step, every byte the device would
hold counted against `--gpu-mem`. Three GPU runs in a row failed for a reason only the GPU
showed (the KV pool doubled past its tier, a step's KV stores held on the device, 4-bit
quantization on the host); each shows here first (docs/benchmarks.md, The CUDA path
rehearsed). `--decode-stride N` (default 8) runs the layer loop of every N-th decode step
of a run of like ones and of the last, and bounds the others' peaks by the next one run
(engine/stand_in_steps.py): OPT-30B's decode steps cost minutes each on fake tensors;
`--decode-stride 1` runs every loop.

The JSON: `ok` (the peak within the cap and the engine ran), `device_peak_bytes`,
`gpu_mem_bytes`, `planned_peak_bytes` (the cost model's gpu peak for the same plan) and
`planned_over_rehearsed`, `peak` (step, task, layer, GPU batch and the live buffers by what
made them), the most bytes alive at once by what made them (`label_peak_bytes`), each step's
peak (a stood-in step's `bound_bytes` beside it), `loops_run` and `stood_in`, the KV pages
the engine gave each tier and the reserve it kept out of the gpu tier's
(`gpu_reserve_bytes`, the planner's: policy/reserves.py), and the policy. Exit status 1
when not `ok`.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from policy import Policy
from policy.units import format_bytes, parse_bytes

H200 = Path(__file__).resolve().parents[1] / "results" / "hardware-h200.json"


def plan(args: argparse.Namespace, gpu_mem: int, cpu_mem: int) -> tuple[Policy, float]:
    """The policy to rehearse (searched unless given) and the cost model's gpu peak for it."""
    from policy.catalog import resolve_model_spec
    from policy.cost_model import estimate, hardware_budgets
    from policy.hardware import HardwareSpec
    from policy.search import search
    from policy.specs import WorkloadSpec

    hardware = HardwareSpec.load(args.hardware)
    model = resolve_model_spec(args.model)
    workload = WorkloadSpec(args.input_len, args.output_len)
    if args.policy == "auto":
        policy = search(model, workload, hardware, gpu_mem=gpu_mem, cpu_mem=cpu_mem).policy
    else:
        policy = Policy.from_json(args.policy)
    budgets = hardware_budgets(hardware, gpu_mem, cpu_mem)
    planned = estimate(policy, model, workload, hardware, budgets).peak_bytes["gpu"]
    return policy, planned


def _shown(path: Path) -> str:
    """`path`, relative to the repository where it lies inside it."""
    repo = H200.parents[2]
    resolved = path.resolve()
    return str(resolved.relative_to(repo)) if resolved.is_relative_to(repo) else str(path)


def run(args: argparse.Namespace) -> dict[str, Any]:
    from engine.loading.generated import local_model_dir
    from engine.rehearsal import rehearse
    from policy.hardware import HardwareSpec

    gpu_mem = parse_bytes(args.gpu_mem)
    cpu_mem = (
        parse_bytes(args.cpu_mem)
        if args.cpu_mem
        else HardwareSpec.load(args.hardware).cpu_mem_bytes
    )
    policy, planned = plan(args, gpu_mem, cpu_mem)
    found = rehearse(
        local_model_dir(f"dummy:{args.model}"),
        policy,
        gpu_mem=gpu_mem,
        cpu_mem=cpu_mem,
        prompt_len=args.input_len,
        gen_len=args.output_len,
        num_prompts=args.num_prompts,
        progress=True,
        decode_stride=args.decode_stride,
    )
    peak = found.device_peak_bytes
    return {
        "ok": found.ok,
        "model": args.model,
        "input_len": args.input_len,
        "output_len": args.output_len,
        "device_peak_bytes": peak,
        "gpu_mem_bytes": gpu_mem,
        "cpu_mem_bytes": cpu_mem,
        "planned_peak_bytes": int(planned),
        "planned_over_rehearsed": planned / peak if peak else None,
        "peak": found.peak,
        "label_peak_bytes": found.label_peaks,
        "side_stream_peak_bytes": found.side_stream_peak,
        "steps": found.steps,
        "decode_stride": args.decode_stride,
        "loops_run": found.loops_run,
        "stood_in": found.stood_in,
        "kv_capacity_pages": found.kv_capacity_pages,
        "gpu_reserve_bytes": found.gpu_reserve_bytes,
        "error": found.error,
        "policy": policy.to_dict(),
        "hardware": _shown(args.hardware),
        "seconds": round(found.seconds, 1),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True, help="a built-in shape: opt-6.7b, opt-30b, ...")
    parser.add_argument("--input-len", type=int, required=True)
    parser.add_argument("--output-len", type=int, required=True)
    parser.add_argument("--gpu-mem", required=True, help="the card's cap, e.g. 16GiB")
    parser.add_argument("--cpu-mem", default=None, help="default: the profile's RAM")
    parser.add_argument("--hardware", type=Path, default=H200, help="the GPU machine's profile")
    parser.add_argument("--policy", default="auto", help="auto (searched) or a Policy as JSON")
    parser.add_argument("--num-prompts", type=int, default=None, help="default: the block")
    parser.add_argument(
        "--decode-stride", type=int, default=8, help="run every N-th like decode loop (1: all)"
    )
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    record = run(args)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(record, indent=1) + "\n")
    peak = record["peak"]
    print(
        f"{args.model} {args.input_len}+{args.output_len} under "
        f"{format_bytes(record['gpu_mem_bytes'])}: "
        f"peak {format_bytes(record['device_peak_bytes'])} "
        f"(planned {format_bytes(record['planned_peak_bytes'])}) at {peak['step']}, "
        f"{peak['task']} layer {peak['layer']}: {'fits' if record['ok'] else 'DOES NOT FIT'}"
    )
    for label, nbytes in list(peak["buffers"].items())[:8]:
        print(f"  {label:14s} {format_bytes(nbytes)}")
    if record["error"]:
        print(f"  the engine refused: {record['error']}")
    return 0 if record["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
