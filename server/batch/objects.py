"""The Files and Batch API objects, one definition each: the store and the routes build them,
and `/openapi.json` documents them (server/http/openapi.py)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel

from server.openai.requests import BatchEndpoint


class FileObject(BaseModel):
    id: str
    object: Literal["file"]
    bytes: int
    created_at: int
    filename: str
    purpose: Literal["batch", "batch_output"]
    status: Literal["processed"]
    status_details: None
    expires_at: None


class FileList(BaseModel):
    object: Literal["list"]
    data: list[FileObject]
    first_id: str | None
    last_id: str | None
    has_more: bool


class FileDeleted(BaseModel):
    id: str
    object: Literal["file"]
    deleted: bool


class BatchError(BaseModel):
    code: str
    message: str
    param: str | None
    line: int | None


class BatchErrors(BaseModel):
    object: Literal["list"]
    data: list[BatchError]


class RequestCounts(BaseModel):
    total: int
    completed: int
    failed: int


class Batch(BaseModel):
    id: str
    object: Literal["batch"]
    endpoint: BatchEndpoint
    errors: BatchErrors | None
    input_file_id: str
    completion_window: Literal["24h"]
    status: Literal[
        "validating",
        "failed",
        "in_progress",
        "finalizing",
        "completed",
        "expired",
        "cancelling",
        "cancelled",
    ]
    output_file_id: str | None
    error_file_id: str | None
    created_at: int
    in_progress_at: int | None
    finalizing_at: int | None
    completed_at: int | None
    cancelling_at: int | None
    cancelled_at: int | None
    failed_at: int | None
    expired_at: int | None
    expires_at: int | None
    request_counts: RequestCounts
    metadata: dict[str, str] | None


class BatchList(BaseModel):
    object: Literal["list"]
    data: list[Batch]
    first_id: str | None
    last_id: str | None
    has_more: bool
