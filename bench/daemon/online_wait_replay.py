"""The online-during-batch job replayed through the real scheduler: rows an online request waits.

    python -m bench.daemon.online_wait_replay [--repeat 11] [--json FILE]

Torch-free and quick: the job of `bench.daemon.online_during_batch` (300 lines of 95 prompt
tokens and 16 output tokens, 64 of them in the engine at a time as the batch runner hands
them over, a block of 256 and a 2,048-token step budget, as the demo daemon runs) goes
through the real `StepLoop`, planning each step while the one before runs, over the tests'
fake executor. An online request of 4 tokens arrives at a point in time, counted in dense
rows (on a CPU every row costs about the same): while a step runs the worker waits on it,
having planned the next, so the request is queued after that one. Its wait is the rows from
its arrival to the end of the step that samples its last token. Three requests a run, each
`--gap` rows after the last answer (0: one after another, as the wall-clock benchmark
sends them), the first at `--repeat` points spread over the job; with `batch_step_cap` off
and on, and with no lingering after online work (`wait_queues.LINGER_STEPS` 0).
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
from concurrent.futures import Future
from typing import Any

from bench.common import Table, write_json
from engine.core import wait_queues
from engine.core.protocol import StepPlan, StepResult
from engine.core.sampling_params import SamplingParams
from engine.core.scheduler import Scheduler
from engine.core.scheduler_config import SchedulerConfig
from engine.core.sequence import BATCH_PRIORITY, Request
from engine.core.step_loop import StepLoop
from tests.engine.fakes import VOCAB, FakeExecutor

NUM_LINES, PROMPT_TOKENS, LINE_TOKENS, IN_ENGINE = 300, 95, 16, 64
ONLINE_TOKENS, ONLINE_PER_RUN = 4, 3


class RunAtOnce(FakeExecutor):
    """Runs each submitted step at once; the step loop still plans one step ahead."""

    def submit(self, plan: StepPlan) -> Future[StepResult]:
        future: Future[StepResult] = Future()
        future.set_result(self.execute(plan))
        return future


def replay(batch_step_cap: bool, gap_rows: int, first_at: int) -> tuple[list[int], int, int]:
    """(rows each online request waited, the job's steps, the job's dense rows)."""
    config = SchedulerConfig(
        gpu_batch_size=256, max_step_tokens=2048, batch_share=0.25, batch_step_cap=batch_step_cap
    )
    sched, fake = Scheduler(config), RunAtOnce()
    core = StepLoop(sched, fake, async_scheduling=True)
    rng = random.Random(0)
    prompts = [[rng.randrange(1, VOCAB) for _ in range(PROMPT_TOKENS)] for _ in range(NUM_LINES)]
    line = SamplingParams(max_tokens=LINE_TOKENS, temperature=0.0, ignore_eos=True)
    online = SamplingParams(max_tokens=ONLINE_TOKENS, temperature=0.0, ignore_eos=True)
    num_sent = num_in_engine = num_online = 0
    waits: list[int] = []
    ends: list[int] = []  # the rows run by the end of each plan
    arrive_at: int | None = first_at  # the next arrival, in rows
    came_at: int | None = None  # the arrival being answered
    online_seq = -1
    while num_sent < NUM_LINES or core.has_unfinished():
        while num_in_engine < IN_ENGINE and num_sent < NUM_LINES:
            sched.add_request(Request(f"b{num_sent}", prompts[num_sent], line, BATCH_PRIORITY))
            num_sent, num_in_engine = num_sent + 1, num_in_engine + 1
        was_waiting = came_at is not None and online_seq < 0
        for delta in core.step():
            if delta.finish_reason is None:
                continue
            if not delta.request_id.startswith("online"):
                num_in_engine -= 1
                continue
            last = max(i for i, p in enumerate(fake.plans) if online_seq in plan_seqs(p))
            assert came_at is not None
            waits.append(ends[last] - came_at)
            came_at, online_seq = None, -1
            arrive_at = ends[last] + gap_rows if num_online < ONLINE_PER_RUN else None
        while len(ends) < len(fake.plans):
            ends.append((ends[-1] if ends else 0) + fake.plans[len(ends)].dense_size)
        if was_waiting:  # it came while the step before ran: queued after the worker's step()
            request_id = f"online{num_online}"
            sched.add_request(Request(request_id, [5, 6], online))
            online_seq, num_online = sched.requests[request_id].seq_id, num_online + 1
        elif arrive_at is not None and ends[-1] > arrive_at and num_sent < NUM_LINES:
            came_at = max(arrive_at, ends[-2] if len(ends) > 1 else 0)  # in the step just sent
            arrive_at = None
    core.close()
    return waits, len(fake.plans), sum(p.dense_size for p in fake.plans)


def plan_seqs(plan: StepPlan) -> set[int]:
    return {chunk.seq_id for chunk in plan.chunks}


def run(args: argparse.Namespace) -> list[dict[str, Any]]:
    results = []
    for name, cap, linger in (
        ("off", False, wait_queues.LINGER_STEPS),
        ("on, no lingering", True, 0),
        ("on", True, wait_queues.LINGER_STEPS),
    ):
        wait_queues.LINGER_STEPS, kept = linger, wait_queues.LINGER_STEPS
        waits: list[int] = []
        job: list[tuple[int, int]] = []
        try:
            for k in range(args.repeat):
                first_at = 500 + k * 7000 // max(1, args.repeat - 1)
                w, num_steps, num_rows = replay(cap, args.gap, first_at)
                waits += w
                job.append((num_steps, num_rows))
        finally:
            wait_queues.LINGER_STEPS = kept
        results.append(
            {
                "batch_step_cap": name,
                "gap_rows": args.gap,
                "wait_rows": waits,
                "job_steps": statistics.median(s for s, _ in job),
                "job_rows": statistics.median(r for _, r in job),
            }
        )
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--repeat", type=int, default=11, help="runs, each first arrival later")
    parser.add_argument("--gap", type=int, default=0, help="rows from an answer to the next")
    parser.add_argument("--json", default=None, help="write the figures here")
    args = parser.parse_args(argv)
    results = run(args)
    table = Table(["batch step cap", "online requests", "median rows", "max rows", "job rows"])
    for r in results:
        waits = r["wait_rows"]
        table.rows.append(
            [
                r["batch_step_cap"],
                str(len(waits)),
                f"{statistics.median(waits):.0f}",
                str(max(waits)),
                f"{r['job_rows']:.0f} in {r['job_steps']:.0f} steps",
            ]
        )
    print(table.markdown("lrrrr"))
    if args.json:
        write_json(args.json, results, table, vars(args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
