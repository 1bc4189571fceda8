"""How many engine steps a block's prefill takes: each pays the step's fixed cost."""

from __future__ import annotations

import math

from policy.policy import Policy

RESIDENT_STEP_TOKENS = 2048
"""Default step budget when the weights stay on the compute device (chunked prefill): the
engine's (`EngineArgs.step_tokens`), which imports it from here."""


def default_step_tokens(policy: Policy, prompt_len: float) -> int:
    """The most tokens one engine step runs by default (`EngineArgs.step_tokens`): resident
    weights, chunks of RESIDENT_STEP_TOKENS (or one token per sequence of the block, if
    more); offloaded ones, the block's prompts at once."""
    if policy.weights_frac[0] >= 1.0:
        return max(RESIDENT_STEP_TOKENS, policy.block_size)
    return max(policy.block_size * int(prompt_len), policy.block_size)


def prefill_steps(policy: Policy, prompt_len: float) -> int:
    """Steps the engine runs a block's prompts in by default (`EngineArgs.step_tokens`):
    resident weights reload nothing, so prompts run in chunks of RESIDENT_STEP_TOKENS
    (or one token per sequence of the block, if more); offloaded ones load each layer once
    per block, so the block's prompts run as one step."""
    if policy.weights_frac[0] < 1.0:
        return 1
    tokens = policy.block_size * prompt_len
    return max(1, math.ceil(tokens / default_step_tokens(policy, prompt_len)))
