"""Placement policy: the `Policy` record, hardware profile, cost model and search. No torch."""

from policy.policy import TIERS, Policy, PolicyError

__all__ = ["TIERS", "Policy", "PolicyError"]
