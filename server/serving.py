"""`Serving`: turns OpenAI completion/chat requests into engine requests and back.

Used by the online routes and by the batch runner alike, so a batch line gets
exactly the body the online endpoint would return. Each choice (prompt i,
sample j) is one engine request with n == 1; its id is `<request id>-<index>`.
An unfinished engine request is aborted whenever its consumer goes away.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncGenerator
from contextlib import aclosing
from dataclasses import dataclass, replace
from typing import Any

from engine.core.sampling_params import SamplingParams
from policy.errors import UserError
from server.engine_client import EngineClient, EngineDeadError
from server.errors import APIError, engine_unavailable, invalid_request, not_found
from server.files import new_id, now
from server.metrics import Metrics
from server.responses import ChoiceState, chat_logprobs, completion_logprobs, envelope, usage
from server.schemas import ChatCompletionRequest, CompletionRequest, parse_body

COMPLETIONS = "/v1/completions"
CHAT = "/v1/chat/completions"


@dataclass(slots=True)
class Prepared:
    """A validated, tokenized request, ready to run."""

    is_chat: bool
    request_id: str
    created: int
    model: str
    prompts: list[list[int]]
    params: list[SamplingParams]
    """One per prompt (chat's default max_tokens depends on the prompt length)."""
    n: int
    echo: bool
    num_logprobs: int | None
    stream: bool
    include_usage: bool

    @property
    def num_prompt_tokens(self) -> int:
        return sum(len(p) for p in self.prompts)


class Serving:
    """Prepare, run and format completion and chat requests against one engine."""

    def __init__(self, engine: EngineClient, model_name: str, metrics: Metrics) -> None:
        self.engine = engine
        self.model_name = model_name
        self.metrics = metrics

    # -- preparation -----------------------------------------------------------------
    def prepare(self, endpoint: str, body: Any) -> Prepared:
        """Validate and tokenize; raises `APIError` (400 invalid, 404 unknown model)."""
        req: CompletionRequest | ChatCompletionRequest
        if endpoint == CHAT:
            req = parse_body(ChatCompletionRequest, body)
            req.check_supported()
            messages = [{"role": m.role, "content": m.text()} for m in req.messages]
            try:
                prompts = [self.engine.apply_chat_template(messages)]
            except UserError as e:
                raise invalid_request(str(e), param="messages", code="chat_template_error") from e
            max_tokens = req.max_completion_tokens or req.max_tokens
            num_logprobs, echo = req.num_logprobs(), False
        else:
            req = parse_body(CompletionRequest, body)
            if req.best_of not in (None, req.n):
                raise invalid_request("best_of must equal n (or be omitted)", param="best_of")
            prompts = self._completion_prompts(req.prompt)
            max_tokens, num_logprobs, echo = req.max_tokens, req.logprobs, req.echo
        if req.model != self.model_name:
            raise not_found("model", req.model, param="model")
        params = [
            req.sampling_params(self._max_tokens(p, max_tokens), num_logprobs, echo)
            for p in prompts
        ]
        return Prepared(
            is_chat=endpoint == CHAT,
            request_id=new_id("chatcmpl-" if endpoint == CHAT else "cmpl-"),
            created=now(),
            model=self.model_name,
            prompts=prompts,
            params=params,
            n=req.n,
            echo=echo,
            num_logprobs=num_logprobs,
            stream=req.stream,
            include_usage=req.include_usage(),
        )

    def _completion_prompts(
        self, prompt: str | list[str] | list[int] | list[list[int]]
    ) -> list[list[int]]:
        items: list[Any]
        if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)):
            items = [prompt]
        else:
            items = list(prompt)
        if not items:
            raise invalid_request("prompt must not be empty", param="prompt", code="empty_prompt")
        prompts: list[list[int]] = []
        for item in items:
            ids = self.engine.encode(item) if isinstance(item, str) else list(item)
            if not ids or item == "":
                raise invalid_request(
                    "prompt must not be empty", param="prompt", code="empty_prompt"
                )
            bad = [t for t in ids if not 0 <= t < self.engine.vocab_size]
            if bad:
                raise invalid_request(
                    f"token ids must be in [0, {self.engine.vocab_size}); got {bad[:5]}",
                    param="prompt",
                    code="invalid_token_ids",
                )
            prompts.append(ids)
        return prompts

    def _max_tokens(self, prompt: list[int], max_tokens: int | None) -> int:
        limit = self.engine.max_model_len
        if max_tokens is None:
            max_tokens = limit - len(prompt)
        if len(prompt) + max_tokens > limit or max_tokens < 1:
            raise invalid_request(
                f"This model's maximum context length is {limit} tokens; the request needs "
                f"{len(prompt) + max(max_tokens, 1)} ({len(prompt)} in the prompt, "
                f"{max(max_tokens, 1)} to generate). Shorten the prompt or lower max_tokens.",
                param="max_tokens",
                code="context_length_exceeded",
            )
        return max_tokens

    # -- running ---------------------------------------------------------------------
    async def _drive(
        self, prep: Prepared, priority: int, index: int, out: asyncio.Queue[Any]
    ) -> None:
        """Run choice `index` to the end, putting (index, output) items on `out`."""
        prompt_index, sample = divmod(index, prep.n)
        params = prep.params[prompt_index]
        if params.seed is not None and sample:
            params = replace(params, seed=params.seed + sample)
        request_id = f"{prep.request_id}-{index}"
        arrival, first, finished = time.monotonic(), True, False
        try:
            async for output in self.engine.generate(
                request_id, prep.prompts[prompt_index], params, priority
            ):
                if first and output.outputs[0].token_ids:
                    self.metrics.ttft.observe(time.monotonic() - arrival)
                    first = False
                finished = output.finished
                await out.put((index, output))
                if finished:
                    completion = output.outputs[0]
                    self.metrics.e2e.observe(time.monotonic() - arrival)
                    self.metrics.generation_tokens.inc(len(completion.token_ids))
                    self.metrics.requests_finished.labels(completion.finish_reason or "").inc()
                    return
            raise EngineDeadError(f"engine ended request {request_id} without finishing it")
        except Exception as e:
            self.metrics.requests_finished.labels("error").inc()
            await out.put((index, e))
        finally:
            if not finished:
                self.metrics.requests_finished.labels("abort").inc()
                await self.engine.abort(request_id)

    async def outputs(
        self, prep: Prepared, priority: int
    ) -> AsyncGenerator[tuple[ChoiceState, bool], None]:
        """Yield (choice state, finished now) as outputs arrive; abort all on early exit."""
        num_choices = len(prep.prompts) * prep.n
        states = [ChoiceState(index=i, prompt_index=i // prep.n) for i in range(num_choices)]
        queue: asyncio.Queue[Any] = asyncio.Queue()
        tasks = [
            asyncio.create_task(self._drive(prep, priority, i, queue)) for i in range(num_choices)
        ]
        self.metrics.prompt_tokens.inc(prep.num_prompt_tokens)
        try:
            remaining = num_choices
            while remaining:
                index, item = await queue.get()
                if isinstance(item, Exception):
                    raise _translate(item) from item
                completion = item.outputs[0]
                state = states[index]
                state.text, state.token_ids = completion.text, tuple(completion.token_ids)
                state.logprobs = list(completion.logprobs) if completion.logprobs else None
                state.prompt_logprobs = item.prompt_logprobs
                if item.finished:
                    state.finish_reason = completion.finish_reason or "stop"
                    remaining -= 1
                yield state, item.finished
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def run(self, prep: Prepared, priority: int) -> dict[str, Any]:
        """The whole (non-streaming) response body."""
        states: dict[int, ChoiceState] = {}
        async with aclosing(self.outputs(prep, priority)) as outputs:
            async for state, _ in outputs:
                states[state.index] = state
        choices = [self.choice(prep, states[i]) for i in sorted(states)]
        kind = "chat.completion" if prep.is_chat else "text_completion"
        body = envelope(kind, prep.request_id, prep.created, prep.model, choices)
        num_generated = sum(len(s.token_ids) for s in states.values())
        body["usage"] = usage(prep.num_prompt_tokens, num_generated)
        return body

    def choice(self, prep: Prepared, state: ChoiceState) -> dict[str, Any]:
        decode = self.engine.decode
        entries = state.logprobs or []
        if prep.is_chat:
            logprobs = None
            if prep.num_logprobs is not None:
                logprobs = chat_logprobs(decode, state.token_ids, entries, prep.num_logprobs)
            return {
                "index": state.index,
                "message": {"role": "assistant", "content": state.text},
                "logprobs": logprobs,
                "finish_reason": state.finish_reason,
            }
        prompt_ids = prep.prompts[state.prompt_index] if prep.echo else []
        prefix = decode(prompt_ids) if prep.echo else ""
        completion_lp = None
        if prep.num_logprobs is not None:
            completion_lp = completion_logprobs(
                decode,
                state.token_ids,
                entries,
                prep.num_logprobs,
                0,
                prompt_ids,
                state.prompt_logprobs,
            )
        return {
            "index": state.index,
            "text": prefix + state.text,
            "logprobs": completion_lp,
            "finish_reason": state.finish_reason,
        }


def _translate(e: Exception) -> APIError:
    """Engine-side failures as API errors."""
    if isinstance(e, APIError):
        return e
    if isinstance(e, EngineDeadError):
        return engine_unavailable()
    if isinstance(e, ValueError):  # the scheduler's RequestError: the caller's 400
        return invalid_request(str(e))
    return APIError(500, f"generation failed: {e}", type="server_error", code="internal_error")
