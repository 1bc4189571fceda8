"""`FileStorage`: file contents under data-dir/files/, written atomically (temp, fsync, rename)."""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any, BinaryIO

from server.batch.objects import FileObject
from server.batch.storage_faults import DataDirError, storage_error

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

    def open_upload(self, file_id: str) -> PendingFile:
        """A temporary file beside the file's final path, written as an upload streams in;
        `commit` renames it into place, `discard` removes it."""
        return PendingFile(self.files_dir, file_id)

    def write_lines(self, file_id: str, lines: Iterable[str]) -> int:
        """Write JSONL `lines` (without newlines) atomically; return the byte count. A full
        disk (or any storage failure) raises `StorageError` and leaves nothing behind."""
        pending = self.open_upload(file_id)
        try:
            for line in lines:
                pending.write((line + "\n").encode())
            pending.commit()
        finally:
            pending.discard()
        return pending.num_bytes

    def remove(self, file_id: str) -> None:
        self.path_for(file_id).unlink(missing_ok=True)


class PendingFile:
    """One file's contents on their way in: `.tmp-<file_id>` in `files_dir`, written once,
    then fsynced and renamed to `<file_id>` (all or nothing). Any storage failure (full
    disk, quota, read-only) raises `StorageError`; `discard` (always safe to call) removes
    whatever was written unless the file was committed."""

    def __init__(self, files_dir: Path, file_id: str) -> None:
        self.file_id = file_id
        self.final = files_dir / file_id
        self.tmp = files_dir / f".tmp-{file_id}"
        self.num_bytes = 0
        self.committed = False
        self._file: BinaryIO | None = None
        # closed by commit or discard
        self._failing(lambda: setattr(self, "_file", open(self.tmp, "wb")))  # noqa: SIM115

    def write(self, data: bytes) -> None:
        assert self._file is not None, "write after commit or discard"
        file = self._file
        self._failing(lambda: file.write(data))
        self.num_bytes += len(data)

    def commit(self) -> None:
        """Flush, fsync, rename into place, fsync the folder."""
        assert self._file is not None, "commit after discard"
        file, self._file = self._file, None

        def finish() -> None:
            with file:
                file.flush()
                os.fsync(file.fileno())
            os.replace(self.tmp, self.final)
            fsync_dir(self.final.parent)

        self._failing(finish)
        self.committed = True

    def discard(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
        if not self.committed:  # a failure after the rename leaves the final path too
            self.tmp.unlink(missing_ok=True)
            self.final.unlink(missing_ok=True)

    def _failing(self, step: Callable[[], object]) -> None:
        """Run `step`; an OS failure of the storage becomes `StorageError` (the partial file
        removed)."""
        try:
            step()
        except OSError as e:
            self.discard()
            error = storage_error(e, f"writing {self.file_id}")
            if error is None:
                raise
            raise error from e


def fsync_dir(directory: Path) -> None:
    """Make a rename or a new file in `directory` durable (fsync of the directory itself)."""
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
