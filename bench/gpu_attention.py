"""The CUDA attention kernels against the gather-and-SDPA path, on one GPU.

    python -m bench.gpu_attention [--dtype bfloat16] [--json bench/results/gpu-attention.json]
    python -m bench.gpu_attention --small        # the same on CPU tensors (Triton's interpreter)

Llama-3-8B's attention shape (32 query heads over 8 kv heads of 128), keys on shuffled
16-token pages of a pool, as the engine lays them out. For each case, the engine's call
(`paged_attention`) with the Triton kernels and without them (every key gathered into a
padded copy, then SDPA), each timed with CUDA events (`triton.testing.do_bench`, median),
and the two outputs compared (relative error). Decode reports the KV bytes read per second
against the device's copy bandwidth (a 1 GiB device-to-device copy, bytes read plus written,
measured here); prefill the causal FLOP/s (the masked half not counted) against a bf16 GEMM
of 8192^3 measured here.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import torch

from engine.executor.attention import RaggedLayout, paged_attention
from engine.kernels import PagedKernels
from engine.models.config import KVShape
from engine.profiling.profiler import paged_pool

HEADS, KV_HEADS, HEAD_DIM = 32, 8, 128

DECODE_CASES = [(64, 2048), (256, 512), (8, 8192), (1, 32768)]
"""(sequences, keys each): a block, many short, a few long, one very long (splits)."""
PREFILL_CASES = [(8, 2048, 0), (4, 1024, 3072)]
"""(sequences, new rows each, past rows each)."""


def _pool(
    lens: list[int], dtype: torch.dtype, device: torch.device, seed: int
) -> tuple[torch.Tensor, list[list[int]]]:
    return paged_pool(lens, 2 * KV_HEADS * HEAD_DIM, dtype, device, seed)


def _timed(fn: Any, on_gpu: bool) -> float:
    """Median seconds of `fn` (CUDA events on a GPU; one run's wall time under the
    interpreter, which only checks that the script runs)."""
    if on_gpu:
        import triton.testing

        return float(triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")) / 1e3
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


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
    seqs: int,
    new: int,
    past: int,
    dtype: torch.dtype,
    device: torch.device,
    kernels: PagedKernels,
) -> dict[str, Any]:
    on_gpu = device.type == "cuda"
    lens = [new + past] * seqs
    pool, seq_slots = _pool(lens, dtype, device, seed=seqs + new)
    q = torch.randn(seqs * new, HEADS, HEAD_DIM, dtype=dtype, device=device)
    layout = RaggedLayout.build([new] * seqs, [past] * seqs, device, seq_slots=seq_slots)

    def plain(rows: torch.Tensor) -> torch.Tensor:
        return rows

    def call(with_kernels: PagedKernels | None) -> torch.Tensor:
        return paged_attention(q, pool, plain, layout, KVShape(KV_HEADS, HEAD_DIM), with_kernels)

    fast, gathered = call(kernels), call(None)
    row = {
        "kind": kind,
        "sequences": seqs,
        "new": new,
        "past": past,
        "relative_error": _relative(fast, gathered),
        "triton_s": _timed(lambda: call(kernels), on_gpu),
        "gather_sdpa_s": _timed(lambda: call(None), on_gpu),
    }
    if kind == "decode":
        row["kv_bytes"] = seqs * (new + past) * pool.shape[1] * pool.element_size()
    else:  # causal: query t of a sequence sees past + t + 1 keys, 4 * head_dim FLOPs each
        seen = seqs * (new * past + new * (new + 1) // 2)
        row["flops"] = 4 * HEAD_DIM * HEADS * seen
    return row


def table(rows: list[dict[str, Any]], ceiling: dict[str, float] | None) -> dict[str, Any]:
    header = ["case", "Triton", "gather + SDPA", "speed-up", "Triton rate", "of the ceiling"]
    out = []
    for r in rows:
        name = f"{r['kind']} {r['sequences']} x ({r['past']} + {r['new']})"
        if r["kind"] == "decode":
            rate = r["kv_bytes"] / r["triton_s"]
            text, ceil = f"{rate / 1e9:.0f} GB/s", (ceiling or {}).get("copy_bytes_per_s")
        else:
            rate = r["flops"] / r["triton_s"]
            text, ceil = f"{rate / 1e12:.1f} TFLOP/s", (ceiling or {}).get("gemm_flops")
        out.append(
            [
                name,
                f"{r['triton_s'] * 1e3:.3f} ms",
                f"{r['gather_sdpa_s'] * 1e3:.3f} ms",
                f"{r['gather_sdpa_s'] / r['triton_s']:.1f}x",
                text,
                "-" if not ceil else f"{rate / ceil:.0%}",
            ]
        )
    return {"header": header, "rows": out}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"])
    parser.add_argument("--small", action="store_true", help="tiny cases on CPU tensors")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    from engine.kernels import triton_attention

    kernels = PagedKernels(triton_attention.paged_decode, triton_attention.paged_prefill)
    dtype = getattr(torch, args.dtype)
    small = args.small or not torch.cuda.is_available()
    device = torch.device("cpu" if small else "cuda")
    decode = [(2, 40), (3, 100)] if small else DECODE_CASES
    prefill = [(2, 20, 0), (2, 9, 30)] if small else PREFILL_CASES
    rows = [run_case("decode", s, 1, n - 1, dtype, device, kernels) for s, n in decode]
    rows += [run_case("prefill", s, n, p, dtype, device, kernels) for s, n, p in prefill]
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
    worst = max(r["relative_error"] for r in rows)
    print(f"largest relative difference, Triton against gather + SDPA: {worst:.2e}")
    if args.json:
        args.json.write_text(json.dumps(record, indent=1) + "\n")
    return 0 if worst < 2e-2 else 1


if __name__ == "__main__":
    sys.exit(main())
