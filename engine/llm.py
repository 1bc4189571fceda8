"""`LLM`: the offline Python API: scheduler, executor and tokenizer in one process."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from engine.checkpoint import ModelLoadError
from engine.core import EngineCore
from engine.executor import Executor
from engine.model_files import eos_token_ids, resolve_model_dir
from engine.outputs import CompletionOutput, RequestOutput
from engine.planning import DEFAULT_WORKLOAD, Workload, resolve_policy
from engine.sampling_params import SamplingError, SamplingParams
from engine.scheduler import Scheduler, SchedulerConfig
from engine.sequence import BATCH_PRIORITY, Request
from policy import Policy
from policy.errors import UserError

__all__ = ["LLM", "CompletionOutput", "RequestOutput"]

Prompt = str | list[int]


class LLM:
    """Generate with one model under one policy, like vLLM's `LLM`.

    model: a local directory, a hub id, or None for the built-in demo model.
    policy: a `Policy`, a policy JSON file, or "auto" (or None): planned by the cost model for
        `workload` on this machine's cached hardware profile (`nanoflex profile`).
    gpu_mem / cpu_mem / disk_mem: byte budgets per tier (gpu_mem is also enforced on CUDA).
    dtype: "float16", "bfloat16" or "float32"; default float32 on the CPU, the checkpoint's
        half type (or float16) on CUDA.
    kv_capacity_blocks: KV blocks per tier the scheduler may use, overriding what the memory
        budgets leave (tests use a tiny pool to force preemption); missing tiers keep theirs.
    static_blocks: FlexGen-style baseline without refill (SchedulerConfig.static_blocks).
    """

    def __init__(
        self,
        model: str | Path | None = None,
        policy: Policy | str | None = "auto",
        offload_dir: str | Path | None = None,
        device: str = "auto",
        gpu_mem: int | None = None,
        *,
        cpu_mem: int | None = None,
        disk_mem: int | None = None,
        async_scheduling: bool = True,
        max_step_tokens: int | None = 2048,
        show_progress: bool = False,
        kv_capacity_blocks: dict[str, int | None] | None = None,
        static_blocks: bool = False,
        workload: Workload | None = None,
        dtype: str | None = None,
    ) -> None:
        model_dir = resolve_model_dir(None if model is None else str(model))
        self.policy, self.plan = resolve_policy(
            policy,
            model_dir,
            device=device,
            workload=workload or DEFAULT_WORKLOAD,
            gpu_mem=gpu_mem,
            cpu_mem=cpu_mem,
            disk_mem=disk_mem,
        )
        self.executor = Executor(
            model_dir,
            self.policy,
            device=device,
            offload_dir=offload_dir,
            gpu_mem=gpu_mem,
            cpu_mem=cpu_mem,
            disk_mem=disk_mem,
            dtype=None if dtype is None else parse_dtype(dtype),
            show_progress=show_progress,
        )
        self.tokenizer = load_tokenizer(self.executor.model_dir)
        config = self.executor.config
        self.scheduler = Scheduler(
            SchedulerConfig.from_policy(
                self.policy,
                block_tokens=self.executor.block_tokens,
                kv_capacity_blocks=self.executor.kv_capacity_blocks() | (kv_capacity_blocks or {}),
                static_blocks=static_blocks,
                eos_token_ids=eos_token_ids(model_dir),
                max_model_len=config.max_position_embeddings,
                # None: a whole block's prompts prefill in one step, as FlexGen does
                max_step_tokens=max_step_tokens
                or self.policy.block_size * config.max_position_embeddings,
            ),
            detokenizer=None if self.tokenizer is None else _Detokenizer(self.tokenizer),
        )
        self.core = EngineCore(self.scheduler, self.executor, async_scheduling=async_scheduling)
        self._ids = itertools.count()

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        priority: int = BATCH_PRIORITY,
    ) -> list[RequestOutput]:
        """One `RequestOutput` per prompt, in prompt order. Prompts are strings or token-id lists;
        `sampling_params` is one for all or a list with one per prompt."""
        if isinstance(prompts, str) or (
            isinstance(prompts, list) and prompts and isinstance(prompts[0], int)
        ):
            prompts = [prompts]
        prompt_list = list(prompts)
        if sampling_params is None:
            params = [SamplingParams()] * len(prompt_list)
        elif isinstance(sampling_params, SamplingParams):
            params = [sampling_params] * len(prompt_list)
        else:
            params = list(sampling_params)
            if len(params) != len(prompt_list):
                raise SamplingError(
                    f"got {len(params)} sampling params for {len(prompt_list)} prompts"
                )
        requests = [
            Request(
                request_id=str(next(self._ids)),
                prompt_token_ids=self.encode(prompt),
                sampling=p,
                priority=priority,
            )
            for prompt, p in zip(prompt_list, params, strict=True)
        ]
        return self.core.generate(requests)

    def encode(self, prompt: Prompt) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ModelLoadError(
                    f"{self.executor.model_dir} has no tokenizer: pass prompts as token ids"
                )
            return list(self.tokenizer.encode(prompt))
        vocab = self.executor.config.vocab_size
        bad = [t for t in prompt if not isinstance(t, int) or not 0 <= t < vocab]
        if bad:
            raise SamplingError(f"token ids must be integers in [0, {vocab}), got {bad[:5]}")
        return list(prompt)

    def placement(self) -> dict[str, Any]:
        return self.executor.placement()

    def close(self) -> None:
        self.core.close()
        self.executor.close()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def parse_dtype(name: str) -> Any:
    """'float16' | 'bfloat16' | 'float32' -> the torch dtype."""
    import torch

    dtypes = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}
    if name not in dtypes:
        raise UserError(f"dtype must be one of {', '.join(dtypes)}, got {name!r}")
    return dtypes[name]


def load_tokenizer(model_dir: Path) -> Any | None:
    """The checkpoint's tokenizer, or None when it ships none (then prompts are token ids)."""
    if not any((model_dir / name).exists() for name in ("tokenizer.json", "tokenizer_config.json")):
        return None
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(model_dir)
    except (OSError, ValueError) as e:
        raise ModelLoadError(f"cannot load the tokenizer in {model_dir}: {e}") from e


class _Detokenizer:
    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer = tokenizer

    def decode(self, token_ids: list[int]) -> str:
        return str(self._tokenizer.decode(token_ids, skip_special_tokens=True))
