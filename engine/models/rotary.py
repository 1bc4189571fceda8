"""Rotary position embeddings: each variant's inverse frequencies, and its cos and sin per row.

A model has one `Rope` per kind of layer (Gemma 3's sliding-window layers rotate with their
own base); the tables of every variant are made once per step (`Model.positions`) and every
layer reads its own. The float operations follow transformers' order, so the angles agree
to the last bit.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch

from engine.models.config import ModelConfig


def rope_inv_freq(dim: int, theta: float, scaling: dict[str, Any]) -> torch.Tensor:
    """(dim/2,) float32 inverse frequencies of `dim` rotated dimensions with `scaling`
    ('default', 'linear', 'llama3', 'yarn'; 'longrope' gives its short factors here)."""
    exponents = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
    rope_type = scaling.get("rope_type", "default")
    if rope_type == "longrope":
        return longrope_inv_freq(dim, theta, scaling["short_factor"])
    if rope_type == "yarn":
        return yarn_inv_freq(dim, theta, scaling)
    inv_freq = 1.0 / (theta**exponents)
    if rope_type == "linear":
        return inv_freq / float(scaling["factor"])
    if rope_type == "llama3":
        # Llama 3.1: long wavelengths slowed by `factor`, short ones kept, the band between blended.
        factor = float(scaling["factor"])
        low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
        old_len = float(scaling["original_max_position_embeddings"])
        low_wavelen, high_wavelen = old_len / low, old_len / high
        wavelen = 2 * torch.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        blended = (1 - smooth) * scaled / factor + smooth * scaled
        is_mid = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
        return torch.where(is_mid, blended, scaled)
    return inv_freq


def yarn_inv_freq(dim: int, theta: float, scaling: dict[str, Any]) -> torch.Tensor:
    """YaRN (DeepSeek-V3, gpt-oss, OLMo 3's global layers): each frequency blended between
    itself (fast ones, extrapolated) and itself / factor (slow ones, interpolated) by a
    linear ramp over the dimensions whose wavelengths fall between beta_fast and beta_slow
    rotations over the original context."""
    factor = float(scaling["factor"])
    original = float(scaling["original_max_position_embeddings"])
    beta_fast = float(scaling.get("beta_fast") or 32)
    beta_slow = float(scaling.get("beta_slow") or 1)

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # no zero-width ramp
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    base = theta ** (torch.arange(0, dim, 2).float() / dim)
    extrapolated = 1 - ramp
    return (1.0 / (factor * base)) * (1 - extrapolated) + (1.0 / base) * extrapolated


def yarn_attention_factor(scaling: dict[str, Any]) -> float:
    """The factor YaRN multiplies cos and sin by: the config's, else 0.1 ln(factor) + 1, or
    with DeepSeek's mscale and mscale_all_dim the ratio of that formula at each."""
    if scaling.get("attention_factor") is not None:
        return float(scaling["attention_factor"])
    factor = float(scaling["factor"])

    def mscale(scale: float) -> float:
        return 1.0 if factor <= 1 else 0.1 * scale * math.log(factor) + 1.0

    if scaling.get("mscale") and scaling.get("mscale_all_dim"):
        return mscale(float(scaling["mscale"])) / mscale(float(scaling["mscale_all_dim"]))
    return mscale(1.0)


def longrope_inv_freq(dim: int, theta: float, factors: list[float]) -> torch.Tensor:
    """LongRoPE (Phi-3): each frequency divided by its own factor."""
    exponents = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
    return 1.0 / (torch.tensor(factors, dtype=torch.float32) * theta**exponents)


def longrope_attention_factor(config: ModelConfig) -> float:
    """The factor LongRoPE multiplies cos and sin by: the config's, else sqrt(1 + ln(s) /
    ln(original length)) with s the context's extension over the original length."""
    scaling = config.rope_scaling
    if scaling.get("attention_factor") is not None:
        return float(scaling["attention_factor"])
    original = float(scaling["original_max_position_embeddings"])
    factor = scaling.get("factor") or config.max_position_embeddings / original
    if factor <= 1.0:
        return 1.0
    return math.sqrt(1 + math.log(factor) / math.log(original))


@dataclass
class Rope:
    """One rotary variant: its frequencies and how a row's position picks them."""

    inv_freq: torch.Tensor
    """(rotary_dim/2,) float32."""
    long_inv_freq: torch.Tensor | None = None
    """LongRoPE: the frequencies of rows at `long_from` and beyond; None: no switch."""
    long_from: int = 0
    """LongRoPE: original_max_position_embeddings. transformers picks one set per forward
    call (long once the call's last position reaches this); here each row picks by its own
    position, so a token's keys never depend on what else ran in its step (prefix caching
    and chunked prefill stay exact). The two agree except on a prompt longer than this,
    whose earlier rows transformers rotates with the long factors."""
    attention_factor: float = 1.0
    """cos and sin are multiplied by it (LongRoPE's attention scaling)."""
    _by_device: dict[torch.device, tuple[torch.Tensor, ...]] = field(default_factory=dict)

    @classmethod
    def of(cls, config: ModelConfig, local: bool = False) -> Rope:
        """The global layers' rotary of `config`, or (`local`) its sliding-window layers'."""
        dim = config.rotary_dim or config.head_dim
        if local and config.local_rope_theta:
            return cls(rope_inv_freq(dim, config.local_rope_theta, {}))
        scaling = config.rope_scaling
        if scaling.get("rope_type") == "yarn":
            inv_freq = rope_inv_freq(dim, config.rope_theta, scaling)
            return cls(inv_freq, attention_factor=yarn_attention_factor(scaling))
        if scaling.get("rope_type") != "longrope":
            return cls(rope_inv_freq(dim, config.rope_theta, scaling))
        return cls(
            longrope_inv_freq(dim, config.rope_theta, scaling["short_factor"]),
            longrope_inv_freq(dim, config.rope_theta, scaling["long_factor"]),
            int(scaling["original_max_position_embeddings"]),
            longrope_attention_factor(config),
        )

    def tables(self, ids: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """(T,) positions -> cos and sin, each (T, 1, rotary_dim) in `dtype`."""
        on_device = self._by_device.get(ids.device)
        if on_device is None:  # copied once per device, not once per step
            kept = (self.inv_freq, *([] if self.long_inv_freq is None else [self.long_inv_freq]))
            on_device = self._by_device[ids.device] = tuple(f.to(ids.device) for f in kept)
        positions = ids.float()[:, None]
        freqs = positions * on_device[0][None, :]  # (T, rotary_dim/2)
        if len(on_device) == 2:
            long = positions * on_device[1][None, :]
            freqs = torch.where((ids >= self.long_from)[:, None], long, freqs)
        emb = torch.cat((freqs, freqs), dim=-1)[:, None, :]  # (T, 1, rotary_dim)
        cos, sin = emb.cos(), emb.sin()
        if self.attention_factor != 1.0:
            cos, sin = cos * self.attention_factor, sin * self.attention_factor
        return cos.to(dtype), sin.to(dtype)
