"""Whether a measurement ran on a quiet machine: the CPU time other processes took meanwhile.

A hardware profile measured while other work runs is wrong in a way its spreads do not show:
every sample of a rate is slow alike, and an overlap share (two operations side by side
against each alone) can come out as 1.0 when the lone runs were the ones slowed. So the
profiler watches the machine while it measures: the CPU time every process but itself used
(from /proc/stat through psutil, less its own and its children's), the time a hypervisor
stole, and the load average before and after. A profile measured while others used more
than `BUSY_CORES` cores on average, or while more than `BUSY_STEAL` of the time was stolen,
is marked as taken under load (`HardwareSpec.machine_load`): the planner does not believe its
overlap shares and has it measured again once the machine is quiet.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from types import TracebackType

import psutil

from policy.hardware import BUSY_CORES, BUSY_STEAL


def _busy_and_steal() -> tuple[float, float, float]:
    """(busy CPU seconds of all processes, stolen seconds, all seconds) since boot, summed
    over the cores."""
    t = psutil.cpu_times()
    idle = t.idle + getattr(t, "iowait", 0.0)
    steal = getattr(t, "steal", 0.0)
    total = sum(t)
    # guest time is already counted in user time on Linux
    total -= getattr(t, "guest", 0.0) + getattr(t, "guest_nice", 0.0)
    return total - idle - steal, steal, total


def _own_seconds() -> float:
    """CPU seconds this process and its waited-for children used."""
    t = psutil.Process().cpu_times()
    return t.user + t.system + t.children_user + t.children_system


@dataclass(frozen=True)
class LoadReport:
    """What else ran while a measurement did."""

    others_cores: float
    """Cores other processes kept busy on average."""
    steal_share: float
    """Share of the machine's CPU time a hypervisor took."""
    loadavg_before: float
    loadavg_after: float
    seconds: float

    @property
    def under_load(self) -> bool:
        return self.others_cores > BUSY_CORES or self.steal_share > BUSY_STEAL

    def to_dict(self) -> dict[str, float]:
        return {
            "others_cores": round(self.others_cores, 3),
            "steal_share": round(self.steal_share, 4),
            "loadavg_before": round(self.loadavg_before, 2),
            "loadavg_after": round(self.loadavg_after, 2),
            "seconds": round(self.seconds, 1),
        }


class LoadMonitor:
    """`with LoadMonitor() as watch: ...`, then `watch.report`: the load while the body ran."""

    def __enter__(self) -> LoadMonitor:
        self._wall = time.monotonic()
        self._busy, self._steal, self._total = _busy_and_steal()
        self._own = _own_seconds()
        self._loadavg = os.getloadavg()[0]
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.report = self.sample()

    def sample(self) -> LoadReport:
        """The load from entering until now."""
        wall = max(time.monotonic() - self._wall, 1e-6)
        busy, steal, total = _busy_and_steal()
        others = max(0.0, (busy - self._busy) - (_own_seconds() - self._own))
        return LoadReport(
            others_cores=others / wall,
            steal_share=(steal - self._steal) / max(total - self._total, 1e-6),
            loadavg_before=self._loadavg,
            loadavg_after=os.getloadavg()[0],
            seconds=wall,
        )


def others_cores(seconds: float = 1.0) -> float:
    """Cores other processes keep busy over the next `seconds`."""
    with LoadMonitor() as watch:
        time.sleep(seconds)
    return watch.report.others_cores


def wait_until_quiet(timeout_s: float, window_s: float = 5.0) -> bool:
    """Poll until a whole window passes with other processes under BUSY_CORES and nothing
    stolen; False if `timeout_s` passes first."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with LoadMonitor() as watch:
            time.sleep(min(window_s, max(0.1, deadline - time.monotonic())))
        if not watch.report.under_load:
            return True
    return False
