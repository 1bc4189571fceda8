"""`nanoflex run-batch`: an OpenAI Batch input file run offline through the engine, resumable.

Lines are validated by the Batch API's own parser (`server.batch_input`) and run
by the daemon's `Serving` over an in-process `CoreEngineClient`, so a line's
body is exactly what `POST /v1/completions` or `/v1/chat/completions` would
answer, and every valid request is queued in the one scheduler at once (the
block refills as sequences finish). A batch has one endpoint, as in OpenAI's
API: the url of the first line that names a supported one; lines with another
url are `invalid_url` errors.

Each result is appended (flush + fsync) to the output file (status 200) or the
error file (invalid lines, refused bodies) the moment it is ready. Run the same
command after a kill and it resumes: whole lines are read back, a torn last
line is cut off, and lines already answered are skipped, so the output ends
with exactly one line per custom_id. Line ids, request ids and `created` are
derived from the input (line index, custom_id, the input file's mtime), so a
resumed greedy run writes the same bytes per line as an uninterrupted one.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from tqdm import tqdm

from engine.core.engine_args import EngineArgs
from engine.core.sequence import BATCH_PRIORITY
from policy.errors import UserError
from server.batch_input import Row, parse_input_lines
from server.batch_lines import error_line, response_line
from server.engine_client import EngineClient
from server.errors import APIError, invalid_request
from server.json_body import JSONBodyError, loads_json
from server.metrics import Metrics
from server.result_log import ResultLog, read_back
from server.serving import CHAT, COMPLETIONS, Serving

ENDPOINTS = (COMPLETIONS, CHAT)
MAX_IN_FLIGHT = 256
"""Requests prepared and queued in the engine at once; more wait here, untokenized."""


class RunBatchError(UserError):
    """The batch cannot run (unreadable input, engine failure); rerun to resume."""


@dataclass(frozen=True, slots=True)
class Summary:
    """How a run-batch invocation ended, counting lines answered by earlier runs too."""

    num_lines: int
    num_completed: int
    """Lines in the output file (status 200)."""
    num_failed: int
    """Lines in the error file (invalid lines and refused requests)."""
    num_resumed: int
    """Lines that earlier runs had already answered."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    EngineArgs.add_cli_args(parser)
    parser.add_argument(
        "-i", "--input", required=True, help="the requests, OpenAI Batch JSONL (required)"
    )
    parser.add_argument(
        "-o", "--output", required=True, help="results JSONL, appended to on resume (required)"
    )
    parser.add_argument("--error-file", default=None, help="errors JSONL (default: OUTPUT.errors)")
    parser.add_argument(
        "--served-model-name",
        default=None,
        help="the model id the lines' bodies name (default: MODEL as given, or "
        "smollm2-135m-instruct without one)",
    )


def main(args: argparse.Namespace) -> int:
    """Entry point of `nanoflex run-batch`: 0 when at least one line succeeded, 1 when none."""
    output = Path(args.output)
    errors = Path(args.error_file) if args.error_file else Path(f"{args.output}.errors")
    summary = asyncio.run(run_batch(Path(args.input), output, errors, lambda: _client(args)))
    written = [
        f"results in {output}" if summary.num_completed else "",
        f"errors in {errors}" if summary.num_failed else "",
    ]
    print(
        f"run-batch: {summary.num_completed} completed, {summary.num_failed} failed "
        f"of {summary.num_lines} lines ({summary.num_resumed} from an earlier run)"
        + "".join(f"; {w}" for w in written if w),
        file=sys.stderr,
    )
    if summary.num_completed == 0:
        print("run-batch: error: no line succeeded", file=sys.stderr)
        return 1
    return 0


def _client(args: argparse.Namespace) -> EngineClient:
    from server.core_client import build_engine_client  # imports the engine: only when needed

    return build_engine_client(argparse.Namespace(**{**vars(args), "in_process": True}))


async def run_batch(
    input_path: Path,
    output_path: Path,
    error_path: Path,
    make_client: Callable[[], EngineClient],
) -> Summary:
    """Answer every line of `input_path` not yet answered in the output or error file.
    `make_client()` builds the (unstarted) engine client; it is not called when nothing is left."""
    check_paths(input_path, output_path, error_path)
    try:
        with open(input_path, "rb") as f:
            endpoint = _endpoint(f)
            f.seek(0)
            rows, _ = parse_input_lines(f, endpoint, error_line)
        created = int(input_path.stat().st_mtime)
    except OSError as e:
        raise RunBatchError(f"cannot read the batch input {input_path}: {e}") from e
    output, errors = ResultLog(output_path), ResultLog(error_path)
    try:
        todo, num_resumed = _pending(rows, output, errors)
        if todo:
            await _run(todo, endpoint, created, make_client(), output, errors, len(rows))
    except OSError as e:  # the disk filled up or a file went away mid-run
        raise RunBatchError(
            f"cannot write the results ({e}); free the space and rerun the same command to resume"
        ) from e
    finally:
        output.close()
        errors.close()
    return Summary(
        num_lines=len(rows),
        num_completed=len(read_back(output_path)),
        num_failed=len(read_back(error_path)),
        num_resumed=num_resumed,
    )


def check_paths(input_path: Path, output_path: Path, error_path: Path) -> None:
    """Refuse outputs that would overwrite the input or each other, or cannot be written."""
    names = {"input": input_path, "output": output_path, "error file": error_path}
    seen: dict[object, str] = {}
    for name, path in names.items():
        real = _identity(path)
        if real in seen:
            raise RunBatchError(
                f"the {name} and the {seen[real]} are the same file ({path}); "
                "give the results a file of their own"
            )
        seen[real] = name
    for name, path in list(names.items())[1:]:
        if path.is_dir():
            raise RunBatchError(f"cannot write the {name} {path}: it is a directory")
        if not path.parent.is_dir():
            raise RunBatchError(f"cannot write the {name} {path}: {path.parent} is not a directory")
        if path.exists() and not os.access(path, os.W_OK):
            raise RunBatchError(f"cannot write the {name} {path}: permission denied")
        if not path.exists() and not os.access(path.parent, os.W_OK | os.X_OK):
            raise RunBatchError(f"cannot write the {name} {path}: {path.parent} is read-only")


def _identity(path: Path) -> object:
    """What makes two paths one file: device and inode when it exists (hard links too)."""
    try:
        st = path.stat()
    except OSError:
        return path.resolve()
    return (st.st_dev, st.st_ino)


def _pending(
    rows: list[Row], output: ResultLog, errors: ResultLog
) -> tuple[list[tuple[str, str, str]], int]:
    """(lines to run, lines earlier runs answered); invalid lines go to the error file now."""
    done_ids = {r.get("id") for r in (*output.records, *errors.records)}
    done_custom_ids = {r.get("custom_id") for r in output.records}
    todo, num_resumed = [], 0
    for index, custom_id, body, status, problem in rows:
        line_id = _line_id(index, custom_id)
        if line_id in done_ids or (status == "pending" and custom_id in done_custom_ids):
            num_resumed += 1
            continue
        if problem is not None:
            errors.append(_with_id(problem, line_id))
        else:
            assert custom_id is not None and body is not None
            todo.append((line_id, custom_id, body))
    return todo, num_resumed


async def _run(
    todo: list[tuple[str, str, str]],
    endpoint: str,
    created: int,
    client: EngineClient,
    output: ResultLog,
    errors: ResultLog,
    num_lines: int,
) -> None:
    """Queue every pending request in the engine and append each result as it finishes."""
    await client.start()
    try:
        serving = Serving(client, client.model_name, Metrics(client))
        window = asyncio.Semaphore(MAX_IN_FLIGHT)
        bar = tqdm(
            total=num_lines,
            initial=num_lines - len(todo),
            desc="run-batch",
            unit="req",
            file=sys.stderr,
        )

        async def one(line_id: str, custom_id: str, body: str) -> None:
            async with window:
                ok, line = await _answer(serving, endpoint, custom_id, body, created)
            (output if ok else errors).append(_with_id(line, line_id))
            bar.update()

        with bar:
            await asyncio.gather(*(one(*item) for item in todo))
    finally:
        await client.shutdown()


async def _answer(
    serving: Serving, endpoint: str, custom_id: str, body: str, created: int
) -> tuple[bool, str]:
    """(ran, output line) for one valid input line; the engine's own failures raise."""
    request_id = _request_id(custom_id, endpoint)
    try:
        prep = serving.prepare(endpoint, json.loads(body))
        if prep.stream:  # as the Batch API answers it (server.batches)
            raise invalid_request("stream is not supported in a batch", param="stream")
        prep = replace(prep, request_id=request_id, created=created)
        result = await serving.run(prep, BATCH_PRIORITY)
        return True, response_line(custom_id, request_id, 200, result)
    except APIError as e:
        if e.status_code >= 500:
            raise RunBatchError(
                f"the engine failed on {custom_id!r}: {e.message} Rerun the same command to resume."
            ) from e
        return False, response_line(custom_id, request_id, e.status_code, e.to_dict())


def _endpoint(f: Any) -> str:
    """The batch's endpoint: the url of the first line that names a supported one."""
    for raw in f:
        try:
            obj = loads_json(raw)
        except JSONBodyError:
            continue
        if isinstance(obj, dict) and obj.get("url") in ENDPOINTS:
            return str(obj["url"])
    return COMPLETIONS


def _digest(*parts: str) -> str:
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()[:24]


def _request_id(custom_id: str, endpoint: str) -> str:
    """The response's request id (and body id), a function of custom_id alone."""
    return ("chatcmpl-" if endpoint == CHAT else "cmpl-") + _digest(custom_id)


def _line_id(index: int, custom_id: str | None) -> str:
    """The output line's id; duplicate custom_ids differ by their line index."""
    return "batch_req_" + _digest(str(index), custom_id or "")


def _with_id(line: str, line_id: str) -> str:
    """`line` (built by server.batches, which draws a random id) with a deterministic id."""
    record = json.loads(line)
    record["id"] = line_id
    return json.dumps(record)
