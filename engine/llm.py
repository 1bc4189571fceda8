"""`LLM`: the offline Python API: scheduler, executor and tokenizer in one process."""

from __future__ import annotations

import dataclasses
import itertools
import logging
from collections.abc import Sequence
from typing import Any

from base.errors import UserError
from engine.core.engine_args import EngineArgs
from engine.core.media import SeqMedia
from engine.core.model_files import ModelLoadError, generation_defaults
from engine.core.outputs import RequestOutput
from engine.core.protocol import Placement
from engine.core.sampling_params import SamplingError, SamplingParams
from engine.core.sequence import BATCH_PRIORITY, Request
from engine.core.step_loop import StepLoop
from engine.core.tokenizer import Tokenizer, has_tokenizer
from engine.executor.executor import build_executor
from engine.loading.generated import local_model_dir
from policy import Policy

Prompt = str | list[int]
log = logging.getLogger("nanoflex.engine")


class LLM:
    """Generate with one model under one policy, like vLLM's `LLM`.

    model: a local directory, a GGUF file, a hub id, `dummy:<shape>`, `nanoflex-demo` (random
        weights, fast), or None for the default model, SmolLM2-135M-Instruct.
    policy: a `Policy`, a policy JSON file, or "auto" (or None): planned by the cost model for
        `workload` on this machine's cached hardware profile (`nanoflex profile`).
    Every other keyword is a field of `EngineArgs` (device, offload_dir, gpu_mem, cpu_mem,
    disk_mem, dtype, max_step_tokens, async_scheduling, static_blocks, kv_capacity_pages,
    workload, show_progress).
    """

    def __init__(
        self, model: str | None = None, policy: Policy | str | None = "auto", **kwargs: Any
    ) -> None:
        try:
            args = EngineArgs(model=None if model is None else str(model), policy=policy, **kwargs)
        except TypeError as e:  # an unknown keyword
            raise UserError(f"LLM(): {e}") from e
        self.args = args
        model_dir = local_model_dir(args.model)
        self.policy, self.plan = args.resolve_policy(model_dir)
        self.executor = build_executor(args, str(model_dir), self.policy)
        for line in self.executor.describe().warnings:  # a damaged disk-cache index, say
            log.warning("%s", line)
        self.tokenizer = Tokenizer(model_dir) if has_tokenizer(model_dir) else None
        self.scheduler = args.create_scheduler(
            self.policy, model_dir, self.executor.describe(), self.tokenizer
        )
        plans_ahead = args.plans_ahead(not self.executor.device.is_cuda)
        self.step_loop = StepLoop(self.scheduler, self.executor, plans_ahead)
        self._ids = itertools.count()
        self._defaults = generation_defaults(model_dir)

    @classmethod
    def from_engine_args(cls, args: EngineArgs) -> LLM:
        return cls(**{f.name: getattr(args, f.name) for f in dataclasses.fields(args)})

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        priority: int = BATCH_PRIORITY,
        media: Sequence[SeqMedia | None] | None = None,
    ) -> list[RequestOutput]:
        """One `RequestOutput` per prompt, in prompt order. Prompts are strings or token-id lists;
        `sampling_params` is one for all or a list with one per prompt; `media`: each prompt's
        images (token-id prompts whose image tokens `expand_image_tokens` widened)."""
        if isinstance(prompts, str) or (
            isinstance(prompts, list) and prompts and isinstance(prompts[0], int)
        ):
            prompts = [prompts]
        prompt_list = list(prompts)
        if sampling_params is None:  # the model's own defaults, as vLLM's LLM
            params = [SamplingParams(**self._defaults)] * len(prompt_list)  # type: ignore[arg-type]
        elif isinstance(sampling_params, SamplingParams):
            params = [sampling_params] * len(prompt_list)
        else:
            params = list(sampling_params)
            if len(params) != len(prompt_list):
                raise SamplingError(
                    f"got {len(params)} sampling params for {len(prompt_list)} prompts"
                )
        encode = None if self.tokenizer is None else self._encode_plain
        vocab = self.executor.config.vocab_size
        requests = [
            Request(
                request_id=str(next(self._ids)),
                prompt_token_ids=self.encode(prompt),
                sampling=p.prepared(encode, vocab),
                priority=priority,
                media=images,
            )
            for prompt, p, images in zip(
                prompt_list, params, media or [None] * len(prompt_list), strict=True
            )
        ]
        return self.step_loop.generate(requests)

    def encode(self, prompt: Prompt) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ModelLoadError(
                    f"{self.executor.model_dir} has no tokenizer: pass prompts as token ids"
                )
            return self.tokenizer.encode(prompt)
        vocab = self.executor.config.vocab_size
        bad = [t for t in prompt if not isinstance(t, int) or not 0 <= t < vocab]
        if bad:
            raise SamplingError(f"token ids must be integers in [0, {vocab}), got {bad[:5]}")
        return list(prompt)

    def _encode_plain(self, text: str) -> list[int]:
        """Text as token ids without the model's special tokens (bad words)."""
        assert self.tokenizer is not None
        return self.tokenizer.encode(text, add_special_tokens=False)

    def placement(self) -> Placement:
        return self.executor.placement()

    def close(self) -> None:
        self.step_loop.close()
        self.executor.close()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
