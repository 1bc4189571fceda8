"""`StorageError`: the data directory cannot take a write (disk full, quota, read-only, I/O).

The store and the file storage translate such failures of SQLite and of the file
system into this one type, so the routes answer 507 and the batch runner pauses
instead of losing a line or answering a generic 500.
"""

from __future__ import annotations

import errno
import sqlite3

from base.errors import UserError

FULL_ERRNOS = {errno.ENOSPC, errno.EDQUOT}
STORAGE_ERRNOS = FULL_ERRNOS | {errno.EROFS, errno.EIO, errno.EACCES, errno.EPERM}
"""OS errors that mean "this write cannot happen now", not a bug of ours."""

_SQLITE_STORAGE_CODES = {  # SQLite's primary result codes (the sqlite3 module names them
    13: "the disk is full",  # SQLITE_FULL            only from Python 3.11 on)
    10: "an I/O error",  # SQLITE_IOERR
    8: "the database is read-only",  # SQLITE_READONLY
    14: "the database file cannot be opened",  # SQLITE_CANTOPEN
}


class DataDirError(UserError):
    """The data directory cannot be used at all (damaged database, not writable): the
    daemon refuses to start and says what to do."""


class StorageError(RuntimeError):
    """A write to the data directory failed for a reason outside the daemon; retry once
    space (or write access) is back. `is_full` says it was a full disk or quota."""

    def __init__(self, message: str, *, is_full: bool) -> None:
        super().__init__(message)
        self.is_full = is_full


def storage_error(exc: BaseException, what: str) -> StorageError | None:
    """`exc` as a `StorageError` while doing `what` ("writing file-…"), or None if it is
    another kind of failure (which the caller re-raises)."""
    if isinstance(exc, StorageError):
        return exc
    if isinstance(exc, OSError) and exc.errno in STORAGE_ERRNOS:
        reason = exc.strerror or errno.errorcode.get(exc.errno or 0, "an OS error")
        return StorageError(f"{what} failed: {reason}", is_full=exc.errno in FULL_ERRNOS)
    if isinstance(exc, sqlite3.OperationalError):
        code = getattr(exc, "sqlite_errorcode", None)
        primary = code & 0xFF if isinstance(code, int) else _code_from_message(str(exc))
        if primary in _SQLITE_STORAGE_CODES:
            reason = _SQLITE_STORAGE_CODES[primary]
            return StorageError(
                f"{what} failed: {reason} ({exc})", is_full=primary == sqlite3.SQLITE_FULL
            )
    return None


def _code_from_message(message: str) -> int | None:
    """SQLite's primary code from its message (Python before 3.11 has no `sqlite_errorcode`)."""
    if "disk is full" in message:
        return sqlite3.SQLITE_FULL
    if "readonly" in message:
        return sqlite3.SQLITE_READONLY
    if "disk I/O error" in message:
        return sqlite3.SQLITE_IOERR
    return None
