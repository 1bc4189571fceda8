"""A folder the daemon cannot write to names its owner, the daemon's uid and the fix (a root-
owned host folder bind-mounted into the image, which runs as uid 1000). CI runs as root, whom
no permission stops, so the refusals are simulated."""

from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest

from engine.core import offload_dir
from engine.core.offload_dir import OffloadDirError, lock_offload_dir
from engine.core.ownership import not_writable
from server.batch.data_dir import check_data_dir
from server.batch.storage_faults import DataDirError


def refuse_writes(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(os, "access", lambda path, mode: False)


def test_a_writable_folder_passes_and_a_refused_one_says_whose_it_is(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert not_writable(tmp_path / "missing" / "below") is None  # its nearest folder is ours
    refuse_writes(monkeypatch)
    hint = not_writable(tmp_path / "missing")
    assert hint is not None
    assert str(tmp_path) in hint and f"uid {tmp_path.stat().st_uid}" in hint
    assert f"runs as uid {os.geteuid()}" in hint and "uid 1000" in hint and "chown" in hint


def test_the_data_dir_check_names_the_uid(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    refuse_writes(monkeypatch)
    with pytest.raises(DataDirError, match=r"not writable: .*uid 1000.*chown"):
        check_data_dir(tmp_path / "data")


def test_the_offload_lock_names_the_uid(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`cannot open /offload/nanoflex.lock: Permission denied` was all issue 36's user saw."""

    def denied(path: str, flags: int, mode: int = 0o777) -> int:
        raise PermissionError(errno.EACCES, "Permission denied", path)

    monkeypatch.setattr(offload_dir.os, "open", denied)
    with pytest.raises(OffloadDirError, match=r"nanoflex.lock: .*uid \d+.*uid 1000.*chown"):
        lock_offload_dir(tmp_path / "offload")
