"""`Executor`: the engine side of the step protocol: an assembled engine that runs steps.

Its roles live apart: `EngineAssembly` (assembly.py) builds the device, model, stores and
pipeline from the `EngineArgs` record; `StepRunner` (step_runner.py) runs one `StepPlan`;
`PromptScorer` (scoring.py) scores whole prompts. `build_executor` is the factory `LLM`
and the engine process call.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch

from base.pages import PAGE_TOKENS
from engine.core.engine_args import EngineArgs
from engine.core.protocol import EngineInfo, StepPlan, StepResult, WarmUp
from engine.executor.assembly import EngineAssembly
from engine.executor.scoring import PromptScorer
from engine.executor.step_runner import StepRunner
from engine.executor.warm_up import warm_up
from policy import Policy


class Executor(EngineAssembly):
    """The engine side of the step protocol. Construct, call `execute(plan)` per step, `close()`.

    args: how to build the engine: the model (a reference or directory, see
        engine.core.model_files), device, byte budgets per tier, dtype, offload directory,
        trace, and every switch (CUDA graphs, weight slots, nano-batch overlap, paged
        attention, native kernels, prepacked weights, hot and grouped experts...), each
        read where it is used and documented on `EngineArgs`.
    policy: the placement and block shape the engine runs under.
    on_progress: called with (layers loaded, layers) while the weights load; None:
        `args.show_progress` decides.
    """

    def __init__(
        self,
        args: EngineArgs,
        policy: Policy,
        on_progress: Callable[[int, int], None] | None = None,
    ) -> None:
        super().__init__(args, policy, on_progress)
        self.steps = StepRunner(self)
        self.scorer = PromptScorer(self.steps)
        self.warmed: WarmUp | None = None
        """What `warm_up` made ready, if it ran."""

    def warm_up(self, batch_sizes: tuple[int, ...] | None, piecewise: bool = True) -> WarmUp:
        """Capture every decode graph (and with `piecewise`, every mixed and prefill step's
        graphs) and compile every Triton specialization a step of the scheduler's discrete
        sizes `batch_sizes` (None: no discrete batching) can meet, before the first step
        (engine/executor/warm_up.py)."""
        self.warmed = warm_up(self, batch_sizes, piecewise)
        return self.warmed

    def describe(self) -> EngineInfo:
        """What a scheduler in this or another process needs to plan for this engine."""
        scratch = str(self.offload_dir) if self._own_offload_dir else None
        return EngineInfo(
            page_tokens=PAGE_TOKENS,
            kv_capacity_pages=self.kv_capacity_pages(),
            placement=self.placement(),
            page_bytes=self.kv.page_bytes,
            cache_salt=self.cache_salt(),
            disk_cache=list(self.found_on_disk),
            scratch_dir=scratch,
            budgets=dict(self.budgets),
            disk_cache_dropped=self.disk_cache.num_dropped,
            warnings=[w for w in [self.disk_cache.warning] if w],
            state_slots=self.running_state_slots(),
            state_bytes=0 if self.states is None else self.states.slot_bytes,
            state_snapshots=dict(self.snapshots),
            warm_up=self.warmed,
        )

    def execute(self, plan: StepPlan) -> StepResult:
        """Run one plan (`StepRunner.execute`)."""
        return self.steps.execute(plan)

    def score(self, prompts: list[list[int]], prefill_len: int | None = None) -> list[torch.Tensor]:
        """(len, vocab) float32 logits at every position of each prompt (`PromptScorer.score`)."""
        return self.scorer.score(prompts, prefill_len)


def build_executor(
    args: EngineArgs,
    model_dir: str,
    policy: Policy,
    on_progress: Callable[[int, int], None] | None = None,
) -> Executor:
    """The executor `args` describe, for the resolved model directory and policy: what `LLM`
    and the engine process (`engine.runtime`) build, the record passed as it is; on CUDA,
    warmed up (`Executor.warm_up`) unless `args.warmup` is off."""
    executor = Executor(dataclasses.replace(args, model=model_dir), policy, on_progress)
    if args.warmup and executor.device.is_cuda:
        try:
            sizes = args.discrete_batch_sizes(policy) if args.discrete_batching else None
            executor.warm_up(sizes, piecewise=args.piecewise_graphs)
        except BaseException:
            executor.close()
            raise
    return executor
