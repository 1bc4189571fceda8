"""`check_request`: the requests the scheduler refuses before queueing them, torch-free.

A refused request is the caller's error (`RequestError`, a `UserError`: the daemon's 400),
never the engine's: an id in use, an empty prompt, a prompt past the context window or
past the largest KV pool, or more than one choice (`ParentRequest` fans out n in front).
"""

from __future__ import annotations

from collections.abc import Container

from base.errors import UserError
from engine.core.sequence import Request


class RequestError(UserError, ValueError):
    """A request the scheduler refuses: duplicate id, empty prompt, or one that can never fit."""


class PromptTooLongError(RequestError):
    """The prompt is longer than max_model_len."""


def check_request(
    request: Request,
    max_model_len: int,
    kv_tokens: int,
    ids_in_use: Container[str],
    max_step_tokens: int,
) -> None:
    """Raise RequestError for a request that can never run; `kv_tokens`: the most tokens one
    sequence can hold in KV (`Scheduler.kv_tokens`); `max_step_tokens`: the most prompt
    tokens one step runs (an image whose tokens attend both ways runs in one step)."""
    num_prompt = len(request.prompt_token_ids)
    media = request.media
    if media is not None and media.bidirectional:
        largest = max(image.num_tokens for image in media.images)
        if largest > max_step_tokens:
            raise RequestError(
                f"an image of this prompt has {largest} tokens, which run in one step, but a "
                f"step runs at most {max_step_tokens}: raise max_step_tokens"
            )
    if request.sampling.n != 1:
        raise RequestError(
            f"request {request.request_id!r} asks for n={request.sampling.n}; the engine "
            "runs one choice per request (ParentRequest fans out n)"
        )
    if request.request_id in ids_in_use:
        raise RequestError(f"request id {request.request_id!r} is already in use")
    if num_prompt == 0:
        raise RequestError("the prompt is empty: send at least one token")
    if num_prompt > max_model_len:
        raise PromptTooLongError(
            f"the prompt has {num_prompt} tokens but max_model_len is "
            f"{max_model_len}: shorten the prompt"
        )
    if num_prompt > kv_tokens:
        raise RequestError(
            f"the prompt ({num_prompt} tokens) does not fit the largest KV pool "
            f"({kv_tokens} tokens): give the KV cache more memory"
        )
