"""`nanoflex profile`: measure this machine's hardware constants and cache them for the planner."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from engine.profiling.profiler import profile_hardware
from policy.hardware import MAX_SPREAD, HardwareSpec, default_cache_path
from policy.machine import machine_key


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--offload-dir", default=None, help="directory to measure disk speed in")
    parser.add_argument(
        "--device", default="auto", choices=["auto", "cuda", "cpu"], help="the device to profile"
    )
    parser.add_argument("--json", action="store_true", help="print the profile as JSON")
    parser.add_argument(
        "--show",
        action="store_true",
        help="say how the cached profile was measured (when, quick or full, how noisy, under "
        "load or quiet, on this machine or another) and what each constant is; measure nothing",
    )


def main(args: argparse.Namespace) -> int:
    if args.show:
        return show(default_cache_path())
    print("profiling (about a minute)...", file=sys.stderr)
    spec = profile_hardware(args.device, args.offload_dir)
    path = default_cache_path()
    spec.save(path)
    if args.json:
        print(spec.to_json())
        return 0
    gb = 1e9
    print(f"saved to {path}: {spec.notes}")
    print(f"machine {spec.machine}")
    print(_spread_line(spec))
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
    flat = spec.dense_flat_rows()
    print(f"dense step     flat up to {flat} rows (padding up to there is free):")
    best = max(n / s for n, s in spec.dense_step_table)
    for rows, seconds in spec.dense_step_table:
        mark = "  <- flat up to here" if rows == flat else ""
        print(
            f"  {rows:6d} rows {seconds * 1e3:9.3f} ms  {rows / seconds / best:6.1%} of best{mark}"
        )
    print(
        f"nano    overlap hides {_share(spec.nano_overlap_device)} of the shorter of dense ops "
        f"and attention on two {'streams' if spec.compute_device == 'cuda' else 'threads'}, "
        f"{_share(spec.nano_overlap_host)} beside CPU attention; each extra nano-batch "
        f"costs {spec.nano_batch_overhead_s * 1e3:.3f} ms per layer"
    )
    if spec.compute_device == "cuda":
        print(
            f"copies  overlap hides {_share(spec.copy_hidden)} of the shorter of a layer's "
            f"copy to the device and the GEMMs beside it"
        )
    print(
        f"fixed   {spec.layer_overhead_s * 1e3:.3f} ms per layer per GPU batch; dequantize "
        f"{spec.dequant_throughput / 1e9:.2f} G elements/s"
    )
    print(
        f"attention  prefill {spec.prefill_attention_flops / 1e9:.1f} GFLOP/s, decode through "
        f"the engine's path {spec.device_attention_bw / 1e9:.2f} GB/s of KV"
    )
    return 0


def show(path: Path) -> int:
    """`nanoflex profile --show`: the cached profile, how it was measured and whether the
    planner trusts it."""
    if not path.is_file():
        print(f"no hardware profile cached at {path}: the first plan measures a quick one")
        return 1
    spec = HardwareSpec.load(path)
    here = machine_key()
    print(f"profile {path}")
    print(f"measured  {spec.describe()}")
    print(f"machine   {spec.machine or '(not recorded)'}")
    stale = spec.staleness(here)
    if stale:
        print(f"planner   measures it again at the next plan: {stale}")
    elif spec.under_load:
        print("planner   plans from it without its overlap shares; a background re-measure")
        print("          replaces it once the machine is quiet (requiet.log beside it)")
    elif spec.noise():
        print(f"planner   plans from it; measures it again in the background: {spec.noise()}")
    else:
        print("planner   trusts it")
    if spec.machine_load:
        print("load      " + ", ".join(f"{k} {v}" for k, v in spec.machine_load.items()))
    print("constant                      value          spread")
    for name, value in spec.to_dict().items():
        if isinstance(value, bool) or not isinstance(value, int | float):
            continue
        spread = spec.spread.get(name)
        width = "-" if spread is None else f"{spread:.0%}"
        print(f"  {name:26s} {value:14.6g} {width:>7s}")
    for name in ("cpu_attention_throughput", "dense_step_table"):
        spread = spec.spread.get(name)
        rows = len(getattr(spec, name))
        print(f"  {name:26s} {rows:11d} rows {'-' if spread is None else f'{spread:.0%}':>7s}")
    return 0


def _spread_line(spec: HardwareSpec) -> str:
    """The noisiest measurements (interquartile range over median of their samples)."""
    noisy = sorted(spec.spread.items(), key=lambda kv: -kv[1])
    worst = ", ".join(f"{name} {value:.0%}" for name, value in noisy[:3])
    wide = [name for name, value in noisy if value > MAX_SPREAD]
    if not wide:
        return f"spread  widest: {worst} (all within {MAX_SPREAD:.0%})"
    return (
        f"spread  widest: {worst}; warning: {len(wide)} measurement(s) spread more than "
        f"{MAX_SPREAD:.0%} even after re-measuring: the machine is busy, plans may be off"
    )


def _share(value: float | None) -> str:
    return "(not measured)" if value is None else f"{value:.0%}"
