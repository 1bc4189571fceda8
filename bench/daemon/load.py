"""The daemon's bounded queue under a burst of concurrent completions (docs/benchmarks.md).

    python -m bench.daemon.load [--requests 200] [--max-queue 16] [--tokens 16] [--json FILE]

Starts a real `nanoflex serve` process on loopback (the demo model, `Policy()`, the
engine in its own process), fires the burst from this process with httpx, twice: once
where a refused request gives up, once where every client retries after `Retry-After`.
Counts what was served, refused (429) and lost (neither), and the throughput.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from bench.common import Table, write_json
from engine.core.model_files import DEMO_MODEL
from policy import Policy

NANOFLEX = Path(sys.executable).with_name("nanoflex")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


BATCH_ENDED = ("completed", "failed", "expired", "cancelled")
"""A Batch API job's final statuses (OpenAI's)."""


def wait_for_batch(http: httpx.Client, batch_id: str, poll_s: float) -> dict[str, Any]:
    """The batch object once the job has ended, polled every `poll_s` seconds."""
    while True:
        state: dict[str, Any] = http.get(f"/v1/batches/{batch_id}").json()
        if state["status"] in BATCH_ENDED:
            return state
        time.sleep(poll_s)


def start_daemon(data_dir: Path, max_queue: int) -> tuple[subprocess.Popen[bytes], str]:
    policy = data_dir / "policy.json"
    data_dir.mkdir(parents=True, exist_ok=True)
    policy.write_text(Policy().to_json())
    args = ["--model", DEMO_MODEL, "--device", "cpu", "--policy", str(policy)]
    return launch(data_dir, [*args, "--max-queue", str(max_queue)])


def launch(
    data_dir: Path, args: list[str], tree: Path | None = None
) -> tuple[subprocess.Popen[bytes], str]:
    """`nanoflex serve ARGS` on a free loopback port with its data in `data_dir` and its log
    in data_dir/daemon.log; returns it and its URL once /ready answers 200. `tree`: run the
    daemon from that source tree (another checkout) with this interpreter."""
    data_dir.mkdir(parents=True, exist_ok=True)
    port = free_port()
    serve = [str(NANOFLEX), "serve"]
    env = None
    if tree is not None:
        serve = [sys.executable, "-m", "server.cli", "serve"]
        env = {**os.environ, "PYTHONPATH": str(tree)}
    argv = [*serve, *args, "--port", str(port), "--data-dir", str(data_dir)]
    log = open(data_dir / "daemon.log", "wb")  # noqa: SIM115 (closed with the process)
    daemon = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, cwd=tree, env=env)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{url}/ready", timeout=1).status_code == 200:
                return daemon, url
        except httpx.HTTPError:
            pass
        if daemon.poll() is not None:
            break
        time.sleep(0.2)
    daemon.kill()
    raise RuntimeError(f"the daemon did not become ready; see {data_dir / 'daemon.log'}")


async def burst(url: str, num: int, tokens: int, retry: bool) -> dict[str, Any]:
    body = {"model": DEMO_MODEL, "prompt": "hello", "max_tokens": tokens, "ignore_eos": True}

    async def one(client: httpx.AsyncClient) -> tuple[str, float, int]:
        start, refusals = time.perf_counter(), 0
        while True:
            try:
                response = await client.post("/v1/completions", json=body)
            except httpx.HTTPError:
                return "lost", time.perf_counter() - start, refusals
            if response.status_code == 200:
                ok = response.json()["usage"]["completion_tokens"] == tokens
                return ("served" if ok else "lost"), time.perf_counter() - start, refusals
            if response.status_code != 429 or response.json()["error"]["code"] != "queue_full":
                return "lost", time.perf_counter() - start, refusals
            refusals += 1
            if not retry:
                return "refused", time.perf_counter() - start, refusals
            await asyncio.sleep(float(response.headers["retry-after"]))

    limits = httpx.Limits(max_connections=num)
    start = time.perf_counter()
    async with httpx.AsyncClient(base_url=url, timeout=300, limits=limits) as client:
        outcomes = await asyncio.gather(*(one(client) for _ in range(num)))
    wall = time.perf_counter() - start
    served = sorted(seconds for kind, seconds, _ in outcomes if kind == "served")
    return {
        "served": len(served),
        "refused": sum(1 for kind, _, _ in outcomes if kind == "refused"),
        "lost": sum(1 for kind, _, _ in outcomes if kind == "lost"),
        "refusals": sum(n for _, _, n in outcomes),
        "max_refusals_one_client": max(n for _, _, n in outcomes),
        "wall_s": wall,
        "served_latency_p50_s": served[len(served) // 2] if served else None,
        "served_latency_max_s": served[-1] if served else None,
        "generated_tok_s": len(served) * tokens / wall,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--requests", type=int, default=200)
    parser.add_argument("--max-queue", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=16)
    parser.add_argument("--runs", type=int, default=4, help="bursts without retries")
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="nanoflex-load-") as tmp:
        daemon, url = start_daemon(Path(tmp), args.max_queue)
        try:
            plain = [
                asyncio.run(burst(url, args.requests, args.tokens, retry=False))
                for _ in range(args.runs)
            ]
            retried = asyncio.run(burst(url, args.requests, args.tokens, retry=True))
        finally:
            os.kill(daemon.pid, signal.SIGTERM)
            daemon.wait(timeout=60)
    table = Table(
        [
            "run",
            "served",
            "refused (429, `Retry-After: 1`)",
            "lost",
            "wall s",
            "served latency p50 / max s",
            "generated tok/s",
        ]
    )

    def span(key: str, fmt: str) -> str:
        values = [r[key] for r in plain]
        low, high = format(min(values), fmt), format(max(values), fmt)
        return low if low == high else f"{low}-{high}"

    table.rows.append(
        [
            f"burst, no retries ({args.runs} runs)",
            span("served", "d"),
            span("refused", "d"),
            span("lost", "d"),
            span("wall_s", ".1f"),
            f"{span('served_latency_p50_s', '.1f')} / {span('served_latency_max_s', '.1f')}",
            span("generated_tok_s", ".0f"),
        ]
    )
    table.rows.append(
        [
            "burst, every client retries after `Retry-After`",
            str(retried["served"]),
            f"{retried['refusals']} refusals on the way "
            f"(at most {retried['max_refusals_one_client']} for one client)",
            str(retried["lost"]),
            f"{retried['wall_s']:.1f}",
            "-",
            f"{retried['generated_tok_s']:.0f}",
        ]
    )
    print(table.markdown("lrrrrrr"))
    config = {"requests": args.requests, "max_queue": args.max_queue, "tokens": args.tokens}
    write_json(args.json, [{"config": config, "no_retries": plain, "retries": retried}], table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
