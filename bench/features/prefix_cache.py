"""The prefix cache on two workloads, cache on against off, one sitting (docs/benchmarks.md).

    python -m bench.features.prefix_cache [--model M] [--device cpu] [--json FILE]

- shared system prompt: 256 requests, each a 1,024-token system prompt shared by all
  plus 32-64 tokens of its own, 16 generated (a batch job over a dataset);
- conversations: 32 conversations x 4 rounds, each round appending 64-128 user tokens to
  the history (previous prompts and answers) and generating 32, with KV budgets small
  enough that the histories spill from the gpu tier to cpu and to disk between rounds.

Generation throughput = generated tokens / wall time, greedy, EOS ignored.
"""

from __future__ import annotations

import argparse
import random
import sys
import tempfile
import time
from typing import Any

from bench.common import Table, write_json
from engine import LLM, SamplingParams
from engine.core.model_files import DEMO_MODEL
from policy import Policy

POLICY = Policy(gpu_batch_size=16, num_gpu_batches=2)
CONVERSATION_PAGES = {"gpu": 96, "cpu": 160, "disk": 4096}
"""KV pages per tier for the conversations: a round's 32 histories do not fit the gpu tier."""


def random_tokens(rng: random.Random, n: int, vocab: int) -> list[int]:
    return [rng.randrange(8, vocab) for _ in range(n)]


def shared_prompt(llm: LLM, seed: int) -> dict[str, Any]:
    rng = random.Random(seed)
    vocab = llm.executor.config.vocab_size
    system = random_tokens(rng, 1024, vocab)
    prompts = [system + random_tokens(rng, rng.randint(32, 64), vocab) for _ in range(256)]
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    start = time.perf_counter()
    outputs = llm.generate(prompts, params)
    seconds = time.perf_counter() - start
    return _result(llm, outputs, seconds, [])


def conversations(llm: LLM, seed: int) -> dict[str, Any]:
    rng = random.Random(seed)
    vocab = llm.executor.config.vocab_size
    histories: list[list[int]] = [[] for _ in range(32)]
    params = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)
    start = time.perf_counter()
    outputs = []
    rounds = []
    for _ in range(4):
        prompts = [h + random_tokens(rng, rng.randint(64, 128), vocab) for h in histories]
        done = llm.generate(prompts, params)
        histories = [p + o.outputs[0].token_ids for p, o in zip(prompts, done, strict=True)]
        outputs.extend(done)
        rounds.append(sum(o.num_cached_tokens for o in done) / sum(len(p) for p in prompts))
    seconds = time.perf_counter() - start
    return _result(llm, outputs, seconds, rounds)


def _result(llm: LLM, outputs: list[Any], seconds: float, rounds: list[float]) -> dict[str, Any]:
    stats = llm.scheduler.page_manager.stats
    generated = sum(len(o.outputs[0].token_ids) for o in outputs)
    prompt_tokens = sum(len(o.prompt_token_ids) for o in outputs)
    return {
        "seconds": seconds,
        "generated_tokens": generated,
        "generation_throughput": generated / seconds,
        "prompt_tokens": prompt_tokens,
        "cached_tokens": sum(o.num_cached_tokens for o in outputs),
        "hit_pages": dict(stats.hit_pages),
        "spilled_pages": dict(stats.spilled_pages),
        "loaded_pages": dict(stats.loaded_pages),
        "evicted_pages": stats.evicted_pages,
        "hit_rate_per_round": rounds,
    }


def run(args: argparse.Namespace, workload: str, cache: bool) -> dict[str, Any]:
    budgets = {"kv_capacity_pages": CONVERSATION_PAGES} if workload == "conversations" else {}
    with (
        tempfile.TemporaryDirectory(prefix="nanoflex-bench-") as offload,
        LLM(
            args.model,
            policy=POLICY,
            device=args.device,
            offload_dir=offload,
            enable_prefix_caching=cache,
            **budgets,
        ) as llm,
    ):
        llm.generate([[5] * 8], SamplingParams(max_tokens=2, temperature=0.0))  # warm-up
        return (shared_prompt if workload == "shared prompt" else conversations)(llm, args.seed)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--model", default=DEMO_MODEL)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    results = []
    table = Table(
        [
            "workload",
            "cache",
            "generation tok/s",
            "wall s",
            "prompt tokens cached",
            "pages hit on gpu / cpu / disk",
            "pages spilled to cpu / disk",
            "on / off",
        ]
    )
    for workload in ("shared prompt", "conversations"):
        off = run(args, workload, cache=False)
        on = run(args, workload, cache=True)
        results.append({"workload": workload, "off": off, "on": on})
        for name, r in (("off", off), ("on", on)):
            hits, spilled = r["hit_pages"], r["spilled_pages"]
            table.rows.append(
                [
                    workload,
                    name,
                    f"{r['generation_throughput']:.1f}",
                    f"{r['seconds']:.1f}",
                    f"{r['cached_tokens'] / r['prompt_tokens']:.0%}",
                    " / ".join(str(hits[t]) for t in ("gpu", "cpu", "disk")),
                    f"{spilled['cpu']} / {spilled['disk']}",
                    ""
                    if name == "off"
                    else f"**{on['generation_throughput'] / off['generation_throughput']:.2f}x**",
                ]
            )
        print(f"{workload}: done", file=sys.stderr)
    print(table.markdown("llrrrrrr"))
    write_json(args.json, results, table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
