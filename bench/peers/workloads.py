"""The named workloads that nanoflex and its peers (vLLM's CPU build) run side by side.

Stdlib only: a peer's own virtualenv imports this file to build the very same token ids.
Each workload is a list of (prompt token ids, tokens to generate); generation is greedy
with EOS ignored, so every system does exactly the same work.

- `mixed`: 64 prompts of 32-256 token ids, 8-32 new tokens each, every fourth 128
  (the engine-efficiency workload of docs/benchmarks.md, "Against vLLM").
- `prefill-heavy`: 16 prompts of 1024 ids, 16 new tokens each.
- `decode-heavy`: 32 prompts of 64 ids, 512 new tokens each.
- `mixed-32`: the first 32 prompts of `mixed` (for the 1.1B shape on 2 cores).
"""

from __future__ import annotations

import argparse
import json
import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

Workload = list[tuple[list[int], int]]
"""(prompt token ids, max new tokens) per request."""

FIRST_ID = 3
"""Token ids are drawn from [FIRST_ID, vocab): ids 0-2 are specials in the models we run."""


def _ids(rng: random.Random, length: int, vocab_size: int) -> list[int]:
    return [rng.randrange(FIRST_ID, vocab_size) for _ in range(length)]


def mixed(vocab_size: int, num_prompts: int = 64, seed: int = 0) -> Workload:
    rng = random.Random(seed)
    out = []
    for i in range(num_prompts):
        prompt_len = rng.randint(32, 256)
        gen_len = 128 if i % 4 == 3 else rng.randint(8, 32)
        out.append((_ids(rng, prompt_len, vocab_size), gen_len))
    return out


def fixed(
    vocab_size: int, num_prompts: int, prompt_len: int, gen_len: int, seed: int = 0
) -> Workload:
    rng = random.Random(seed)
    return [(_ids(rng, prompt_len, vocab_size), gen_len) for _ in range(num_prompts)]


WORKLOADS = {
    "mixed": lambda vocab: mixed(vocab),
    "mixed-32": lambda vocab: mixed(vocab, num_prompts=32),
    "prefill-heavy": lambda vocab: fixed(vocab, 16, 1024, 16),
    "decode-heavy": lambda vocab: fixed(vocab, 32, 64, 512),
}


def build(name: str, vocab_size: int) -> Workload:
    """The named workload's requests for a model with `vocab_size` tokens."""
    if name not in WORKLOADS:
        raise ValueError(f"unknown workload {name!r}; one of {', '.join(WORKLOADS)}")
    return WORKLOADS[name](vocab_size)


def num_tokens(workload: Workload) -> tuple[int, int]:
    """(prompt tokens, generated tokens) of a workload."""
    return sum(len(p) for p, _ in workload), sum(n for _, n in workload)


def record(
    system: str,
    name: str,
    workload: Workload,
    generated: int,
    seconds: float,
    **extra: Any,
) -> dict[str, Any]:
    """One timed run of workload `name` as both sides' children report it: throughput of the
    generated tokens (checked to be exactly what the workload asks) and `extra` fields."""
    prompt_tokens, expected = num_tokens(workload)
    if generated != expected:
        raise RuntimeError(f"{system} generated {generated} tokens, the workload asks {expected}")
    return {
        "system": system,
        "workload": name,
        "num_prompts": len(workload),
        "prompt_tokens": prompt_tokens,
        "generated_tokens": generated,
        "seconds": seconds,
        "throughput": generated / seconds,
        "total_throughput": (prompt_tokens + generated) / seconds,
        **extra,
    }


def emit(record: dict[str, Any], path: str | None) -> None:
    """Print a child's record as JSON, and write it to `path` when given."""
    text = json.dumps(record, indent=2)
    print(text)
    if path:
        Path(path).write_text(text + "\n")


def child_main(
    doc: str | None,
    run: Callable[[argparse.Namespace], dict[str, Any]],
    add_arguments: Callable[[argparse.ArgumentParser], None],
    argv: list[str] | None = None,
) -> int:
    """A child's entry point: its own flags, then `--workload` and `--json`; runs it once and
    prints (and writes) its record."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0] if doc else None)
    add_arguments(parser)
    parser.add_argument("--workload", default="mixed", choices=sorted(WORKLOADS))
    parser.add_argument("--json", default=None, help="also write the record here")
    args = parser.parse_args(argv)
    emit(run(args), args.json)
    return 0
