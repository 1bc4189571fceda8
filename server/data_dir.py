"""`open_data_dir`: the store and file storage of `--data-dir`, checked before serving.

A database that cannot be opened (damaged, not ours, on a read-only or full disk)
is a `DataDirError` with one line that says what to do. A database with no records
while `files/` holds files was truncated, deleted or replaced: starting on it would
silently forget every file and batch, so the daemon refuses to start instead.
"""

from __future__ import annotations

import logging

from server.files import FileStorage
from server.settings import ServerSettings
from server.storage_faults import DataDirError
from server.store import Store

logger = logging.getLogger("nanoflex.server")


def open_data_dir(settings: ServerSettings) -> tuple[Store, FileStorage]:
    """Open (creating if new) the data directory's store and file storage."""
    storage = FileStorage(settings.files_dir)
    store = Store(settings.db_path)
    on_disk = set(storage.file_ids())
    if on_disk and store.is_empty():
        store.close()
        raise DataDirError(
            f"the database {settings.db_path} has no record of the {len(on_disk)} files in "
            f"{settings.files_dir}: it was truncated, deleted or replaced. Restore it from a "
            f"backup, or move {settings.files_dir} aside to start with an empty store"
        )
    orphans = on_disk - store.file_ids()
    if orphans:  # a crash between writing a file and recording it leaves one
        logger.warning(
            "%d files in %s have no record in the database (left by a crash mid-upload?): %s",
            len(orphans),
            settings.files_dir,
            ", ".join(sorted(orphans)[:5]),
        )
    return store, storage


def check_data_dir(settings: ServerSettings) -> None:
    """Fail fast (before the model loads) if the data directory cannot be served."""
    store, _ = open_data_dir(settings)
    store.close()
