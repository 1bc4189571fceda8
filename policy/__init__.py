"""Placement policy: the `Policy` record, hardware profile, cost model and search. No torch.

The search (`policy.search.search`) pulls in cvxpy, so it is imported from its module
rather than here; this package's top level stays cheap for the engine and the daemon.
"""

from policy.hardware import FLEXGEN_T4, HardwareSpec, default_cache_path, load_cached
from policy.policy import TIERS, Policy, PolicyError
from policy.specs import ModelSpec, WorkloadSpec
from policy.units import format_bytes, parse_bytes

__all__ = [
    "FLEXGEN_T4",
    "TIERS",
    "HardwareSpec",
    "ModelSpec",
    "Policy",
    "PolicyError",
    "WorkloadSpec",
    "default_cache_path",
    "format_bytes",
    "load_cached",
    "parse_bytes",
]
