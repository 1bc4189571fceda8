"""Routes of the Files and Batch APIs: /v1/files and /v1/batches, in OpenAI's shapes."""

from __future__ import annotations

import asyncio
from typing import Annotated, Any

from fastapi import APIRouter, Query, Request
from fastapi.responses import FileResponse, Response
from starlette.datastructures import UploadFile

from server.batch.files import file_object, safe_filename
from server.batch.objects import Batch, BatchList, FileDeleted, FileList
from server.batch.storage_faults import storage_error
from server.http.request_body import read_json
from server.http.responses import json_response
from server.http.state import AppState, get_state
from server.openai.errors import (
    APIError,
    invalid_request,
    not_found,
    storage_limit_reached,
    too_many_batches,
)
from server.openai.requests import BatchCreateRequest, parse_body
from server.openai.responses import new_id, now

router = APIRouter()
UPLOAD_PURPOSES = ("batch",)
COMPLETION_WINDOW_S = {"24h": 24 * 3600}


def _page(kind: type[FileList] | type[BatchList], data: list[Any], limit: int) -> Response:
    """OpenAI's list object from `limit + 1` objects."""
    page = data[:limit]
    first, last = (page[0].id, page[-1].id) if page else (None, None)
    body = kind(object="list", data=page, first_id=first, last_id=last, has_more=len(data) > limit)
    return json_response(body)


def _file(state: AppState, file_id: str) -> dict[str, Any]:
    record = state.store.get_file(file_id)
    if record is None:
        raise not_found("file", file_id)
    return record


# -- files -------------------------------------------------------------------------------
@router.post("/v1/files")
async def upload_file(request: Request) -> Response:
    state = get_state(request)
    try:
        form = await request.form(max_files=1, max_fields=8)
    except OSError as e:  # the multipart parser spools large parts to a temporary file
        error = storage_error(e, "receiving the upload")
        if error is None:
            raise
        raise error from e
    try:
        upload, purpose = form.get("file"), form.get("purpose")
        if not isinstance(upload, UploadFile):
            raise invalid_request("Send the file as the multipart field 'file'.", param="file")
        if purpose not in UPLOAD_PURPOSES:
            raise invalid_request(
                f"purpose must be one of {list(UPLOAD_PURPOSES)}, got {purpose!r}.",
                param="purpose",
            )
        limit = state.settings.max_stored_bytes
        if limit is not None and state.store.stored_bytes() + (upload.size or 0) > limit:
            raise storage_limit_reached(limit, state.store.stored_bytes())
        file_id = new_id("file-")
        num_bytes = await asyncio.to_thread(state.storage.write_stream, file_id, upload.file)
        if num_bytes == 0:
            state.storage.remove(file_id)
            raise invalid_request("The uploaded file is empty.", param="file", code="empty_file")
        record = {
            "id": file_id,
            "bytes": num_bytes,
            "filename": safe_filename(upload.filename),
            "purpose": purpose,
            "created_at": now(),
            "status": "processed",
            "path": file_id,
        }
        try:
            state.store.insert_file(record)
        except BaseException:
            state.storage.remove(file_id)
            raise
        return json_response(file_object(record))
    finally:
        await form.close()


@router.get("/v1/files")
async def list_files(
    request: Request,
    purpose: str | None = None,
    limit: Annotated[int, Query(ge=1, le=10_000)] = 10_000,
    after: str | None = None,
    order: Annotated[str, Query(pattern="^(asc|desc)$")] = "desc",
) -> Response:
    rows = get_state(request).store.list_files(purpose, after, limit + 1, order == "asc")
    return _page(FileList, [file_object(r) for r in rows], limit)


@router.get("/v1/files/{file_id}")
async def get_file(request: Request, file_id: str) -> Response:
    return json_response(file_object(_file(get_state(request), file_id)))


@router.get("/v1/files/{file_id}/content")
async def file_content(request: Request, file_id: str) -> FileResponse:
    state = get_state(request)
    record = _file(state, file_id)
    path = state.storage.path_for(record["id"])
    if not path.is_file():
        raise APIError(
            404,
            f"The contents of {file_id} are missing from the server's data directory.",
            code="file_content_missing",
        )
    return FileResponse(
        path,
        media_type="application/octet-stream",
        filename=record["filename"],
    )


@router.delete("/v1/files/{file_id}")
async def delete_file(request: Request, file_id: str) -> Response:
    state = get_state(request)
    _file(state, file_id)
    state.store.delete_file(file_id)
    state.storage.remove(file_id)
    return json_response(FileDeleted(id=file_id, object="file", deleted=True))


# -- batches -----------------------------------------------------------------------------
@router.post("/v1/batches")
async def create_batch(request: Request) -> Response:
    state = get_state(request)
    req = parse_body(BatchCreateRequest, await read_json(request))
    if state.store.num_unfinished_batches() >= state.settings.max_batches:
        raise too_many_batches(state.settings.max_batches)
    record = state.store.get_file(req.input_file_id)
    if record is None:
        raise not_found("file", req.input_file_id, param="input_file_id")
    if record["purpose"] != "batch":
        raise invalid_request(
            f"File {req.input_file_id} has purpose {record['purpose']!r}; upload the input "
            "with purpose 'batch'.",
            param="input_file_id",
        )
    created = now()
    batch_id = new_id("batch_")
    state.store.insert_batch(
        {
            "id": batch_id,
            "endpoint": req.endpoint,
            "input_file_id": req.input_file_id,
            "completion_window": req.completion_window,
            "status": "validating",
            "created_at": created,
            "expires_at": created + COMPLETION_WINDOW_S[req.completion_window],
            "metadata": req.metadata,
        }
    )
    state.runner.submit(batch_id)
    return json_response(_batch(state, batch_id))


def _batch(state: AppState, batch_id: str) -> Batch:
    """The batch object, with the reason it is paused (if it is) in its `errors`."""
    batch = state.store.get_batch(batch_id)
    if batch is None:
        raise not_found("batch", batch_id)
    return state.runner.with_pause(batch)


@router.get("/v1/batches")
async def list_batches(
    request: Request,
    after: str | None = None,
    limit: Annotated[int, Query(ge=1, le=100)] = 20,
) -> Response:
    state = get_state(request)
    batches = [state.runner.with_pause(b) for b in state.store.list_batches(after, limit + 1)]
    return _page(BatchList, batches, limit)


@router.get("/v1/batches/{batch_id}")
async def get_batch(request: Request, batch_id: str) -> Response:
    return json_response(_batch(get_state(request), batch_id))


@router.post("/v1/batches/{batch_id}/cancel")
async def cancel_batch(request: Request, batch_id: str) -> Response:
    state = get_state(request)
    _batch(state, batch_id)
    return json_response(state.runner.cancel(batch_id))
