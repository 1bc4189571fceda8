"""`nanoflex profile`: measure this machine's hardware constants and cache them for the planner."""

from __future__ import annotations

import argparse
import sys

from engine.executor.profiler import profile_hardware
from policy.hardware import default_cache_path


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--offload-dir", default=None, help="directory to measure disk speed in")
    parser.add_argument(
        "--device", default="auto", choices=["auto", "cuda", "cpu"], help="the device to profile"
    )
    parser.add_argument("--json", action="store_true", help="print the profile as JSON")


def main(args: argparse.Namespace) -> int:
    print("profiling (about a minute)...", file=sys.stderr)
    spec = profile_hardware(args.device, args.offload_dir)
    path = default_cache_path()
    spec.save(path)
    if args.json:
        print(spec.to_json())
        return 0
    gb = 1e9
    print(f"saved to {path}: {spec.notes}")
    print(
        f"memory  gpu {spec.gpu_mem_bytes / 2**30:.1f} GiB, "
        f"cpu {spec.cpu_mem_bytes / 2**30:.1f} GiB, "
        f"disk free {spec.disk_mem_bytes / 2**30:.0f} GiB"
    )
    print(f"copy    host->dev {spec.ctog_bw / gb:.1f} GB/s, dev->host {spec.gtoc_bw / gb:.1f} GB/s")
    print(f"disk    read {spec.dtoc_bw / gb:.2f} GB/s, write {spec.ctod_bw / gb:.2f} GB/s")
    print(
        f"compute matmul {spec.gpu_flops / 1e12:.2f} TFLOP/s, bmm {spec.gpu_bmm_flops / 1e12:.3f} "
        f"TFLOP/s, cpu {spec.cpu_flops / 1e12:.3f} TFLOP/s"
    )
    attention = ", ".join(
        f"{t} threads {bw / gb:.1f} GB/s" for t, bw in spec.cpu_attention_throughput
    )
    print(f"cpu attention  {attention}")
    knee = spec.dense_knee_rows()
    print(f"dense step     knee at {knee} rows (discrete batch sizes start there):")
    best = max(n / s for n, s in spec.dense_step_table)
    for rows, seconds in spec.dense_step_table:
        mark = "  <- knee" if rows == knee else ""
        print(
            f"  {rows:6d} rows {seconds * 1e3:9.3f} ms  {rows / seconds / best:6.1%} of best{mark}"
        )
    print(
        f"nano    overlap hides {_share(spec.nano_overlap_device)} of the shorter of dense ops "
        f"and attention on two {'streams' if spec.compute_device == 'cuda' else 'threads'}, "
        f"{_share(spec.nano_overlap_host)} beside CPU attention; each extra nano-batch "
        f"costs {spec.nano_batch_overhead_s * 1e3:.3f} ms per layer"
    )
    print(
        f"fixed   {spec.layer_overhead_s * 1e3:.3f} ms per layer per GPU batch; dequantize "
        f"{spec.dequant_throughput / 1e9:.2f} G elements/s"
    )
    return 0


def _share(value: float | None) -> str:
    return "(not measured)" if value is None else f"{value:.0%}"
