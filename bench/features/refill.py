"""Continuous refill against static blocks: generation throughput on ragged output lengths.

Both runs use the same model, policy, prompts and per-request max_tokens (greedy); only
the scheduler differs. Static blocks admit sequences only into an empty block, so a block
runs until its longest member finishes, as FlexGen does; refill replaces every finished
sequence at the next step. Generation throughput = generated tokens / wall time
(docs/benchmarks.md, Metrics, with ragged lengths).

Two workloads: `random` (random prompt tokens, drawn max_tokens, EOS ignored: any model,
the demo model's figure) and `chat` (bench/features/chat_prompts.py through the chat template, EOS
honoured under a max_tokens cap: the lengths are the trained model's own answers).

    .venv/bin/python -m bench.features.refill --workload chat --device cpu [--json FILE]
    .venv/bin/python -m bench.features.refill --model nanoflex-demo --workload random [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import sys
import time
from typing import Any

from bench.common import Table, write_json
from bench.features.chat_prompts import QUESTIONS
from engine import LLM, SamplingParams
from engine.core.sequence import Request
from policy import Policy


def workload(num_prompts: int, vocab: int, seed: int) -> list[tuple[list[int], int]]:
    """(prompt ids, max_tokens) pairs: prompts of 16..128 tokens; three in four outputs are
    short (8..32 tokens), one in four long (96..128), shuffled."""
    rng = random.Random(seed)
    items = []
    for i in range(num_prompts):
        prompt = [rng.randrange(8, vocab) for _ in range(rng.randint(16, 128))]
        gen_len = rng.randint(96, 128) if i % 4 == 0 else rng.randint(8, 32)
        items.append((prompt, gen_len))
    rng.shuffle(items)
    return items


def chat_workload(llm: LLM, max_tokens: int) -> list[tuple[list[int], int]]:
    """(prompt ids, max_tokens) for every question of bench/features/chat_prompts.py, one user turn
    through the model's chat template."""
    assert llm.tokenizer is not None, "the chat workload needs a model with a tokenizer"
    chats = [[{"role": "user", "content": q}] for q in QUESTIONS]
    return [(llm.tokenizer.apply_chat_template(chat), max_tokens) for chat in chats]


def run(llm: LLM, items: list[tuple[list[int], int]], ignore_eos: bool) -> dict[str, Any]:
    """Run every request to the end through the step loop; time, steps, block occupancy,
    and the output lengths."""
    for i, (prompt, gen_len) in enumerate(items):
        params = SamplingParams(max_tokens=gen_len, temperature=0.0, ignore_eos=ignore_eos)
        llm.step_loop.add_request(Request(f"bench-{i}", prompt, params))
    num_steps = num_seq_steps = 0
    lengths: list[int] = []
    num_eos = 0
    num_tokens: dict[str, int] = {}
    start = time.perf_counter()
    while llm.step_loop.has_unfinished():
        num_seq_steps += len(llm.scheduler.running)
        for delta in llm.step_loop.step():
            num_tokens[delta.request_id] = num_tokens.get(delta.request_id, 0) + len(
                delta.new_token_ids
            )
            if delta.finished:
                lengths.append(num_tokens[delta.request_id])
                num_eos += delta.finish_reason == "stop"
        num_steps += 1
    seconds = time.perf_counter() - start
    block_size = llm.policy.block_size
    lengths.sort()
    return {
        "seconds": round(seconds, 3),
        "generated_tokens": sum(lengths),
        "num_steps": num_steps,
        "generation_throughput": round(sum(lengths) / seconds, 2),
        "block_occupancy": round(num_seq_steps / (num_steps * block_size), 3),
        "output_tokens_min_median_max": [lengths[0], lengths[len(lengths) // 2], lengths[-1]],
        "finished_by_eos": num_eos,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="default: smollm2-135m-instruct")
    parser.add_argument("--workload", default="chat", choices=["chat", "random"])
    parser.add_argument("--max-tokens", type=int, default=160, help="chat: the cap per answer")
    parser.add_argument("--device", default="cpu", choices=["auto", "cpu", "cuda"])
    parser.add_argument("--num-prompts", type=int, default=48)
    parser.add_argument("--gpu-batch-size", type=int, default=4)
    parser.add_argument("--num-gpu-batches", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", default=None, help="also write the result here")
    args = parser.parse_args(argv)
    policy = Policy(gpu_batch_size=args.gpu_batch_size, num_gpu_batches=args.num_gpu_batches)
    result: dict[str, Any] = {
        "command": "python -m bench.features.refill " + " ".join(argv or sys.argv[1:]),
        "policy": policy.to_dict(),
        "workload_kind": args.workload,
    }
    for name, static_blocks in (("static", True), ("refill", False)):
        with LLM(
            args.model,
            policy=policy,
            device=args.device,
            static_blocks=static_blocks,
        ) as llm:
            if args.workload == "chat":
                items = chat_workload(llm, args.max_tokens)
            else:
                items = workload(args.num_prompts, llm.executor.config.vocab_size, args.seed)
            ignore_eos = args.workload == "random"
            run(llm, items[:2], ignore_eos)  # warm-up
            result[name] = run(llm, items, ignore_eos)
            placement = llm.placement()
            result["device"] = f"{_device_name(placement.device)}, {placement.dtype}"
            result["model"] = str(llm.executor.model_dir.name)
    for name in ("static", "refill"):  # print the runs last, after what they ran on
        result[name] = result.pop(name)
    result["workload"] = (
        {
            "prompts": (
                f"{len(QUESTIONS)} questions of bench/features/chat_prompts.py, chat template"
            ),
            "max_tokens": f"{args.max_tokens}, EOS honoured",
        }
        if args.workload == "chat"
        else {
            "prompts": f"{args.num_prompts}, random tokens, 16..128 tokens",
            "max_tokens": "3/4 in 8..32, 1/4 in 96..128, EOS ignored",
        }
    )
    result["workload"]["total_generated"] = result["refill"]["generated_tokens"]
    result["speedup"] = round(
        result["refill"]["generation_throughput"] / result["static"]["generation_throughput"], 2
    )
    table = refill_table(result)
    print(json.dumps(result, indent=2), file=sys.stderr)
    print(table.markdown("lrrrr"))
    write_json(args.json, [result], table)
    return 0


def refill_table(result: dict[str, Any]) -> Table:
    """Static blocks against continuous refill, and their ratio."""
    static, refill = result["static"], result["refill"]
    table = Table(
        [
            "scheduler",
            "wall time (s)",
            "engine steps",
            "mean block occupancy",
            "generation throughput (token/s)",
        ]
    )
    for label, runs in (("static blocks (FlexGen-style)", static), ("continuous refill", refill)):
        table.rows.append(
            [
                label,
                f"{runs['seconds']:.2f}",
                str(runs["num_steps"]),
                f"{runs['block_occupancy']:.2f}",
                f"{runs['generation_throughput']:.1f}",
            ]
        )
    table.rows.append(
        [
            "refill / static",
            "",
            f"{refill['num_steps'] / static['num_steps']:.2f}x",
            f"{refill['block_occupancy'] / static['block_occupancy']:.1f}x",
            f"**{result['speedup']:.2f}x**",
        ]
    )
    return table


def _device_name(device: str) -> str:
    if device.startswith("cuda"):
        import torch

        return f"{device} ({torch.cuda.get_device_name(device)})"
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return f"cpu ({line.split(':', 1)[1].strip()}, {os.cpu_count()} cores)"
    except OSError:
        pass
    return f"cpu ({platform.processor() or platform.machine()})"


if __name__ == "__main__":
    sys.exit(main())
