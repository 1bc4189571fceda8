"""The engine: models, tiers, KV store, block pipeline, sampler, and the `LLM` API.

Importing `engine` does not import torch: the daemon uses the torch-free parts
(protocol records, scheduler, KV bookkeeping). `LLM` loads lazily on first use.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from engine.sampling_params import SamplingError, SamplingParams

if TYPE_CHECKING:
    from engine.llm import LLM, CompletionOutput, RequestOutput

__all__ = ["LLM", "CompletionOutput", "RequestOutput", "SamplingError", "SamplingParams"]


def __getattr__(name: str) -> Any:
    if name in ("LLM", "CompletionOutput", "RequestOutput"):
        from engine import llm

        return getattr(llm, name)
    raise AttributeError(f"module 'engine' has no attribute {name!r}")
