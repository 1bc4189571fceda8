"""Operators dispatched and host time of one 2,048-token prefill step, on the CUDA path's
torch ops, counted on the CPU (the demo model, 2 x 1024-token prompts, native kernels off).

    PYTHONPATH=<a checkout> python bench/kernels/prefill_step_ops.py [--json OUT.json]

Run as a file, it runs the engine of whichever checkout PYTHONPATH names, so that two
commits can be compared (a `git worktree` of each): docs/benchmarks.md, "The prefill step
between two sittings".
"""

from __future__ import annotations

import argparse
import collections
import json
import sys
import time
from pathlib import Path
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from engine import LLM, SamplingParams
from engine.loading.demo import demo_model_dir
from policy import Policy


class Dispatched(TorchDispatchMode):
    """Counts every operator dispatched while on."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: collections.Counter[str] = collections.Counter()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.ops[str(func.overloadpacket)] += 1
        return func(*args, **(kwargs or {}))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args(argv)
    generator = torch.Generator().manual_seed(0)

    def fresh() -> list[list[int]]:  # new prompts each time: no prefix-cache hits
        return [torch.randint(10, 2000, (1024,), generator=generator).tolist() for _ in range(2)]

    llm = LLM(
        str(demo_model_dir()),
        policy=Policy(gpu_batch_size=2),
        device="cpu",
        dtype="float32",
        native_kernels=False,
    )
    executor = llm.executor
    execute = executor.execute
    seconds: list[float] = []
    mode: list[Dispatched | None] = [None]

    def timed(plan: Any) -> Any:
        start = time.perf_counter()
        counter = mode[0]
        if counter is not None:
            with counter:
                out = execute(plan)
        else:
            out = execute(plan)
        if plan.chunks:
            seconds.append(time.perf_counter() - start)
        return out

    executor.execute = timed  # type: ignore[method-assign]
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    with llm:
        llm.generate(fresh(), params)  # warm-up
        seconds.clear()
        for _ in range(args.steps):
            llm.generate(fresh(), params)
        timed_steps = list(seconds)
        counter = mode[0] = Dispatched()
        llm.generate(fresh(), params)
    record = {
        "prefill_step_seconds": timed_steps,
        "ops_per_step": sum(counter.ops.values()),
        "ops": dict(counter.ops.most_common()),
    }
    print(json.dumps({k: v for k, v in record.items() if k != "ops"}))
    if args.json:
        args.json.write_text(json.dumps(record, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
