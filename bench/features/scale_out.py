"""Batch lines answered by 1 engine without Ray, and by 1 and 2 Ray replicas, one sitting.

    python -m bench.features.scale_out [--model nanoflex-demo] [--num-lines 512] [--json FILE]

Every variant answers the same OpenAI batch lines (completions, prompts of about
`--prompt-len` tokens, `--gen-len` tokens generated, greedy, EOS ignored) with the
run-batch code: `answer_all` over one in-process engine for the local row, a
`ReplicaPool` on a local Ray instance (`ray.init(num_cpus=2)`, loopback) for the others,
each replica planning its own policy (`policy="auto"`). Startup (model load, policy,
actors) is timed apart from answering; throughput = generated tokens / answering time.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from typing import Any

from bench.common import Table, write_json
from engine.core.engine_args import EngineArgs
from engine.core.model_files import DEMO_MODEL, served_model_name
from engine.runtime.step_loop_client import StepLoopClient
from server.batch.lines import BatchLine
from server.offline.work import BatchWork, Pending, answer_all, line_id
from server.openai.metrics import Metrics
from server.openai.serving import COMPLETIONS, Serving


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=DEMO_MODEL)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--num-lines", type=int, default=512)
    parser.add_argument("--prompt-len", type=int, default=64, help="about this many tokens")
    parser.add_argument("--gen-len", type=int, default=32)
    parser.add_argument("--replicas", default="1,2", help="Ray replica counts to measure")
    parser.add_argument("--json", default=None, help="also write the results here")
    return parser.parse_args()


def batch_work(args: argparse.Namespace) -> BatchWork:
    todo = []
    for i in range(args.num_lines):
        body = {
            "model": args.model,
            "prompt": f"{i} " + "word " * (args.prompt_len - 2),
            "max_tokens": args.gen_len,
            "temperature": 0,
            "ignore_eos": True,
        }
        todo.append(Pending(line_id(i, str(i)), BatchLine(i, str(i), body)))
    return BatchWork(COMPLETIONS, int(time.time()), todo)


class Tally:
    """The record callback: counts lines and generated tokens."""

    def __init__(self) -> None:
        self.num_lines = 0
        self.num_tokens = 0

    def __call__(self, ok: bool, line: str) -> None:
        assert ok, line
        self.num_lines += 1
        self.num_tokens += json.loads(line)["response"]["body"]["usage"]["completion_tokens"]


def result(
    name: str, replicas: int, startup_s: float, answer_s: float, tally: Tally
) -> dict[str, Any]:
    return {
        "name": name,
        "replicas": replicas,
        "startup_s": startup_s,
        "answer_s": answer_s,
        "num_lines": tally.num_lines,
        "generated_tokens": tally.num_tokens,
        "lines_per_s": tally.num_lines / answer_s,
        "generation_throughput": tally.num_tokens / answer_s,
    }


async def local(engine_args: EngineArgs, work: BatchWork) -> dict[str, Any]:
    start = time.perf_counter()
    name = served_model_name(engine_args.model)
    client = StepLoopClient(engine_args, model_name=name, in_process=True)
    await client.start()
    ready = time.perf_counter()
    tally = Tally()
    try:
        serving = Serving(client, client.model_name, Metrics(client))
        await answer_all(serving, work, lambda item, ok, line: tally(ok, line))
    finally:
        await client.shutdown()
    return result("local run-batch (no Ray)", 1, ready - start, time.perf_counter() - ready, tally)


async def on_ray(ray: Any, engine_args: EngineArgs, work: BatchWork, n: int) -> dict[str, Any]:
    from server.offline.scale_out.pool import ReplicaPool

    pool = ReplicaPool(ray, engine_args, n)
    start = time.perf_counter()
    tally = Tally()
    try:
        await pool.start()
        ready = time.perf_counter()
        await pool.answer(work, tally)
        end = time.perf_counter()
    finally:
        pool.shutdown()
    name = f"Ray, {n} replica{'s' if n > 1 else ''}"
    out = result(name, n, ready - start, end - ready, tally)
    out["policies"] = [slot.info.policy for slot in pool.slots if slot.info is not None]
    return out


def main() -> int:
    args = parse_args()
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")  # loopback only
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    import ray

    engine_args = EngineArgs(model=args.model, device=args.device)
    work = batch_work(args)
    results = [asyncio.run(local(engine_args, work))]
    print(f"{results[-1]['name']}: done", file=sys.stderr)
    ray.init(num_cpus=os.cpu_count(), include_dashboard=False, log_to_driver=False)
    try:
        for n in (int(x) for x in args.replicas.split(",")):
            results.append(asyncio.run(on_ray(ray, engine_args, work, n)))
            print(f"{results[-1]['name']}: done", file=sys.stderr)
    finally:
        ray.shutdown()
    base = results[0]["generation_throughput"]
    table = Table(
        ["run", "engines", "startup (s)", "answering (s)", "lines/s", "generated tok/s", "vs local"]
    )
    for r in results:
        table.rows.append(
            [
                r["name"],
                str(r["replicas"]),
                f"{r['startup_s']:.1f}",
                f"{r['answer_s']:.1f}",
                f"{r['lines_per_s']:.1f}",
                f"{r['generation_throughput']:.0f}",
                f"{r['generation_throughput'] / base:.2f}x",
            ]
        )
    print(table.markdown("lrrrrrr"))
    write_json(args.json, results, table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
