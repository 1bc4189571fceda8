"""`RestartPolicy`: when the daemon restarts an engine that crashed, and when it gives up.

Only an engine that started once is restarted: a start failure (no device, a bad model, out
of memory at load) does not change on retry, so it ends the daemon instead. Restarts wait
with exponential back-off (1 s, 2 s, 4 s, ... up to 30 s); more than `max_restarts` crashes
inside `window_s` mean the engine crashes as it runs, and the daemon exits with one line so
that its supervisor (systemd, Docker's restart policy) sees it.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class RestartPolicy:
    """How often an engine that crashed after a successful start is restarted."""

    max_restarts: int = 5
    """Restarts allowed within `window_s`; the next crash ends the daemon."""
    window_s: float = 600.0
    """The sliding window, in seconds, over which restarts are counted."""
    first_backoff_s: float = 1.0
    """Wait before the first restart in the window; doubles with each further one."""
    max_backoff_s: float = 30.0
    """The longest wait before a restart."""

    def __post_init__(self) -> None:
        if self.max_restarts < 0 or self.window_s <= 0 or self.first_backoff_s < 0:
            raise ValueError(f"invalid restart policy {self}")


@dataclass
class RestartTracker:
    """Counts restarts in the window of a `RestartPolicy` and says how long to wait."""

    policy: RestartPolicy = field(default_factory=RestartPolicy)
    times: list[float] = field(default_factory=list)
    """When each restart within the window was granted (monotonic seconds)."""

    def next_delay(self, now: float) -> float | None:
        """Seconds to wait before restarting after a crash at `now`, or None: give up."""
        self.times = [t for t in self.times if now - t < self.policy.window_s]
        if len(self.times) >= self.policy.max_restarts:
            return None
        delay = self.policy.first_backoff_s * 2 ** len(self.times)
        self.times.append(now)
        return min(delay, self.policy.max_backoff_s)

    @property
    def num_recent(self) -> int:
        """Restarts granted within the window (as of the last `next_delay`)."""
        return len(self.times)
