"""`Serving`: turns OpenAI completion/chat requests into engine requests and back.

Used by the online routes and by the batch runner alike, so a batch line gets
exactly the body the online endpoint would return. Each choice (prompt i,
sample j) is one engine request with n == 1; its id is `<request id>-<index>`.
An unfinished engine request is aborted whenever its consumer goes away.

Hostile sizes are refused before any costly work: a request of more than
`max_seqs_per_request` sequences (prompts x n) before tokenizing, a prompt text
longer than `max_prompt_bytes` (no such text fits the context window) before
tokenizing it, a token-id prompt longer than the context before scanning it.
`prepare` is synchronous and may take a while on a long prompt: callers run it in
a worker thread.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncGenerator, Callable, Iterable, Sequence
from contextlib import aclosing
from dataclasses import dataclass, replace
from typing import Any

from engine.core.sampling_params import SamplingError, SamplingParams
from policy.errors import UserError
from server.engine_client import EngineClient, EngineDeadError
from server.errors import APIError, engine_unavailable, invalid_request, not_found
from server.files import new_id, now
from server.metrics import Metrics
from server.responses import ChoiceState, chat_logprobs, completion_logprobs, envelope, usage
from server.schemas import (
    ChatCompletionRequest,
    ChatMessage,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
    parse_body,
)

COMPLETIONS = "/v1/completions"
CHAT = "/v1/chat/completions"
MAX_SEQS_PER_REQUEST = 256
"""Most sequences (prompts x n) one request may ask for."""


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
    tokens_as_ids: bool = False
    """Logprobs name tokens "token_id:<id>" (`return_tokens_as_token_ids`)."""

    @property
    def num_prompt_tokens(self) -> int:
        return sum(len(p) for p in self.prompts)

    def num_cached_tokens(self, states: Iterable[ChoiceState]) -> int:
        """Cached prompt tokens, counted like `num_prompt_tokens`: once per prompt (its first
        choice's; with n > 1 the other choices of a prompt usually hit the same pages)."""
        return sum(s.num_cached_tokens for s in states if s.index % self.n == 0)

    @property
    def num_seqs(self) -> int:
        """Engine requests this request becomes (prompts x n): what it takes of the queue."""
        return len(self.prompts) * self.n


class Serving:
    """Prepare, run and format completion and chat requests against one engine."""

    def __init__(
        self,
        engine: EngineClient,
        model_name: str,
        metrics: Metrics,
        max_seqs_per_request: int = MAX_SEQS_PER_REQUEST,
    ) -> None:
        self.engine = engine
        self.model_name = model_name
        self.metrics = metrics
        self.max_seqs_per_request = max_seqs_per_request

    @property
    def max_prompt_bytes(self) -> int:
        """The longest prompt text (UTF-8 bytes) that can fit the context window: no token
        stands for more than `engine.max_token_bytes` bytes of text."""
        return self.engine.max_model_len * self.engine.max_token_bytes

    # -- preparation -----------------------------------------------------------------
    def prepare(self, endpoint: str, body: Any) -> Prepared:
        """Validate and tokenize; raises `APIError` (400 invalid, 404 unknown model, 503 while
        the model is still loading)."""
        try:
            return self._prepare(endpoint, body)
        except SamplingError as e:
            raise invalid_request(str(e)) from e
        except EngineDeadError as e:
            raise engine_unavailable() from e

    def _prepare(self, endpoint: str, body: Any) -> Prepared:
        req: CompletionRequest | ChatCompletionRequest
        if endpoint == CHAT:
            req = parse_body(ChatCompletionRequest, body)
            req.check_supported()
            self._check_model(req.model)
            self._check_num_seqs(1, req.n)
            prompts = [self._chat_ids(req.messages)]
            max_tokens = req.max_completion_tokens or req.max_tokens
            num_logprobs, echo = req.num_logprobs(), False
        else:
            self._precheck_prompt(body)
            req = parse_body(CompletionRequest, body)
            if req.best_of not in (None, req.n):
                raise invalid_request("best_of must equal n (or be omitted)", param="best_of")
            self._check_model(req.model)
            prompts = self._completion_prompts(req.prompt, req.n)
            max_tokens, num_logprobs, echo = req.max_tokens, req.logprobs, req.echo
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
            tokens_as_ids=req.return_tokens_as_token_ids,
        )

    # -- the served tokenizer (vLLM's /tokenize and /detokenize) ----------------------
    def tokenize(self, body: Any) -> dict[str, Any]:
        """A prompt's token ids as a completion or chat request would get them, so that a
        harness counts and cuts with the served tokenizer instead of guessing one."""
        try:
            req = parse_body(TokenizeRequest, body)
            if req.model is not None:
                self._check_model(req.model)
            if (req.prompt is None) == (req.messages is None):
                raise invalid_request("give one of prompt or messages", param="prompt")
            if req.messages is not None:
                ids = self._chat_ids(req.messages)
            else:
                assert req.prompt is not None
                self._check_text_bytes([req.prompt], "prompt")
                ids = self.engine.encode(req.prompt, req.add_special_tokens)
            return {"count": len(ids), "max_model_len": self.engine.max_model_len, "tokens": ids}
        except EngineDeadError as e:
            raise engine_unavailable() from e

    def detokenize(self, body: Any) -> dict[str, Any]:
        """Token ids as text, special tokens skipped (as generated text is)."""
        try:
            req = parse_body(DetokenizeRequest, body)
            if req.model is not None:
                self._check_model(req.model)
            self._check_token_ids(req.tokens, "tokens")
            return {"prompt": self.engine.decode(req.tokens)}
        except EngineDeadError as e:
            raise engine_unavailable() from e

    def _precheck_prompt(self, body: Any) -> None:
        """The size checks on a completion body's raw `prompt`, before validation looks at
        each of its (possibly millions of) elements."""
        prompt = body.get("prompt") if isinstance(body, dict) else None
        if not isinstance(prompt, list) or not prompt:
            return
        n = body.get("n", 1)
        n = n if isinstance(n, int) and not isinstance(n, bool) and n >= 1 else 1
        if isinstance(prompt[0], int):
            self._check_num_tokens(len(prompt))
            return
        self._check_num_seqs(len(prompt), n)
        for item in prompt:
            if isinstance(item, list):
                self._check_num_tokens(len(item))

    def _check_model(self, model: str) -> None:
        if model != self.model_name:
            raise not_found("model", model, param="model")

    def _check_num_seqs(self, num_prompts: int, n: int) -> None:
        if num_prompts * n > self.max_seqs_per_request:
            raise invalid_request(
                f"This request asks for {num_prompts * n} sequences ({num_prompts} prompts x "
                f"n={n}); the limit is {self.max_seqs_per_request} per request. Split it.",
                param="prompt" if num_prompts > 1 else "n",
                code="too_many_sequences",
            )

    def _check_text_bytes(self, texts: list[str], param: str) -> None:
        """Refuse a prompt text that cannot fit the context, before tokenizing it."""
        limit = self.max_prompt_bytes
        if 4 * sum(len(t) for t in texts) <= limit:  # a character is at most 4 bytes
            return
        num_bytes = sum(len(t.encode()) for t in texts)
        if num_bytes > limit:
            raise invalid_request(
                f"The prompt is {num_bytes} bytes of text; no text over {limit} bytes fits "
                f"this model's context of {self.engine.max_model_len} tokens. Shorten it.",
                param=param,
                code="context_length_exceeded",
            )

    def _completion_prompts(
        self, prompt: str | list[str] | list[int] | list[list[int]], n: int
    ) -> list[list[int]]:
        items: list[Any]
        if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)):
            items = [prompt]
        else:
            items = list(prompt)
        if not items:
            raise invalid_request("prompt must not be empty", param="prompt", code="empty_prompt")
        self._check_num_seqs(len(items), n)
        prompts: list[list[int]] = []
        for item in items:
            if isinstance(item, str):
                self._check_text_bytes([item], "prompt")
                ids = self.engine.encode(item)
            else:
                ids = list(item)
                self._check_num_tokens(len(ids))
            if not ids or item == "":
                raise invalid_request(
                    "prompt must not be empty", param="prompt", code="empty_prompt"
                )
            self._check_token_ids(ids, "prompt")
            prompts.append(ids)
        return prompts

    def _check_token_ids(self, ids: list[int], param: str) -> None:
        bad = [t for t in ids if not 0 <= t < self.engine.vocab_size]
        if bad:
            raise invalid_request(
                f"token ids must be in [0, {self.engine.vocab_size}); got {bad[:5]}",
                param=param,
                code="invalid_token_ids",
            )

    def _chat_ids(self, messages: list[ChatMessage]) -> list[int]:
        """A chat's token ids: its messages rendered with the model's template."""
        chat = [{"role": m.role, "content": m.text()} for m in messages]
        self._check_text_bytes([m["content"] for m in chat], "messages")
        try:
            return self.engine.apply_chat_template(chat)
        except UserError as e:
            raise invalid_request(str(e), param="messages", code="chat_template_error") from e

    def _check_num_tokens(self, num_tokens: int) -> None:
        if num_tokens > self.engine.max_model_len:
            raise invalid_request(
                f"This model's maximum context length is {self.engine.max_model_len} tokens; "
                f"the prompt has {num_tokens}. Shorten it.",
                param="prompt",
                code="context_length_exceeded",
            )

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
                state.num_cached_tokens = item.num_cached_tokens or 0
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
        return self.body(prep, await self.run_choices(prep, priority))

    async def run_choices(self, prep: Prepared, priority: int) -> list[ChoiceState]:
        """Every choice run to its end, in choice order (token ids included)."""
        states: dict[int, ChoiceState] = {}
        async with aclosing(self.outputs(prep, priority)) as outputs:
            async for state, _ in outputs:
                states[state.index] = state
        return [states[i] for i in sorted(states)]

    def body(self, prep: Prepared, states: list[ChoiceState]) -> dict[str, Any]:
        """The non-streaming response body of finished choices."""
        choices = [self.choice(prep, state) for state in states]
        kind = "chat.completion" if prep.is_chat else "text_completion"
        body = envelope(kind, prep.request_id, prep.created, prep.model, choices)
        num_generated = sum(len(s.token_ids) for s in states)
        cached = prep.num_cached_tokens(states)
        body["usage"] = usage(prep.num_prompt_tokens, num_generated, cached)
        return body

    def token_names(self, prep: Prepared) -> Callable[[Sequence[int]], str]:
        """How logprobs name tokens: their text, or "token_id:<id>" when asked."""
        if prep.tokens_as_ids:
            return lambda ids: "".join(f"token_id:{t}" for t in ids)
        return self.engine.decode

    def choice(self, prep: Prepared, state: ChoiceState) -> dict[str, Any]:
        decode, names = self.engine.decode, self.token_names(prep)
        entries = state.logprobs or []
        if prep.is_chat:
            logprobs = None
            if prep.num_logprobs is not None:
                logprobs = chat_logprobs(names, state.token_ids, entries, prep.num_logprobs)
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
                names,
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
