"""The `logprobs` objects of completions and chat, built from the engine's `TokenLogprobs`."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from server.openai.responses import ChatLogprobs, CompletionLogprobs, TokenLogprob, TopLogprob

Decode = Callable[[Sequence[int]], str]


def _entry(token_id: int, entry: Any) -> tuple[float, list[tuple[int, float]]]:
    """(chosen logprob, top alternatives) from a TokenLogprobs or a vLLM dict[id, Logprob]."""
    if hasattr(entry, "top"):
        return float(entry.logprob), [(int(t), float(lp)) for t, lp in entry.top]
    items = [(int(t), float(getattr(lp, "logprob", lp))) for t, lp in entry.items()]
    chosen = dict(items).get(token_id, float("-inf"))
    top = sorted(((t, lp) for t, lp in items), key=lambda x: -x[1])
    return chosen, top


def _keyed(name: Decode, top: list[tuple[int, float]]) -> dict[str, float]:
    """A completions `top_logprobs` entry: each alternative under its text, best first; one
    whose text an alternative ranked above it already has (two pieces of one character,
    say) under "token_id:<id>" (vLLM's spelling), so that no alternative is lost."""
    keyed: dict[str, float] = {}
    for token_id, logprob in top:
        key = name([token_id])
        if key in keyed:
            key = f"token_id:{token_id}"
        keyed[key] = logprob
    return keyed


def completion_logprobs(
    decode: Decode,
    token_ids: Sequence[int],
    entries: Sequence[Any],
    num_top: int,
    text_offset: int,
    prompt_ids: Sequence[int] = (),
    prompt_entries: Sequence[Any] | None = None,
    names: Decode | None = None,
) -> CompletionLogprobs:
    """The legacy completions `logprobs` object. Echoed prompt tokens carry the engine's
    prompt logprobs (`prompt_entries[i - 1]` for position i); position 0 has none (null).
    `names` names the tokens and the top-logprob keys (default: their text, `decode`);
    text offsets always count the text."""
    name = names or decode
    tokens: list[str] = []
    token_logprobs: list[float | None] = []
    top_logprobs: list[dict[str, float] | None] = []
    offsets: list[int] = []
    offset = text_offset

    def append(token_id: int, entry: Any) -> None:
        nonlocal offset
        piece = decode([token_id])
        tokens.append(name([token_id]))
        offsets.append(offset)
        offset += len(piece)
        if entry is None:
            token_logprobs.append(None)
            top_logprobs.append(None)
            return
        chosen, top = _entry(token_id, entry)
        token_logprobs.append(chosen)
        top_logprobs.append(_keyed(name, top[:num_top]))

    known = list(prompt_entries or [])
    for position, token_id in enumerate(prompt_ids):
        append(token_id, known[position - 1] if 0 < position <= len(known) else None)
    for token_id, entry in zip(token_ids, entries):
        append(token_id, entry)
    return CompletionLogprobs(
        tokens=tokens, token_logprobs=token_logprobs, top_logprobs=top_logprobs, text_offset=offsets
    )


def chat_logprobs(
    decode: Decode, token_ids: Sequence[int], entries: Sequence[Any], num_top: int
) -> ChatLogprobs:
    """The chat `logprobs` object: {"content": [{token, logprob, bytes, top_logprobs}]}."""
    content = []
    for token_id, entry in zip(token_ids, entries):
        chosen, top = _entry(token_id, entry)
        piece = decode([token_id])
        alternatives = [
            TopLogprob(token=decode([t]), logprob=lp, bytes=list(decode([t]).encode()))
            for t, lp in top[:num_top]
        ]
        content.append(
            TokenLogprob(
                token=piece, logprob=chosen, bytes=list(piece.encode()), top_logprobs=alternatives
            )
        )
    return ChatLogprobs(content=content)
