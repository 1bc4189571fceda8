"""Falcon-H1's muP multipliers (`Multipliers`), apart so that both `ModelConfig` and the
config reader (hf_config.py) import them without a cycle."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Multipliers:
    """Falcon-H1's muP multipliers, each as transformers applies it."""

    attention_in: float = 1.0
    """The normed input to the q, k and v projections."""
    key: float = 1.0
    """The keys, before the rotary."""
    attention_out: float = 1.0
    """The attention's output after o_proj."""
    ssm_in: float = 1.0
    """The normed input to the Mamba-2 in_proj."""
    ssm_zxbcdt: tuple[float, ...] = (1.0, 1.0, 1.0, 1.0, 1.0)
    """in_proj's output, per part: z, x, B, C and dt (the mup vector)."""
    ssm_out: float = 1.0
    """The Mamba-2 mixer's output after out_proj."""
    mlp_gate: float = 1.0
    """The MLP's gate projection, before the SiLU."""
    mlp_down: float = 1.0
    """The MLP's output after down_proj."""
    lm_head: float = 1.0
    """The logits."""
