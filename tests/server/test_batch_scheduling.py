"""A batch job scheduled as a whole, on a live server over the real engine (demo model): its
lines handed to the engine in prefix order, and online requests ahead of it."""

from __future__ import annotations

import dataclasses
import json
import random
import time

import pytest

from engine.core.engine_args import EngineArgs
from engine.runtime.step_loop_client import StepLoopClient
from tests.server.batch_files import URL, read_lines, request_line, upload, wait_batch
from tests.server.live import MODEL, LiveServer, ServerFactory, engine_args, wait_for

NUM_SYSTEMS, LINES_EACH = 6, 3


def budget_engine(**fields: object) -> StepLoopClient:
    """The demo engine with 24 KV pages: room for about two of the job's system prompts."""
    args = EngineArgs.from_cli_args(engine_args())
    args = dataclasses.replace(args, kv_capacity_pages={"gpu": 24, "cpu": 0, "disk": 0}, **fields)
    return StepLoopClient(args, model_name=MODEL, in_process=True)


def shuffled_job() -> list[str]:
    """6 long system prompts x 3 questions each, shuffled."""
    rng = random.Random(0)
    words = ["alpha", "beta", "gamma", "delta", "omega", "sigma", "kappa", "theta"]
    systems = [" ".join(rng.choice(words) for _ in range(60)) for _ in range(NUM_SYSTEMS)]
    lines = [
        request_line(f"s{i}-q{j}", f"{system} question {j}:", max_tokens=1)
        for i, system in enumerate(systems)
        for j in range(LINES_EACH)
    ]
    rng.shuffle(lines)
    return lines


def run_job(live: LiveServer, lines: list[str]) -> list[dict[str, object]]:
    client = live.openai()
    batch = client.batches.create(
        input_file_id=upload(client, lines), endpoint=URL, completion_window="24h"
    )
    batch = wait_batch(client, batch.id, timeout_s=120)
    assert batch.status == "completed"
    return read_lines(client, batch.output_file_id)


def cached_tokens(output: list[dict[str, object]]) -> int:
    return sum(
        line["response"]["body"]["usage"]["prompt_tokens_details"]["cached_tokens"]  # type: ignore[index]
        for line in output
    )


@pytest.mark.slow  # two servers and two jobs: about 15 s on 2 idle cores
def test_a_shuffled_job_runs_in_prefix_order_and_answers_in_input_order(
    make_server: ServerFactory,
) -> None:
    """Two lines in the engine at a time: only the daemon's sort (its input order otherwise)
    brings a system prompt's lines together while it is cached."""
    lines = shuffled_job()
    ids = [json.loads(line)["custom_id"] for line in lines]
    figures = {}
    for order in (True, False):
        live = make_server(budget_engine(), batch_concurrency=2, prefix_order=order)
        output = run_job(live, lines)
        assert [line["custom_id"] for line in output] == ids  # input order, each once
        figures[order] = cached_tokens(output)
        live.stop()
    assert figures[True] > 0
    assert figures[False] < 0.5 * figures[True], figures


def test_online_request_during_a_batch_job_goes_first(make_server: ServerFactory) -> None:
    """24 batch lines of 40 tokens, 8 at a time (Policy() block): an online request sent
    during the first wave (the block full of batch lines) is admitted before any waiting batch
    line, the newest batch line making room (preempted once, its tokens kept: the job still
    completes), and /metrics shows both queues."""
    live = make_server(batch_concurrency=64)
    client = live.openai()
    lines = [request_line(f"b{i}", "slow", max_tokens=40, ignore_eos=True) for i in range(24)]
    batch = client.batches.create(
        input_file_id=upload(client, lines), endpoint=URL, completion_window="24h"
    )
    with live.http() as http:
        wait_for(lambda: 'nanoflex_queue_waiting{queue="batch"} 16.0' in http.get("/metrics").text)
        start = time.monotonic()
        result = client.completions.create(model=MODEL, prompt="now", max_tokens=4)
        latency = time.monotonic() - start
        metrics = http.get("/metrics").text
    assert result.choices[0].finish_reason in ("length", "stop")
    counts = client.batches.retrieve(batch.id).request_counts
    assert counts is not None and counts.completed < 16, counts
    assert 'nanoflex_queue_running{queue="online"}' in metrics
    assert wait_batch(client, batch.id, timeout_s=120).status == "completed"
    core = live.engine._step_loop  # type: ignore[attr-defined]
    assert core.scheduler.num_preemptions == 1
    print(f"online latency during the batch job: {latency:.2f} s")
