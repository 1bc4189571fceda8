"""Online endpoints over a real uvicorn server with the official `openai` client, on the real
engine (demo model): greedy output equals the offline `engine.LLM` for the same token ids."""

from __future__ import annotations

import math
import subprocess
import sys
from pathlib import Path

import httpx

from engine.core.sampling_params import SamplingParams
from engine.runtime.step_loop_client import build_engine_client
from policy import Policy
from policy.search import GPU_BATCH_SIZES, NUM_GPU_BATCHES
from tests.server.live import MODEL, LiveServer, Reference, ServerFactory, engine_args

REPO = Path(__file__).resolve().parents[2]
PROMPT = "The quick brown fox"


def test_completion_greedy_equals_offline_engine(live: LiveServer, reference: Reference) -> None:
    result = live.openai().completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0
    )
    expected = reference.greedy(PROMPT, 12)
    choice = result.choices[0]
    assert choice.text == expected.text and choice.text
    assert choice.finish_reason == expected.finish_reason
    assert result.usage is not None
    assert result.usage.prompt_tokens == len(reference.tokenizer.encode(PROMPT))
    assert result.usage.completion_tokens == len(expected.token_ids)
    assert result.usage.total_tokens == result.usage.prompt_tokens + len(expected.token_ids)
    assert result.object == "text_completion" and result.id.startswith("cmpl-")
    assert result.model == MODEL


def test_daemon_runs_the_largest_block_the_search_can_return(
    make_server: ServerFactory, reference: Reference
) -> None:
    """policy.search may return 1024 x 32; the daemon starts with it and answers."""
    largest = Policy(gpu_batch_size=GPU_BATCH_SIZES[-1], num_gpu_batches=NUM_GPU_BATCHES[-1])
    live = make_server(build_engine_client(engine_args(policy=largest)))
    result = live.openai().completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=5, temperature=0
    )
    assert result.choices[0].text == reference.greedy(PROMPT, 5).text


def test_completion_prompt_forms_n_and_echo(live: LiveServer, reference: Reference) -> None:
    client = live.openai()
    prompts = ["Once upon", "a time there"]
    result = client.completions.create(
        model=MODEL, prompt=prompts, max_tokens=6, n=2, temperature=0
    )
    texts = [c.text for c in sorted(result.choices, key=lambda c: c.index)]
    expected = [out.text for out in reference.greedy_many(prompts, 6)]
    assert texts == [expected[0], expected[0], expected[1], expected[1]]
    assert result.usage is not None
    assert result.usage.prompt_tokens == sum(len(reference.tokenizer.encode(p)) for p in prompts)
    token_ids = [1, 100, 101, 102]
    result = client.completions.create(
        model=MODEL, prompt=[token_ids], max_tokens=4, echo=True, temperature=0
    )
    generated = reference.greedy(token_ids, 4).text
    assert result.choices[0].text == reference.tokenizer.decode(token_ids) + generated


def test_echo_with_logprobs_scores_the_prompt(live: LiveServer, reference: Reference) -> None:
    """OpenAI's legacy echo + logprobs: the prompt's tokens carry logprobs (the first none)."""
    token_ids = [1, 100, 101, 102, 103]
    result = live.openai().completions.create(
        model=MODEL, prompt=[token_ids], max_tokens=3, echo=True, logprobs=2, temperature=0
    )
    lp = result.choices[0].logprobs
    assert lp is not None and lp.token_logprobs is not None and lp.top_logprobs is not None
    assert len(lp.token_logprobs) == len(token_ids) + 3
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    expected = reference.llm.generate(
        [token_ids], SamplingParams(max_tokens=3, temperature=0, logprobs=2, echo=True)
    )[0]
    assert expected.prompt_logprobs is not None
    for position in range(1, len(token_ids)):
        got = lp.token_logprobs[position]
        assert got is not None
        assert abs(got - expected.prompt_logprobs[position - 1].logprob) < 1e-5
        assert len(lp.top_logprobs[position] or {}) == 2
    generated = lp.token_logprobs[len(token_ids) :]
    assert [round(x or 0, 5) for x in generated] == [
        round(e.logprob, 5) for e in expected.outputs[0].logprobs or []
    ]


def test_completion_stop_string(live: LiveServer, reference: Reference) -> None:
    full = reference.greedy(PROMPT, 16).text
    stop = full[len(full) // 2 : len(full) // 2 + 3]
    assert stop.strip(), f"pick another prompt: {full!r}"
    result = live.openai().completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=16, stop=[stop], temperature=0
    )
    choice = result.choices[0]
    assert choice.text == full[: full.index(stop)]
    assert choice.finish_reason == "stop"


def test_many_stop_strings_and_twenty_logprobs(live: LiveServer, reference: Reference) -> None:
    """What evaluation harnesses send: every `until` string of a task (more than OpenAI's 4)
    and up to 20 logprobs (vLLM's cap)."""
    full = reference.greedy(PROMPT, 16).text
    stop = full[len(full) // 2 : len(full) // 2 + 3]
    never = [f"<never {i}>" for i in range(9)]
    result = live.openai().completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=16, stop=[*never, stop], temperature=0, logprobs=20
    )
    choice = result.choices[0]
    assert choice.text == full[: full.index(stop)] and choice.finish_reason == "stop"
    assert choice.logprobs is not None and choice.logprobs.top_logprobs
    # 20 ranked ids; ids whose text is the same share one key of this dict (OpenAI's shape)
    assert all(10 <= len(top) <= 20 for top in choice.logprobs.top_logprobs)


def test_seeded_sampling_repeats(live: LiveServer) -> None:
    client = live.openai()
    runs = [
        client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, seed=7)
        for _ in range(2)
    ]
    assert runs[0].choices[0].text == runs[1].choices[0].text


def test_completion_logprobs(live: LiveServer, reference: Reference) -> None:
    result = live.openai().completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=5, logprobs=3, temperature=0
    )
    logprobs = result.choices[0].logprobs
    expected = reference.greedy(PROMPT, 5)
    assert logprobs is not None and logprobs.tokens is not None
    assert logprobs.token_logprobs is not None and logprobs.top_logprobs is not None
    assert "".join(logprobs.tokens) == expected.text
    assert len(logprobs.token_logprobs) == len(expected.token_ids) == 5
    for chosen, top in zip(logprobs.token_logprobs, logprobs.top_logprobs, strict=True):
        assert chosen <= 0 and 1 <= len(top) <= 3
        assert math.isclose(chosen, max(top.values()), abs_tol=1e-4)  # greedy took the best


def test_completion_stream_equals_non_stream(live: LiveServer) -> None:
    client = live.openai()
    whole = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=10, temperature=0)
    stream = client.completions.create(
        model=MODEL,
        prompt=PROMPT,
        max_tokens=10,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    deltas = [c.choices[0].text for c in chunks if c.choices]
    assert len(deltas) > 1 and "".join(deltas) == whole.choices[0].text
    assert chunks[-1].choices == [] and chunks[-1].usage == whole.usage


def test_stream_ends_with_done(shared_client: httpx.Client) -> None:
    body = {"model": MODEL, "prompt": "a", "max_tokens": 2, "stream": True}
    with shared_client.stream("POST", "/v1/completions", json=body) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        events = [line for line in response.iter_lines() if line]
    assert events[-1] == "data: [DONE]"
    assert all(e.startswith("data: ") for e in events)


def test_chat_and_chat_stream(live: LiveServer, reference: Reference) -> None:
    client = live.openai()
    messages = [{"role": "user", "content": "Say hello"}]
    result = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=8, temperature=0
    )
    prompt_ids = reference.chat_ids([{"role": "user", "content": "Say hello"}])
    expected = reference.greedy(prompt_ids, 8)
    message = result.choices[0].message
    assert message.role == "assistant" and message.content == expected.text
    assert result.object == "chat.completion"
    assert result.usage is not None and result.usage.prompt_tokens == len(prompt_ids)
    stream = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=8, temperature=0, stream=True
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == message.content
    assert chunks[-1].choices[0].finish_reason == expected.finish_reason


def test_chat_logprobs(live: LiveServer) -> None:
    result = live.openai().chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "x"}],
        max_tokens=3,
        logprobs=True,
        top_logprobs=2,
        extra_body={"ignore_eos": True},
    )
    logprobs = result.choices[0].logprobs
    assert logprobs is not None and logprobs.content is not None
    assert len(logprobs.content) == 3
    assert all(len(entry.top_logprobs) == 2 for entry in logprobs.content)
    assert "".join(entry.token for entry in logprobs.content) == result.choices[0].message.content


def test_models_health_ready(shared_client: httpx.Client) -> None:
    models = shared_client.get("/v1/models").json()
    assert models["data"][0]["id"] == MODEL
    assert models["data"][0]["max_model_len"] == 2048
    assert shared_client.get(f"/v1/models/{MODEL}").status_code == 200
    assert shared_client.get("/health").json() == {"status": "ok"}
    assert shared_client.get("/ready").json() == {"status": "ready", "model": MODEL}


def test_daemon_never_imports_torch(tmp_path: Path) -> None:
    """Every daemon module, the `serve` command's engine client (demo model, built in a child)
    and the app load without torch or transformers, and without ray (server/scale_out's
    modules included: they import it only when called)."""
    policy = tmp_path / "policy.json"
    policy.write_text(Policy().to_json())
    code = f"""
import importlib, pkgutil, sys
import server
from server.http.app import create_app
from server.cli import build_parser
from engine.runtime.step_loop_client import build_engine_client
from server.http.settings import ServerSettings
for module in pkgutil.walk_packages(server.__path__, "server."):
    importlib.import_module(module.name)
argv = ["serve", "--model", "nanoflex-demo", "--device", "cpu", "--policy", {str(policy)!r}]
args = build_parser("serve").parse_args(argv)
create_app(ServerSettings(data_dir={str(tmp_path)!r}), build_engine_client(args))
bad = sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'transformers', 'ray'))
assert not bad, bad
"""
    subprocess.run([sys.executable, "-c", code], check=True, cwd=REPO, timeout=120)


def test_tokenize_and_detokenize_use_the_served_tokenizer(
    shared_client: httpx.Client, reference: Reference
) -> None:
    """vLLM's /tokenize and /detokenize, so that a harness counts and cuts prompts with the
    served tokenizer: the ids a completion or chat request gets, and their text back."""
    ids = reference.tokenizer.encode(PROMPT)
    got = shared_client.post("/tokenize", json={"model": MODEL, "prompt": PROMPT}).json()
    assert got["tokens"] == ids and got["count"] == len(ids) and got["max_model_len"] > 0
    bare = shared_client.post(
        "/tokenize", json={"prompt": PROMPT, "add_special_tokens": False}
    ).json()
    assert bare["tokens"] == reference.tokenizer.encode(PROMPT, add_special_tokens=False)
    messages = [{"role": "user", "content": "Hello there"}]
    chat = shared_client.post("/tokenize", json={"messages": messages}).json()
    assert chat["tokens"] == reference.chat_ids(messages)
    text = shared_client.post("/detokenize", json={"model": MODEL, "tokens": ids}).json()
    assert text == {"prompt": reference.tokenizer.decode(ids)}
    completion = shared_client.post(
        "/v1/completions", json={"model": MODEL, "prompt": PROMPT, "max_tokens": 1}
    ).json()
    assert completion["usage"]["prompt_tokens"] == got["count"]


def test_tokenize_errors_are_openai_envelopes(shared_client: httpx.Client) -> None:
    cases = [
        ("/tokenize", {"prompt": "x", "messages": [{"role": "user", "content": "y"}]}, 400),
        ("/tokenize", {}, 400),
        ("/tokenize", {"prompt": "x", "model": "no-such-model"}, 404),
        ("/tokenize", {"prompt": 5}, 400),
        ("/detokenize", {"tokens": [10**9]}, 400),
        ("/detokenize", {"tokens": [-1]}, 400),
        ("/detokenize", {"tokens": [1], "frobnicate": 1}, 400),
    ]
    for path, body, status in cases:
        response = shared_client.post(path, json=body)
        assert response.status_code == status, (path, body, response.text)
        assert response.json()["error"]["type"] in {"invalid_request_error", "not_found_error"}


def test_logprobs_can_name_tokens_by_id(live: LiveServer, reference: Reference) -> None:
    """vLLM's `return_tokens_as_token_ids`: top logprobs keyed "token_id:<id>", so that tokens
    with the same text no longer share a key: all 20 of them stay, the text does not change."""
    client = live.openai()
    ask = dict(model=MODEL, prompt=PROMPT, max_tokens=4, temperature=0, logprobs=20)
    by_text = client.completions.create(**ask).choices[0]  # type: ignore[call-overload]
    by_id = client.completions.create(  # type: ignore[call-overload]
        **ask, extra_body={"return_tokens_as_token_ids": True}
    ).choices[0]
    assert by_id.text == by_text.text == reference.greedy(PROMPT, 4).text
    lp = by_id.logprobs
    assert lp is not None and lp.tokens is not None and lp.top_logprobs is not None
    ids = reference.greedy(PROMPT, 4).token_ids
    assert lp.tokens == [f"token_id:{t}" for t in ids]
    for token, top in zip(lp.tokens, lp.top_logprobs, strict=True):
        assert len(top) == 20 and all(k.startswith("token_id:") for k in top)
        assert token in top  # greedy took one of the top 20
