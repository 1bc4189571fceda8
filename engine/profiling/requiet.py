"""Measure a profile taken under load, or a noisy quick one, again in the background once the
machine is quiet.

    python -m engine.profiling.requiet DEVICE PROFILE_PATH [STARTER_PID]

The planner starts this, detached, when the cached profile it plans from was measured while
other work ran (`HardwareSpec.under_load`) or is a quick one whose measurements spread too
wide (`HardwareSpec.noise`). It waits until other processes leave the CPU alone for a whole
window (engine/profiling/load.py) and measures a profile (quick for a quick one, full for a
full one). One measured under load again is dropped and the wait starts over, for up to
`TIMEOUT_S` in all. Otherwise it is counted (`attempts`) and kept in the cache if the cached
one was the loaded one or was noisier; a noisy one is measured again while attempts remain
(`MAX_ATTEMPTS`). The next start plans from the cached one. One such process runs per
profile (a lock beside it); its log is `requiet.log` beside it. It lives no longer than the
process that started it (STARTER_PID: the daemon, `LLM`, `run-batch`): within a second of
that one's exit it exits too, so a stopped daemon leaves no process behind (the next start
tries again).
"""

from __future__ import annotations

import dataclasses
import fcntl
import os
import sys
import threading
import time
from pathlib import Path

TIMEOUT_S = 6 * 3600.0
"""How long to wait for a quiet machine before giving up (the next start tries again)."""
WINDOW_S = 30.0
"""A quiet machine: other processes under BUSY_CORES for this long
($NANOFLEX_REQUIET_WINDOW_S overrides it)."""


def lock_path(profile: Path) -> Path:
    return profile.with_name(profile.name + ".requiet.lock")


WATCH_S = 0.5
"""How often the starter's presence is checked."""


def exit_with_starter(starter_pid: int) -> None:
    """Exit this process (at once, whatever it is measuring: the cached profile is only ever
    replaced by an atomic rename) as soon as the process `starter_pid` is gone: this one is
    then re-parented, so its parent pid changes."""

    def watch() -> None:
        while os.getppid() == starter_pid:
            time.sleep(WATCH_S)
        print(
            f"the process that started this one (pid {starter_pid}) is gone: stopping", flush=True
        )
        os._exit(0)

    threading.Thread(target=watch, name="starter-watch", daemon=True).start()


def main(argv: list[str]) -> int:
    device, profile = argv[1], Path(argv[2])
    if len(argv) > 3:
        exit_with_starter(int(argv[3]))
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
    one), keep the better: 0 when done or no longer needed, 1 on timeout."""
    from engine.profiling.load import wait_until_quiet
    from engine.profiling.profiler import profile_hardware
    from policy.hardware import HardwareSpec

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        cached = HardwareSpec.load(profile) if profile.is_file() else None
        if cached is not None and not cached.under_load and cached.noise() is None:
            print("the cached profile is neither taken under load nor noisy", flush=True)
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
        now = HardwareSpec.load(profile) if profile.is_file() else None
        if now is not None and not now.under_load and now.noise() is None:
            return 0  # replaced meanwhile (`nanoflex profile`, say): keep that one
        keep_cached = (
            now is not None and not now.under_load and fresh.max_spread[1] >= now.max_spread[1]
        )
        kept = now if keep_cached and now is not None else fresh
        if now is not None:
            kept = dataclasses.replace(kept, attempts=now.attempts + 1)
        kept.save(profile)
        which = "kept the cached one, less noisy" if keep_cached else f"replaced {profile}"
        print(f"{which}: {kept.describe()}", flush=True)
        if kept.noise() is None:
            return 0
    print("the machine never went quiet; the next start tries again", flush=True)
    return 1


if __name__ == "__main__":
    sys.exit(main(sys.argv))
