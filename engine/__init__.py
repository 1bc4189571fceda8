"""nanoflex's engine. The public API: `from engine import LLM, SamplingParams`.

Subpackages by role (docs/architecture.md has the map and the import rules):
core/ (torch-free: what the daemon imports), executor/, storage/, models/, loading/.
Importing `engine` does not import torch: `LLM` loads on first use.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from engine.core.outputs import CompletionOutput, RequestOutput
from engine.core.sampling_params import SamplingError, SamplingParams

if TYPE_CHECKING:
    from engine.llm import LLM

__all__ = ["LLM", "CompletionOutput", "RequestOutput", "SamplingError", "SamplingParams"]


def __getattr__(name: str) -> Any:
    if name == "LLM":
        from engine.llm import LLM

        return LLM
    raise AttributeError(f"module 'engine' has no attribute {name!r}")
