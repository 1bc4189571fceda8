"""Online endpoints over a real uvicorn server with the official `openai` client (toy engine).

LEAD: switch these to the real demo model once the engine client is wired.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import httpx
from conftest import LiveServer

REPO = Path(__file__).resolve().parents[2]


def test_completion_greedy_and_usage(live: LiveServer) -> None:
    result = live.openai().completions.create(
        model="toy-model", prompt="abc", max_tokens=5, temperature=0
    )
    # toy rule: letter k = 'a' + (len(prompt)=4 incl. BOS + k) % 26
    assert result.choices[0].text == "efghi"
    assert result.choices[0].finish_reason == "length"
    assert result.usage is not None
    assert (result.usage.prompt_tokens, result.usage.completion_tokens) == (4, 5)
    assert result.object == "text_completion" and result.id.startswith("cmpl-")


def test_completion_prompt_forms_n_and_echo(live: LiveServer) -> None:
    client = live.openai()
    result = client.completions.create(
        model="toy-model", prompt=["a", "ab"], max_tokens=2, n=2, temperature=0
    )
    texts = [c.text for c in sorted(result.choices, key=lambda c: c.index)]
    assert texts == ["cd", "cd", "de", "de"]
    result = client.completions.create(
        model="toy-model", prompt=[[1, 100, 101]], max_tokens=1, echo=True, temperature=0
    )
    assert result.choices[0].text == "ab" + "d"


def test_completion_stop_seed_and_logprobs(live: LiveServer) -> None:
    client = live.openai()
    result = client.completions.create(
        model="toy-model", prompt="a", max_tokens=8, stop=["e"], temperature=0
    )
    assert result.choices[0].text == "cd" and result.choices[0].finish_reason == "stop"
    first = client.completions.create(model="toy-model", prompt="a", max_tokens=6, seed=7)
    again = client.completions.create(model="toy-model", prompt="a", max_tokens=6, seed=7)
    assert first.choices[0].text == again.choices[0].text
    result = client.completions.create(
        model="toy-model", prompt="a", max_tokens=2, logprobs=1, temperature=0
    )
    logprobs = result.choices[0].logprobs
    assert logprobs is not None and logprobs.tokens == ["c", "d"]
    assert logprobs.token_logprobs == [-0.5, -0.5]


def test_completion_stream_with_usage(live: LiveServer) -> None:
    stream = live.openai().completions.create(
        model="toy-model",
        prompt="abc",
        max_tokens=4,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == "efgh"
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == 4


def test_stream_ends_with_done(client: httpx.Client) -> None:
    body = {"model": "toy-model", "prompt": "a", "max_tokens": 2, "stream": True}
    with client.stream("POST", "/v1/completions", json=body) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        events = [line for line in response.iter_lines() if line]
    assert events[-1] == "data: [DONE]"
    assert all(e.startswith("data: ") for e in events)


def test_chat_and_chat_stream(live: LiveServer) -> None:
    client = live.openai()
    messages = [{"role": "user", "content": "hi"}]
    result = client.chat.completions.create(
        model="toy-model",
        messages=messages,
        max_tokens=3,
        temperature=0,
    )
    message = result.choices[0].message
    assert message.role == "assistant" and len(message.content or "") == 3
    assert result.object == "chat.completion"
    stream = client.chat.completions.create(
        model="toy-model",
        messages=messages,
        max_tokens=3,
        temperature=0,
        stream=True,
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == message.content
    assert chunks[-1].choices[0].finish_reason == "length"


def test_chat_logprobs(live: LiveServer) -> None:
    result = live.openai().chat.completions.create(
        model="toy-model",
        messages=[{"role": "user", "content": "x"}],
        max_tokens=2,
        logprobs=True,
        top_logprobs=2,
    )
    content = result.choices[0].logprobs.content
    assert content is not None and len(content) == 2 and len(content[0].top_logprobs) == 2


def test_models_health_ready(client: httpx.Client) -> None:
    models = client.get("/v1/models").json()
    assert models["data"][0]["id"] == "toy-model"
    assert client.get("/v1/models/toy-model").status_code == 200
    assert client.get("/health").json() == {"status": "ok"}
    assert client.get("/ready").status_code == 200


def test_engine_down_is_503_and_not_ready(live: LiveServer, client: httpx.Client) -> None:
    live.engine.kill()
    assert client.get("/ready").status_code == 503
    response = client.post(
        "/v1/completions", json={"model": "toy-model", "prompt": "a", "max_tokens": 2}
    )
    assert response.status_code == 503
    assert response.json()["error"]["code"] == "engine_unavailable"
    live.engine.revive()
    assert client.get("/ready").status_code == 200


def test_daemon_never_imports_torch(tmp_path: Path) -> None:
    """The daemon's modules, an app and a tokenizer load without torch (fresh interpreter)."""
    code = f"""
import sys
sys.path.insert(0, {str(Path(__file__).parent)!r})
from server import app, batches, engine_process, serve, tokenizer
from server.settings import ServerSettings
from toy_engine import ToyEngineClient
app.create_app(ServerSettings(data_dir={str(tmp_path)!r}), ToyEngineClient())
bad = sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'transformers'))
assert not bad, bad
"""
    subprocess.run([sys.executable, "-c", code], check=True, cwd=REPO, timeout=120)
