"""The daemon's memory and responsiveness while batches over one huge input line run.

    python -m bench.daemon.batch_line_memory [--mib 60] [--batches 1 2] [--json FILE]

Starts a real `nanoflex serve` process from this tree on loopback (the demo model, the
engine in its own process), uploads one input file: a chat line whose message is `--mib`
MiB of text, then a small line. For each count in `--batches` it creates that many
batches over the file at once, asks `GET /health` every 20 ms until they end, and reads the
daemon process's peak resident memory (`VmHWM`, reset through `/proc/PID/clear_refs`
first) and its resident memory once settled. Figures: peak growth over the line's size,
the slowest `/health`, what stayed resident, and each line's answer (the big one a
`context_length_exceeded` response line, the small one answered).
"""

from __future__ import annotations

import argparse
import json
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import psutil

from bench.common import Table, write_json
from bench.daemon.load import launch
from engine.core.model_files import DEMO_MODEL
from policy import Policy

TREE = Path(__file__).resolve().parents[2]
CHAT = "/v1/chat/completions"
WORD = "lorem ipsum dolor sit amet "


def input_file(path: Path, mib: int) -> int:
    """Write the batch input (a `mib` MiB chat line, then a small one); its big line's bytes."""
    text = WORD * (mib * 2**20 // len(WORD))
    big = {"model": DEMO_MODEL, "messages": [{"role": "user", "content": text}], "max_tokens": 2}
    small = {"model": DEMO_MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    lines = [
        json.dumps({"custom_id": c, "method": "POST", "url": CHAT, "body": b})
        for c, b in (("big", big), ("small", small))
    ]
    path.write_text("\n".join(lines) + "\n")
    return len(lines[0])


def vm_hwm(pid: int) -> int:
    """The process's peak resident bytes since start (or since `reset_hwm`)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmHWM in /proc/PID/status (not Linux?)")


def reset_hwm(pid: int) -> None:
    """Set the process's peak resident memory to its current one (Linux 4.0+)."""
    Path(f"/proc/{pid}/clear_refs").write_text("5")


def settled_rss(pid: int, seconds: float = 3.0) -> int:
    """Resident bytes after `seconds` of quiet (what a finished batch left behind)."""
    time.sleep(seconds)
    return int(psutil.Process(pid).memory_info().rss)


def run_batches(url: str, file_id: str, num: int) -> tuple[list[dict[str, Any]], float]:
    """Create `num` batches over `file_id` at once; (their final objects, the slowest
    `/health` in ms while they ran)."""
    slowest = 0.0
    with httpx.Client(base_url=url, timeout=300) as client:
        body = {"input_file_id": file_id, "endpoint": CHAT, "completion_window": "24h"}
        ids = [client.post("/v1/batches", json=body).json()["id"] for _ in range(num)]
        while True:
            start = time.perf_counter()
            assert client.get("/health").status_code == 200
            slowest = max(slowest, (time.perf_counter() - start) * 1000)
            batches = [client.get(f"/v1/batches/{i}").json() for i in ids]
            if all(b["status"] in ("completed", "failed", "cancelled", "expired") for b in batches):
                return batches, slowest
            time.sleep(0.02)


def answers(url: str, batch: dict[str, Any]) -> dict[str, str]:
    """custom_id -> 200, or the error code of its line."""
    out: dict[str, str] = {}
    for key in ("output_file_id", "error_file_id"):
        if batch.get(key) is None:
            continue
        text = httpx.get(f"{url}/v1/files/{batch[key]}/content", timeout=60).text
        for line in text.splitlines():
            record = json.loads(line)
            response = record["response"]
            if response is None:
                out[record["custom_id"]] = record["error"]["code"]
            elif response["status_code"] == 200:
                out[record["custom_id"]] = "200"
            else:
                out[record["custom_id"]] = response["body"]["error"]["code"]
    return out


def measure(url: str, pid: int, file_id: str, line_bytes: int, num: int) -> dict[str, Any]:
    before = settled_rss(pid, 1.0)
    reset_hwm(pid)
    health: list[float] = []
    stop = threading.Event()

    def poll_health() -> None:  # a second client, so a slow batch poll does not hide it
        with httpx.Client(base_url=url, timeout=60) as client:
            while not stop.is_set():
                start = time.perf_counter()
                client.get("/health")
                health.append((time.perf_counter() - start) * 1000)
                time.sleep(0.02)

    poller = threading.Thread(target=poll_health)
    poller.start()
    try:
        batches, _ = run_batches(url, file_id, num)
    finally:
        stop.set()
        poller.join()
    peak = vm_hwm(pid)
    after = settled_rss(pid)
    return {
        "batches": num,
        "line_mib": round(line_bytes / 2**20, 1),
        "rss_before_mib": round(before / 2**20),
        "peak_growth_mib": round((peak - before) / 2**20),
        "peak_growth_per_line_size": round((peak - before) / line_bytes, 2),
        "health_max_ms": round(max(health), 1),
        "health_requests": len(health),
        "rss_after_growth_mib": round((after - before) / 2**20),
        "answers": [answers(url, b) for b in batches],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=60, help="size of the big line's text")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--json", default=None, help="also write the results here")
    args = parser.parse_args()
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmp:
        data_dir = Path(tmp) / "data"
        data_dir.mkdir()
        policy = Path(tmp) / "policy.json"
        policy.write_text(Policy().to_json())
        serve = ["--model", DEMO_MODEL, "--device", "cpu", "--policy", str(policy)]
        daemon, url = launch(data_dir, serve, tree=TREE)
        try:
            path = Path(tmp) / "input.jsonl"
            line_bytes = input_file(path, args.mib)
            with open(path, "rb") as f:
                files = {"file": ("input.jsonl", f)}
                upload = httpx.post(f"{url}/v1/files", data={"purpose": "batch"}, files=files)
            file_id = upload.json()["id"]
            path.unlink()
            for num in args.batches:
                rows.append(measure(url, daemon.pid, file_id, line_bytes, num))
                print(json.dumps(rows[-1]), flush=True)
        finally:
            daemon.terminate()
            daemon.wait(timeout=60)
    table = Table(
        ["batches", "line MiB", "peak growth / line", "/health max ms", "RSS kept MiB"],
        [
            [
                str(r[key])
                for key in (
                    "batches",
                    "line_mib",
                    "peak_growth_per_line_size",
                    "health_max_ms",
                    "rss_after_growth_mib",
                )
            ]
            for r in rows
        ],
    )
    print(table.markdown())
    write_json(args.json, rows, table, {"mib": args.mib, "batches": args.batches})


if __name__ == "__main__":
    main()
