"""Llama 3.1's rope scaling from a GGUF file's `rope_freqs` tensor.

llama.cpp's converter does not write Llama 3.1's (and Llama 4 Scout's) `llama3` rope parameters:
it writes their effect, one factor per rotated pair (`rope_freqs.weight`, (dim / 2,)): 1 where
the wavelength is under original_max_position_embeddings / high_freq_factor, `factor` where it
is over original_max_position_embeddings / low_freq_factor, 1 / ((1 - s) / factor + s) between,
s = (original / wavelength - low) / (high - low). Given the rotary base and dimensions, those
factors pin the parameters down: `factor` is the largest, and, with low_freq_factor 1 (every
Llama 3.x and 4 checkpoint's), the blended band's s, a line in 1 / wavelength, gives
high_freq_factor and the original context; without a band (Scout: low = high = 1) the original
context is the power of two between the last kept and the first slowed wavelength. The
parameters found are checked by recomputing the factors from them; a file whose factors are not
of this form is refused.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from engine.models.hf_config import UnsupportedModelError

FACTORS = "rope_freqs.weight"
RTOL = 1e-5
"""How close the recomputed factors must come to the file's (they are float32)."""


def llama3_parameters(factors: np.ndarray, theta: float, dim: int, name: str) -> dict[str, Any]:
    """transformers' `llama3` rope parameters (without rope_theta) whose factors over `dim`
    rotated dimensions at base `theta` are `factors`; `name` names the file in a refusal."""
    factors = factors.astype(np.float64)
    wavelength = 2 * math.pi * theta ** (np.arange(0, dim, 2) / dim)
    factor = float(factors.max())
    blended = (factors > 1 + RTOL) & (factors < factor * (1 - RTOL))
    if blended.sum() >= 2:  # s = slope / wavelength + intercept, low_freq_factor = 1
        share = (1 / factors[blended] - 1 / factor) / (1 - 1 / factor)
        slope, intercept = np.polyfit(1 / wavelength[blended], share, 1)
        high = round(1 - 1 / intercept, 4)
        original = round(-slope / intercept)
    else:
        high = 1.0
        kept = wavelength[factors <= 1 + RTOL]
        slowed = wavelength[factors >= factor * (1 - RTOL)]
        low_end, high_end = kept.max(initial=0.0), slowed.min(initial=math.inf)
        original = 2 ** math.ceil(math.log2(low_end)) if low_end > 0 else 1
        if not low_end < original < high_end:
            original = round(math.sqrt(low_end * high_end))
    parameters = dict(
        rope_type="llama3",
        factor=round(factor, 4),
        low_freq_factor=1.0,
        high_freq_factor=high,
        original_max_position_embeddings=int(original),
    )
    if not np.allclose(_factors(parameters, wavelength), factors, rtol=RTOL):
        raise UnsupportedModelError(
            f"{name} scales its rotary frequencies per dimension (rope_freqs) in a way that is "
            "not Llama 3.1's llama3 scaling, which nanoflex does not convert; load the original "
            "safetensors checkpoint instead"
        )
    return parameters


def add_rope_factors(hf_config: Any, tensors: Any) -> None:
    """Llama 3.1's rope parameters into `hf_config` where the GGUF file behind `tensors` (a
    GgufTensors) has rope_freqs; nothing otherwise."""
    if FACTORS not in tensors.tensor_names():
        return
    rope = dict(getattr(hf_config, "rope_parameters", None) or {})
    theta = float(rope.get("rope_theta", 10000.0))
    heads = hf_config.num_attention_heads
    head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // heads
    factors = tensors.raw(FACTORS)
    rope.update(llama3_parameters(factors, theta, int(head_dim), tensors.path.name))
    hf_config.rope_parameters = rope


def _factors(parameters: dict[str, Any], wavelength: np.ndarray) -> np.ndarray:
    """The per-pair factors llama.cpp's converter writes for `parameters`."""
    factor, low, high = (parameters[k] for k in ("factor", "low_freq_factor", "high_freq_factor"))
    original = parameters["original_max_position_embeddings"]
    with np.errstate(divide="ignore", invalid="ignore"):
        share = (original / wavelength - low) / (high - low)
        blended = 1 / ((1 - share) / factor + share)
    out = np.where(wavelength > original / low, factor, blended)
    return np.where(wavelength < original / high, 1.0, out)
