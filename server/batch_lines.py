"""The lines of Batch API output and error files, in OpenAI's shape."""

from __future__ import annotations

import json
from typing import Any

from server.files import new_id

SERVER_ERROR = "server_error"
"""Error-file code of a line the server failed on (an unexpected exception)."""


def error_line(custom_id: str | None, code: str, message: str) -> str:
    """OpenAI's line for a request that did not run (invalid, cancelled, server failure)."""
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
