"""The prefix cache seen from outside: `usage.prompt_tokens_details.cached_tokens` on every
route (completions, chat, streamed usage, Batch API lines), the cache's /metrics series, and
a daemon restarted on the same offload directory finding its disk cache."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import openai

from engine.core.engine_args import EngineArgs
from engine.core.model_files import resolve_model_dir
from engine.runtime.step_loop_client import StepLoopClient
from policy import Policy
from tests.server.batch_files import read_lines, upload, wait_batch
from tests.server.live import MODEL, LiveServer, ServerFactory, engine_args

PAGE = 16  # tokens per KV page (policy/prefix.py)


def _engine(offload_dir: Path, policy: Policy, **fields: Any) -> StepLoopClient:
    """The daemon's engine on the demo model, KV spilled into `offload_dir` (ours, so the
    disk cache persists), with engine fields the command line does not expose."""
    args = EngineArgs.from_cli_args(
        engine_args(policy=policy, offload_dir=str(offload_dir)), **fields
    )
    model_dir = resolve_model_dir(MODEL)
    return StepLoopClient(args, model_dir, policy, model_name=MODEL, in_process=True)


def _prompts(live: LiveServer, num: int) -> list[list[int]]:
    """`num` token-id prompts of 34 to 40 tokens: 2 full pages each, no two sharing one."""
    vocab = live.engine.vocab_size
    return [[(7 + 31 * i + 13 * t) % (vocab - 3) + 3 for t in range(34 + i)] for i in range(num)]


def _complete(client: openai.OpenAI, prompt: list[int]) -> tuple[str, int]:
    result = client.completions.create(model=MODEL, prompt=prompt, max_tokens=2, temperature=0)
    assert result.usage is not None and result.usage.prompt_tokens_details is not None
    return result.choices[0].text, result.usage.prompt_tokens_details.cached_tokens or 0


def _series(metrics: str, name: str) -> float:
    """The value of one series (`name` with its labels) in a /metrics text; 0 if absent."""
    match = re.search(rf"^{re.escape(name)} (\S+)$", metrics, re.MULTILINE)
    return float(match.group(1)) if match else 0.0


def test_cached_tokens_on_every_route_and_the_cache_metrics(
    tmp_path: Path, make_server: ServerFactory
) -> None:
    """A gpu pool of 8 pages, a cpu pool of 4: six 2-page prompts push the oldest down to
    cpu and disk; asking again finds them there, loads them back and reports 32 cached
    tokens, with the same text as the first time."""
    capacity = {"gpu": 8, "cpu": 4, "disk": 64}
    engine = _engine(tmp_path / "offload", Policy(), kv_capacity_pages=capacity)
    live = make_server(engine)
    client = live.openai()
    prompts = _prompts(live, 6)
    first = [_complete(client, p) for p in prompts]
    assert [cached for _, cached in first] == [0] * 6
    again = _complete(client, prompts[0])  # the oldest: spilled to disk by now
    assert again == (first[0][0], 2 * PAGE)

    stream = client.completions.create(
        model=MODEL,
        prompt=prompts[1],
        max_tokens=2,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    usage = [chunk.usage for chunk in stream if chunk.usage is not None]
    assert len(usage) == 1 and usage[0].prompt_tokens_details is not None
    assert usage[0].prompt_tokens_details.cached_tokens == 2 * PAGE

    messages: Any = [{"role": "user", "content": "Tell me about pages of keys and values. " * 4}]
    chats = [
        client.chat.completions.create(model=MODEL, messages=messages, max_tokens=2, temperature=0)
        for _ in range(2)
    ]
    details = [c.usage.prompt_tokens_details for c in chats if c.usage is not None]
    assert len(details) == 2 and details[0] is not None and details[1] is not None
    assert details[0].cached_tokens == 0
    num_prompt = chats[1].usage.prompt_tokens if chats[1].usage is not None else 0
    assert details[1].cached_tokens == (num_prompt - 1) // PAGE * PAGE > 0
    assert chats[1].choices[0].message.content == chats[0].choices[0].message.content

    line = (
        '{"custom_id": "c", "method": "POST", "url": "/v1/completions", "body": '
        f'{{"model": "{MODEL}", "prompt": {prompts[2]}, "max_tokens": 2, "temperature": 0}}}}'
    )
    batch = client.batches.create(
        input_file_id=upload(client, [line]), endpoint="/v1/completions", completion_window="24h"
    )
    batch = wait_batch(client, batch.id)
    body = read_lines(client, batch.output_file_id)[0]["response"]["body"]
    assert body["usage"]["prompt_tokens_details"] == {"cached_tokens": 2 * PAGE}
    assert body["choices"][0]["text"] == first[2][0]

    with live.http() as http:
        metrics = http.get("/metrics").text
    queried = sum(len(p) for p in prompts) + len(prompts[0]) + len(prompts[1]) + len(prompts[2])
    assert _series(metrics, "nanoflex_prefix_cache_queries_total") >= queried
    hits = 3 * 2 * PAGE + (num_prompt - 1) // PAGE * PAGE
    assert _series(metrics, "nanoflex_prefix_cache_hits_total") == hits
    page_bytes = engine._executor.describe().page_bytes
    for tier in ("cpu", "disk"):
        spilled = _series(metrics, f'nanoflex_kv_spilled_bytes_total{{tier="{tier}"}}')
        assert spilled > 0 and spilled % page_bytes == 0, tier
    assert _series(metrics, 'nanoflex_kv_loaded_bytes_total{tier="disk"}') >= 2 * page_bytes
    assert _series(metrics, 'nanoflex_prefix_cache_hit_pages_total{tier="disk"}') >= 2
    assert _series(metrics, 'nanoflex_kv_cached_pages{tier="gpu"}') > 0
    assert "nanoflex_kv_evicted_pages_total" in metrics


def test_a_restarted_daemon_finds_its_disk_cache(
    tmp_path: Path, make_server: ServerFactory
) -> None:
    """KV homed on disk in an offload directory of ours: the first daemon computes the
    prompt, a second one on the same directory (a fresh engine) reuses its pages."""
    offload, policy = tmp_path / "offload", Policy(kv_frac=(0.0, 0.0, 1.0))
    first = make_server(_engine(offload, policy))
    prompt = _prompts(first, 1)[0]
    text, cached = _complete(first.openai(), prompt)
    assert cached == 0
    first.stop()
    assert (offload / "kv-cache-index.json").is_file()

    second = make_server(_engine(offload, policy))
    assert _complete(second.openai(), prompt) == (text, 2 * PAGE)
    with second.http() as http:
        metrics = http.get("/metrics").text
    assert _series(metrics, 'nanoflex_prefix_cache_hit_pages_total{tier="disk"}') == 2
