"""A hybrid's prefix cache on a shared system prompt, on against off, one sitting, on the CPU.

The model is bench/features/hybrid_state.py's Qwen3.5-shaped hybrid (1.35B parameters, three Gated
DeltaNet layers to one attention layer, generated weights, float32). The workload is a
batch job over a dataset: `--requests` prompts of one `--shared`-token system prompt plus
16-32 tokens of their own, `--gen-len` generated each, greedy, EOS ignored, sent together.
"on" is the default engine (prefix caching with 8 saved states); "off" is
`prefix_state_slots=0`, which turns prefix caching off for a hybrid (a cached KV prefix is
usable only with the state at its end). The two alternate, `--repeat` times each; the
medians are kept.

Throughput = (prompt + generated tokens) / wall time: the prompts are most of the work
here, and what the cache saves. The run also reports the prompt tokens served from the
cache and the states saved and restored (docs/architecture.md, "Prefix caching for hybrids").

    .venv/bin/python -m bench.features.hybrid_prefix --json bench/results/hybrid-prefix-cpu.json
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.common import Table, write_json
from bench.features.hybrid_state import HYBRID, VOCAB, num_params
from engine import LLM, SamplingParams
from policy import Policy

GPU_MEM = 12 << 30
"""The gpu tier's budget (host memory on a CPU device): the weights' 5 GiB, KV and states."""


def prompts_of(args: argparse.Namespace) -> list[list[int]]:
    rng = random.Random(args.seed)
    system = [rng.randrange(3, VOCAB) for _ in range(args.shared)]
    return [
        system + [rng.randrange(3, VOCAB) for _ in range(rng.randint(16, 32))]
        for _ in range(args.requests)
    ]


def run(model_dir: Path, slots: int, args: argparse.Namespace) -> dict[str, Any]:
    prompts = prompts_of(args)
    params = SamplingParams(max_tokens=args.gen_len, temperature=0.0, ignore_eos=True)
    policy = Policy(gpu_batch_size=args.block)
    with (
        tempfile.TemporaryDirectory(prefix="nanoflex-bench-") as offload,
        LLM(
            f"dummy:{model_dir}",
            policy=policy,
            device="cpu",
            offload_dir=offload,
            gpu_mem=GPU_MEM,  # derived from free memory, a previous run's pages could shrink it
            prefix_state_slots=slots,
        ) as llm,
    ):
        llm.generate([[5] * 8], SamplingParams(max_tokens=2, temperature=0.0))  # warm-up
        stats = llm.scheduler.page_manager.stats
        before = (stats.hit_tokens, stats.state_hits, stats.state_saves)
        start = time.perf_counter()
        outputs = llm.generate(prompts, params)
        seconds = time.perf_counter() - start
        prompt_tokens = sum(len(p) for p in prompts)
        generated = sum(len(o.outputs[0].token_ids) for o in outputs)
        return {
            "seconds": seconds,
            "tokens_per_s": (prompt_tokens + generated) / seconds,
            "prompt_tokens": prompt_tokens,
            "generated_tokens": generated,
            "cached_tokens": stats.hit_tokens - before[0],
            "state_hits": stats.state_hits - before[1],
            "state_saves": stats.state_saves - before[2],
            "state_bytes": llm.executor.states.slot_bytes if llm.executor.states else 0,
            "token_ids": [o.outputs[0].token_ids for o in outputs],
        }


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--shared", type=int, default=256, help="system prompt tokens")
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--gen-len", type=int, default=4)
    parser.add_argument("--block", type=int, default=8, help="sequences running at once")
    parser.add_argument("--repeat", type=int, default=2, help="runs of each (median kept)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    runs: dict[str, list[dict[str, Any]]] = {"off": [], "on": []}
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = Path(tmp) / "hybrid"
        model_dir.mkdir()
        (model_dir / "config.json").write_text(json.dumps(HYBRID))
        for _ in range(args.repeat):
            for name, slots in (("off", 0), ("on", 8)):
                runs[name].append(run(model_dir, slots, args))
                gc.collect()
    same = all(r["token_ids"] == runs["off"][0]["token_ids"] for rs in runs.values() for r in rs)
    for rs in runs.values():
        for r in rs:
            del r["token_ids"]
    median = {name: statistics.median(r["tokens_per_s"] for r in rs) for name, rs in runs.items()}
    table = Table(
        [
            "prefix cache",
            "tok/s (prompt + generated)",
            "runs",
            "prompt tokens cached",
            "states saved / restored",
            "on / off",
        ]
    )
    for name, rs in runs.items():
        r = rs[0]
        table.rows.append(
            [
                name,
                f"{median[name]:.1f}",
                " / ".join(f"{x['tokens_per_s']:.1f}" for x in rs),
                f"{r['cached_tokens']} of {r['prompt_tokens']}",
                f"{r['state_saves']} / {r['state_hits']}",
                "" if name == "off" else f"**{median['on'] / median['off']:.2f}x**",
            ]
        )
    print(table.markdown("lrrrrr"))
    print(f"tokens identical on and off: {same}")
    meta = {**vars(args), "params": num_params(HYBRID), "tokens_identical": same}
    write_json(args.json, [{"runs": runs, "medians": median}], table, args=meta)


if __name__ == "__main__":
    main()
