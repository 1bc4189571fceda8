"""How much of the daemon's time goes to detokenizing and output handling (docs/benchmarks.md).

    python -m bench.daemon.output_share [--seqs 64] [--tokens 1024] [--rate 250] [--rounds 3]
                                 [--json FILE] [--tree LABEL=DIR ...]
                                 [--daemon-args LABEL=FLAGS ...]

Starts a real `nanoflex serve` process on loopback (the demo model, one block of `--seqs`
sequences, the engine in its own process), warms it up, then sends `--seqs` concurrent
completions of `--tokens` generated tokens each (EOS ignored), once streamed and once not,
while py-spy (`pip install py-spy`) samples the daemon process's thread that holds the GIL
(not the engine process): its Python work, whichever thread does it (a thread that waits
for the GIL or a syscall is not counted). A sample counts as *output handling* when one of
its frames is in
`OUTPUT_FRAMES`: the incremental detokenizer and stop strings, the engine's output
records, handing them from the engine thread to the event loop, the per-choice fan-in and
accumulation, building the response body or chunk, and encoding it as JSON. The share is
those samples over the samples of the whole run (rate x wall seconds): the daemon's Python
runs under one GIL, so that is the share of the one core it can use. A thread holding the
GIL is sampled while it runs and while it waits for a core (runnable, not running), so the
last column says how the daemon's threads spent the run: seconds on a CPU and seconds
waiting for one (Linux's schedstat).

`--tree LABEL=DIR` (repeatable) runs the daemon from each source tree in turn, in one sitting
(a checkout of an older commit: the "before" figure; default: this tree), with this
script's own load generator. `--rounds` takes the trees in turn that many times, each with a
fresh daemon, and the table gives medians: the same tree's figure moves by up to half from
one sitting to the next on a 2-core box (where the engine's threads and the daemon share the
cores), far less between rounds of one sitting.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from statistics import median
from typing import Any

import httpx

from bench.common import Table, source_trees, write_json
from bench.daemon.load import launch
from engine.core.model_files import DEMO_MODEL

REPO = Path(__file__).resolve().parents[2]
OUTPUT_FRAMES: dict[str, set[str] | None] = {
    # file (as py-spy names it, the path's tail) -> functions, None: every function
    # before and after the issue-24 rework: the engine's side
    "engine/core/sequence.py": {
        *("append_token", "_detokenize", "_cut_at_stop_string", "delta", "report")
    },
    "engine/core/detokenizer.py": None,
    "engine/core/outputs.py": None,
    "engine/core/parent_request.py": None,
    "engine/core/scheduler.py": {"_output", "_delta"},
    # handing outputs to the event loop and fanning them in
    "server/core_client.py": {"generate", "_deliver", "_call_soon"},
    "engine/runtime/core_client.py": {"generate", "_deliver", "_dispatch", "_call_soon"},
    "engine/runtime/step_loop_client.py": {"generate", "_deliver", "_dispatch", "_call_soon"},
    "engine/runtime/request_streams.py": {"dispatch", "put", "take"},
    "server/serving.py": {"_drive", "outputs", "run_choices", "body", "choice", "token_names"},
    "server/openai/serving.py": {
        *("_prompt_deltas", "_prompt_choices", "_merged", "outputs", "run_choices"),
        *("body", "choice", "chat_choice"),
    },
    # the same, split by endpoint (server/openai/endpoints/)
    "server/openai/endpoints/generation.py": {
        *("_prompt_choices", "_merged", "outputs", "run_choices")
    },
    "server/openai/endpoints/completions.py": {"body", "choice"},
    "server/openai/endpoints/chat.py": {"body", "choice"},
    "server/streaming.py": None,
    "server/openai/streaming.py": None,
    "server/responses.py": None,
    "server/openai/responses.py": None,
    "server/openai/logprobs.py": None,
    # encoding the answer
    "starlette/responses.py": {"render"},
    "server/http/responses.py": {"json_response"},
}


def is_output_frame(frame: str) -> bool:
    """`frame` as py-spy's raw format writes it: 'Class.function (path/to/file.py:line)' or
    'function.<locals>.inner (...)'."""
    name, _, where = frame.partition(" (")
    path = where.rsplit(":", 1)[0]
    parts = set(name.strip().split("."))
    for tail, functions in OUTPUT_FRAMES.items():
        if path.endswith(tail) and (functions is None or parts & functions):
            return True
    return False


def start_daemon(
    data_dir: Path, tree: Path, seqs: int, extra: list[str]
) -> tuple[subprocess.Popen[bytes], str]:
    policy = data_dir / "policy.json"
    data_dir.mkdir(parents=True, exist_ok=True)
    # the one field that differs from the default: a daemon from an older tree (whose Policy
    # knew fewer fields) reads it too
    policy.write_text(json.dumps({"gpu_batch_size": seqs}))
    args = ["--model", DEMO_MODEL, "--device", "cpu", "--policy", str(policy)]
    return launch(data_dir, [*args, "--max-queue", str(4 * seqs), *extra], tree)


async def fire(url: str, seqs: int, tokens: int, stream: bool) -> tuple[float, int]:
    """(wall seconds, generated tokens) of `seqs` concurrent completions."""

    async def one(client: httpx.AsyncClient, i: int) -> int:
        body = {
            "model": DEMO_MODEL,
            "prompt": f"Request {i}: once upon a time",
            "max_tokens": tokens,
            "temperature": 0,
            "ignore_eos": True,
            "stream": stream,
        }
        if stream:
            body["stream_options"] = {"include_usage": True}
            used = 0
            async with client.stream("POST", "/v1/completions", json=body) as response:
                response.raise_for_status()
                async for line in response.aiter_lines():
                    if line.startswith("data: {") and '"usage":{' in line:
                        used = json.loads(line[6:])["usage"]["completion_tokens"]
            return used
        response = await client.post("/v1/completions", json=body)
        response.raise_for_status()
        return int(response.json()["usage"]["completion_tokens"])

    limits = httpx.Limits(max_connections=seqs)
    start = time.perf_counter()
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as client:
        counts = await asyncio.gather(*(one(client, i) for i in range(seqs)))
    return time.perf_counter() - start, sum(counts)


def scheduler_times(pid: int) -> tuple[float, float]:
    """Seconds the threads of process `pid` alive now have run on a CPU, and have waited
    runnable for one (Linux's /proc/PID/task/TID/schedstat; 0, 0 without it)."""
    on_cpu = waiting = 0
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            run, wait, _ = (int(v) for v in (task / "schedstat").read_text().split())
        except (OSError, ValueError):  # a thread that has just ended; no schedstat
            continue
        on_cpu, waiting = on_cpu + run, waiting + wait
    return on_cpu / 1e9, waiting / 1e9


def profiled_run(
    url: str, pid: int, args: argparse.Namespace, stream: bool, out: Path
) -> dict[str, Any]:
    beside = Path(sys.executable).with_name("py-spy")
    spy = str(beside) if beside.is_file() else shutil.which("py-spy")
    if spy is None:
        raise SystemExit("bench.daemon.output_share needs py-spy: pip install py-spy")
    cmd = [spy, "record", "--pid", str(pid), "--rate", str(args.rate), "--format", "raw"]
    cmd += ["--output", str(out), "--nonblocking", "--threads", "--gil"]
    recorder = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    time.sleep(1.0)  # py-spy attaches
    before = scheduler_times(pid)
    wall, generated = asyncio.run(fire(url, args.seqs, args.tokens, stream))
    on_cpu, waiting = (a - b for a, b in zip(scheduler_times(pid), before, strict=True))
    recorder.send_signal(signal.SIGINT)
    recorder.wait(timeout=60)
    samples: Counter[str] = Counter()
    where: Counter[str] = Counter()  # output samples by their outermost output frame
    for line in out.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        frames = stack.split(";")
        hits = [f for f in frames if is_output_frame(f)]
        samples["output" if hits else "other"] += int(count)
        if hits:
            where[hits[-1].split(" (")[0] + " " + hits[-1].rsplit("/", 1)[-1]] += int(count)
    busy = samples["output"] + samples["other"]
    one_core = args.rate * (wall + 1.0)  # the sampled window: the run and the attach second
    return {
        "stream": stream,
        "wall_s": round(wall, 2),
        "generated_tokens": generated,
        "generated_tok_s": round(generated / wall, 1),
        "samples_output": samples["output"],
        "samples_busy": busy,
        "output_share_of_one_core": round(samples["output"] / one_core, 4),
        "output_share_of_busy": round(samples["output"] / max(busy, 1), 4),
        "output_us_per_token": round(1e6 * samples["output"] / args.rate / max(generated, 1), 2),
        "daemon_cpu_s": round(on_cpu, 2),
        "daemon_waiting_for_cpu_s": round(waiting, 2),
        "output_samples_by_innermost_frame": dict(where.most_common(8)),
    }


def run_tree(label: str, tree: Path, round_: int, args: argparse.Namespace) -> list[dict[str, Any]]:
    """One round of one tree: a fresh daemon, warmed up, profiled not streamed then streamed."""
    runs = []
    with tempfile.TemporaryDirectory(prefix="nanoflex-output-") as tmp:
        extra = shlex.split(args.daemon_args.get(label, ""))
        daemon, url = start_daemon(Path(tmp) / "data", tree, args.seqs, extra)
        try:
            asyncio.run(fire(url, args.seqs, 16, stream=False))  # warm-up: kernels, caches
            for stream in (False, True):
                keep = Path(args.profiles or tmp)
                keep.mkdir(parents=True, exist_ok=True)
                name = "".join(c if c.isalnum() else "-" for c in label)
                mode = "stream" if stream else "whole"
                out = keep / f"profile-{name}-{mode}-{round_}.txt"
                run = profiled_run(url, daemon.pid, args, stream, out)
                runs.append({"tree": label, "round": round_, **run})
                print(json.dumps(runs[-1]), file=sys.stderr)
        finally:
            os.kill(daemon.pid, signal.SIGTERM)
            daemon.wait(timeout=60)
    return runs


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--seqs", type=int, default=64)
    parser.add_argument("--tokens", type=int, default=1024)
    parser.add_argument("--rate", type=int, default=250, help="py-spy samples per second")
    parser.add_argument(
        "--tree",
        action="append",
        default=[],
        metavar="LABEL=DIR",
        help="a source tree the daemon runs from, and its name in the table (repeatable; "
        "default: this tree)",
    )
    parser.add_argument(
        "--daemon-args",
        action="append",
        default=[],
        metavar="LABEL=FLAGS",
        help="more `nanoflex serve` flags for the tree of that label (repeatable; a tree may "
        "be named twice under two labels, the ablation of a flag)",
    )
    parser.add_argument(
        "--rounds",
        type=int,
        default=3,
        help="runs of every tree, taken in turn (tree A, tree B, A, B, ...); the table has "
        "each figure's median (sittings differ by up to half, rounds within one much less)",
    )
    parser.add_argument("--json", default=None)
    parser.add_argument("--profiles", default=None, help="keep py-spy's raw profiles here")
    args = parser.parse_args(argv)
    trees = source_trees(args.tree, REPO)
    args.daemon_args = dict(a.split("=", 1) for a in args.daemon_args)
    results = []
    for round_ in range(args.rounds):
        for label, tree in trees:
            results += run_tree(label, Path(tree), round_, args)
    header = ["daemon", "mode", "wall s", "generated tok/s", "output handling, share of one core"]
    table = Table(
        [
            *header,
            "of the daemon's busy samples",
            "output handling, us per token",
            "us per token, each round",
            "daemon's threads: s on a CPU / s waiting for one",
        ]
    )
    for label, _ in trees:
        for stream in (False, True):
            runs = [r for r in results if r["tree"] == label and r["stream"] == stream]
            table.rows.append(
                [
                    label,
                    "streamed" if stream else "not streamed",
                    f"{median(r['wall_s'] for r in runs):.1f}",
                    f"{median(r['generated_tok_s'] for r in runs):.0f}",
                    f"{100 * median(r['output_share_of_one_core'] for r in runs):.1f}%",
                    f"{100 * median(r['output_share_of_busy'] for r in runs):.1f}%",
                    f"{median(r['output_us_per_token'] for r in runs):.1f}",
                    ", ".join(f"{r['output_us_per_token']:.1f}" for r in runs),
                    f"{median(r['daemon_cpu_s'] for r in runs):.1f} / "
                    f"{median(r['daemon_waiting_for_cpu_s'] for r in runs):.1f}",
                ]
            )
    print(table.markdown("llrrrrrlr"))
    config = {
        **{"seqs": args.seqs, "tokens": args.tokens, "rate": args.rate},
        **{"rounds": args.rounds, "trees": trees, "daemon_args": args.daemon_args},
    }
    write_json(args.json, [{"config": config, "runs": results}], table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
