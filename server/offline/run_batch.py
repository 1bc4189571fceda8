"""`nanoflex run-batch`: an OpenAI Batch input file run offline through the engine, resumable.

Lines are read once, validated and answered by the batch-line core the daemon's Batch API
uses (`server.batch.lines`), through the daemon's `Serving` over an in-process
`StepLoopClient`, so a line's body is exactly what `POST /v1/completions` or
`/v1/chat/completions` would answer, and every valid request is queued in the one
scheduler at once (the block refills as sequences finish). A batch has one endpoint, as in
OpenAI's API: the url of the first line that names a supported one; lines with another url
are `invalid_url` errors.

Each result is appended (flush + fsync) to the output file (status 200) or the
error file (invalid lines, refused bodies) the moment it is ready; once every line is
answered, both files are rewritten in the input's order (`sort_log`: one atomic rename
each, a finished file left as it is). Run the same
command after a kill and it resumes: whole lines are read back, a torn last
line is cut off, and lines already answered are skipped, so the output ends
with exactly one line per custom_id. Line ids, request ids and `created` are
derived from the input (line index, custom_id, the input file's mtime), so a
resumed greedy run writes the same bytes per line as an uninterrupted one.

Who answers the pending lines is a `Runner` (`server.offline.work`): here one engine in this
process; with `--ray` the replicas of `server.offline.scale_out.driver` (imported only then,
so the local path never imports ray), whose actors answer each line the same way.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from tqdm import tqdm

from engine.core.engine_args import EngineArgs
from engine.runtime.engine_client import EngineClient
from server.batch.lines import BatchLine, ParsedLine, parse_lines, problem_line
from server.batch.order import in_prefix_order
from server.offline.result_log import ResultLog, read_back, sort_log
from server.offline.work import (
    BatchWork,
    Pending,
    Record,
    RunBatchError,
    Runner,
    answer_all,
    line_id,
)
from server.openai.media import NO_LOCAL_MEDIA, MediaLimits, add_media_arguments, media_limits_from
from server.openai.metrics import Metrics
from server.openai.serving import Serving


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
    add_media_arguments(parser)
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
    parser.add_argument(
        "--ray",
        nargs="?",
        const="",
        default=None,
        metavar="ADDRESS",
        help="run on a Ray cluster (pip install 'nanoflex[ray]'): ADDRESS as ray.init takes it "
        "(auto, HOST:6379, ray://HOST:10001); alone: RAY_ADDRESS, the cluster `ray start` "
        "started here, or a new local one",
    )
    parser.add_argument(
        "--replicas",
        type=int,
        default=None,
        help="with --ray: engines to run, one per actor (default: one per GPU of the "
        "cluster, or one per node without GPUs)",
    )
    parser.add_argument(
        "--gpus-per-replica",
        type=float,
        default=None,
        help="with --ray: GPUs each actor reserves (default: 1 on a cluster with GPUs, else 0)",
    )


def main(args: argparse.Namespace) -> int:
    """Entry point of `nanoflex run-batch`: 0 when at least one line succeeded, 1 when none."""
    output = Path(args.output)
    errors = Path(args.error_file) if args.error_file else Path(f"{args.output}.errors")
    runner: Runner
    if args.ray is not None:
        from server.offline.scale_out.driver import ray_runner  # imports ray: only with --ray

        runner = ray_runner(args)
    else:
        if args.replicas is not None or args.gpus_per_replica is not None:
            raise RunBatchError("--replicas and --gpus-per-replica need --ray")
        runner = local_runner(lambda: _client(args), media_limits_from(args))
    prefix_order = getattr(args, "prefix_ordering", True)
    summary = asyncio.run(run_batch(Path(args.input), output, errors, runner, prefix_order))
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
    from engine.runtime.step_loop_client import (
        build_engine_client,  # imports the engine: only when needed
    )

    return build_engine_client(argparse.Namespace(**{**vars(args), "in_process": True}))


async def run_batch(
    input_path: Path,
    output_path: Path,
    error_path: Path,
    runner: Runner,
    prefix_order: bool = True,
) -> Summary:
    """Answer every line of `input_path` not yet answered in the output or error file, in
    prefix order (`server.batch.order`) unless `prefix_order` is False; results are written
    as they finish, and once all are in, each file is put in the input's order. `runner` is
    not called when nothing is left."""
    check_paths(input_path, output_path, error_path)
    try:
        with open(input_path, "rb") as f:
            endpoint, lines = parse_lines(f, None)
        created = int(input_path.stat().st_mtime)
    except OSError as e:
        raise RunBatchError(f"cannot read the batch input {input_path}: {e}") from e
    output, errors = ResultLog(output_path), ResultLog(error_path)
    try:
        todo, num_resumed = _pending(lines, output, errors)
        if prefix_order:
            todo = in_prefix_order(todo, lambda item: item.line)
        if todo:
            await _run(BatchWork(endpoint, created, todo), runner, output, errors, len(lines))
        output.close()
        errors.close()
        _sort_in_input_order(lines, output_path, error_path)
    except OSError as e:  # the disk filled up or a file went away mid-run
        raise RunBatchError(
            f"cannot write the results ({e}); free the space and rerun the same command to resume"
        ) from e
    finally:
        output.close()
        errors.close()
    return Summary(
        num_lines=len(lines),
        num_completed=len(read_back(output_path)),
        num_failed=len(read_back(error_path)),
        num_resumed=num_resumed,
    )


def _sort_in_input_order(lines: list[ParsedLine], *paths: Path) -> None:
    """Rewrite each finished result file in the order of its lines in the input."""
    index: dict[object, int] = {line_id(line.index, line.custom_id): line.index for line in lines}
    for path in paths:
        sort_log(path, lambda record: index.get(record.get("id"), len(lines)))


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
    lines: list[ParsedLine], output: ResultLog, errors: ResultLog
) -> tuple[list[Pending], int]:
    """(lines to run, lines earlier runs answered); invalid lines go to the error file now."""
    done_ids = {r.get("id") for r in (*output.records, *errors.records)}
    done_custom_ids = {r.get("custom_id") for r in output.records}
    todo, num_resumed = [], 0
    for line in lines:
        this_id = line_id(line.index, line.custom_id)
        if this_id in done_ids or (
            isinstance(line, BatchLine) and line.custom_id in done_custom_ids
        ):
            num_resumed += 1
        elif isinstance(line, BatchLine):
            todo.append(Pending(this_id, line))
        else:
            errors.append(problem_line(this_id, line))
    return todo, num_resumed


async def _run(
    work: BatchWork, runner: Runner, output: ResultLog, errors: ResultLog, num_lines: int
) -> None:
    """Run `runner` over the work, each answer appended to its file, a progress bar over all."""
    bar = tqdm(
        total=num_lines,
        initial=num_lines - len(work.todo),
        desc="run-batch",
        unit="req",
        file=sys.stderr,
    )

    def record(ok: bool, line: str) -> None:
        (output if ok else errors).append(line)
        bar.update()

    with bar:
        await runner(work, record)


def local_runner(
    make_client: Callable[[], EngineClient], media_limits: MediaLimits = NO_LOCAL_MEDIA
) -> Runner:
    """One engine in this process; `make_client()` builds its (unstarted) client; the lines'
    images are read within `media_limits`."""

    async def run(work: BatchWork, record: Record) -> None:
        client = make_client()
        await client.start()
        try:
            serving = Serving(client, client.model_name, Metrics(client), media_limits=media_limits)
            await answer_all(serving, work, lambda item, ok, line: record(ok, line))
        finally:
            await client.shutdown()

    return run
