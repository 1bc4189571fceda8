"""`ResultLog`: an append-only JSONL file whose every line is durable once `append` returns.

A process killed mid-write (SIGKILL, power loss) leaves at most one torn line at
the end; opening the log again reads back every whole line and cuts the rest
off, so the next append starts on a clean line. Lines are appended in the order they
finish; `sort_log` rewrites a finished log in the input's order, atomically.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, BinaryIO

from server.batch.files import fsync_dir


class ResultLog:
    """One JSONL file of JSON objects, appended to one line at a time (flush + fsync)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.records: list[dict[str, Any]] = read_back(path)
        """The whole lines that were in the file when it was opened, in file order."""
        self._file: BinaryIO | None = None

    def append(self, line: str) -> None:
        """Write `line` (one JSON object, no newline) and make it durable before returning."""
        if self._file is None:
            is_new = not self.path.exists()
            self._file = open(self.path, "ab")  # noqa: SIM115 (closed by close())
            if is_new:
                fsync_dir(self.path.parent)
        self._file.write(line.encode() + b"\n")
        self._file.flush()
        os.fsync(self._file.fileno())

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


def read_back(path: Path) -> list[dict[str, Any]]:
    """Every whole JSON-object line of `path`; a torn or unreadable tail is truncated away."""
    return [record for _, record in _whole_lines(path)]


def _whole_lines(path: Path) -> Iterator[tuple[bytes, dict[str, Any]]]:
    """(raw line with its newline, its record) for every whole JSON-object line of `path`,
    in file order; once they are all read, a torn or unreadable tail is truncated away."""
    if not path.exists():
        return
    data = path.read_bytes()
    keep = 0
    while True:
        end = data.find(b"\n", keep)
        if end < 0:
            break
        try:
            record = json.loads(data[keep:end])
        except (UnicodeDecodeError, json.JSONDecodeError):
            break  # a torn write: this line and anything after it are dropped
        if not isinstance(record, dict):
            break
        yield data[keep : end + 1], record
        keep = end + 1
    if keep < len(data):
        os.truncate(path, keep)


def sort_log(path: Path, rank: Callable[[dict[str, Any]], int]) -> None:
    """Rewrite `path` with its lines sorted by `rank(record)` (the input line's index; ties
    keep file order), one line per `id` (the first), each line's bytes unchanged. The new
    file replaces the old by rename after an fsync, so a crash leaves one or the other whole;
    a file already in order is left untouched."""
    lines = list(_whole_lines(path))
    seen: set[Any] = set()
    unique = []
    for raw, record in lines:
        if record.get("id") not in seen:
            seen.add(record.get("id"))
            unique.append((rank(record), raw))
    ordered = sorted(unique, key=lambda pair: pair[0])  # stable: ties keep file order
    if len(ordered) == len(lines) and all(a is b for a, b in zip(ordered, unique, strict=True)):
        return
    temp = path.with_name(f"{path.name}.sorting")
    with open(temp, "wb") as f:
        for _, raw in ordered:
            f.write(raw)
        f.flush()
        os.fsync(f.fileno())
    os.replace(temp, path)
    fsync_dir(path.parent)
