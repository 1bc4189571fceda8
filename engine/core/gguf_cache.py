"""Where a converted GGUF checkpoint lives in the cache (torch-free): the file's content hash,
remembered per (path, size, mtime), and the finished directory keyed by it.

engine/loading/gguf_convert.py converts into these directories; the daemon finds a finished
one here without the converter's child process (which imports torch).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from engine.core.cache import cache_root, lookup_roots, publish_file

MANIFEST = "nanoflex-gguf.json"
"""Written last into a converted directory: its presence means the conversion is complete."""
_HASH_CHUNK = 8 << 20


def file_digest(path: Path) -> str:
    """sha256 of the file's bytes. Remembered per (path, size, mtime) in the cache, so a large
    file is hashed once, not at every start."""
    stat = path.stat()
    resolved = str(path.resolve())
    stamp = {"path": resolved, "size": stat.st_size, "mtime_ns": stat.st_mtime_ns}
    name = f"{_sha256_text(resolved)[:16]}.json"
    memo = cache_root() / "gguf" / "digests" / name
    for root in lookup_roots():
        try:
            remembered = json.loads((root / "gguf" / "digests" / name).read_text())
            if {k: remembered.get(k) for k in stamp} == stamp:
                return str(remembered["sha256"])
        except (OSError, ValueError, KeyError):
            pass  # no memo yet, or a torn one: hash again
    sha = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(_HASH_CHUNK):
            sha.update(chunk)
    digest = sha.hexdigest()
    memo.parent.mkdir(parents=True, exist_ok=True)
    publish_file(memo, json.dumps({**stamp, "sha256": digest}) + "\n")  # racing readers: whole
    return digest


def converted_dir(digest: str) -> Path | None:
    """The complete converted directory of the file with this digest, in the cache or the seed
    cache (under any file name: a renamed copy is the same checkpoint); None if there is none."""
    for found in lookup_roots():
        for done in sorted((found / "gguf").glob(f"*-{digest[:16]}")):
            if (done / MANIFEST).is_file():
                return done
    return None


def _sha256_text(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()
