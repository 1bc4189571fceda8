"""CUDA attention: the one paged kernel against the paths it replaces, on one GPU.

    python -m bench.gpu.attention [--dtype bfloat16] [--json bench/results/gpu-attention.json]
    python -m bench.gpu.attention --small        # the same on CPU tensors (Triton's interpreter)
    python -m bench.gpu.attention --sweep [--json ...]   # the one kernel's tiles, timed

Llama-3-8B's attention shape (32 query heads over 8 kv heads of 128), keys on shuffled
16-token pages of a pool, as the engine lays them out. For each step (decodes at 1K+ keys,
prefill chunks, and both mixed in one step), the engine's call (`paged_attention`) three
ways: the one paged kernel (engine/kernels/triton_paged.py, the default), the previous pair
(the Triton decode kernel, prefill chunks gathered for SDPA: `cuda_paged_kernels(one_kernel=
False)`), and every key gathered into a padded copy for SDPA (`--no-native-kernels`, the
reference); each timed with CUDA events (`triton.testing.do_bench`, median), the outputs
compared (relative error against the reference). Decode reports the KV bytes read per
second against the device's copy bandwidth (a 1 GiB device-to-device copy, bytes read plus
written, measured here), target >= 80%; prefill the causal FLOP/s (the masked half not
counted) against a bf16 GEMM of 8192^3 measured here, target >= 50%. A mixed step reports
both rates of its time (its decodes' bytes and its chunks' FLOPs), without a target.
`--sweep` times the one kernel alone over launch configurations (`Tiles`: rows and keys a
tile, warps, pipelining stages) on a prefill and a decode step, to choose its defaults.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from engine.executor.attention import RaggedLayout, paged_attention
from engine.kernels import PagedKernels
from engine.kernels.triton_paged import Tiles
from engine.models.config import KVShape
from engine.profiling.profiler import paged_pool

HEADS, KV_HEADS, HEAD_DIM = 32, 8, 128

DECODE_CASES = [(64, 2048), (256, 1024), (8, 8192), (1, 32768)]
"""(sequences, keys each), 1K+ keys: a block, many, a few long, one very long (splits)."""
PREFILL_CASES = [(8, 2048, 0), (4, 1024, 3072)]
"""(sequences, new rows each, past rows each)."""
MIXED_CASES = [((1, 2048, 0), (64, 1, 2047)), ((2, 512, 1536), (128, 1, 1023))]
"""Steps of prefill chunks then decodes: (chunks, new rows, past rows), (decodes, 1, past)."""
TARGETS = {"decode": 0.8, "prefill": 0.5}
"""The share of its ceiling each kind of step should reach (issue 51)."""


def _pool(
    lens: list[int], dtype: torch.dtype, device: torch.device, seed: int
) -> tuple[torch.Tensor, list[list[int]]]:
    return paged_pool(lens, 2 * KV_HEADS * HEAD_DIM, dtype, device, seed)


def _timed(fn: Any) -> float:
    """Median seconds of `fn` on a GPU, by CUDA events."""
    import triton.testing

    return float(triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")) / 1e3


def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


def ceilings(device: torch.device) -> dict[str, float]:
    """This device's copy bandwidth (read plus write) and bf16 GEMM rate, measured here."""
    import triton.testing

    src = torch.empty(1 << 30, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    copy = triton.testing.do_bench(lambda: dst.copy_(src), return_mode="median") / 1e3
    n = 8192
    a = torch.randn(n, n, dtype=torch.bfloat16, device=device)
    b = torch.randn(n, n, dtype=torch.bfloat16, device=device)
    gemm = triton.testing.do_bench(lambda: a @ b, return_mode="median") / 1e3
    return {"copy_bytes_per_s": 2 * src.numel() / copy, "gemm_flops": 2 * n**3 / gemm}


def run_case(
    kind: str,
    shapes: list[tuple[int, int, int]],
    dtype: torch.dtype,
    device: torch.device,
    paths: dict[str, PagedKernels | None],
) -> dict[str, Any]:
    """One step of `shapes` ((sequences, new rows, past rows) each), timed along every path
    of `paths` (the first is the one rated; None: gather + SDPA, the reference)."""
    on_gpu = device.type == "cuda"
    q_lens = [new for seqs, new, _ in shapes for _ in range(seqs)]
    past_lens = [past for seqs, _, past in shapes for _ in range(seqs)]
    lens = [n + p for n, p in zip(q_lens, past_lens, strict=True)]
    pool, seq_slots = _pool(lens, dtype, device, seed=len(lens) + max(q_lens))
    q = torch.randn(sum(q_lens), HEADS, HEAD_DIM, dtype=dtype, device=device)
    layout = RaggedLayout.build(q_lens, past_lens, device, seq_slots=seq_slots)

    def plain(rows: torch.Tensor) -> torch.Tensor:
        return rows

    def call(kernels: PagedKernels | None) -> torch.Tensor:
        return paged_attention(q, pool, plain, layout, KVShape(KV_HEADS, HEAD_DIM), kernels)

    reference = call(None)
    row: dict[str, Any] = {"kind": kind, "shapes": shapes, "seconds": {}, "relative_error": {}}
    for name, kernels in paths.items():
        start = time.perf_counter()
        out = call(kernels)
        seconds = time.perf_counter() - start
        row["relative_error"][name] = _relative(out, reference)
        # under the interpreter, which only checks that the script runs, the checked run's
        # wall time is the figure (a second run would double the dry run's slowest step)
        row["seconds"][name] = _timed(lambda k=kernels: call(k)) if on_gpu else seconds
    decodes = [n for n, ql in zip(lens, q_lens, strict=True) if ql == 1]
    row["kv_bytes"] = sum(decodes) * pool.shape[1] * pool.element_size()
    # causal: new row t of a chunk over `past` sees past + t + 1 keys, 4 * head_dim FLOPs each
    seen = sum(n * p + n * (n + 1) // 2 for n, p in zip(q_lens, past_lens, strict=True) if n > 1)
    row["flops"] = 4 * HEAD_DIM * HEADS * seen
    return row


def table(rows: list[dict[str, Any]], ceiling: dict[str, float] | None) -> dict[str, Any]:
    """The rows as text: every path's time, the first path's rate and share of its ceiling;
    rows of a sweep (each its own path: a `Tiles`) name theirs in the step."""
    swept = len({tuple(r["seconds"]) for r in rows}) > 1
    paths = ["time (m, n, warps, stages)"] if swept else list(rows[0]["seconds"])
    header = ["step", *paths, "rate", "of the ceiling", "target"]
    out = []
    for r in rows:
        name = " + ".join(f"{s} x ({p} + {n})" for s, n, p in r["shapes"])
        times = {p: t * 1e3 for p, t in r["seconds"].items()}
        seconds = next(iter(r["seconds"].values()))
        if swept:
            name += f" {next(iter(times))}"
        cells = [f"{r['kind']} {name}", *(f"{t:.3f} ms" for t in times.values())]
        rates, shares = [], []
        for key, unit, scale, ceil_key in (
            ("kv_bytes", "GB/s", 1e9, "copy_bytes_per_s"),
            ("flops", "TFLOP/s", 1e12, "gemm_flops"),
        ):
            if r[key]:
                rate = r[key] / seconds
                rates.append(f"{rate / scale:.1f} {unit}")
                ceil = (ceiling or {}).get(ceil_key)
                shares.append(f"{rate / ceil:.0%}" if ceil else "-")
        target = TARGETS.get(r["kind"])
        cells += [", ".join(rates), ", ".join(shares), f">= {target:.0%}" if target else "-"]
        out.append(cells)
    return {"header": header, "rows": out}


SWEEP_PREFILL = [
    Tiles(m, n, w, s) for m in (64, 128) for n in (32, 64, 128) for w in (4, 8) for s in (2, 3)
]
SWEEP_DECODE = [Tiles(16, n, w, s) for n in (32, 64, 128) for w in (2, 4) for s in (2, 3, 4)]


def sweep(dtype: torch.dtype, device: torch.device, small: bool) -> list[dict[str, Any]]:
    """The one kernel over each configuration of SWEEP_PREFILL on a prefill step and of
    SWEEP_DECODE on a decode step (on the interpreter, two of each, to check the script);
    a configuration that does not compile (too much shared memory) is left out."""
    from engine.kernels import cuda_paged_kernels, triton_paged

    base = cuda_paged_kernels()
    assert base is not None
    steps = [
        ("prefill", [(2, 20, 0)] if small else [PREFILL_CASES[0]], SWEEP_PREFILL),
        ("decode", [(2, 1, 99)] if small else [(DECODE_CASES[0][0], 1, DECODE_CASES[0][1] - 1)],
         SWEEP_DECODE),
    ]  # fmt: skip
    rows = []
    for kind, shapes, configs in steps:
        paths: dict[str, PagedKernels | None] = {}
        for tiles in configs[:2] if small else configs:
            one = functools.partial(triton_paged.paged_attention, tiles=tiles)
            paths[str(dataclasses.astuple(tiles))] = replace(base, attention=one)
        for name, kernels in paths.items():
            try:
                rows.append(run_case(kind, shapes, dtype, device, {name: kernels}))
            except Exception as e:  # a configuration past the device's limits
                print(f"{kind} {name}: {type(e).__name__}: {str(e)[:200]}", file=sys.stderr)
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"])
    parser.add_argument("--small", action="store_true", help="tiny cases on CPU tensors")
    parser.add_argument("--sweep", action="store_true", help="time the one kernel's tiles")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    from engine.kernels import cuda_paged_kernels

    one, pair = cuda_paged_kernels(), cuda_paged_kernels(one_kernel=False)
    if one is None or pair is None:
        print("triton is not installed", file=sys.stderr)
        return 1
    paths = {"one kernel": one, "decode kernel + SDPA": pair, "gather + SDPA": None}
    dtype = getattr(torch, args.dtype)
    small = args.small or not torch.cuda.is_available()
    device = torch.device("cpu" if small else "cuda")
    decode = [(2, 100), (1, 300)] if small else DECODE_CASES
    prefill = [(2, 20, 0), (2, 9, 30)] if small else PREFILL_CASES
    mixed = [((1, 20, 0), (2, 1, 40))] if small else MIXED_CASES
    if args.sweep:
        rows = sweep(dtype, device, small)
    else:
        rows = [run_case("decode", [(s, 1, n - 1)], dtype, device, paths) for s, n in decode]
        rows += [run_case("prefill", [shape], dtype, device, paths) for shape in prefill]
        rows += [run_case("mixed", list(step), dtype, device, paths) for step in mixed]
    ceiling = None if small else ceilings(device)
    record: dict[str, Any] = {
        "device": "cpu (interpreter)" if small else torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "dtype": args.dtype,
        "ceilings": ceiling,
        "results": rows,
        "table": table(rows, ceiling),
    }
    print(" | ".join(record["table"]["header"]))
    for cells in record["table"]["rows"]:
        print(" | ".join(cells))
    worst = max(max(r["relative_error"].values()) for r in rows)
    print(f"largest relative difference from gather + SDPA: {worst:.2e}")
    if args.json:
        args.json.write_text(json.dumps(record, indent=1) + "\n")
    return 0 if worst < 2e-2 else 1


if __name__ == "__main__":
    sys.exit(main())
