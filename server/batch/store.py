"""`Store`: the durable SQLite (WAL) record of files, batches and per-request batch results.

Two connections, each guarded by a lock, so any thread (the event loop or a worker
thread) may call it: one writes, one reads. In WAL mode a read does not wait for a write, so
the event loop's reads (a batch's status) are not held up while a worker thread stores a
long batch line. Every method is one transaction: a request's result is
written in the same transaction that marks it done and bumps the batch's counts.
A write that fails because the disk is full (or read-only) raises `StorageError`
and changes nothing; a database that cannot be opened raises `DataDirError`.
"""

from __future__ import annotations

import json
import sqlite3
import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from server.batch.objects import Batch, RequestCounts
from server.batch.storage_faults import DataDirError, storage_error
from server.openai.json_body import utf8_pieces, utf8_size

SCHEMA = """
CREATE TABLE IF NOT EXISTS files (
    seq INTEGER PRIMARY KEY AUTOINCREMENT,
    id TEXT UNIQUE NOT NULL,
    bytes INTEGER NOT NULL,
    filename TEXT NOT NULL,
    purpose TEXT NOT NULL,
    created_at INTEGER NOT NULL,
    status TEXT NOT NULL,
    path TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS batches (
    seq INTEGER PRIMARY KEY AUTOINCREMENT,
    id TEXT UNIQUE NOT NULL,
    endpoint TEXT NOT NULL,
    input_file_id TEXT NOT NULL,
    completion_window TEXT NOT NULL,
    status TEXT NOT NULL,
    output_file_id TEXT,
    error_file_id TEXT,
    created_at INTEGER NOT NULL,
    in_progress_at INTEGER,
    finalizing_at INTEGER,
    completed_at INTEGER,
    cancelling_at INTEGER,
    cancelled_at INTEGER,
    failed_at INTEGER,
    expired_at INTEGER,
    expires_at INTEGER,
    total INTEGER NOT NULL DEFAULT 0,
    completed INTEGER NOT NULL DEFAULT 0,
    failed INTEGER NOT NULL DEFAULT 0,
    metadata TEXT,
    errors TEXT
);
CREATE TABLE IF NOT EXISTS batch_requests (
    batch_id TEXT NOT NULL,
    line_index INTEGER NOT NULL,
    custom_id TEXT,
    body TEXT,
    status TEXT NOT NULL CHECK (status IN ('pending', 'done', 'failed')),
    result TEXT,
    PRIMARY KEY (batch_id, line_index)
);
CREATE INDEX IF NOT EXISTS batch_requests_status ON batch_requests (batch_id, status);
CREATE TABLE IF NOT EXISTS batch_request_lines (
    batch_id TEXT NOT NULL,
    line_index INTEGER NOT NULL,
    line BLOB NOT NULL,
    PRIMARY KEY (batch_id, line_index)
);
"""

RequestRow = tuple[int, str | None, str | None, str, str | None]
"""A batch request row: (line index, custom_id, the input line as read, 'pending'), or
(line index, custom_id, None, 'failed', its error line)."""
PIECE_CHARS = 1 << 20
"""A line's text is written into the store this many characters at a time."""
FILE_FIELDS = ("id", "bytes", "filename", "purpose", "created_at", "status", "path")
UNFINISHED_BATCH_STATUSES = ("validating", "in_progress", "finalizing", "cancelling")
BATCH_TIMESTAMPS = (
    "created_at",
    "in_progress_at",
    "finalizing_at",
    "completed_at",
    "cancelling_at",
    "cancelled_at",
    "failed_at",
    "expired_at",
    "expires_at",
)


class BatchInvariantError(RuntimeError):
    """A batch was about to close with a line unaccounted for (a bug: nothing is written)."""


class Store:
    """SQLite-backed records for the Files and Batch APIs."""

    def __init__(self, db_path: Path) -> None:
        self._lock = threading.RLock()
        self._read_lock = threading.Lock()
        try:
            db_path.parent.mkdir(parents=True, exist_ok=True)
            self._conn = sqlite3.connect(db_path, check_same_thread=False, isolation_level=None)
        except (OSError, sqlite3.Error) as e:
            raise DataDirError(
                f"cannot open the database {db_path}: {e}; check that --data-dir exists "
                "and is writable"
            ) from e
        try:
            self._conn.row_factory = sqlite3.Row
            self._conn.execute("PRAGMA journal_mode=WAL")
            self._conn.execute("PRAGMA synchronous=FULL")
            self._conn.executescript(SCHEMA)
            self._reader = sqlite3.connect(db_path, check_same_thread=False, isolation_level=None)
            self._reader.row_factory = sqlite3.Row
        except sqlite3.Error as e:
            self._conn.close()
            if storage_error(e, "opening the database") is not None:
                advice = "check that --data-dir is writable and its disk has free space"
            else:
                advice = "it is damaged or not a nanoflex database: restore it from a backup"
            raise DataDirError(f"cannot use the database {db_path} ({e}): {advice}") from e

    def close(self) -> None:
        with self._read_lock:
            self._reader.close()
        with self._lock:
            self._conn.close()

    @contextmanager
    def _tx(self) -> Iterator[sqlite3.Connection]:
        """One write transaction; a storage failure rolls it back and raises StorageError."""
        with self._lock:
            try:
                self._conn.execute("BEGIN IMMEDIATE")
                try:
                    yield self._conn
                    self._conn.execute("COMMIT")
                except BaseException:
                    if self._conn.in_transaction:  # a failed COMMIT may have rolled back already
                        self._conn.execute("ROLLBACK")
                    raise
            except sqlite3.Error as e:
                error = storage_error(e, "writing the database")
                if error is None:
                    raise
                raise error from e

    def _query(self, sql: str, args: tuple[Any, ...] = ()) -> list[sqlite3.Row]:
        with self._read_lock:
            return self._reader.execute(sql, args).fetchall()

    # -- files -----------------------------------------------------------------------
    def insert_file(self, record: dict[str, Any]) -> None:
        with self._tx() as conn:
            _insert_file(conn, record)

    def get_file(self, file_id: str) -> dict[str, Any] | None:
        rows = self._query(f"SELECT {', '.join(FILE_FIELDS)} FROM files WHERE id = ?", (file_id,))
        return dict(rows[0]) if rows else None

    def list_files(
        self, purpose: str | None, after: str | None, limit: int, ascending: bool
    ) -> list[dict[str, Any]]:
        """Files newest first (or oldest first), starting after the file id `after`."""
        where, args = ["1 = 1"], []
        if purpose is not None:
            where.append("purpose = ?")
            args.append(purpose)
        if after is not None:
            op = ">" if ascending else "<"
            where.append(f"seq {op} (SELECT seq FROM files WHERE id = ?)")
            args.append(after)
        order = "ASC" if ascending else "DESC"
        sql = (
            f"SELECT {', '.join(FILE_FIELDS)} FROM files WHERE {' AND '.join(where)} "
            f"ORDER BY seq {order} LIMIT ?"
        )
        return [dict(r) for r in self._query(sql, (*args, limit))]

    def stored_bytes(self) -> int:
        """The bytes of every file recorded (uploads and batch results)."""
        return int(self._query("SELECT COALESCE(SUM(bytes), 0) AS n FROM files")[0]["n"])

    def num_unfinished_batches(self) -> int:
        return len(self.unfinished_batch_ids())

    def file_ids(self) -> set[str]:
        return {r["id"] for r in self._query("SELECT id FROM files")}

    def is_empty(self) -> bool:
        """No file and no batch recorded (a new data directory, or a lost database)."""
        return not self._query("SELECT 1 FROM files UNION ALL SELECT 1 FROM batches LIMIT 1")

    def delete_file(self, file_id: str) -> bool:
        with self._tx() as conn:
            return conn.execute("DELETE FROM files WHERE id = ?", (file_id,)).rowcount > 0

    # -- batches ---------------------------------------------------------------------
    def insert_batch(self, record: dict[str, Any]) -> None:
        record = dict(record)
        record["metadata"] = json.dumps(record.get("metadata"))
        cols = ", ".join(record)
        marks = ", ".join("?" for _ in record)
        with self._tx() as conn:
            conn.execute(f"INSERT INTO batches ({cols}) VALUES ({marks})", tuple(record.values()))

    def get_batch(self, batch_id: str) -> Batch | None:
        rows = self._query("SELECT * FROM batches WHERE id = ?", (batch_id,))
        return _batch_object(rows[0]) if rows else None

    def list_batches(self, after: str | None, limit: int) -> list[Batch]:
        """Batches newest first, starting after the batch id `after`."""
        if after is None:
            rows = self._query("SELECT * FROM batches ORDER BY seq DESC LIMIT ?", (limit,))
        else:
            rows = self._query(
                "SELECT * FROM batches WHERE seq < (SELECT seq FROM batches WHERE id = ?) "
                "ORDER BY seq DESC LIMIT ?",
                (after, limit),
            )
        return [_batch_object(r) for r in rows]

    def update_batch(self, batch_id: str, **fields: Any) -> None:
        if "errors" in fields:
            fields["errors"] = json.dumps(fields["errors"])
        sets = ", ".join(f"{k} = ?" for k in fields)
        with self._tx() as conn:
            conn.execute(f"UPDATE batches SET {sets} WHERE id = ?", (*fields.values(), batch_id))

    def advance_batch(self, batch_id: str, from_status: str, **fields: Any) -> bool:
        """`update_batch` only while the batch is still `from_status`, in one statement: a
        cancel that lands between a worker's read of the status and its write is not
        overwritten. True when the batch moved."""
        sets = ", ".join(f"{k} = ?" for k in fields)
        with self._tx() as conn:
            moved = conn.execute(
                f"UPDATE batches SET {sets} WHERE id = ? AND status = ?",
                (*fields.values(), batch_id, from_status),
            )
            return bool(moved.rowcount)

    def unfinished_batch_ids(self) -> list[str]:
        marks = ", ".join("?" for _ in UNFINISHED_BATCH_STATUSES)
        rows = self._query(
            f"SELECT id FROM batches WHERE status IN ({marks}) ORDER BY seq",
            UNFINISHED_BATCH_STATUSES,
        )
        return [r["id"] for r in rows]

    # -- batch requests --------------------------------------------------------------
    def clear_requests(self, batch_id: str) -> None:
        """Remove the batch's requests and zero its counts (validation starts over)."""
        with self._tx() as conn:
            _clear_requests(conn, batch_id)

    def add_requests(self, batch_id: str, rows: Sequence[RequestRow]) -> None:
        """Add `rows` to the batch's requests and count them, in one transaction. Each line's
        text is written into its row in 1 MiB pieces (SQLite's incremental blob I/O), so the
        store holds no copy of it: a bound value would be copied twice."""
        with self._tx() as conn:
            _add_requests(conn, batch_id, rows)

    def pending_requests(self, batch_id: str) -> list[tuple[int, str]]:
        """(line_index, custom_id) of requests not yet done, in input order."""
        rows = self._query(
            "SELECT line_index, custom_id FROM batch_requests "
            "WHERE batch_id = ? AND status = 'pending' ORDER BY line_index",
            (batch_id,),
        )
        return [(r["line_index"], r["custom_id"]) for r in rows]

    def request_line_bytes(self, batch_id: str, line_index: int) -> int:
        """The size of a pending request's input line as stored (0 if a store written before
        kept it), without reading it."""
        row = self._query(
            "SELECT length(line) FROM batch_request_lines WHERE batch_id = ? AND line_index = ?",
            (batch_id, line_index),
        )
        return int(row[0][0]) if row else 0

    def request_line(self, batch_id: str, line_index: int) -> str:
        """A pending request's input line as read: read into one buffer of its size, then
        decoded (the buffer is dropped before this returns). Stores written before kept it
        in `batch_requests.body` (the oldest just its body: see `lines.stored_line`)."""
        with self._read_lock:
            row = self._reader.execute(
                "SELECT rowid FROM batch_request_lines WHERE batch_id = ? AND line_index = ?",
                (batch_id, line_index),
            ).fetchone()
            if row is None:
                (text,) = self._reader.execute(
                    "SELECT body FROM batch_requests WHERE batch_id = ? AND line_index = ?",
                    (batch_id, line_index),
                ).fetchone()
                return str(text)
            with self._reader.blobopen(
                "batch_request_lines", "line", row[0], readonly=True
            ) as blob:
                data = blob.read()
        text = data.decode("utf-8", "surrogatepass")
        del data
        return str(text)

    def commit_result(self, batch_id: str, line_index: int, ok: bool, result: str) -> bool:
        """Mark a pending request done (ok) or failed with its output line, and bump the
        batch's count, atomically. False if it was not pending (already committed)."""
        status, counter = ("done", "completed") if ok else ("failed", "failed")
        with self._tx() as conn:
            changed = conn.execute(
                "UPDATE batch_requests SET status = ?, result = ? "
                "WHERE batch_id = ? AND line_index = ? AND status = 'pending'",
                (status, result, batch_id, line_index),
            ).rowcount
            if changed:
                conn.execute(
                    f"UPDATE batches SET {counter} = {counter} + 1 WHERE id = ?", (batch_id,)
                )
            return changed > 0

    def results(self, batch_id: str, status: str) -> Iterator[str]:
        """Output lines of requests with `status` ('done' or 'failed'), in input order."""
        rows = self._query(
            "SELECT result FROM batch_requests WHERE batch_id = ? AND status = ? "
            "ORDER BY line_index",
            (batch_id, status),
        )
        for r in rows:
            yield r["result"]

    def finalize_batch(self, batch_id: str, new_files: list[dict[str, Any]], **fields: Any) -> None:
        """Insert the output/error file records and update the batch, in one transaction,
        only if every line of the batch is done or failed and the counts agree."""
        sets = ", ".join(f"{k} = ?" for k in fields)
        with self._tx() as conn:
            _check_accounted(conn, batch_id)
            for record in new_files:
                _insert_file(conn, record)
            conn.execute(f"UPDATE batches SET {sets} WHERE id = ?", (*fields.values(), batch_id))


def _clear_requests(conn: sqlite3.Connection, batch_id: str) -> None:
    conn.execute("DELETE FROM batch_requests WHERE batch_id = ?", (batch_id,))
    conn.execute("DELETE FROM batch_request_lines WHERE batch_id = ?", (batch_id,))
    conn.execute(
        "UPDATE batches SET total = 0, completed = 0, failed = 0 WHERE id = ?", (batch_id,)
    )


def _add_requests(conn: sqlite3.Connection, batch_id: str, rows: Sequence[RequestRow]) -> None:
    for line_index, custom_id, text, status, result in rows:
        conn.execute(
            "INSERT INTO batch_requests VALUES (?, ?, ?, NULL, ?, ?)",
            (batch_id, line_index, custom_id, status, result),
        )
        if text is None:
            continue
        # The blob last in its row: SQLite then writes its zeros without making them first.
        cursor = conn.execute(
            "INSERT INTO batch_request_lines VALUES (?, ?, zeroblob(?))",
            (batch_id, line_index, utf8_size(text)),
        )
        assert cursor.lastrowid is not None
        with conn.blobopen("batch_request_lines", "line", cursor.lastrowid) as blob:
            for piece in utf8_pieces(text, PIECE_CHARS):
                blob.write(piece)
    num_failed = sum(1 for r in rows if r[3] == "failed")
    conn.execute(
        "UPDATE batches SET total = total + ?, failed = failed + ? WHERE id = ?",
        (len(rows), num_failed, batch_id),
    )


def _check_accounted(conn: sqlite3.Connection, batch_id: str) -> None:
    """The batch invariant: no line pending, and total = completed + failed = its lines."""
    by_status = dict(
        conn.execute(
            "SELECT status, count(*) FROM batch_requests WHERE batch_id = ? GROUP BY status",
            (batch_id,),
        ).fetchall()
    )
    total, completed, failed = conn.execute(
        "SELECT total, completed, failed FROM batches WHERE id = ?", (batch_id,)
    ).fetchone()
    done, errors, pending = (by_status.get(k, 0) for k in ("done", "failed", "pending"))
    if pending or (completed, failed) != (done, errors) or total != done + errors:
        raise BatchInvariantError(
            f"batch {batch_id} cannot close: {pending} lines pending, "
            f"counts {completed} + {failed} of {total}, rows {done} done + {errors} failed"
        )


def _insert_file(conn: sqlite3.Connection, record: dict[str, Any]) -> None:
    conn.execute(
        f"INSERT INTO files ({', '.join(FILE_FIELDS)}) VALUES (?, ?, ?, ?, ?, ?, ?)",
        tuple(record[k] for k in FILE_FIELDS),
    )


def _batch_object(row: sqlite3.Row) -> Batch:
    """OpenAI's Batch object from a `batches` row."""
    errors = json.loads(row["errors"]) if row["errors"] else None
    counts = {"total": row["total"], "completed": row["completed"], "failed": row["failed"]}
    return Batch(
        id=row["id"],
        object="batch",
        endpoint=row["endpoint"],
        errors=errors,
        input_file_id=row["input_file_id"],
        completion_window=row["completion_window"],
        status=row["status"],
        output_file_id=row["output_file_id"],
        error_file_id=row["error_file_id"],
        **{k: row[k] for k in BATCH_TIMESTAMPS},
        request_counts=RequestCounts(**counts),
        metadata=json.loads(row["metadata"]) if row["metadata"] else None,
    )
