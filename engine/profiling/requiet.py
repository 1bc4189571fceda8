"""Measure a profile taken under load again, in the background, once the machine is quiet.

    python -m engine.profiling.requiet DEVICE PROFILE_PATH

The planner starts this, detached, when the cached profile it plans from was measured while
other work ran (`HardwareSpec.under_load`). It waits until other processes leave the CPU
alone for a whole window (engine/profiling/load.py), measures a profile (quick for a quick
one, full for a full one), and replaces
the cached one with it if the new one was measured quietly and the cached one is still the
loaded one; a new one measured under load again is dropped and the wait starts over, for up
to `TIMEOUT_S` in all. The next start plans from the new profile. One such process runs per
profile (a lock beside it); its log is `requiet.log` beside it.
"""

from __future__ import annotations

import dataclasses
import fcntl
import os
import sys
import time
from pathlib import Path

TIMEOUT_S = 6 * 3600.0
"""How long to wait for a quiet machine before giving up (the next start tries again)."""
WINDOW_S = 30.0
"""A quiet machine: other processes under BUSY_CORES for this long
($NANOFLEX_REQUIET_WINDOW_S overrides it)."""


def lock_path(profile: Path) -> Path:
    return profile.with_name(profile.name + ".requiet.lock")


def main(argv: list[str]) -> int:
    device, profile = argv[1], Path(argv[2])
    with open(lock_path(profile), "w") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            print("another re-measure of this profile is running", flush=True)
            return 0
        window = float(os.environ.get("NANOFLEX_REQUIET_WINDOW_S", WINDOW_S))
        return requiet(device, profile, TIMEOUT_S, window)


def requiet(device: str, profile: Path, timeout_s: float, window_s: float) -> int:
    """Wait for quiet, measure like for like (a quick profile for a quick one, else a full
    one), replace: 0 when replaced or no longer needed, 1 on timeout."""
    from engine.profiling.load import wait_until_quiet
    from engine.profiling.profiler import profile_hardware
    from policy.hardware import HardwareSpec

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        cached = HardwareSpec.load(profile) if profile.is_file() else None
        if cached is not None and not cached.under_load:
            print("the cached profile is no longer one taken under load", flush=True)
            return 0
        if not wait_until_quiet(deadline - time.monotonic(), window_s):
            break
        quick = cached is not None and cached.quick
        print(
            f"quiet for {window_s:.0f} s: measuring a {'quick' if quick else 'full'} profile",
            flush=True,
        )
        fresh = profile_hardware(device, quick=quick)
        if fresh.under_load:
            print(f"measured under load again ({fresh.describe()}); waiting", flush=True)
            continue
        if profile.is_file() and not HardwareSpec.load(profile).under_load:
            return 0  # replaced meanwhile (`nanoflex profile`, say): keep that one
        if cached is not None:
            fresh = dataclasses.replace(fresh, attempts=cached.attempts + 1)
        fresh.save(profile)
        print(f"replaced {profile}: {fresh.describe()}", flush=True)
        return 0
    print("the machine never went quiet; the next start tries again", flush=True)
    return 1


if __name__ == "__main__":
    sys.exit(main(sys.argv))
