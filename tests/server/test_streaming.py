"""Streamed answers equal whole ones, over a real uvicorn server with the `openai` client.

The engine hands out each choice's text piece by piece (its incremental detokenizer holds
back a character until its last byte and a possible stop string until it is ruled out), and
the daemon streams each piece as it comes: joined, the chunks must be exactly the text of
the same request without `stream`, for every prompt, with stop strings that span tokens and
outputs that hold multi-byte characters.
"""

from __future__ import annotations

from typing import Any

from tests.server.live import MODEL, LiveServer, Reference

PROMPTS = [
    "The quick brown fox",
    "naïve café, 日本語 and 🙂",
    "Ωmega ümlaut ß",
    "¿Qué tal? ñandú",
    "Once upon a time",
    "1 2 3 4",
    "€100 → £",
    "Zürich — Köln",
]
MAX_TOKENS = 12
"""Enough: by 8 tokens every prompt's greedy answer holds a stop string across tokens (the
test needs 4 of them) and one a multi-byte character."""


def spanning_stop(reference: Reference, prompt: str, text: str) -> str | None:
    """A two-character stop string that starts in one token's text and ends in the next's,
    and first occurs there; None if the output has no such place."""
    ids = reference.greedy(prompt, MAX_TOKENS).token_ids
    for k in range(1, len(ids)):
        cut = len(reference.tokenizer.decode(ids[:k]))
        if not text.startswith(reference.tokenizer.decode(ids[:k])) or not 0 < cut < len(text):
            continue
        stop = text[cut - 1 : cut + 1]
        if stop.strip() and text.find(stop) == cut - 1:
            return stop
    return None


def both(live: LiveServer, **body: Any) -> tuple[list[str], list[str]]:
    """(texts without stream, texts of the joined chunks), by choice index."""
    client = live.openai()
    whole = client.completions.create(model=MODEL, **body)
    texts = [c.text for c in sorted(whole.choices, key=lambda c: c.index)]
    streamed = [""] * len(texts)
    for chunk in client.completions.create(model=MODEL, stream=True, **body):
        for choice in chunk.choices:
            streamed[choice.index] += choice.text
    return texts, streamed


def test_streamed_text_equals_the_whole_answer(live: LiveServer, reference: Reference) -> None:
    num_stops, multibyte = 0, False
    for prompt in PROMPTS:
        full = reference.greedy(prompt, MAX_TOKENS).text
        multibyte |= any(ord(c) > 127 for c in full)
        stop = spanning_stop(reference, prompt, full)
        for stops in ([], [stop] if stop else []):
            num_stops += bool(stops)
            texts, streamed = both(
                live, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0, stop=stops or None
            )
            expected = full[: full.find(stops[0])] if stops else full
            assert texts == streamed == [expected], (prompt, stops)
    assert num_stops >= 4, "too few outputs with a stop string across tokens"
    assert multibyte, "no output held a multi-byte character"


def test_streamed_choices_of_many_prompts_equal_the_whole_answer(live: LiveServer) -> None:
    """n > 1 over several prompts, sampled with a seed: every choice's chunks join to its text."""
    body = {"prompt": PROMPTS[:3], "n": 2, "max_tokens": 16, "seed": 5, "temperature": 0.9}
    texts, streamed = both(live, **body, stop=["e ", "ü"])
    assert texts == streamed and len(texts) == 6


def test_streamed_chat_equals_the_whole_answer(live: LiveServer, reference: Reference) -> None:
    client = live.openai()
    messages = [{"role": "user", "content": "Sag mir etwas über Köln 🙂"}]
    full = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=MAX_TOKENS, temperature=0
    )
    text = full.choices[0].message.content or ""
    for stop in (None, text[len(text) // 2 : len(text) // 2 + 2] or None):
        kwargs: dict[str, Any] = {"stop": [stop]} if stop else {}
        whole = client.chat.completions.create(
            model=MODEL, messages=messages, max_tokens=MAX_TOKENS, temperature=0, **kwargs
        )
        chunks = client.chat.completions.create(
            model=MODEL,
            messages=messages,
            max_tokens=MAX_TOKENS,
            temperature=0,
            stream=True,
            **kwargs,
        )
        streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert streamed == whole.choices[0].message.content
        assert streamed == (text[: text.find(stop)] if stop else text)


def test_text_only_chunks_equal_their_rendered_models() -> None:
    """A chunk that carries text alone is encoded from bytes rendered once per choice (the
    text swapped in): byte for byte the chunk pydantic renders, for text that JSON escapes."""
    from server.openai.endpoints.prepared import Prepared
    from server.openai.responses import ChatDelta
    from server.openai.streaming import _Chunks

    texts = ['say "hi"', "back\\slash", "line\nbreak\ttab\r", "\x00\x1f\x7f", "日本語 🙂", ""]
    for is_chat, include_usage in [(False, False), (False, True), (True, False), (True, True)]:
        prep = Prepared(
            *(is_chat, "cmpl-1", 1700000000, 'm "q"', [[1]], [], 1, False, None, True),
            include_usage=include_usage,
        )
        chunks = _Chunks(None, prep)  # type: ignore[arg-type]
        for index in (0, 3):
            for text in texts:
                if is_chat:
                    fast = chunks._text_chunk(index, text, chunks._chat_text)
                    whole = chunks._chat_chunk(
                        index, ChatDelta.model_construct(content=text), None, None
                    )
                else:
                    fast = chunks._text_chunk(index, text, chunks._completion_text)
                    whole = chunks._completion_chunk(index, text, None, None)
                assert fast == whole, (is_chat, include_usage, index, text)
