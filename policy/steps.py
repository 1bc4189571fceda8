"""How many engine steps a block's prefill takes: each pays the step's fixed cost."""

from __future__ import annotations

import math

from policy.policy import Policy

RESIDENT_STEP_TOKENS = 2048
"""Default step budget when the weights stay on the compute device (chunked prefill): the
engine's (`EngineArgs.step_tokens`), which imports it from here."""


def prefill_steps(policy: Policy, prompt_len: float) -> int:
    """Steps the engine runs a block's prompts in by default (`EngineArgs.step_tokens`):
    resident weights reload nothing, so prompts run in chunks of RESIDENT_STEP_TOKENS
    (or one token per sequence of the block, if more); offloaded ones load each layer once
    per block, so the block's prompts run as one step."""
    tokens = policy.block_size * prompt_len
    if policy.weights_frac[0] >= 1.0:
        return max(1, math.ceil(tokens / max(RESIDENT_STEP_TOKENS, policy.block_size)))
    return 1
