"""The native CPU prefill-attention kernel alone, against SDPA over the gathered keys.

    python -m bench.kernels.prefill_attention [--seqs 2] [--len 1024]
        [--json bench/results/prefill-attention-cpu.json]

One step's prefill attention for SmolLM2-135M's shape (9 query heads over 3 kv heads of 64):
`--seqs` whole prompts of `--len` tokens (a step of 2048 tokens by default, the engine's
step budget with resident weights), their keys on shuffled 16-token pages of a KV pool as
the engine lays them out, one pool per layer (bench.kernels.decode_attention says why). Times are
the best of 3 rounds of every layer, per layer. GFLOP/s counts the causal products the
attention needs: 2 x 2 x heads x head_dim x L (L + 1) / 2 per sequence. The other path is
what runs without the kernel (`--no-native-kernels`): gather the keys into a packed copy,
then SDPA with its causal mask, one call a sequence.
"""

from __future__ import annotations

import argparse
from typing import Any

import torch

from bench.common import Table, write_json
from bench.kernels.decode_attention import (
    HEAD_DIM,
    HEADS,
    LAYERS,
    add_rows,
    step_inputs,
    time_layers,
)
from engine.executor.attention import RaggedLayout
from engine.kernels import paged_kernels


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seqs", type=int, default=2)
    parser.add_argument("--len", type=int, default=1024)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    kernels = paged_kernels()
    if kernels is None:
        raise SystemExit("the native kernels did not build (see the warning above)")
    lens = [args.len] * args.seqs
    flops = sum(2 * 2 * HEADS * HEAD_DIM * n * (n + 1) / 2 for n in lens)
    table = Table(["dtype", "path", "ms per layer", "GFLOP/s", "kernel speed-up"])
    results: list[dict[str, Any]] = []
    for dtype in (torch.float32, torch.bfloat16):
        _, pools, seq_slots = step_inputs(lens, dtype, LAYERS)
        q = torch.randn(sum(lens), HEADS, HEAD_DIM, generator=torch.Generator().manual_seed(1))
        q = q.to(dtype)
        paged = RaggedLayout.build(lens, [0] * len(lens), torch.device("cpu"), None, seq_slots)
        assert paged.groups[0].starts is not None  # one group of chunks, read in place
        times = {
            "native kernel": time_layers(q, pools, paged, kernels),
            "gather + SDPA": time_layers(q, pools, paged, None),
        }
        add_rows(table, results, dtype, times, flops / 1e9, ".0f", lens)
    print(table.markdown("llrrr"))
    write_json(args.json, results, table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
