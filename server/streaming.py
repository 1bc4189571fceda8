"""Server-sent events for `stream: true`: delta chunks, an optional usage chunk, `[DONE]`."""

from __future__ import annotations

from collections.abc import AsyncGenerator
from contextlib import aclosing
from typing import Any

from server.errors import APIError
from server.responses import ChoiceState, chat_logprobs, completion_logprobs, envelope, sse, usage
from server.serving import Prepared, Serving


def _delta_choice(
    serving: Serving, prep: Prepared, state: ChoiceState, finished: bool
) -> dict[str, Any] | None:
    """The chunk choice for what `state` gained since the last chunk (None: nothing new)."""
    decode, names = serving.engine.decode, serving.token_names(prep)
    text = state.text[state.sent_text :]
    new_ids = state.token_ids[state.sent_tokens :]
    entries = (state.logprobs or [])[state.sent_tokens :]
    prefix_ids: list[int] = []
    if not state.started:
        state.started = True
        if prep.echo:
            prefix_ids = prep.prompts[state.prompt_index]
            text = decode(prefix_ids) + text
    elif not text and not finished and not new_ids:
        return None
    state.sent_text, state.sent_tokens = len(state.text), len(state.token_ids)
    finish_reason = state.finish_reason if finished else None
    if prep.is_chat:
        logprobs = None
        if prep.num_logprobs is not None and new_ids:
            logprobs = chat_logprobs(names, new_ids, entries, prep.num_logprobs)
        delta: dict[str, Any] = {"content": text} if text or not finished else {}
        return {
            "index": state.index,
            "delta": delta,
            "logprobs": logprobs,
            "finish_reason": finish_reason,
        }
    completion_lp = None
    if prep.num_logprobs is not None:
        completion_lp = completion_logprobs(
            decode, new_ids, entries, prep.num_logprobs, 0, prefix_ids, state.prompt_logprobs, names
        )
    return {
        "index": state.index,
        "text": text,
        "logprobs": completion_lp,
        "finish_reason": finish_reason,
    }


async def stream_chunks(
    serving: Serving, prep: Prepared, priority: int
) -> AsyncGenerator[bytes, None]:
    """SSE bytes for one request. Errors raised before the first chunk propagate as
    `APIError`; later ones are sent as a final `data: {"error": ...}` event."""
    kind = "chat.completion.chunk" if prep.is_chat else "text_completion"
    num_generated: dict[int, int] = {}
    states: dict[int, ChoiceState] = {}
    sent_any = False

    def chunk(choices: list[dict[str, Any]]) -> bytes:
        body = envelope(kind, prep.request_id, prep.created, prep.model, choices)
        if prep.include_usage:
            body["usage"] = None
        return sse(body)

    try:
        async with aclosing(serving.outputs(prep, priority)) as outputs:
            async for state, finished in outputs:
                if prep.is_chat and not state.started:
                    state.started = True
                    role = {"role": "assistant", "content": ""}
                    yield chunk(
                        [
                            {
                                "index": state.index,
                                "delta": role,
                                "logprobs": None,
                                "finish_reason": None,
                            }
                        ]
                    )
                    sent_any = True
                choice = _delta_choice(serving, prep, state, finished)
                num_generated[state.index] = len(state.token_ids)
                states[state.index] = state
                if choice is not None:
                    yield chunk([choice])
                    sent_any = True
    except APIError as e:
        if not sent_any:
            raise
        yield sse(e.to_dict())
        return
    if prep.include_usage:
        body = envelope(kind, prep.request_id, prep.created, prep.model, [])
        cached = prep.num_cached_tokens(states.values())
        body["usage"] = usage(prep.num_prompt_tokens, sum(num_generated.values()), cached)
        yield sse(body)
    yield sse("[DONE]")
