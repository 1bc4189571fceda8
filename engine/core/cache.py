"""The nanoflex cache directory, and publishing a built directory or a file atomically."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

from policy.jsonfile import publish_file as publish_file  # the cache's files, written whole

CACHE_ENV = "NANOFLEX_CACHE"
SEED_ENV = "NANOFLEX_SEED_CACHE"
"""A read-only cache filled ahead (the Docker images' converted default model): entries found
there are used in place, never written."""


def cache_root() -> Path:
    """The nanoflex cache directory: $NANOFLEX_CACHE, else ~/.cache/nanoflex."""
    env = os.environ.get(CACHE_ENV)
    return Path(env).expanduser() if env else Path.home() / ".cache" / "nanoflex"


def lookup_roots() -> list[Path]:
    """Where to look for a built entry: the cache, then the seed cache ($NANOFLEX_SEED_CACHE)
    if one is set."""
    seed = os.environ.get(SEED_ENV)
    return [cache_root(), *([Path(seed).expanduser()] if seed else [])]


def publish_dir(final: Path, build: Callable[[Path], None], complete_file: str) -> Path:
    """`final`, built once: `build(tmp)` fills a temporary sibling that is renamed into place,
    so a reader never sees a half-built directory and two racing processes both end up with
    the same complete one. `final / complete_file` existing means the build is done."""
    if (final / complete_file).is_file():
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.tmp-", dir=final.parent))
    try:
        build(tmp)
        tmp.chmod(0o755)  # mkdtemp makes it private; a cache entry is readable like any cache
        for path in tmp.iterdir():
            path.chmod(0o644)
        try:
            os.rename(tmp, final)  # atomic; fails if another process got there first
        except OSError:
            if not (final / complete_file).is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final
