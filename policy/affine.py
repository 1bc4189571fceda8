"""Affine functions of the twelve placement fractions, and maxima of them: the cost model's terms.

Every time and byte count of the cost model is affine in the fractions (wg, wc, wd, cg, cc,
cd, hg, hc, hd, eg, ec, ed), or the max of a few affine rows (a task whose parts overlap), so
the LP in `policy.search` can minimize them with epigraph variables.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from policy.policy import Policy

VARS: tuple[str, ...] = ("wg", "wc", "wd", "cg", "cc", "cd", "hg", "hc", "hd", "eg", "ec", "ed")
"""The LP variables: weights, KV cache, activations and routed experts on (gpu, cpu, disk)."""
NUM_TRIPLES = len(VARS) // 3


@dataclass(frozen=True, eq=False)
class Affine:
    """const + coeffs . x over VARS; values are seconds or bytes."""

    coeffs: np.ndarray  # (12,)
    const: float = 0.0

    @staticmethod
    def of(const: float = 0.0, **coeffs: float) -> Affine:
        vector = np.zeros(len(VARS))
        for name, value in coeffs.items():
            vector[VARS.index(name)] += value
        return Affine(vector, const)

    def __add__(self, other: Affine) -> Affine:
        return Affine(self.coeffs + other.coeffs, self.const + other.const)

    def __mul__(self, scale: float) -> Affine:
        return Affine(self.coeffs * scale, self.const * scale)

    __rmul__ = __mul__

    def __call__(self, x: np.ndarray) -> float:
        return float(self.coeffs @ x + self.const)

    def minimum(self) -> float:
        """Smallest value over the placement simplex (each triple sums to 1, x >= 0)."""
        return self.const + float(self.coeffs.reshape(NUM_TRIPLES, 3).min(axis=1).sum())


ZERO = Affine.of()


@dataclass(frozen=True, eq=False)
class MaxOf:
    """The max of affine rows: the seconds of a task whose parts overlap (convex, so the LP
    bounds it row by row). A plain task is one row."""

    rows: tuple[Affine, ...]

    def __call__(self, x: np.ndarray) -> float:
        return max(row(x) for row in self.rows)

    def minimum(self) -> float:
        """A lower bound over the placement simplex: the largest of the rows' minima."""
        return max(row.minimum() for row in self.rows)

    def __add__(self, other: Affine) -> MaxOf:
        return MaxOf(tuple(row + other for row in self.rows))


def policy_vector(policy: Policy) -> np.ndarray:
    """The policy's fractions in VARS order."""
    return np.array([*policy.weights_frac, *policy.kv_frac, *policy.act_frac, *policy.experts_frac])
