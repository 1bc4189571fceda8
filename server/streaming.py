"""Server-sent events for `stream: true`: delta chunks, an optional usage chunk, `[DONE]`."""

from __future__ import annotations

from collections.abc import AsyncGenerator
from contextlib import aclosing
from typing import Any

from engine.core.outputs import ChoiceAccumulator, SequenceDelta
from server.errors import APIError
from server.responses import chat_logprobs, completion_logprobs, envelope, sse, usage
from server.serving import Prepared, Serving


def _delta_choice(
    serving: Serving,
    prep: Prepared,
    choice: ChoiceAccumulator,
    delta: SequenceDelta,
    text_offset: int | None,
) -> dict[str, Any] | None:
    """The chunk choice for what `choice` just gained (`delta`); None: nothing new.
    `text_offset`: where its text starts in the choice's streamed text; None for the first
    chunk, which carries the echoed prompt."""
    decode, names = serving.engine.decode, serving.token_names(prep)
    text, new_ids = delta.new_text, delta.new_token_ids
    entries = delta.new_logprobs or []
    prefix_ids: list[int] = []
    if text_offset is None and prep.echo:
        prefix_ids = prep.prompts[prep.prompt_index(choice)]
        text = decode(prefix_ids) + text
    elif text_offset is not None and not text and not delta.finished and not new_ids:
        return None
    if prep.is_chat:
        logprobs = None
        if prep.num_logprobs is not None and new_ids:
            logprobs = chat_logprobs(names, new_ids, entries, prep.num_logprobs)
        content: dict[str, Any] = {"content": text} if text or not delta.finished else {}
        return {
            "index": choice.index,
            "delta": content,
            "logprobs": logprobs,
            "finish_reason": delta.finish_reason,
        }
    completion_lp = None
    if prep.num_logprobs is not None:
        completion_lp = completion_logprobs(
            decode,
            new_ids,
            entries,
            prep.num_logprobs,
            text_offset or 0,
            prefix_ids,
            choice.prompt_logprobs if prefix_ids else None,
            names,
        )
    return {
        "index": choice.index,
        "text": text,
        "logprobs": completion_lp,
        "finish_reason": delta.finish_reason,
    }


async def stream_chunks(
    serving: Serving, prep: Prepared, priority: int
) -> AsyncGenerator[bytes, None]:
    """SSE bytes for one request: each chunk what one choice gained. Errors raised before the
    first chunk propagate as `APIError`; later ones are sent as a final `data: {"error": ...}`
    event."""
    kind = "chat.completion.chunk" if prep.is_chat else "text_completion"
    choices: dict[int, ChoiceAccumulator] = {}
    sent_chars: dict[int, int] = {}  # per choice: characters streamed (the echo included)
    sent_any = False

    def chunk(rendered: list[dict[str, Any]]) -> bytes:
        body = envelope(kind, prep.request_id, prep.created, prep.model, rendered)
        if prep.include_usage:
            body["usage"] = None
        return sse(body)

    try:
        async with aclosing(serving.outputs(prep, priority)) as outputs:
            async for choice, delta in outputs:
                first = choice.index not in choices
                choices[choice.index] = choice
                if prep.is_chat and first:
                    role = {"role": "assistant", "content": ""}
                    yield chunk(
                        [
                            {
                                "index": choice.index,
                                "delta": role,
                                "logprobs": None,
                                "finish_reason": None,
                            }
                        ]
                    )
                    sent_any = True
                offset = None if first else sent_chars[choice.index]
                rendered = _delta_choice(serving, prep, choice, delta, offset)
                if rendered is not None:
                    sent_chars[choice.index] = (offset or 0) + len(rendered.get("text", ""))
                    yield chunk([rendered])
                    sent_any = True
    except APIError as e:
        if not sent_any:
            raise
        yield sse(e.to_dict())
        return
    if prep.include_usage:
        body = envelope(kind, prep.request_id, prep.created, prep.model, [])
        cached = prep.num_cached_tokens(choices.values())
        generated = sum(len(c.token_ids) for c in choices.values())
        body["usage"] = usage(prep.num_prompt_tokens, generated, cached)
        yield sse(body)
    yield sse("[DONE]")
