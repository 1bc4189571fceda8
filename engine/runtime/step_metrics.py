"""`EngineMetrics`: the figures the daemon reports after every engine step, torch-free.

Each step's `StepStats` (feeding /metrics) come from the scheduler's queues and KV pages,
what the step ran (`StepCounter`) and counts kept across engine restarts: preemptions,
restarts and dropped disk-cache index entries.
"""

from __future__ import annotations

import copy
import logging

from engine.core.protocol import EngineInfo, StepPlan, StepResult
from engine.core.step_loop import StepLoop
from engine.runtime.engine_client import StepStats
from engine.runtime.executor_client import ExecutorClient
from policy import TIERS

log = logging.getLogger("nanoflex.engine")


class StepCounter:
    """The executor, remembering what the last step ran and left: the batch size (the
    scheduler's running list no longer holds the ones that finished in the step) and the
    bytes resident per tier (the pools grow as they fill: /metrics follows them)."""

    def __init__(self, executor: ExecutorClient) -> None:
        self.executor = executor
        self.num_seqs = 0
        self.bytes_per_tier = executor.describe().placement.bytes_per_tier()

    def execute(self, plan: StepPlan) -> StepResult:
        self.num_seqs = len({chunk.seq_id for chunk in plan.chunks})
        result = self.executor.execute(plan)
        if result.bytes_per_tier:
            self.bytes_per_tier = result.bytes_per_tier
        return result


class EngineMetrics:
    """Counts kept across step loops and restarts, and each step's `StepStats`."""

    def __init__(self) -> None:
        self.preemptions_before = 0
        """Preemptions of the step loops closed so far (a restart starts a fresh one)."""
        self.num_restarts = 0
        self.index_dropped = 0
        """Disk-cache index entries dropped at the starts so far."""
        self.reported_busy = False
        """The last stats showed requests in the scheduler (idle again: report zeros)."""

    def took(self, info: EngineInfo) -> None:
        """Log what a freshly built engine reports: its warnings and its warm-up's time."""
        for line in info.warnings:
            log.warning("%s", line)
        self.index_dropped += info.disk_cache_dropped
        if info.warm_up is not None:
            w = info.warm_up
            log.info(
                "engine: warm-up %.1f s (%d CUDA graphs captured, %d Triton specializations "
                "compiled)",
                w.seconds,
                w.graphs_captured,
                w.kernels_compiled,
            )

    def closed(self, core: StepLoop) -> None:
        """Keep the counts of an step loop that is closed."""
        self.preemptions_before += core.scheduler.num_preemptions

    def stats(
        self,
        core: StepLoop,
        counter: StepCounter | None,
        page_bytes: int,
        step_seconds: float,
        batch_size: int,
    ) -> StepStats:
        """The figures after a step of `batch_size` sequences (0: none ran, only the queues
        changed) that took `step_seconds`."""
        scheduler = core.scheduler
        pages = scheduler.page_manager
        self.reported_busy = scheduler.has_unfinished()
        return StepStats(
            step_seconds=step_seconds,
            batch_size=batch_size,
            num_waiting=scheduler.num_waiting,
            num_running=len(scheduler.running),
            queues=scheduler.queue_lengths(),
            bytes_per_tier=counter.bytes_per_tier if counter else {},
            num_preemptions=self.preemptions_before + scheduler.num_preemptions,
            prefix_cache=copy.deepcopy(pages.stats),
            cached_pages={tier: pages.num_cached_pages(tier) for tier in TIERS},
            page_bytes=page_bytes,
            used_pages={tier: pages.num_used_pages(tier) for tier in TIERS},
            capacity_pages=dict(pages.capacity_pages),
            offload_faults=scheduler.rest.num_faults,
            index_dropped=self.index_dropped,
            num_restarts=self.num_restarts,
        )
