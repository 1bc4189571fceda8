"""gpt-oss's harmony format: the published chat template renders as transformers renders it,
and the analysis and final channels come apart (reasoning_content, content) in whole and
streamed answers, over a real daemon on loopback.

The model is a tiny random gpt-oss whose tokenizer is the demo model's with harmony's markers
added as special tokens (`<|start|>`, `<|channel|>`, `<|message|>`, `<|return|>`, `<|call|>`,
`<|constrain|>`; the demo's `<|end|>` is one already) and the chat template gpt-oss publishes
(tests/fixtures/gpt-oss/chat_template.jinja: openai/gpt-oss-20b's chat_template.jinja as of
its revision "Update chat_template.jinja (#94)"). Its weights are random, so its answers are
made harmony by a grammar that spells the format with the special tokens themselves, as a
trained model writes it; the engine generates them token by token and the server reads them.
"""

from __future__ import annotations

import json
import re
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from engine.core.tokenizer import ChatOptions, Tokenizer
from engine.loading.demo import demo_model_dir
from server.http.settings import ServerSettings
from server.openai.harmony import HarmonySplitter
from server.openai.reasoning import HARMONY, parser_for_template, split_reasoning
from tests.engine.tiny_models import TINY_CONFIGS, build_from_spec
from tests.server.live import LiveServer, build_engine_client, engine_args, start_server
from tests.server.test_tools import TIME, TOOLS, chat

TEMPLATE = Path(__file__).parents[1] / "fixtures" / "gpt-oss" / "chat_template.jinja"
MARKERS = ("<|start|>", "<|channel|>", "<|message|>", "<|return|>", "<|call|>", "<|constrain|>")
HARMONY_ANSWER = (
    'start: <|channel|> "analysis" <|message|> /[a-z ]{3,12}/ <|end|> <|start|> "assistant" '
    '<|channel|> "final" <|message|> ("yes" | "no")'
)
"""An answer thinking first, in harmony's special tokens (a Lark grammar applies as it is)."""


def harmony_tokenizer(dest: Path) -> Path:
    """The demo tokenizer with harmony's markers as special tokens and gpt-oss's published
    chat template, written into `dest`; <|return|> ends an answer."""
    from tokenizers import AddedToken
    from tokenizers import Tokenizer as HFTokenizer

    dest.mkdir(parents=True, exist_ok=True)
    tokenizer = HFTokenizer.from_file(str(demo_model_dir() / "tokenizer.json"))
    tokenizer.add_special_tokens([AddedToken(m, special=True, normalized=False) for m in MARKERS])
    tokenizer.save(str(dest / "tokenizer.json"))
    config = json.loads((demo_model_dir() / "tokenizer_config.json").read_text())
    config.pop("chat_template")
    config["eos_token"] = "<|return|>"
    (dest / "tokenizer_config.json").write_text(json.dumps(config))
    shutil.copy(TEMPLATE, dest / "chat_template.jinja")
    return dest


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random gpt-oss with the harmony tokenizer."""
    dest = harmony_tokenizer(tmp_path_factory.mktemp("gpt-oss") / "model")
    tokenizer = Tokenizer(dest)
    end = tokenizer.token_to_id("<|return|>")
    spec = {**TINY_CONFIGS["gpt_oss"], "vocab_size": tokenizer.vocab_size}
    build_from_spec(spec, dest, eos_token_id=end)
    return dest


@pytest.fixture(scope="module")
def live(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    engine = build_engine_client(engine_args(model=str(model_dir)))
    server = start_server(ServerSettings(data_dir=tmp_path_factory.mktemp("data")), engine)
    yield server
    server.stop()


CHATS: list[tuple[list[dict[str, Any]], dict[str, Any]]] = [
    ([{"role": "user", "content": "Weather in Paris?"}], {}),
    (
        [
            {"role": "system", "content": "Answer briefly."},
            {"role": "user", "content": "Time?"},
            {"role": "assistant", "content": "It is noon."},
            {"role": "user", "content": "And in CET?"},
        ],
        {"reasoning_effort": "high"},
    ),
    (
        [
            {"role": "user", "content": "Time in CET?"},
            {
                "role": "assistant",
                "tool_calls": [
                    {
                        "type": "function",
                        "function": {"name": "get_time", "arguments": {"zone": "CET"}},
                    }
                ],
            },
            {"role": "tool", "content": "12:00"},
        ],
        {
            "tools": [
                {**t, "function": {**t["function"], "description": "Look it up."}} for t in TOOLS
            ]
        },
    ),
]
"""(messages, options): a user turn; a developer message, an earlier answer and the
reasoning effort; a tool call and its result, with tools described (the template reads each
one's description)."""


@pytest.mark.parametrize(("messages", "options"), CHATS, ids=["user", "multi-turn", "tools"])
def test_published_template_renders_as_transformers_renders_it(
    tmp_path: Path, messages: list[dict[str, Any]], options: dict[str, Any]
) -> None:
    from transformers import PreTrainedTokenizerFast

    dest = harmony_tokenizer(tmp_path / "tokenizer")
    assert parser_for_template(TEMPLATE.read_text()) == HARMONY
    theirs = PreTrainedTokenizerFast(
        tokenizer_file=str(dest / "tokenizer.json"), chat_template=TEMPLATE.read_text()
    ).apply_chat_template(messages, add_generation_prompt=True, tokenize=False, **options)
    tools = options.pop("tools", None)
    ours = Tokenizer(dest).render_chat(messages, ChatOptions(tools=tools, template_kwargs=options))
    assert ours == theirs
    assert ours.startswith("<|start|>system<|message|>") and ours.endswith("<|start|>assistant")


ANSWERS = [
    (
        "<|channel|>analysis<|message|>Let me <think>.<|end|><|start|>assistant<|channel|>final"
        "<|message|>Paris <b>is</b> sunny.<|return|>",
        "Let me <think>.",
        "Paris <b>is</b> sunny.",
    ),
    ("<|channel|>final<|message|>Paris.<|return|>", None, "Paris."),
    ('{"zone": "UTC"}', None, '{"zone": "UTC"}'),  # not harmony (a constrained answer): content
    ("<|channel|>analysis<|message|>cut short by max_tok", "cut short by max_tok", ""),
    (
        "<|channel|>commentary<|message|>Checking.<|end|><|start|>assistant<|channel|>"
        "analysis<|message|>ok<|end|><|start|>assistant<|channel|>final<|message|>Done<|retu",
        "ok",
        "Checking.Done<|retu",
    ),
    ("<|channel|>analysis<|message|>x<|end|><|start|>assistant<|channel|>fin", "x", ""),
]
"""(answer text with its markers, reasoning_content, content): both channels (markup and a
`<` in each); final only; no harmony; cut in the analysis; a commentary preamble and an end
marker cut short; a header cut short (dropped)."""


@pytest.mark.parametrize(("text", "reasoning", "content"), ANSWERS)
def test_channels_come_apart_whole_and_a_character_at_a_time(
    text: str, reasoning: str | None, content: str
) -> None:
    assert split_reasoning(HARMONY, text) == (reasoning, content)
    splitter = HarmonySplitter()
    pieces = [splitter.feed(c) for c in text] + [splitter.finish()]
    assert "".join(r for r, _ in pieces) == (reasoning or "")
    assert "".join(c for _, c in pieces) == content


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_server_splits_the_analysis_channel_from_the_final_one(
    live: LiveServer, stream: bool
) -> None:
    """The template's own parser (none given): the answer's analysis message is
    reasoning_content, its final message the content, no marker in either."""
    client, served = live.openai(), live.state.serving.model_name
    grammar = {"grammar": HARMONY_ANSWER}
    answer = chat(client, stream, model=served, structured_outputs=grammar, max_tokens=30)
    message = answer["message"]
    assert message["content"] in ("yes", "no")
    assert re.fullmatch("[a-z ]{3,12}", message["reasoning_content"])
    assert answer["finish_reason"] == "stop"


def test_special_tokens_kept_on_request(live: LiveServer) -> None:
    """skip_special_tokens (vLLM's): false keeps harmony's markers in a completion's text,
    the default leaves them out."""
    grammar = {"grammar": 'start: <|channel|> "final" <|message|> ("yes" | "no")'}
    client, served = live.openai(), live.state.serving.model_name

    def text(**extra: Any) -> str:
        extra["structured_outputs"] = grammar
        done = client.completions.create(
            model=served, prompt="Hi", max_tokens=8, temperature=0, extra_body=extra
        )
        return done.choices[0].text

    assert re.fullmatch(r"<\|channel\|>final<\|message\|>(yes|no)", text(skip_special_tokens=False))
    assert re.fullmatch("final(yes|no)", text())


def test_a_constraint_applies_to_the_final_channel() -> None:
    """A json_schema (or choice, regex) on a harmony model holds the final message: any
    analysis message first, then the final channel's header, then the constrained answer
    (llguidance, the engine's matcher, on the harmony tokenizer)."""
    from llguidance import LLMatcher, LLTokenizer

    from engine.core.structured import StructuredOutput, after_harmony_analysis

    dest = harmony_tokenizer(Path(__file__).parent / ".harmony-tokenizer")
    try:
        tokenizer = Tokenizer(dest)
        vocab = (dest / "tokenizer.json").read_text()
        lltokenizer = LLTokenizer(vocab, n_vocab=tokenizer.vocab_size)
    finally:
        shutil.rmtree(dest)
    spec = StructuredOutput("json", json.dumps({**TIME, "additionalProperties": False}))
    grammar = after_harmony_analysis(spec).grammar

    def accepts(text: str) -> bool:
        matcher = LLMatcher(lltokenizer, grammar, log_level=0)
        ids = tokenizer.encode(text, add_special_tokens=False)
        return bool(matcher.consume_tokens(ids)) and matcher.is_accepting()

    final = '<|channel|>final<|message|>{"zone": "CET"}'
    assert accepts(f"<|channel|>analysis<|message|>UTC or <CET>?<|end|><|start|>assistant{final}")
    assert accepts(final)
    assert not accepts('<|channel|>final<|message|>{"zone": "GMT"}')
    assert not accepts('{"zone": "UTC"}')  # no final channel
