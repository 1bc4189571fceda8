"""A hybrid against a transformer of the same size on the CPU: how many sequences fit a fixed
KV + state budget, and tokens per second, generated weights.

The hybrid is a Qwen3.5-shaped model (three Gated DeltaNet layers to one attention layer),
the transformer a Llama of the same width, depth and parameter count (its MLP widened to
match). Sequences that fit: the budget over one sequence's bytes at that context, as the
engine holds them (its KV page bytes, every attention layer, for the pages the context
spans, plus the hybrid's state slot). Tokens per second: FlexGen's generation throughput
(prompts x gen_len / total time) of `--num-prompts` prompts run together, float32 (KV
and convolution windows in float32 too), the median of `--repeat` runs.

    .venv/bin/python -m bench.features.hybrid_state --json bench/results/hybrid_state.json
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from bench.common import Table, write_json
from engine import LLM, SamplingParams
from policy import Policy

HIDDEN, LAYERS, HEADS, KV_HEADS, HEAD_DIM, VOCAB = 2048, 24, 16, 2, 128, 32000
SHARED: dict[str, Any] = dict(
    hidden_size=HIDDEN,
    num_hidden_layers=LAYERS,
    num_attention_heads=HEADS,
    num_key_value_heads=KV_HEADS,
    head_dim=HEAD_DIM,
    vocab_size=VOCAB,
    tie_word_embeddings=False,
    max_position_embeddings=32768,
    torch_dtype="float32",
)
"""What the two models share: width, depth, attention heads, vocabulary."""
HYBRID: dict[str, Any] = dict(
    SHARED,
    model_type="qwen3_5_text",
    intermediate_size=5120,
    linear_num_key_heads=16,
    linear_num_value_heads=16,
    linear_key_head_dim=128,
    linear_value_head_dim=128,
    linear_conv_kernel_dim=4,
    layer_types=["linear_attention", "linear_attention", "linear_attention", "full_attention"]
    * (LAYERS // 4),
)
LLAMA: dict[str, Any] = dict(SHARED, model_type="llama", intermediate_size=6656)
CONTEXTS = (1024, 4096, 16384, 32768)
"""Context lengths (prompt + generated) the fit table is computed at."""


def num_params(config: dict[str, Any]) -> int:
    from transformers import AutoConfig, AutoModelForCausalLM

    spec = dict(config)
    hf = AutoConfig.for_model(spec.pop("model_type"), **spec)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(hf)
    return sum(p.numel() for p in model.parameters())


def measure(
    name: str, config: dict[str, Any], args: argparse.Namespace, root: Path
) -> dict[str, Any]:
    model_dir = root / name
    model_dir.mkdir()
    (model_dir / "config.json").write_text(json.dumps(config))
    policy = Policy(gpu_batch_size=args.num_prompts)
    with LLM(f"dummy:{model_dir}", policy=policy, device="cpu") as llm:
        executor = llm.executor
        page_bytes, page_tokens = executor.kv.page_bytes, executor.kv.page_tokens
        state_bytes = 0 if executor.states is None else executor.states.slot_bytes
        per_seq = {n: -(-n // page_tokens) * page_bytes + state_bytes for n in CONTEXTS}
        fits = {n: args.budget_gib * 2**30 // b for n, b in per_seq.items()}
        generator = torch.Generator().manual_seed(0)
        prompts = [
            torch.randint(3, VOCAB, (args.prompt_len,), generator=generator).tolist()
            for _ in range(args.num_prompts)
        ]
        params = SamplingParams(max_tokens=args.gen_len, temperature=0.0, ignore_eos=True)
        llm.generate(prompts[:1], SamplingParams(max_tokens=2, ignore_eos=True))  # warm up
        times = []
        for _ in range(args.repeat):
            start = time.perf_counter()
            llm.generate(prompts, params)
            times.append(time.perf_counter() - start)
        seconds = sorted(times)[len(times) // 2]
    return {
        "model": name,
        "params": num_params(config),
        "kv_page_bytes": page_bytes,
        "state_bytes_per_seq": state_bytes,
        "bytes_per_seq": per_seq,
        "seqs_in_budget": fits,
        "seconds": seconds,
        "all_seconds": times,
        "tokens_per_s": args.num_prompts * args.gen_len / seconds,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--gen-len", type=int, default=16)
    parser.add_argument("--num-prompts", type=int, default=8)
    parser.add_argument("--budget-gib", type=int, default=16, help="KV + state budget")
    parser.add_argument("--repeat", type=int, default=3, help="runs per model (median kept)")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        results = [
            measure(name, config, args, Path(tmp))
            for name, config in (("qwen3.5-shaped hybrid", HYBRID), ("llama", LLAMA))
        ]
    table = table_of(results, args)
    print(table.markdown("lrrrrrrr"))
    write_json(args.json, results, table, args=vars(args))


def table_of(results: list[dict[str, Any]], args: argparse.Namespace) -> Table:
    header = ["model", "params", "state / seq"] + [
        f"seqs in {args.budget_gib} GiB @ {n}" for n in CONTEXTS
    ]
    header.append(f"tok/s ({args.num_prompts} x {args.prompt_len}+{args.gen_len})")
    table = Table(header)
    for r in results:
        row = [
            r["model"],
            f"{r['params'] / 1e9:.2f}B",
            f"{r['state_bytes_per_seq'] / 2**20:.1f} MiB",
        ]
        counts = {int(k): v for k, v in r["seqs_in_budget"].items()}  # str keys once in JSON
        row += [str(counts[n]) for n in CONTEXTS] + [f"{r['tokens_per_s']:.2f}"]
        table.rows.append(row)
    return table


if __name__ == "__main__":
    main()
