"""`open_data_dir`: the store and file storage of `--data-dir`, checked before serving.

A database that cannot be opened (damaged, not ours, on a read-only or full disk)
is a `DataDirError` with one line that says what to do. A database with no records
while `files/` holds files was truncated, deleted or replaced: starting on it would
silently forget every file and batch, so the daemon refuses to start instead.
"""

from __future__ import annotations

import logging
from pathlib import Path

from engine.core.ownership import not_writable
from server.batch.files import FileStorage
from server.batch.storage_faults import DataDirError
from server.batch.store import Store

logger = logging.getLogger("nanoflex.server")


DB_NAME = "nanoflex.db"
"""The SQLite database in the data directory."""
FILES_DIR = "files"
"""The folder of file contents in the data directory."""


def open_data_dir(data_dir: Path) -> tuple[Store, FileStorage]:
    """Open (creating if new) the data directory's store and file storage."""
    db_path, files_dir = data_dir / DB_NAME, data_dir / FILES_DIR
    storage = FileStorage(files_dir)
    store = Store(db_path)
    on_disk = set(storage.file_ids())
    if on_disk and store.is_empty():
        store.close()
        raise DataDirError(
            f"the database {db_path} has no record of the {len(on_disk)} files in "
            f"{files_dir}: it was truncated, deleted or replaced. Restore it from a "
            f"backup, or move {files_dir} aside to start with an empty store"
        )
    orphans = on_disk - store.file_ids()
    if orphans:  # a crash between writing a file and recording it leaves one
        logger.warning(
            "%d files in %s have no record in the database (left by a crash mid-upload?): %s",
            len(orphans),
            files_dir,
            ", ".join(sorted(orphans)[:5]),
        )
    return store, storage


def check_data_dir(data_dir: Path) -> None:
    """Fail fast (before the model loads) if the data directory cannot be served: one that
    this process cannot write to names its owner and this process's uid."""
    refused = not_writable(data_dir)
    if refused is not None:
        raise DataDirError(f"the data directory is not writable: {refused}")
    store, _ = open_data_dir(data_dir)
    store.close()
