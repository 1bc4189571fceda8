"""`lock_offload_dir`: one owner per offload directory (a daemon with its engine process, an
`LLM`, a Ray replica), held with an exclusive `flock` on `nanoflex.lock` inside it.

Two engines on one directory would overwrite each other's KV pages and disk weights, and
each would answer from the other's bytes. So whoever builds an executor on a directory of
the user's takes the lock first, and `nanoflex serve` takes it before it loads anything: a
second owner gets an `OffloadDirError` with one line (the daemon: exit status 2).

- The kernel drops a `flock` when its last holder exits, however it dies: a lock file left by
  a dead process (its pid still written in it) is simply taken over.
- The daemon's engine process holds the daemon's lock too: the open file is handed to it
  when it is spawned (`inherited_locks`), so the directory stays locked until both are gone.
  An engine process whose daemon was killed exits within a fraction of a second
  (engine/runtime/engine_process.py); a daemon restarted at once waits for that (up to
  `WAIT_S`) when the pid in the lock file is no longer alive.
- Within one process the lock is re-entrant (the daemon's in-process engine, an executor
  rebuilt after a crash): the directory is the process's.
"""

from __future__ import annotations

import fcntl
import os
import threading
import time
from dataclasses import dataclass
from multiprocessing import reduction
from pathlib import Path
from typing import Any

from base.errors import UserError
from engine.core.ownership import ownership_hint

LOCK_NAME = "nanoflex.lock"
WAIT_S = 30.0
"""How long to wait for a lock whose recorded owner is dead (its engine process exiting)."""
_POLL_S = 0.1


class OffloadDirError(UserError):
    """The offload directory cannot be used: another process owns it, or it has no room."""


@dataclass
class _Held:
    fd: int
    count: int


_held: dict[str, _Held] = {}
"""Locks this process holds, by the directory's real path."""
_guard = threading.Lock()


class OffloadDirLock:
    """This process's hold on one offload directory; `release()` once (idempotent)."""

    def __init__(self, key: str) -> None:
        self.key = key
        self._released = False

    def release(self) -> None:
        if self._released:
            return
        self._released = True
        with _guard:
            held = _held[self.key]
            held.count -= 1
            if held.count == 0:
                del _held[self.key]
                # close, never LOCK_UN: an engine process sharing this open file keeps it
                os.close(held.fd)


def lock_offload_dir(directory: Path, wait_s: float = WAIT_S) -> OffloadDirLock:
    """Hold `directory` (created if missing) for this process. Raises `OffloadDirError` when
    another live process owns it, or when a dead owner's engine does not let go in `wait_s`."""
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except PermissionError as e:
        raise OffloadDirError(
            f"cannot create {directory}: {ownership_hint(Path(e.filename or directory).parent)}"
        ) from e
    key = os.path.realpath(directory)
    with _guard:
        if key in _held:
            _held[key].count += 1
            return OffloadDirLock(key)
        path = Path(key) / LOCK_NAME
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        except PermissionError as e:
            raise OffloadDirError(f"cannot open {path}: {ownership_hint(Path(key))}") from e
        except OSError as e:
            raise OffloadDirError(f"cannot open {path}: {e.strerror}") from e
        try:
            _take(fd, path, wait_s)
        except BaseException:
            os.close(fd)
            raise
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        _held[key] = _Held(fd, 1)
    return OffloadDirLock(key)


def _take(fd: int, path: Path, wait_s: float) -> None:
    deadline = time.monotonic() + wait_s
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return
        except BlockingIOError:
            pass
        owner = _owner(fd)
        if owner is not None and _is_alive(owner):
            raise OffloadDirError(
                f"the offload directory {path.parent} is in use by another nanoflex process "
                f"(pid {owner}); give each daemon or engine its own --offload-dir"
            )
        if time.monotonic() > deadline:
            raise OffloadDirError(
                f"the offload directory {path.parent} is still locked {wait_s:.0f} s after its "
                f"owner (pid {owner}) died; stop its engine process, or use another --offload-dir"
            )
        time.sleep(_POLL_S)


def _owner(fd: int) -> int | None:
    """The pid written in the lock file, if it holds one."""
    text = os.pread(fd, 32, 0).decode(errors="replace").strip()
    return int(text) if text.isdigit() else None


def _is_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


class InheritedLock:
    """A lock of this process, pickled for a child that multiprocessing spawns: the child gets
    the same open file (so it holds the lock too) and counts the directory as its own."""

    def __init__(self, key: str, fd: int) -> None:
        self.key, self.fd = key, fd

    def __reduce__(self) -> tuple[Any, ...]:
        return _adopt, (self.key, reduction.DupFd(self.fd))


def _adopt(key: str, dup: Any) -> InheritedLock:
    fd = dup.detach()
    with _guard:
        if key in _held:
            os.close(fd)
        else:
            _held[key] = _Held(fd, 1)  # for the child's lifetime: the process exit drops it
    return InheritedLock(key, fd)


def inherited_locks() -> list[InheritedLock]:
    """The offload-directory locks this process holds, to pass to a spawned child."""
    with _guard:
        return [InheritedLock(key, held.fd) for key, held in _held.items()]
