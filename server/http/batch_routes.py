"""Routes of the Files and Batch APIs: /v1/files and /v1/batches, in OpenAI's shapes."""

from __future__ import annotations

import asyncio
from typing import Annotated, Any

from fastapi import APIRouter, Query, Request
from fastapi.responses import FileResponse, Response

from server.batch.files import file_object, safe_filename
from server.batch.objects import Batch, BatchList, FileDeleted, FileList
from server.http.request_body import read_json
from server.http.responses import json_response
from server.http.state import AppState, get_state
from server.http.upload_stream import NoRoom, receive_upload
from server.openai.errors import (
    APIError,
    invalid_request,
    not_found,
    storage_limit_reached,
    too_many_batches,
    too_many_uploads,
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
    if state.num_uploads >= state.settings.max_uploads:
        raise too_many_uploads(state.settings.max_uploads, state.settings.retry_after_s)
    state.num_uploads += 1
    try:
        return await _receive_file(state, request)
    finally:
        state.num_uploads -= 1


async def _receive_file(state: AppState, request: Request) -> Response:
    """The upload streamed into the data directory (server/http/upload_stream.py), checked,
    committed and recorded; on any refusal nothing is stored."""
    limit = state.settings.max_stored_bytes
    room = None if limit is None else limit - state.store.stored_bytes()
    file_id = new_id("file-")
    content_type = request.headers.get("content-type", "")
    try:
        upload = await receive_upload(request.stream(), content_type, state.storage, file_id, room)
    except NoRoom as e:
        assert limit is not None
        raise storage_limit_reached(limit, state.store.stored_bytes()) from e
    pending = upload.pending
    assert pending is not None
    try:
        purpose = upload.fields.get("purpose")
        if purpose not in UPLOAD_PURPOSES:
            raise invalid_request(
                f"purpose must be one of {list(UPLOAD_PURPOSES)}, got {purpose!r}.",
                param="purpose",
            )
        if pending.num_bytes == 0:
            raise invalid_request("The uploaded file is empty.", param="file", code="empty_file")
        await asyncio.to_thread(pending.commit)
        stored = state.store.stored_bytes()  # others may have been stored meanwhile
        if limit is not None and stored + pending.num_bytes > limit:
            raise storage_limit_reached(limit, stored)
        record = {
            "id": file_id,
            "bytes": pending.num_bytes,
            "filename": safe_filename(upload.filename),
            "purpose": purpose,
            "created_at": now(),
            "status": "processed",
            "path": file_id,
        }
        state.store.insert_file(record)
    except BaseException:
        pending.discard()
        state.storage.remove(file_id)  # committed but recorded nowhere: it goes too
        raise
    return json_response(file_object(record))


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
