"""Placement policy: the `Policy` record, hardware profile, cost model and search. No torch."""

from policy.errors import UserError
from policy.policy import TIERS, Policy, PolicyError

__all__ = ["TIERS", "Policy", "PolicyError", "UserError"]
