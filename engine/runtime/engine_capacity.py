"""`EngineCapacity`: the KV capacity an engine announced at its first start, torch-free.

Capacity is fixed when the engine first starts: the budgets it derived (or was given) are
passed to every restarted engine, and one that reports less KV capacity than the first is
not taken. A first engine whose KV pools cannot hold one sequence of the context length does
not start.
"""

from __future__ import annotations

import dataclasses

from base.errors import UserError
from engine.core.engine_args import EngineArgs
from engine.core.protocol import EngineInfo
from engine.core.tier_rest import largest_pool_tokens
from policy import Policy


class EngineCapacity:
    """The first engine's KV pages per tier, against which every restarted one is checked."""

    def __init__(self) -> None:
        self.first: dict[str, int | None] = {}
        """KV pages per tier of the first engine: no restarted one may have fewer."""

    def fix(
        self, info: EngineInfo, policy: Policy, max_model_len: int, args: EngineArgs
    ) -> EngineArgs:
        """After the first start: refuse KV pools too small for one sequence of the context
        length (a `UserError`), and keep this engine's capacity. The engine args every
        restart gets: `args` with the budgets this engine derived, never derived again."""
        tokens = largest_pool_tokens(info.kv_capacity_pages, policy.kv_frac, info.page_tokens)
        if tokens < max_model_len:
            budgets = ", ".join(f"{t} {b / 2**20:.1f} MiB" for t, b in info.budgets.items())
            raise UserError(
                f"the KV cache can hold only {tokens} tokens per sequence under the policy's "
                f"kv_frac {list(policy.kv_frac)} and the budgets ({budgets}), fewer than "
                f"the context length {max_model_len}: give the KV tier more room "
                "(--disk-mem, --cpu-mem, free space under --offload-dir) or lower --max-model-len"
            )
        self.first = dict(info.kv_capacity_pages)
        if not info.budgets:
            return args
        b = info.budgets  # a restart gets what the daemon announced
        return dataclasses.replace(args, gpu_mem=b["gpu"], cpu_mem=b["cpu"], disk_mem=b["disk"])

    def check_restarted(self, info: EngineInfo) -> None:
        """A restarted engine must have the capacity the first one announced (RuntimeError)."""
        now = info.kv_capacity_pages
        smaller = [
            t
            for t, first in self.first.items()
            if (first is None and now.get(t) is not None) or (now.get(t) or 0) < (first or 0)
        ]
        if smaller:
            raise RuntimeError(
                f"the restarted engine has less KV capacity ({now}) than at start ({self.first})"
            )
