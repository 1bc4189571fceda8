"""`publish_file` (engine/core/cache.py): the nanoflex cache's small files (expert pick counts,
GGUF digest memos, the disk cache's index) are replaced whole or not at all."""

from __future__ import annotations

import stat
from pathlib import Path

import pytest

from engine.core.cache import publish_file


def test_a_published_file_replaces_the_old_one_whole(tmp_path: Path) -> None:
    path = tmp_path / "counts.json"
    publish_file(path, "first")
    publish_file(path, "second")
    assert path.read_text() == "second"
    assert stat.S_IMODE(path.stat().st_mode) == 0o644  # readable as any cache file
    assert [p.name for p in tmp_path.iterdir()] == ["counts.json"]


def test_a_failed_write_keeps_the_old_file_and_leaves_no_temporary(tmp_path: Path) -> None:
    path = tmp_path / "index.json"
    publish_file(path, "kept")
    with pytest.raises(UnicodeEncodeError):  # fails mid-write, as a full disk would
        publish_file(path, "\ud800")
    assert path.read_text() == "kept"
    assert [p.name for p in tmp_path.iterdir()] == ["index.json"]
