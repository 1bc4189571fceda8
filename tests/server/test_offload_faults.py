"""The offload directory under faults, seen from outside the daemon (the demo model, all KV on
disk, `--offload-dir` on a small tmpfs): a disk that fills mid-batch pauses the batch and
loses nothing; a full disk at start is one line; the budgets do not shrink across an engine
restart; a damaged disk-cache index is a warning and a counter; one daemon per directory, and
a daemon killed with -9 leaves nothing behind that stops its restart.

After each: the batch invariant (every custom_id once, no capacity or storage error charged to
the caller), every answer equal to a cold run (the prefix cache off), the engine restart
count as expected, and a following request served normally.
"""

from __future__ import annotations

import json
import logging
import re
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import psutil
import pytest

from engine.core.engine_args import EngineArgs
from engine.core.model_files import resolve_model_dir
from engine.runtime.step_loop_client import StepLoopClient
from policy import Policy
from tests.server.batch_files import (
    URL,
    assert_accounted,
    greedy_lines,
    read_lines,
    upload,
    wait_batch,
    wait_completed,
)
from tests.server.daemon import Daemon
from tests.server.daemon import daemons as daemons  # a fixture
from tests.server.faults import fill_to_the_last_byte, tmpfs
from tests.server.live import MODEL, LiveServer, ServerFactory, engine_args, free_port, wait_for

ON_DISK = Policy(kv_frac=(0.0, 0.0, 1.0))
MAX_TOKENS = 24


@pytest.fixture(scope="module")
def cold() -> Iterator[Any]:
    """The offline engine with the prefix cache off: what every answer must equal."""
    from engine.llm import LLM

    with LLM(MODEL, policy=Policy(), device="cpu", enable_prefix_caching=False) as llm:
        yield llm


def cold_texts(llm: Any, prompts: list[str], max_tokens: int = MAX_TOKENS) -> list[str]:
    from engine.core.sampling_params import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    return [o.outputs[0].text for o in llm.generate(prompts, params)]


class OffloadDisk:
    """The offload directory `root` on a tmpfs, and a filler file beside it (the directory
    is its owner's, the filler the operator's) to fill the disk up."""

    def __init__(self, root: Path, filler: Path) -> None:
        self.root, self.filler = root, filler

    def fill(self, leave_bytes: int = 0) -> None:
        """Fill the disk, then give `leave_bytes` back."""
        fill_to_the_last_byte(self.filler)
        if leave_bytes:
            size = self.filler.stat().st_size
            with open(self.filler, "r+b") as f:
                f.truncate(max(0, size - leave_bytes))

    def free(self) -> None:
        self.filler.unlink(missing_ok=True)


@pytest.fixture
def offload_disk(tmp_path: Path) -> Iterator[OffloadDisk]:
    """A 32 MiB tmpfs holding the offload directory and the filler."""
    mount = tmp_path / "disk"
    with tmpfs(mount, "32m") as mounted:
        if not mounted:
            pytest.skip("needs a tmpfs mount (root); tests/engine/storage injects ENOSPC instead")
        disk = OffloadDisk(mount / "offload", mount / "filler")
        yield disk
        disk.free()


def _engine(offload_dir: Path, **fields: Any) -> StepLoopClient:
    """The daemon's engine on the demo model, all KV on disk in `offload_dir`."""
    args = EngineArgs.from_cli_args(
        engine_args(policy=ON_DISK, offload_dir=str(offload_dir)), **fields
    )
    return StepLoopClient(
        args, resolve_model_dir(MODEL), ON_DISK, model_name=MODEL, in_process=True
    )


def _series(metrics: str, name: str) -> float | None:
    match = re.search(rf"^{re.escape(name)} (\S+)$", metrics, re.MULTILINE)
    return float(match.group(1)) if match else None


def _metrics(live: LiveServer) -> str:
    with live.http() as http:
        return http.get("/metrics").text


def _prompts(n: int) -> list[str]:
    return [
        f"Item {i} of a list long enough to fill two pages of keys and values:" for i in range(n)
    ]


def _complete(client: openai.OpenAI, prompt: str) -> Any:
    return client.completions.create(
        model=MODEL,
        prompt=prompt,
        max_tokens=MAX_TOKENS,
        temperature=0,
        extra_body={"ignore_eos": True},
    )


def _pause(batch: Any, code: str) -> str | None:
    data = batch.errors.data if batch.errors is not None and batch.errors.data else []
    return next((e.message for e in data if e.code == code), None)


def test_a_disk_that_fills_mid_batch_pauses_the_batch_and_loses_nothing(
    offload_disk: OffloadDisk, make_server: ServerFactory, cold: Any
) -> None:
    """Every KV page on disk; the tmpfs is filled to the last byte while a batch runs: the
    engine does not crash, the batch pauses with `offload_storage_unavailable`, no line is
    charged to the caller, and once the filler is deleted the batch completes with every
    answer equal to the cold run. The series of /metrics exist before the first request."""
    engine = _engine(offload_disk.root, offload_retry_s=0.2)
    live = make_server(engine, storage_retry_s=0.1, batch_concurrency=4)
    metrics = _metrics(live)
    for tier in ("gpu", "cpu", "disk"):
        for name in ("nanoflex_kv_used_pages", "nanoflex_kv_cached_pages"):
            assert _series(metrics, f'{name}{{tier="{tier}"}}') == 0, (name, tier)
    assert (_series(metrics, 'nanoflex_kv_capacity_pages{tier="disk"}') or 0) > 2048 // 16
    for name in ("offload_faults", "kv_cache_failed_pages", "engine_restarts"):
        assert _series(metrics, f"nanoflex_{name}_total") == 0, name

    client = live.openai()
    prompts = _prompts(16)
    lines = greedy_lines(prompts, MAX_TOKENS)
    batch = client.batches.create(
        input_file_id=upload(client, lines), endpoint=URL, completion_window="24h"
    )
    wait_completed(client, batch.id, 2)
    offload_disk.fill()
    wait_for(
        lambda: (
            _pause(client.batches.retrieve(batch.id), "offload_storage_unavailable") is not None
        ),
        60,
    )
    paused = client.batches.retrieve(batch.id)
    assert paused.status == "in_progress", paused
    message = _pause(paused, "offload_storage_unavailable") or ""
    assert "No space left on device" in message and "No line is lost" in message
    assert (_series(_metrics(live), "nanoflex_offload_faults_total") or 0) >= 1
    offload_disk.free()
    batch = wait_batch(client, batch.id, timeout_s=180)
    assert batch.status == "completed" and batch.errors is None, batch
    assert_accounted(client, batch, lines)
    assert batch.error_file_id is None  # nothing charged to the caller
    output = read_lines(client, batch.output_file_id)
    assert [line["response"]["body"]["choices"][0]["text"] for line in output] == cold_texts(
        cold, prompts
    )
    metrics = _metrics(live)
    assert _series(metrics, "nanoflex_engine_restarts_total") == 0  # no crash, no restart
    assert _series(metrics, 'nanoflex_kv_used_pages{tier="disk"}') == 0  # nothing leaked
    assert (
        _complete(client, "and one more").choices[0].text == cold_texts(cold, ["and one more"])[0]
    )


def test_a_full_offload_disk_at_start_is_one_line(
    offload_disk: OffloadDisk, make_server: ServerFactory
) -> None:
    """The disk is full before the daemon starts: the KV pool it can derive holds less than
    one sequence of the context length, so the engine does not start (vLLM refuses such a
    KV cache too) and says what to do, instead of refusing every prompt with a 400."""
    offload_disk.root.mkdir()
    offload_disk.fill(leave_bytes=256 << 10)
    with pytest.raises(RuntimeError, match="the engine did not start") as refused:
        make_server(_engine(offload_disk.root))
    line = str(refused.value)
    assert "the KV cache can hold only" in line and "fewer than the context length 2048" in line
    assert "--disk-mem" in line and "\n" not in line


def test_a_restarted_engine_keeps_the_budgets_it_announced(
    offload_disk: OffloadDisk, make_server: ServerFactory, cold: Any
) -> None:
    """The engine crashes and restarts while the disk is nearly full: it comes up with the
    disk budget and KV capacity of its first start (not 90% of what is free now), so a long
    prompt meets a retryable 503 while the disk is full, never a 400, and is answered once
    space is freed."""
    engine = _engine(offload_disk.root, offload_retry_s=1.0)
    live = make_server(engine)
    assert engine._executor is not None
    first = engine._executor.describe()
    offload_disk.fill(leave_bytes=512 << 10)
    crash = engine._executor.execute

    def crash_once(plan: Any) -> Any:
        engine._executor.execute = crash  # type: ignore[union-attr, method-assign]
        raise RuntimeError("a bug in the engine")

    engine._executor.execute = crash_once  # type: ignore[method-assign]
    client = live.openai()
    with pytest.raises(openai.InternalServerError):  # in flight when it crashed: 503
        _complete(client, "crash")
    wait_for(live.engine.is_ready, 30)
    again = engine._executor.describe()
    assert again.budgets == first.budgets and again.kv_capacity_pages == first.kv_capacity_pages
    assert _series(_metrics(live), "nanoflex_engine_restarts_total") == 1
    long_prompt = " ".join(f"word{i}" for i in range(300))
    with live.http() as http:
        body = {"model": MODEL, "prompt": long_prompt, "max_tokens": 4, "temperature": 0}
        refused = http.post("/v1/completions", json=body)
        ready = http.get("/ready")  # no tier may take KV for the next second
        meanwhile = http.post("/v1/completions", json={**body, "prompt": "short"})
    assert refused.status_code == 503, refused.text
    assert refused.json()["error"]["code"] == "offload_storage_unavailable"
    assert ready.status_code == 503 and "offload storage failed" in ready.json()["detail"]
    assert meanwhile.status_code == 503 and meanwhile.headers["Retry-After"] == "2"
    assert meanwhile.json()["error"]["code"] == "offload_storage_unavailable"
    offload_disk.free()
    wait_for(live.engine.is_ready, 10)  # the disk tier rests 1 s after a fault
    answer = client.completions.create(model=MODEL, prompt=long_prompt, max_tokens=4, temperature=0)
    assert answer.choices[0].text == cold_texts(cold, [long_prompt], 4)[0]


def test_a_damaged_index_is_a_warning_and_a_counter(
    tmp_path: Path, make_server: ServerFactory, caplog: pytest.LogCaptureFixture, cold: Any
) -> None:
    """An index of the wrong shape (`{"pages": []}`) stopped the daemon from starting; now it
    is one warning line, a counter in /metrics, and misses."""
    offload = tmp_path / "offload"
    offload.mkdir()
    (offload / "kv-cache-index.json").write_text(json.dumps({"pages": []}))
    with caplog.at_level(logging.WARNING, logger="nanoflex.engine"):
        live = make_server(_engine(offload))
    warnings = [r.getMessage() for r in caplog.records if "disk cache index" in r.getMessage()]
    assert len(warnings) == 1 and "dropped 1" in warnings[0], warnings
    assert _series(_metrics(live), "nanoflex_kv_cache_index_dropped_entries_total") == 1
    prompt = _prompts(1)[0]
    assert _complete(live.openai(), prompt).choices[0].text == cold_texts(cold, [prompt])[0]


# -- a real `nanoflex serve` on the directory ---------------------------------------------------


def test_one_daemon_per_offload_directory_and_a_killed_one_restarts_at_once(
    tmp_path: Path, daemons: list[Daemon], cold: Any
) -> None:
    """A second daemon on the same --offload-dir is one line and exit 2, before it loads
    anything. kill -9 of the first: its engine process exits at once (it saves the
    disk-cache index as it goes), and a daemon started on the directory right away serves,
    finding that cache."""
    offload, log = tmp_path / "offload", tmp_path / "daemon.log"
    flags = ["--offload-dir", str(offload)]
    first = Daemon(tmp_path / "data", free_port(), log, policy=ON_DISK, extra=flags)
    daemons.append(first)
    prompt = _prompts(1)[0]
    answer = _complete(first.openai(), prompt)
    assert answer.choices[0].text == cold_texts(cold, [prompt])[0]

    second = Daemon(
        tmp_path / "data2",
        free_port(),
        tmp_path / "second.log",
        policy=ON_DISK,
        extra=flags,
        wait=False,
    )
    daemons.append(second)
    assert second.process.wait(timeout=60) == 2
    errors = [x for x in second.log.read_text().splitlines() if "error" in x.lower()]
    assert len(errors) == 1 and errors[0].startswith("nanoflex serve: error: "), errors
    assert f"in use by another nanoflex process (pid {first.process.pid})" in errors[0]

    engine = first.engine_process()
    first.process.send_signal(signal.SIGKILL)
    first.process.wait(timeout=30)
    again = Daemon(tmp_path / "data", free_port(), log, policy=ON_DISK, extra=flags, wait=False)
    daemons.append(again)
    psutil.wait_procs([engine], timeout=10)
    assert not engine.is_running(), "the engine process outlived its daemon"
    again.wait_ready()
    answer = _complete(again.openai(), prompt)
    assert answer.choices[0].text == cold_texts(cold, [prompt])[0]
    assert answer.usage is not None and answer.usage.prompt_tokens_details is not None
    full_pages = (answer.usage.prompt_tokens - 1) // 16
    assert answer.usage.prompt_tokens_details.cached_tokens == 16 * full_pages > 0  # found
    with httpx.Client() as http:
        metrics = http.get(f"{again.url}/metrics").text
    assert _series(metrics, "nanoflex_engine_restarts_total") == 0
