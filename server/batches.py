"""`BatchRunner`: validates, runs, cancels, expires and finalizes Batch API jobs, durably.

Lifecycle of a batch: validating -> in_progress -> finalizing -> completed, or
failed (no valid line), cancelling -> cancelled, expired (past its window).
Every request's output line is committed with its done/failed mark in one
transaction; on start every unfinished batch resumes from its pending requests.
"""

from __future__ import annotations

import asyncio
import json
import logging
from typing import Any

from engine.core.sequence import BATCH_PRIORITY
from server.batch_input import parse_input_lines
from server.errors import APIError, invalid_request
from server.files import FileStorage, new_id, now
from server.serving import Serving
from server.settings import ServerSettings
from server.store import Store

logger = logging.getLogger("nanoflex.batches")
ENGINE_RETRY_S = 0.5


def error_line(custom_id: str | None, code: str, message: str) -> str:
    """OpenAI's line for a request that never ran."""
    line = {
        "id": new_id("batch_req_"),
        "custom_id": custom_id,
        "response": None,
        "error": {"code": code, "message": message},
    }
    return json.dumps(line)


def response_line(custom_id: str, request_id: str, status_code: int, body: Any) -> str:
    """OpenAI's line for a request that ran (status 200) or was refused by the endpoint."""
    response = {"status_code": status_code, "request_id": request_id, "body": body}
    line = {"id": new_id("batch_req_"), "custom_id": custom_id, "response": response, "error": None}
    return json.dumps(line)


class BatchRunner:
    """Runs every unfinished batch as one asyncio task; at most `batch_concurrency`
    requests of all batches are in the engine at once, at batch priority."""

    def __init__(
        self, store: Store, storage: FileStorage, serving: Serving, settings: ServerSettings
    ) -> None:
        self.store = store
        self.storage = storage
        self.serving = serving
        self.settings = settings
        self._tasks: dict[str, asyncio.Task[None]] = {}
        self._in_flight: dict[str, set[asyncio.Task[None]]] = {}
        self._cancelled: dict[str, asyncio.Event] = {}
        self._slots: asyncio.Semaphore | None = None

    async def start(self) -> None:
        """Resume every unfinished batch (call from the running event loop)."""
        self._slots = asyncio.Semaphore(self.settings.batch_concurrency)
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
        self._cancelled[batch_id] = asyncio.Event()
        task = asyncio.create_task(self._run(batch_id), name=f"batch {batch_id}")
        self._tasks[batch_id] = task
        task.add_done_callback(lambda _: self._forget(batch_id))

    def _forget(self, batch_id: str) -> None:
        self._tasks.pop(batch_id, None)
        self._cancelled.pop(batch_id, None)

    async def wait(self, batch_id: str) -> None:
        """Until the batch's task ends (tests, shutdown)."""
        task = self._tasks.get(batch_id)
        if task is not None:
            await asyncio.gather(task, return_exceptions=True)

    def cancel(self, batch_id: str) -> dict[str, Any]:
        """Move a batch to cancelling; its task aborts in-flight requests and finalizes."""
        batch = self.store.get_batch(batch_id)
        assert batch is not None
        if batch["status"] in ("completed", "failed", "expired"):
            raise invalid_request(
                f"Batch {batch_id} is {batch['status']} and cannot be cancelled.",
                code="batch_not_cancellable",
            )
        if batch["status"] in ("validating", "in_progress"):
            self.store.update_batch(batch_id, status="cancelling", cancelling_at=now())
            event = self._cancelled.get(batch_id)
            if event is not None:
                event.set()
            for task in self._in_flight.get(batch_id, set()):
                task.cancel()
        result = self.store.get_batch(batch_id)
        assert result is not None
        return result

    # -- the batch task --------------------------------------------------------------
    async def _run(self, batch_id: str) -> None:
        try:
            batch = self.store.get_batch(batch_id)
            assert batch is not None
            if batch["status"] == "validating":
                await asyncio.to_thread(self._validate, batch)
            batch = self.store.get_batch(batch_id)
            assert batch is not None
            if batch["status"] == "in_progress":
                await self._execute(batch)
            batch = self.store.get_batch(batch_id)
            assert batch is not None
            if batch["status"] == "cancelling":
                await asyncio.to_thread(self._finalize, batch_id, "cancelled")
            elif batch["status"] == "in_progress" and now() >= batch["expires_at"]:
                await asyncio.to_thread(self._finalize, batch_id, "expired")
            elif batch["status"] in ("in_progress", "finalizing"):
                await asyncio.to_thread(self._finalize, batch_id, "completed")
        except asyncio.CancelledError:
            raise
        except Exception:
            logger.exception("batch %s stopped on an unexpected error", batch_id)

    def _validate(self, batch: dict[str, Any]) -> None:
        """Split the input file into runnable requests and error lines (worker thread)."""
        batch_id = batch["id"]
        record = self.store.get_file(batch["input_file_id"])
        if record is None:
            self._fail(batch_id, "file_not_found", f"Input file {batch['input_file_id']} is gone.")
            return
        with open(self.storage.path_for(record["id"]), "rb") as f:
            rows, problems = parse_input_lines(f, batch["endpoint"], error_line)
        if len(rows) > self.settings.max_batch_requests:
            message = f"{len(rows)} requests; the limit is {self.settings.max_batch_requests}."
            self._fail(batch_id, "too_many_requests", message)
            return
        if not any(status == "pending" for _, _, _, status, _ in rows):
            self._fail(
                batch_id, "no_valid_requests", "No line of the input file is valid.", problems
            )
            return
        self.store.insert_requests(batch_id, rows)
        if self.store.get_batch(batch_id)["status"] == "validating":  # type: ignore[index]
            self.store.update_batch(batch_id, status="in_progress", in_progress_at=now())

    def _fail(
        self, batch_id: str, code: str, message: str, problems: list[dict[str, Any]] | None = None
    ) -> None:
        data = problems or [{"code": code, "message": message, "param": None, "line": None}]
        errors = {"object": "list", "data": data[:100]}
        self.store.update_batch(batch_id, status="failed", failed_at=now(), errors=errors)

    async def _execute(self, batch: dict[str, Any]) -> None:
        batch_id, endpoint = batch["id"], batch["endpoint"]
        assert self._slots is not None, "call start() first"
        cancelled = self._cancelled.setdefault(batch_id, asyncio.Event())
        in_flight = self._in_flight.setdefault(batch_id, set())
        try:
            pending = await asyncio.to_thread(self.store.pending_requests, batch_id)
            for line_index, custom_id, body in pending:
                await self._slots.acquire()
                if cancelled.is_set() or now() >= batch["expires_at"]:
                    self._slots.release()
                    break
                task = asyncio.create_task(
                    self._one(batch_id, endpoint, line_index, custom_id, body)
                )
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

    async def _one(
        self, batch_id: str, endpoint: str, line_index: int, custom_id: str, body: str
    ) -> None:
        """Run one request (retrying while the engine restarts) and commit its line."""
        while True:
            try:
                prep = self.serving.prepare(endpoint, json.loads(body))
                if prep.stream:
                    raise invalid_request("stream is not supported in a batch", param="stream")
                result = await self.serving.run(prep, BATCH_PRIORITY)
                line, ok = response_line(custom_id, prep.request_id, 200, result), True
            except APIError as e:
                if e.status_code == 503:
                    await asyncio.sleep(ENGINE_RETRY_S)  # engine restarting: run it again
                    continue
                line, ok = (
                    response_line(custom_id, new_id("req_"), e.status_code, e.to_dict()),
                    False,
                )
            break
        await asyncio.to_thread(self.store.commit_result, batch_id, line_index, ok, line)

    def _finalize(self, batch_id: str, status: str) -> None:
        """Write output and error files (input order) and close the batch (worker thread)."""
        reason = {"cancelled": "batch_cancelled", "expired": "batch_expired"}.get(status)
        if reason is not None:
            message = f"The batch was {status} before this request ran."
            for line_index, custom_id, _ in self.store.pending_requests(batch_id):
                line = error_line(custom_id, reason, message)
                self.store.commit_result(batch_id, line_index, False, line)
        else:
            self.store.update_batch(batch_id, status="finalizing", finalizing_at=now())
        new_files, file_ids = [], {}
        for kind, state in (("output", "done"), ("error", "failed")):
            lines = list(self.store.results(batch_id, state))
            if not lines:
                continue
            file_id = new_id("file-")
            num_bytes = self.storage.write_lines(file_id, lines)
            file_ids[f"{kind}_file_id"] = file_id
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
