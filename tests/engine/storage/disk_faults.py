"""Injected OS errors at the disk tier's write and read calls (`DiskFile.write`, `read_into`),
for engines in the test's own process: ENOSPC as a full disk gives it, EIO as a failing one."""

from __future__ import annotations

import errno
import os
import threading
from collections.abc import Iterator
from dataclasses import dataclass

import pytest
import torch

from engine.storage.disk import DiskFile


@dataclass
class _Rule:
    prefix: str
    code: int
    skip: int
    times: int | None


class DiskFaults:
    """`fail("write", "kv-", errno.ENOSPC, times=2, skip=5)`: the 6th and 7th writes to files
    named kv-* raise ENOSPC (times None: every one from then on, until `clear`)."""

    def __init__(self) -> None:
        self._rules: dict[str, _Rule] = {}
        self._lock = threading.Lock()
        self.injected = 0

    def fail(
        self, op: str, prefix: str, code: int, *, times: int | None = None, skip: int = 0
    ) -> None:
        assert op in ("write", "read")
        with self._lock:
            self._rules[op] = _Rule(prefix, code, skip, times)

    def clear(self) -> None:
        with self._lock:
            self._rules.clear()

    def check(self, op: str, f: DiskFile) -> None:
        with self._lock:
            rule = self._rules.get(op)
            if rule is None or not f.path.name.startswith(rule.prefix):
                return
            if rule.skip:
                rule.skip -= 1
                return
            if rule.times is not None:
                if rule.times == 0:
                    return
                rule.times -= 1
            self.injected += 1
        raise OSError(rule.code, os.strerror(rule.code), str(f.path))


@pytest.fixture
def disk_faults(monkeypatch: pytest.MonkeyPatch) -> Iterator[DiskFaults]:
    faults = DiskFaults()
    write, read_into = DiskFile.write, DiskFile.read_into

    def failing_write(self: DiskFile, offset: int, data: torch.Tensor) -> None:
        faults.check("write", self)
        write(self, offset, data)

    def failing_read(self: DiskFile, offset: int, out: torch.Tensor) -> None:
        faults.check("read", self)
        read_into(self, offset, out)

    monkeypatch.setattr(DiskFile, "write", failing_write)
    monkeypatch.setattr(DiskFile, "read_into", failing_read)
    yield faults


ENOSPC, EIO = errno.ENOSPC, errno.EIO
