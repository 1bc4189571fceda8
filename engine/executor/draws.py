"""Counter-based uniform variates and the batched inverse-CDF draw of the sampler.

A row's uniform is a hash of (key, counter), computed for every row of a step in one
batch of integer ops on the compute device: no generator object per request, no host call
per row, and the value depends only on the pair, never on the batch around it (a seeded
request keyed by (seed, tokens sampled so far) samples the same tokens alone or in a
crowd). The hash is SplitMix64's finalizer (Steele, Lea and Flood, 2014), whose outputs
pass BigCrush for consecutive inputs.
"""

from __future__ import annotations

import torch

_U64 = 2**64
_GOLDEN = 0x9E3779B97F4A7C15
_MIX1 = 0xBF58476D1CE4E5B9
_MIX2 = 0x94D049BB133111EB
UNIFORM_BITS = 24
"""Bits of a uniform variate: float32's mantissa, as many as `torch.rand` gives."""


def as_int64(value: int) -> int:
    """`value` modulo 2**64 as a signed 64-bit integer (what an int64 tensor holds)."""
    value %= _U64
    return value - _U64 if value >= 2**63 else value


def _shift_right(x: torch.Tensor, bits: int) -> torch.Tensor:
    """Logical right shift of int64 values (torch's `>>` is arithmetic: it copies the sign)."""
    return (x >> bits) & ((1 << (64 - bits)) - 1)


def mix64(x: torch.Tensor) -> torch.Tensor:
    """SplitMix64 of each int64 in `x` (wrapping arithmetic modulo 2**64, as int64 tensors
    multiply on every torch device)."""
    z = x + as_int64(_GOLDEN)
    z = (z ^ _shift_right(z, 30)) * as_int64(_MIX1)
    z = (z ^ _shift_right(z, 27)) * as_int64(_MIX2)
    return z ^ _shift_right(z, 31)


def uniforms(keys: torch.Tensor, counters: torch.Tensor) -> torch.Tensor:
    """(n,) float32 in [0, 1), one per (key, counter) pair: keys and counters (n,) int64."""
    bits = _shift_right(mix64(mix64(keys) + counters), 64 - UNIFORM_BITS)
    return bits.to(torch.float32) * 2.0**-UNIFORM_BITS


def draw_rows(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """(n,) int64: per row of probs (n, vocab), the token whose probability interval holds
    u (n,) in [0, 1): the inverse of the cumulative distribution, one cumulative sum and one
    binary search per row (torch.multinomial draws an exponential variate for every token
    instead). A token of probability 0 is never drawn: the sums do not grow there, and where
    u times the total rounds up to the total the row's last possible token is taken."""
    cdf = probs.cumsum(dim=-1)
    target = cdf[:, -1:] * u[:, None]
    index = torch.searchsorted(cdf, target, right=True)[:, 0]
    columns = torch.arange(probs.shape[-1], device=probs.device)
    last_possible = torch.where(probs > 0, columns, 0).amax(dim=-1)
    return torch.minimum(index, last_possible)
