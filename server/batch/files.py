"""`FileStorage`: file contents under data-dir/files/, written atomically (temp, fsync, rename)."""

from __future__ import annotations

import os
import re
from collections.abc import Iterable
from pathlib import Path
from typing import Any, BinaryIO

from server.batch.objects import FileObject
from server.batch.storage_faults import DataDirError, storage_error

COPY_CHUNK_BYTES = 1 << 20


MAX_FILENAME_CHARS = 255
_UNSAFE_FILENAME = re.compile(r'[\x00-\x1f\x7f"\\]')


def safe_filename(name: str | None) -> str:
    """An uploaded file's name as it is stored and echoed (File object, Content-Disposition):
    its last path component, without control characters, quotes or backslashes, at most
    255 characters; 'upload.jsonl' if nothing is left."""
    base = (name or "").replace("\\", "/").rsplit("/", 1)[-1]
    cleaned = _UNSAFE_FILENAME.sub("_", base).strip(" .")[:MAX_FILENAME_CHARS]
    return cleaned or "upload.jsonl"


def file_object(record: dict[str, Any]) -> FileObject:
    """OpenAI's File object for a `files` row."""
    return FileObject(
        id=record["id"],
        object="file",
        bytes=record["bytes"],
        created_at=record["created_at"],
        filename=record["filename"],
        purpose=record["purpose"],
        status=record["status"],
        status_details=None,
        expires_at=None,
    )


class FileStorage:
    """Contents of uploaded and produced files, one regular file per File id."""

    def __init__(self, files_dir: Path) -> None:
        self.files_dir = files_dir
        try:
            files_dir.mkdir(parents=True, exist_ok=True)
            for leftover in files_dir.glob(".tmp-*"):  # a crash mid-write leaves these
                leftover.unlink(missing_ok=True)
        except OSError as e:
            raise DataDirError(f"cannot use {files_dir}: {e}; check that it is writable") from e

    def file_ids(self) -> list[str]:
        """The ids of every file with contents on disk."""
        return [p.name for p in self.files_dir.iterdir() if not p.name.startswith(".")]

    def path_for(self, file_id: str) -> Path:
        return self.files_dir / file_id

    def write_stream(self, file_id: str, src: BinaryIO) -> int:
        """Copy `src` to the file's path atomically; return the byte count."""
        return self._write(file_id, iter(lambda: src.read(COPY_CHUNK_BYTES), b""))

    def write_lines(self, file_id: str, lines: Iterable[str]) -> int:
        """Write JSONL `lines` (without newlines) atomically; return the byte count."""
        return self._write(file_id, ((line + "\n").encode() for line in lines))

    def _write(self, file_id: str, chunks: Iterable[bytes]) -> int:
        """Write to a temporary file, fsync, rename: all or nothing. A full disk (or any
        storage failure) raises `StorageError` and leaves nothing behind."""
        final = self.path_for(file_id)
        tmp = self.files_dir / f".tmp-{file_id}"
        num_bytes = 0
        try:
            with open(tmp, "wb") as f:
                for chunk in chunks:
                    f.write(chunk)
                    num_bytes += len(chunk)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, final)
            self._fsync_dir()
        except OSError as e:
            final.unlink(missing_ok=True)
            error = storage_error(e, f"writing {file_id}")
            if error is None:
                raise
            raise error from e
        finally:
            tmp.unlink(missing_ok=True)
        return num_bytes

    def _fsync_dir(self) -> None:
        fd = os.open(self.files_dir, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    def remove(self, file_id: str) -> None:
        self.path_for(file_id).unlink(missing_ok=True)
