"""Prefix ordering of a batch job on and off: cached prompt tokens and wall time.

    python -m bench.batch_ordering [--model M] [--device cpu] [--json FILE]

One job, `engine.LLM` (a batch job's lines queued at once, at batch priority): 24 system
prompts of 128 tokens x 5 lines each (its own 8-16 token question, 4 greedy tokens, EOS
ignored), under a KV budget of 96 pages of 16 tokens (the 24 prefixes need 192, and the 8
running lines hold up to 80). Three runs, each
on a fresh engine: the lines shuffled with ordering on (the default) and off
(`prefix_ordering=False`: FIFO, no gate), and grouped by system prompt with ordering on
(the best case the shuffled job should reach).
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from typing import Any

from bench.common import Table, write_json
from engine import LLM, SamplingParams
from engine.core.model_files import DEMO_MODEL
from policy import Policy

NUM_SYSTEMS, LINES_EACH, SYSTEM_TOKENS = 24, 5, 128
KV_PAGES = {"gpu": 96, "cpu": 0, "disk": 0}
POLICY = Policy(gpu_batch_size=8, num_gpu_batches=1)


def job(vocab: int, seed: int = 0) -> list[list[int]]:
    """The grouped job: line j of system i is system i + its own question."""
    rng = random.Random(seed)
    systems = [[rng.randrange(8, vocab) for _ in range(SYSTEM_TOKENS)] for _ in range(NUM_SYSTEMS)]
    return [
        system + [rng.randrange(8, vocab) for _ in range(rng.randint(8, 16))]
        for system in systems
        for _ in range(LINES_EACH)
    ]


def run(model: str, device: str, shuffled: bool, ordering: bool) -> dict[str, Any]:
    llm = LLM(
        model,
        policy=POLICY,
        device=device,
        kv_capacity_pages=KV_PAGES,
        prefix_ordering=ordering,
        show_progress=False,
    )
    prompts = job(llm.executor.config.vocab_size)
    if shuffled:
        random.Random(1).shuffle(prompts)
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    llm.generate([[1, 2, 3]], params)  # warm up on a prompt that shares nothing
    start = time.perf_counter()
    outputs = llm.generate(prompts, params)
    seconds = time.perf_counter() - start
    assert len({o.request_id for o in outputs}) == len(prompts)
    prompt_tokens = sum(len(p) for p in prompts)
    cached = sum(o.num_cached_tokens or 0 for o in outputs)
    return {
        "seconds": seconds,
        "prompt_tokens": prompt_tokens,
        "cached_tokens": cached,
        "cached_frac": cached / prompt_tokens,
        "computed_prompt_tokens": prompt_tokens - cached,
        "preemptions": llm.scheduler.num_preemptions,
        "outputs": [o.outputs[0].token_ids for o in outputs],
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=DEMO_MODEL)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--json", default=None, help="write the figures here")
    args = parser.parse_args(argv)
    runs = {
        "shuffled, ordering on": run(args.model, args.device, True, True),
        "shuffled, ordering off": run(args.model, args.device, True, False),
        "grouped, ordering on": run(args.model, args.device, False, True),
    }
    on, off = runs["shuffled, ordering on"], runs["shuffled, ordering off"]
    assert on["outputs"] == off["outputs"], "ordering changed a greedy output"
    best = runs["grouped, ordering on"]
    table = Table(["run", "cached prompt tokens", "of grouped", "computed prompt tokens", "s"])
    for name, r in runs.items():
        share = r["cached_tokens"] / best["cached_tokens"]
        row = [name, str(r["cached_tokens"]), f"{share:.2f}", str(r["computed_prompt_tokens"])]
        table.rows.append([*row, f"{r['seconds']:.2f}"])
    print(table.markdown("lrrrr"))
    results = [
        {"run": name, **{k: v for k, v in r.items() if k != "outputs"}} for name, r in runs.items()
    ]
    write_json(args.json, results, table, vars(args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
