"""Fixtures of the loading tests."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A cache directory of this test's own (tiny conversions take well under a second)."""
    root = tmp_path / "cache"
    monkeypatch.setenv("NANOFLEX_CACHE", str(root))
    return root
