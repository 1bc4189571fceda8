"""GET /metrics (per-app registry) and the torch-free `Tokenizer`."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
from tokenizers import Tokenizer as RawTokenizer
from tokenizers import models, pre_tokenizers

from engine.core.engine_args import EngineArgs
from engine.core.model_files import resolve_model_dir
from engine.core.tokenizer import Tokenizer
from engine.loading.demo import demo_model_dir
from engine.runtime.step_loop_client import StepLoopClient
from policy import Policy
from tests.server.live import MODEL, LiveServer, Reference, ServerFactory


def test_metrics_endpoint(
    live: LiveServer, client: httpx.Client, make_server: ServerFactory
) -> None:
    body = {"model": MODEL, "prompt": "abc", "max_tokens": 3, "ignore_eos": True}
    num_prompt = len(live.engine.encode("abc"))
    assert client.post("/v1/completions", json=body).status_code == 200
    response = client.get("/metrics")
    assert response.status_code == 200 and response.headers["content-type"].startswith("text/plain")
    text = response.text
    for series in (
        "nanoflex_requests_waiting",
        "nanoflex_requests_running",
        f"nanoflex_prompt_tokens_total {float(num_prompt)}",
        "nanoflex_generation_tokens_total 3.0",
        "nanoflex_step_seconds_bucket",
        "nanoflex_batch_size_bucket",
        'nanoflex_tier_bytes{tier="gpu"}',  # weights resident on the compute device (CPU here)
        "nanoflex_time_to_first_token_seconds_count 1.0",
        "nanoflex_e2e_request_latency_seconds_count 1.0",
        'nanoflex_requests_finished_total{finish_reason="length"} 1.0',
        # prefill + 2 decodes, one sequence each: the test server's engine computes on the
        # CPU in this process, so it does not plan ahead (EngineArgs.plans_ahead) and no
        # step is planned before the stop is known
        "nanoflex_batch_size_count 3.0",
        "nanoflex_batch_size_sum 3.0",
    ):
        assert series in text, series
    other = make_server()  # a second app in the same process has its own registry
    with other.http() as c:
        assert "nanoflex_prompt_tokens_total 0.0" in c.get("/metrics").text


def _write_tokenizer(directory: Path) -> None:
    vocab = {"<s>": 0, "</s>": 1, "<unk>": 2, "hello": 3, "world": 4, "<|user|>": 5, "!": 6}
    raw = RawTokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    raw.pre_tokenizer = pre_tokenizers.Whitespace()
    raw.add_special_tokens(["<s>", "</s>", "<|user|>", "<|assistant|>"])
    raw.save(str(directory / "tokenizer.json"))
    template = (
        "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|> {{ m['content'] }} "
        "{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}"
    )
    config = {
        "bos_token": "<s>",
        "eos_token": {"content": "</s>"},
        "add_bos_token": True,
        "chat_template": template,
    }
    (directory / "tokenizer_config.json").write_text(json.dumps(config))


def test_tokenizer_without_transformers(tmp_path: Path) -> None:
    _write_tokenizer(tmp_path)
    tokenizer = Tokenizer(tmp_path)
    assert tokenizer.encode("hello world") == [0, 3, 4]
    assert tokenizer.decode([0, 3, 4, 1]) == "hello world"
    assert tokenizer.eos_token_id == 1 and tokenizer.vocab_size == 8
    text = tokenizer.render_chat([{"role": "user", "content": "hello"}])
    assert text == "<s><|user|> hello <|assistant|>"
    # the template writes BOS itself: encoded without adding a second one
    assert tokenizer.apply_chat_template([{"role": "user", "content": "hello"}]) == [0, 5, 3, 7]


def test_daemon_tokenizer_equals_transformers(reference: Reference) -> None:
    """The daemon's torch-free tokenizer agrees with transformers' on the demo model."""
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(demo_model_dir())
    for text in ("hello world", "The quick brown fox", " spaces  and\nnewlines", "ünïcödé"):
        assert reference.tokenizer.encode(text) == hf.encode(text)
        ids = reference.tokenizer.encode(text)
        assert reference.tokenizer.decode(ids) == hf.decode(ids, skip_special_tokens=True)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    text = hf.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert reference.tokenizer.render_chat(messages) == text
    expected = hf.encode(text, add_special_tokens=False)
    assert reference.tokenizer.apply_chat_template(messages) == expected


def test_preemptions_are_counted_and_outputs_survive_them(
    make_server: ServerFactory, reference: Reference
) -> None:
    """A small KV pool and an admission estimate taught by short requests: long ones are
    admitted, outgrow the pool, are preempted and recomputed; /metrics counts it and every
    answer equals the offline engine's."""
    args = EngineArgs(model=MODEL, policy=Policy(), device="cpu", kv_capacity_pages={"gpu": 12})
    model_dir = resolve_model_dir(MODEL)
    engine = StepLoopClient(args, model_dir, Policy(), model_name=MODEL, in_process=True)
    live = make_server(engine)
    client = live.openai()
    for i in range(4):  # teach the estimate: 1 token
        client.completions.create(model=MODEL, prompt=f"short {i}", max_tokens=1, temperature=0)
    prompts = [f"a longer request number {i} that keeps going" for i in range(6)]

    def ask(prompt: str) -> str:
        done = client.completions.create(model=MODEL, prompt=prompt, max_tokens=40, temperature=0)
        return done.choices[0].text

    with ThreadPoolExecutor(6) as pool:
        answers = list(pool.map(ask, prompts))
    assert answers == [out.text for out in reference.greedy_many(prompts, 40)]
    metrics = live.http().get("/metrics").text
    line = next(x for x in metrics.splitlines() if x.startswith("nanoflex_preemptions_total"))
    assert float(line.split()[-1]) > 0, line
