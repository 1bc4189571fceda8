"""`BatchRunner`: validates, runs, cancels, expires and finalizes Batch API jobs, durably.

Lifecycle of a batch: validating -> in_progress -> finalizing -> completed, or
failed (no valid line, input file gone), cancelling -> cancelled, expired (past its
window). Every request's output line is committed with its done/failed mark in one
transaction; on start every unfinished batch resumes from its pending requests.

The invariant: a batch reaches a final state only when every line of its input is in
its output file or its error file, exactly once (`Store.finalize_batch` checks it in
the closing transaction). A line the server fails on becomes a `server_error` line. A
batch that cannot make progress (data directory full or read-only, engine down, the
engine's offload directory full or failing) pauses: its `errors` say why while it waits,
and it resumes by itself; its lines are retried, never charged to the caller.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from contextlib import closing, nullcontext
from dataclasses import dataclass
from typing import Any

from engine.core.sequence import BATCH_PRIORITY
from server.batch.files import FileStorage
from server.batch.lines import (
    SERVER_ERROR,
    BatchLine,
    CheckedLine,
    LineProblem,
    answer_line,
    error_line,
    problem_line,
    read_batch_lines,
    stored_line,
)
from server.batch.objects import Batch, BatchError, BatchErrors
from server.batch.order import prefix_key
from server.batch.storage_faults import StorageError
from server.batch.store import RequestRow, Store
from server.openai.errors import OFFLOAD_UNAVAILABLE, APIError, invalid_request
from server.openai.memory import LARGE_BODY_BYTES, return_freed_memory
from server.openai.responses import new_id, now
from server.openai.serving import Serving

logger = logging.getLogger("nanoflex.batches")
ENGINE_RETRY_S = 0.5
STORAGE_PAUSED = "storage_unavailable"
ENGINE_PAUSED = "engine_unavailable"
OFFLOAD_PAUSED = OFFLOAD_UNAVAILABLE
SERVER_PAUSED = "server_error"
ROWS_PER_WRITE = 512
WRITE_BYTES = 4 << 20
"""Validation stores a file's lines `ROWS_PER_WRITE` lines or `WRITE_BYTES` of text at a time
(a longer line on its own), so the store's lock is never held for long."""
MAX_ERRORS = 100
"""A failed batch lists at most this many line errors (the first ones)."""


@dataclass(frozen=True)
class BatchConfig:
    """How the daemon runs Batch API jobs (from `ServerSettings`)."""

    batch_concurrency: int = 64
    """Batch requests handed to the engine at once (all batches together)."""
    max_batch_requests: int = 50_000
    """Most lines in one batch input file (OpenAI's limit)."""
    storage_retry_s: float = 2.0
    """How often a batch paused on a full (or read-only) data directory tries again."""
    prefix_order: bool = True
    """Hand a job's lines to the engine sorted by prompt text (`server.batch.order`), so
    lines that share a prefix run together; False: input order. The output file keeps the
    input's order either way."""


class BatchRunner:
    """Runs every unfinished batch as one asyncio task; at most `batch_concurrency`
    requests of all batches are in the engine at once, at batch priority."""

    def __init__(
        self, store: Store, storage: FileStorage, serving: Serving, config: BatchConfig
    ) -> None:
        self.store = store
        self.storage = storage
        self.serving = serving
        self.config = config
        self._tasks: dict[str, asyncio.Task[None]] = {}
        self._in_flight: dict[str, set[asyncio.Task[None]]] = {}
        self._cancelled: dict[str, asyncio.Event] = {}
        self._slots: asyncio.Semaphore | None = None
        self._long_lines = threading.Lock()
        """Held while a long line (over `LARGE_BODY_BYTES`) is read, parsed and stored or
        answered, in every batch: the daemon holds one long line at a time."""
        self._keys: dict[str, dict[int, str]] = {}
        """batch id -> line index -> its prefix-order key (`order.prefix_key`), as validation
        read them (a resumed batch's are read back from the store instead). Lines themselves
        are read from the store one at a time as they run."""
        self._pauses: dict[str, BatchError] = {}
        """batch id -> the error entry that says why it is paused (in memory: the disk may
        be full, and a restart retries anyway)."""

    async def start(self) -> None:
        """Resume every unfinished batch (call from the running event loop)."""
        self._slots = asyncio.Semaphore(self.config.batch_concurrency)
        for batch_id in self.store.unfinished_batch_ids():
            logger.info("resuming %s", batch_id)
            self.submit(batch_id)

    async def stop(self) -> None:
        """Stop all batch work; pending requests stay pending for the next start."""
        tasks = list(self._tasks.values())
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    def submit(self, batch_id: str) -> None:
        self._cancelled.setdefault(batch_id, asyncio.Event())
        task = asyncio.create_task(self._run(batch_id), name=f"batch {batch_id}")
        self._tasks[batch_id] = task
        task.add_done_callback(lambda _: self._forget(batch_id))

    def _forget(self, batch_id: str) -> None:
        self._tasks.pop(batch_id, None)
        self._keys.pop(batch_id, None)
        self._cancelled.pop(batch_id, None)
        self._pauses.pop(batch_id, None)

    async def wait(self, batch_id: str) -> None:
        """Until the batch's task ends (tests, shutdown)."""
        task = self._tasks.get(batch_id)
        if task is not None:
            await asyncio.gather(task, return_exceptions=True)

    def cancel(self, batch_id: str) -> Batch:
        """Move a batch to cancelling; its task aborts in-flight requests and finalizes."""
        batch = self.store.get_batch(batch_id)
        assert batch is not None
        if batch.status in ("completed", "failed", "expired"):
            raise invalid_request(
                f"Batch {batch_id} is {batch.status} and cannot be cancelled.",
                code="batch_not_cancellable",
            )
        if batch.status in ("validating", "in_progress"):
            self.store.update_batch(batch_id, status="cancelling", cancelling_at=now())
            event = self._cancelled.get(batch_id)
            if event is not None:
                event.set()
            for task in self._in_flight.get(batch_id, set()):
                task.cancel()
        if batch_id not in self._tasks:  # nothing runs it (it ended on an error): finalize
            self.submit(batch_id)
        return self.describe(batch_id)

    # -- pauses ----------------------------------------------------------------------
    def describe(self, batch_id: str) -> Batch:
        """The batch object, with the reason it is paused (if it is) in its `errors`."""
        batch = self.store.get_batch(batch_id)
        assert batch is not None
        return self.with_pause(batch)

    def with_pause(self, batch: Batch) -> Batch:
        """`batch` with the reason it is paused in its `errors`. A pause for the engine ends
        the moment the engine is ready (its lines run again from then), not when the first
        of them finishes, which may take a while."""
        if self._is_paused(batch.id, ENGINE_PAUSED) and self.serving.engine.is_ready():
            self._resume(batch.id, ENGINE_PAUSED)
        pause = self._pauses.get(batch.id)
        if pause is None:
            return batch
        errors = batch.errors or BatchErrors(object="list", data=[])
        errors = errors.model_copy(update={"data": [*errors.data, pause]})
        return batch.model_copy(update={"errors": errors})

    def _pause(self, batch_id: str, code: str, message: str) -> None:
        if not self._is_paused(batch_id, code):
            logger.warning("batch %s paused: %s", batch_id, message)
        self._pauses[batch_id] = BatchError(code=code, message=message, param=None, line=None)

    def _is_paused(self, batch_id: str, code: str) -> bool:
        pause = self._pauses.get(batch_id)
        return pause is not None and pause.code == code

    def _resume(self, batch_id: str, code: str) -> None:
        if self._is_paused(batch_id, code):
            del self._pauses[batch_id]
            logger.info("batch %s resumed", batch_id)

    def _pause_for_storage(self, batch_id: str, error: StorageError) -> None:
        self._pause(
            batch_id,
            STORAGE_PAUSED,
            f"Paused: the server cannot write its data directory ({error}). No line is "
            "lost; the batch resumes by itself once space is freed.",
        )

    # -- the batch task --------------------------------------------------------------
    async def _run(self, batch_id: str) -> None:
        """Drive the batch to a final state, pausing (and retrying) while it cannot."""
        while True:
            try:
                await self._advance(batch_id)
                return
            except asyncio.CancelledError:
                raise
            except StorageError as e:
                self._pause_for_storage(batch_id, e)
            except Exception as e:
                logger.exception("batch %s stopped on an unexpected error", batch_id)
                self._pause(
                    batch_id,
                    SERVER_PAUSED,
                    f"Paused on a server error ({type(e).__name__}); retrying. No line is "
                    "lost; the daemon log has the details.",
                )
            await asyncio.sleep(self.config.storage_retry_s)
            self._pauses.pop(batch_id, None)  # try again; a new failure pauses it again

    async def _advance(self, batch_id: str) -> None:
        """Validate, run and finalize from wherever the batch is; idempotent."""
        status = self._status(batch_id)
        if status == "validating":
            await asyncio.to_thread(self._validate, batch_id)
            status = self._status(batch_id)
        while status in ("in_progress", "finalizing") and not self._expired(batch_id):
            pending = await asyncio.to_thread(self.store.pending_requests, batch_id)
            if not pending:
                break
            await self._execute(batch_id, pending)
            status = self._status(batch_id)
        if status == "cancelling":
            await asyncio.to_thread(self._finalize, batch_id, "cancelled")
        elif status == "in_progress" and self._expired(batch_id):
            await asyncio.to_thread(self._finalize, batch_id, "expired")
        elif status in ("in_progress", "finalizing"):
            await asyncio.to_thread(self._finalize, batch_id, "completed")
        self._pauses.pop(batch_id, None)

    def _status(self, batch_id: str) -> str:
        batch = self.store.get_batch(batch_id)
        assert batch is not None
        return str(batch.status)

    def _expired(self, batch_id: str) -> bool:
        batch = self.store.get_batch(batch_id)
        assert batch is not None
        return now() >= (batch.expires_at or 0)

    def _validate(self, batch_id: str) -> None:
        """Split the input file into runnable requests and error lines (worker thread), one
        line at a time: no more than one line (and its parse) is held at once."""
        batch = self.store.get_batch(batch_id)
        assert batch is not None
        record = self.store.get_file(batch.input_file_id)
        path = self.storage.path_for(batch.input_file_id)
        if record is None or not path.is_file():
            message = f"Input file {batch.input_file_id} is gone; upload it again."
            self._fail(batch_id, "file_not_found", message)
            return
        self.store.clear_requests(batch_id)
        keys: dict[int, str] = {}
        problems: list[dict[str, Any]] = []
        rows: list[RequestRow] = []
        num_lines = num_bytes = 0
        with (
            open(path, "rb") as f,
            closing(read_batch_lines(f, batch.endpoint, self._long_lines)) as checked,
        ):
            for line in checked:
                num_lines += 1
                if num_lines > self.config.max_batch_requests:
                    break
                if isinstance(line, CheckedLine):
                    keys[line.index] = line.key
                    num_bytes += len(line.text)
                elif len(problems) < MAX_ERRORS:
                    problems.append(line.error())
                rows.append(_row(line))
                del line  # the rows hold the only copy of its text
                if len(rows) >= ROWS_PER_WRITE or num_bytes >= WRITE_BYTES:
                    self.store.add_requests(batch_id, rows)
                    rows, num_bytes = [], 0
        self.store.add_requests(batch_id, rows)
        del rows
        return_freed_memory()
        if num_lines > self.config.max_batch_requests:
            message = f"More than {self.config.max_batch_requests} requests; that is the limit."
            self.store.clear_requests(batch_id)
            self._fail(batch_id, "too_many_requests", message)
            return
        if not keys:
            self.store.clear_requests(batch_id)
            message = "No line of the input file is valid."
            self._fail(batch_id, "no_valid_requests", message, problems)
            return
        self._keys[batch_id] = keys
        # a cancel on the event loop may land while this thread validates: only a batch still
        # validating moves on (a read of the status, then a write, lost the cancel)
        self.store.advance_batch(batch_id, "validating", status="in_progress", in_progress_at=now())

    def _fail(
        self, batch_id: str, code: str, message: str, problems: list[dict[str, Any]] | None = None
    ) -> None:
        if self._status(batch_id) == "cancelling":  # the caller's cancel wins: it finalizes
            return
        data = problems or [{"code": code, "message": message, "param": None, "line": None}]
        errors = {"object": "list", "data": data[:100]}
        self.store.update_batch(batch_id, status="failed", failed_at=now(), errors=errors)

    async def _execute(self, batch_id: str, pending: list[tuple[int, str]]) -> None:
        """Run `pending` requests, `batch_concurrency` at a time over all batches, in prefix
        order (`BatchConfig.prefix_order`); each line is read from the store as it starts."""
        batch = self.store.get_batch(batch_id)
        assert batch is not None and self._slots is not None, "call start() first"
        endpoint = batch.endpoint
        cancelled = self._cancelled.setdefault(batch_id, asyncio.Event())
        in_flight = self._in_flight.setdefault(batch_id, set())
        try:
            if self.config.prefix_order:
                keys = self._keys.get(batch_id)
                if keys is None or any(index not in keys for index, _ in pending):
                    keys = await asyncio.to_thread(self._read_keys, batch_id, pending)
                    self._keys[batch_id] = keys
                pending = sorted(pending, key=lambda item: (keys[item[0]], item[0]))
            for line in pending:
                while self._is_paused(batch_id, STORAGE_PAUSED) and not cancelled.is_set():
                    await asyncio.sleep(self.config.storage_retry_s)  # no new work meanwhile
                await self._slots.acquire()
                if cancelled.is_set() or now() >= (batch.expires_at or 0):
                    self._slots.release()
                    break
                task = asyncio.create_task(self._one(batch_id, endpoint, *line))
                in_flight.add(task)
                task.add_done_callback(in_flight.discard)
                task.add_done_callback(lambda _: self._release())
            await asyncio.gather(*list(in_flight), return_exceptions=True)
        finally:
            for task in list(in_flight):
                task.cancel()
            await asyncio.gather(*list(in_flight), return_exceptions=True)
            self._in_flight.pop(batch_id, None)

    def _release(self) -> None:
        assert self._slots is not None
        self._slots.release()

    def _read_keys(self, batch_id: str, pending: list[tuple[int, str]]) -> dict[int, str]:
        """The prefix-order keys of `pending` lines, read back from the store one line at a
        time (a resumed batch; worker thread)."""
        keys: dict[int, str] = {}
        for index, custom_id in pending:
            try:
                keys[index] = prefix_key(self._read_line(batch_id, index, custom_id).body)
            except Exception:  # answering it reports the failure on its line
                keys[index] = ""
        return keys

    def _read_line(self, batch_id: str, index: int, custom_id: str) -> BatchLine:
        """A pending line, read from the store and parsed (worker thread)."""
        return stored_line(index, custom_id, self.store.request_line(batch_id, index))

    def _read_sized_line(self, batch_id: str, index: int, custom_id: str) -> tuple[BatchLine, int]:
        """(a pending line as `_read_line` gives it, its size in bytes) (worker thread). Holds
        the line's text and its parse at once, no more; a long line inside `_long_lines`."""
        num_bytes = self.store.request_line_bytes(batch_id, index)
        with self._long_lines if num_bytes >= LARGE_BODY_BYTES else nullcontext():
            return self._read_line(batch_id, index, custom_id), num_bytes

    async def _one(self, batch_id: str, endpoint: str, index: int, custom_id: str) -> None:
        """Read one line, answer it and commit it, whatever happens to it."""
        num_bytes = 0
        try:
            line, num_bytes = await asyncio.to_thread(
                self._read_sized_line, batch_id, index, custom_id
            )
        except Exception as e:  # a line the store cannot give back must not be lost
            logger.exception("batch %s: line %r cannot be read", batch_id, custom_id)
            message = f"The server failed to read this request ({type(e).__name__}: {e})."
            ok, output = False, error_line(new_id("batch_req_"), custom_id, SERVER_ERROR, message)
        else:
            ok, output = await self._answer(batch_id, endpoint, line)
            del line
        if num_bytes >= LARGE_BODY_BYTES:  # what its parse left: back to the OS
            await asyncio.to_thread(return_freed_memory)
        while True:  # the line is computed: keep it until the store takes it
            try:
                await asyncio.to_thread(self.store.commit_result, batch_id, index, ok, output)
                self._resume(batch_id, STORAGE_PAUSED)
                return
            except StorageError as e:
                self._pause_for_storage(batch_id, e)
                await asyncio.sleep(self.config.storage_retry_s)

    async def _answer(self, batch_id: str, endpoint: str, line: BatchLine) -> tuple[bool, str]:
        """(ran, output line): the endpoint's answer, retried while the engine restarts; a
        refusal (4xx) is a response line, any failure of the server a `server_error` line."""
        line_id = new_id("batch_req_")
        while True:
            try:
                answer = await answer_line(self.serving, endpoint, line, line_id, BATCH_PRIORITY)
                self._resume(batch_id, ENGINE_PAUSED)
                self._resume(batch_id, OFFLOAD_PAUSED)
                return answer
            except APIError as e:
                if e.code == OFFLOAD_PAUSED:  # the engine's disk: run it again once it works
                    self._pause(
                        batch_id,
                        OFFLOAD_PAUSED,
                        f"Paused: {e.message} No line is lost; the batch resumes by itself "
                        "once the offload directory takes writes again.",
                    )
                    await asyncio.sleep(self.config.storage_retry_s)
                    continue
                if e.status_code == 503:
                    self._pause(batch_id, ENGINE_PAUSED, f"Paused: {e.message}")
                    await asyncio.sleep(ENGINE_RETRY_S)  # engine restarting: run it again
                    continue
                message = e.message
            except Exception as e:  # a bug on this line must not lose it
                logger.exception("batch %s: line %r failed", batch_id, line.custom_id)
                message = f"The server failed on this request ({type(e).__name__}: {e})."
            return False, error_line(line_id, line.custom_id, SERVER_ERROR, message)

    def _finalize(self, batch_id: str, status: str) -> None:
        """Write output and error files (input order) and close the batch (worker thread).
        All or nothing: on a failure the files written so far are removed."""
        reason = {"cancelled": "batch_cancelled", "expired": "batch_expired"}.get(status)
        if reason is not None:
            message = f"The batch was {status} before this request ran."
            for line_index, custom_id in self.store.pending_requests(batch_id):
                line = error_line(new_id("batch_req_"), custom_id, reason, message)
                self.store.commit_result(batch_id, line_index, False, line)
        elif self._status(batch_id) != "finalizing":
            self.store.update_batch(batch_id, status="finalizing", finalizing_at=now())
        new_files: list[dict[str, Any]] = []
        file_ids: dict[str, str] = {}
        try:
            for kind, state in (("output", "done"), ("error", "failed")):
                lines = list(self.store.results(batch_id, state))
                if not lines:
                    continue
                file_id = new_id("file-")
                file_ids[f"{kind}_file_id"] = file_id
                num_bytes = self.storage.write_lines(file_id, lines)
                new_files.append(
                    {
                        "id": file_id,
                        "bytes": num_bytes,
                        "filename": f"{batch_id}_{kind}.jsonl",
                        "purpose": "batch_output",
                        "created_at": now(),
                        "status": "processed",
                        "path": file_id,
                    }
                )
            self.store.finalize_batch(
                batch_id, new_files, status=status, **file_ids, **{f"{status}_at": now()}
            )
        except BaseException:
            for file_id in file_ids.values():
                self.storage.remove(file_id)
            raise


def _row(line: CheckedLine | LineProblem) -> RequestRow:
    """The store's row of a checked input line: (line index, custom_id, the line as read,
    'pending') or (line index, custom_id, None, 'failed', its error line)."""
    if isinstance(line, CheckedLine):
        return line.index, line.custom_id, line.text, "pending", None
    return line.index, line.custom_id, None, "failed", problem_line(new_id("batch_req_"), line)
