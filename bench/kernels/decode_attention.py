"""The native CPU decode-attention kernel alone, against SDPA over the padded copy.

    python -m bench.kernels.decode_attention [--seqs 32] [--min-len 64] [--max-len 576]
        [--json bench/results/decode-attention-cpu.json]

One decode step's attention for SmolLM2-135M's shape (9 query heads over 3 kv heads of
64), sequences of random lengths whose keys lie on shuffled 16-token pages of a KV pool,
as the engine lays them out. Each layer has its own pool; cycling through 30 of them (the
model's layers) keeps the pools out of the caches, as in a real step, where one layer's
rows are read once per step. Times are the best of 3 rounds of every layer, per layer;
"GB/s" is the pool bytes the step must read over that time. The padded path is what runs
without the kernel (`--no-native-kernels`): gather every past row into a (B, kv_heads, L,
head_dim) copy, then SDPA with a length mask.
"""

from __future__ import annotations

import argparse
import random
import time
from typing import Any

import torch

from bench.common import Table, write_json
from engine.executor.attention import RaggedLayout, paged_attention
from engine.kernels import PagedKernels, paged_kernels
from engine.models.config import KVShape

HEADS, KV_HEADS, HEAD_DIM, LAYERS, PAGE = 9, 3, 64, 30, 16


def step_inputs(
    lens: list[int], dtype: torch.dtype, layers: int, seed: int = 0
) -> tuple[torch.Tensor, list[torch.Tensor], list[list[int]]]:
    """(q, one pool per layer, per sequence the slots of its keys on shuffled pages)."""
    g = torch.Generator().manual_seed(seed)
    num_pages = sum(-(-n // PAGE) for n in lens) + 4
    pages = torch.randperm(num_pages, generator=g).tolist()
    seq_slots, used = [], 0
    for n in lens:
        mine = pages[used : used + -(-n // PAGE)]
        used += len(mine)
        seq_slots.append([mine[t // PAGE] * PAGE + t % PAGE for t in range(n)])
    width = 2 * KV_HEADS * HEAD_DIM
    pools = [torch.randn(num_pages * PAGE, width, generator=g).to(dtype) for _ in range(layers)]
    q = torch.randn(len(lens), HEADS, HEAD_DIM, generator=g).to(dtype)
    return q, pools, seq_slots


def time_layers(
    q: torch.Tensor,
    pools: list[torch.Tensor],
    layout: RaggedLayout,
    kernels: PagedKernels | None,
) -> float:
    """Seconds per layer of `paged_attention`: the best of 3 rounds over every layer's pool."""

    def run(pool: torch.Tensor) -> None:
        paged_attention(q, pool, lambda rows: rows, layout, KVShape(KV_HEADS, HEAD_DIM), kernels)

    for pool in pools[:2]:
        run(pool)
    best = float("inf")
    for _ in range(3):
        start = time.perf_counter()
        for pool in pools:
            run(pool)
        best = min(best, (time.perf_counter() - start) / len(pools))
    return best


def add_rows(
    table: Table,
    results: list[dict[str, Any]],
    dtype: torch.dtype,
    times: dict[str, float],
    work: float,
    fmt: str,
    lens: list[int],
) -> None:
    """One row per path of `times` (seconds per layer; "gather + SDPA" the baseline), with
    `work` (GB or GFLOP a layer) over its seconds, in format `fmt`, and its speed-up."""
    for path, seconds in times.items():
        speedup = times["gather + SDPA"] / seconds
        row = [str(dtype).removeprefix("torch."), path, f"{seconds * 1e3:.3f}"]
        table.rows.append([*row, format(work / seconds, fmt), f"{speedup:.2f}x"])
        results.append({"dtype": row[0], "path": path, "seconds": seconds, "lens": lens})


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seqs", type=int, default=32)
    parser.add_argument("--min-len", type=int, default=64)
    parser.add_argument("--max-len", type=int, default=576)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    kernels = paged_kernels()
    if kernels is None:
        raise SystemExit("the native kernels did not build (see the warning above)")
    rng = random.Random(0)
    lens = [rng.randint(args.min_len, args.max_len) for _ in range(args.seqs)]
    table = Table(["dtype", "path", "ms per layer", "GB/s of KV read", "kernel speed-up"])
    results: list[dict[str, Any]] = []
    for dtype in (torch.float32, torch.bfloat16):
        q, pools, seq_slots = step_inputs(lens, dtype, LAYERS)
        paged = RaggedLayout.build(
            [1] * len(lens), [n - 1 for n in lens], torch.device("cpu"), None, seq_slots
        )
        assert paged.groups[0].kv_lens is not None  # one decode group, read in place
        times = {
            "native kernel": time_layers(q, pools, paged, kernels),
            "gather + SDPA": time_layers(q, pools, paged, None),
        }
        kv_bytes = sum(lens) * 2 * KV_HEADS * HEAD_DIM * pools[0].element_size()
        add_rows(table, results, dtype, times, kv_bytes / 1e9, ".1f", lens)
    print(table.markdown("llrrr"))
    write_json(args.json, results, table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
