"""`Serving`: turns OpenAI completion/chat requests into engine requests and back.

Used by the online routes and by the batch runner alike, so a batch line gets
exactly the body the online endpoint would return. Each prompt is one engine request
of n choices (`<request id>-<prompt index>`, fanned out by the engine client); choice
j of prompt i is the response's choice i * n + j, and one `ChoiceAccumulator` each adds
up its deltas. An unfinished request is aborted whenever its consumer goes away.

Hostile sizes are refused before any costly work: a request of more than
`max_seqs_per_request` sequences (prompts x n) before tokenizing, a prompt text
longer than `max_prompt_bytes` (no such text fits the context window) before
tokenizing it, a token-id prompt longer than the context before scanning it.
`prepare` is synchronous and may take a while on a long prompt: callers run it in
a worker thread.
"""

from __future__ import annotations

import asyncio
import hashlib
import time
from collections.abc import AsyncGenerator, Callable, Iterable, Sequence
from contextlib import aclosing
from dataclasses import dataclass, replace
from typing import Any

from pydantic import BaseModel

from engine.core.media import ImageError, SeqMedia, expand_image_tokens
from engine.core.outputs import ChoiceAccumulator, SequenceDelta
from engine.core.sampling_params import SamplingError, SamplingParams
from engine.core.structured import (
    StructuredOutput,
    StructuredOutputError,
    after_harmony_analysis,
    after_reasoning,
)
from engine.core.tokenizer import ChatOptions
from engine.runtime.engine_client import EngineClient, EngineDeadError, StorageUnavailableError
from policy.errors import UserError
from server.openai.embeddings import (
    EMBEDDINGS,
    POOLING_ENDPOINTS,
    PoolingJob,
    pooling_job,
    run_job,
)
from server.openai.errors import (
    APIError,
    engine_unavailable,
    invalid_request,
    not_found,
    offload_unavailable,
)
from server.openai.json_body import utf8_size
from server.openai.logprobs import chat_logprobs, completion_logprobs
from server.openai.media import NO_LOCAL_MEDIA, MediaLimits, load_image
from server.openai.metrics import Metrics
from server.openai.reasoning import HARMONY, split_reasoning
from server.openai.reasoning import parser_for_template as reasoning_for_template
from server.openai.requests import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
    parse_body,
)
from server.openai.responses import (
    AssistantMessage,
    ChatChoice,
    ChatCompletion,
    Completion,
    CompletionChoice,
    Detokenized,
    FunctionCallOut,
    Tokenized,
    TokenizerInfo,
    ToolCall,
    Usage,
    new_id,
    now,
    usage,
)
from server.openai.responses_api import (
    Response,
    ResponsesRequest,
    refuse_stored_state,
    response_body,
)
from server.openai.tool_parsers import HARMONY as HARMONY_TOOLS
from server.openai.tool_parsers import parser_for_template as tools_for_template
from server.openai.tools import (
    ToolPlan,
    chat_for_template,
    described,
    template_knows_tools,
    tool_plan,
)

COMPLETIONS = "/v1/completions"
CHAT = "/v1/chat/completions"
RESPONSES = "/v1/responses"
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
    """One per prompt, with n (chat's default max_tokens depends on the prompt length)."""
    n: int
    echo: bool
    num_logprobs: int | None
    stream: bool
    include_usage: bool
    tokens_as_ids: bool = False
    """Logprobs name tokens "token_id:<id>" (`return_tokens_as_token_ids`)."""
    tools: ToolPlan | None = None
    """A chat's tools: the answer is read for calls (server/openai/tools.py)."""
    reasoning: str | None = None
    """The reasoning parser that splits a chat's answer (server/openai/reasoning.py)."""
    responses: ResponsesRequest | None = None
    """A Responses API request, run as the chat it means and answered as a Response."""
    pooling: PoolingJob | None = None
    """A pooling request (server/openai/embeddings.py): its inputs are `prompts`."""
    media: list[SeqMedia | None] | None = None
    """Each prompt's images (a chat with image parts); None: text alone."""

    @property
    def num_prompt_tokens(self) -> int:
        return sum(len(p) for p in self.prompts)

    def num_cached_tokens(self, choices: Iterable[ChoiceAccumulator]) -> int:
        """Cached prompt tokens, counted like `num_prompt_tokens`: once per prompt (its first
        choice's; with n > 1 the other choices fork its KV and report the same hit)."""
        return sum(c.num_cached_tokens for c in choices if c.index % self.n == 0)

    def prompt_index(self, choice: ChoiceAccumulator) -> int:
        return choice.index // self.n

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
        *,
        tool_call_parser: str | None = None,
        reasoning_parser: str | None = None,
        media_limits: MediaLimits = NO_LOCAL_MEDIA,
    ) -> None:
        self.engine = engine
        self.media_limits = media_limits
        """What a request may send of images, and where local image files may be read."""
        self.model_name = model_name
        self.metrics = metrics
        self.max_seqs_per_request = max_seqs_per_request
        self.tool_call_parser = tool_call_parser
        """The model's tool-call format; None: the one its chat template shows."""
        self.reasoning_parser = reasoning_parser
        """qwen3, deepseek_r1 or "none"; None: the one its chat template shows."""

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

    def check_ready(self) -> None:
        """Raise the 503 a request meets now if the engine cannot take it (loading,
        restarting, its offload storage resting after a fault)."""
        try:
            self.engine.check_ready()
        except Exception as e:
            raise _translate(e) from e

    def _prepare(self, endpoint: str, body: Any) -> Prepared:
        if endpoint in POOLING_ENDPOINTS or self.engine.pooling_spec is not None:
            return self._prepare_pooling(endpoint, body)
        if endpoint == RESPONSES:
            refuse_stored_state(body)
            responses = parse_body(ResponsesRequest, body)
            prep = self._prepare(CHAT, responses.chat_body())
            return replace(
                prep, request_id=new_id("resp_"), stream=responses.stream, responses=responses
            )
        req: CompletionRequest | ChatCompletionRequest
        tools: ToolPlan | None = None
        reasoning: str | None = None
        if endpoint == CHAT:
            req = parse_body(ChatCompletionRequest, body)
            self._check_model(req.model)
            self._check_num_seqs(1, req.n)
            template = self.engine.tokenizer_info().get("chat_template")
            tools = tool_plan(
                [t.model_dump(exclude_none=True) for t in req.tools or []] or None,
                _dump(req.tool_choice),
                req.parallel_tool_calls,
                None if req.functions is None else [_dump(f) for f in req.functions],
                _dump(req.function_call),
                self.tool_call_parser or tools_for_template(template),
            )
            reasoning = self.reasoning_parser or reasoning_for_template(template)
            reasoning = None if reasoning == "none" else reasoning
            if tools is not None and tools.parses and tools.parser == HARMONY_TOOLS:
                reasoning = HARMONY  # harmony's calls are messages: the answer is read as one
            images: list[tuple[str, str]] | None = [] if self.engine.vision else None
            messages = req.template_messages(images)
            prompts = [self._chat_ids(messages, req, tools, template)]
            media = [self._media(prompts[0], images)] if images else None
            max_tokens = req.max_completion_tokens or req.max_tokens
            num_logprobs, echo = req.num_logprobs(), False
        else:
            self._precheck_prompt(body)
            req = parse_body(CompletionRequest, body)
            if req.best_of not in (None, req.n):
                raise invalid_request("best_of must equal n (or be omitted)", param="best_of")
            self._check_model(req.model)
            prompts = self._completion_prompts(req.prompt, req.n, req.add_special_tokens)
            max_tokens, num_logprobs, echo = req.max_tokens, req.logprobs, req.echo
            media = None
        forced = None if tools is None else tools.constraint()
        params = self._sampling_params(
            req, prompts, max_tokens, num_logprobs, echo, forced, reasoning
        )
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
            tools=tools if tools is not None and tools.parses else None,
            reasoning=reasoning,
            media=media,
        )

    def _media(self, prompt: list[int], images: list[tuple[str, str]]) -> SeqMedia | None:
        """A chat's images (URL, param each) read and checked against the limits, and its
        prompt's image tokens widened to each image's (`expand_image_tokens`)."""
        spec = self.engine.vision
        assert spec is not None
        limits = self.media_limits
        if len(images) > limits.max_images:
            raise invalid_request(
                f"this request has {len(images)} images; the limit is {limits.max_images}",
                param="messages",
                code="too_many_images",
            )
        loaded = [load_image(url, limits, param) for url, param in images]
        try:
            return expand_image_tokens(prompt, spec, [(i.data, i.width, i.height) for i in loaded])
        except ImageError as e:
            raise invalid_request(str(e), param="messages") from e

    def _sampling_params(
        self,
        req: CompletionRequest | ChatCompletionRequest,
        prompts: list[list[int]],
        max_tokens: int | None,
        num_logprobs: int | None,
        echo: bool,
        forced: StructuredOutput | None = None,
        reasoning: str | None = None,
    ) -> list[SamplingParams]:
        """Each prompt's settings, ready for the engine: the model's generation_config
        defaults where the request is silent, bad words tokenized, token ids checked, a
        structured output's grammar built and checked (cached by spec, time-limited).
        `forced`: a forced tool call's grammar, which takes the place of the request's.
        `reasoning`: the model thinks aloud first, so the constraint applies after its think
        block (`after_reasoning`)."""
        if max_tokens == 0 and not (echo and num_logprobs is not None):
            raise invalid_request(
                "max_tokens may be 0 only with echo and logprobs (the prompt's logprobs)",
                param="max_tokens",
            )
        defaults = self.engine.generation_defaults
        limits = [self._max_tokens(p, max_tokens, defaults.get("max_tokens")) for p in prompts]
        structured, structured_param = req.structured()
        if forced is not None:
            if structured is not None:
                raise invalid_request(
                    f"a forced tool call (tool_choice required or named) fixes the answer's "
                    f"format; leave {structured_param} out",
                    param=structured_param,
                )
            structured, structured_param = forced, "tool_choice"
        if structured is not None and reasoning == HARMONY:
            structured = after_harmony_analysis(structured)
        elif structured is not None and reasoning is not None:
            structured = after_reasoning(structured, opened=reasoning == "deepseek_r1")
        params = req.sampling_params(limits[0], num_logprobs, echo, defaults, structured)
        if reasoning == HARMONY:  # its channels are read from the special tokens that mark them
            params = replace(params, skip_special_tokens=False)
        try:  # once per request: the prompts differ only in their max_tokens
            params = params.prepared(self._encode_plain, self.engine.vocab_size)
        except StructuredOutputError as e:
            raise invalid_request(str(e), param=structured_param) from e
        return [params if n == params.max_tokens else replace(params, max_tokens=n) for n in limits]

    def _encode_plain(self, text: str) -> list[int]:
        """Token ids without the model's special tokens (bad words)."""
        return self.engine.encode(text, add_special_tokens=False)

    # -- the served tokenizer (vLLM's /tokenize and /detokenize) ----------------------
    def tokenize(self, body: Any) -> Tokenized:
        """A prompt's token ids as a completion or chat request would get them, so that a
        harness counts and cuts with the served tokenizer instead of guessing one."""
        try:
            req = parse_body(TokenizeRequest, body)
            if req.model is not None:
                self._check_model(req.model)
            if (req.prompt is None) == (req.messages is None):
                raise invalid_request("give one of prompt or messages", param="prompt")
            if req.messages is not None:
                messages = [m.for_template(i) for i, m in enumerate(req.messages)]
                template = self.engine.tokenizer_info().get("chat_template")
                ids = self._chat_ids(messages, template=template)
            else:
                assert req.prompt is not None
                self._check_text_bytes([req.prompt], "prompt")
                ids = self.engine.encode(req.prompt, req.add_special_tokens)
            return Tokenized(count=len(ids), max_model_len=self.engine.max_model_len, tokens=ids)
        except EngineDeadError as e:
            raise engine_unavailable() from e

    def tokenizer_info(self) -> TokenizerInfo:
        """The served tokenizer's special tokens and chat template (vLLM's GET
        /tokenizer_info: lm-eval's remote tokenizer reads it)."""
        try:
            return TokenizerInfo(**self.engine.tokenizer_info())
        except EngineDeadError as e:
            raise engine_unavailable() from e

    def detokenize(self, body: Any) -> Detokenized:
        """Token ids as text, special tokens skipped (as generated text is)."""
        try:
            req = parse_body(DetokenizeRequest, body)
            if req.model is not None:
                self._check_model(req.model)
            self._check_token_ids(req.tokens, "tokens")
            return Detokenized(prompt=self.engine.decode(req.tokens))
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

    def _prepare_pooling(self, endpoint: str, body: Any) -> Prepared:
        """A pooling route on a pooling model; any other pairing is refused (400)."""
        engine = self.engine
        if engine.pooling_spec is None:
            raise invalid_request(
                f"{self.model_name} generates text: {endpoint} needs a pooling model (an "
                "embedding model or a cross-encoder) served by `nanoflex serve MODEL_DIR`",
                code="unsupported_task",
            )
        if endpoint not in POOLING_ENDPOINTS:
            raise invalid_request(
                f"{self.model_name} is a pooling model: it does not generate text ({endpoint}); "
                f"it serves {', '.join(POOLING_ENDPOINTS)} as its task allows",
                code="unsupported_task",
            )
        if isinstance(body, dict) and body.get("model") is not None:
            self._check_model(body["model"])
        job = pooling_job(engine, endpoint, body)
        return Prepared(
            is_chat=False, request_id=new_id("embd-" if endpoint == EMBEDDINGS else "score-"),
            created=int(time.time()), model=self.model_name, prompts=job.inputs, params=[],
            n=1, echo=False, num_logprobs=None, stream=False, include_usage=False, pooling=job,
        )  # fmt: skip

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
        num_bytes = sum(utf8_size(t) for t in texts)  # no copy of a long text
        if num_bytes > limit:
            raise invalid_request(
                f"The prompt is {num_bytes} bytes of text; no text over {limit} bytes fits "
                f"this model's context of {self.engine.max_model_len} tokens. Shorten it.",
                param=param,
                code="context_length_exceeded",
            )

    def _completion_prompts(
        self,
        prompt: str | list[str] | list[int] | list[list[int]],
        n: int,
        add_special_tokens: bool = True,
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
                ids = self.engine.encode(item, add_special_tokens)
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

    def _chat_ids(
        self,
        messages: list[dict[str, Any]],
        req: ChatCompletionRequest | None = None,
        tools: ToolPlan | None = None,
        template: str | None = None,
    ) -> list[int]:
        """A chat's token ids: its messages rendered with the model's template, with the
        request's tools and template options (`req`); a template that knows no tools gets
        them written into the chat (server/openai/tools.py)."""
        native = template_knows_tools(template)
        harmony = tools_for_template(template) == HARMONY_TOOLS
        chat = chat_for_template(messages, tools.tools if tools else None, native, harmony)
        listed = tools.tools if tools and native else None
        if listed and harmony:
            listed = described(listed)
        self._check_text_bytes([str(m.get("content") or "") for m in chat], "messages")
        try:
            if req is None:
                return self.engine.apply_chat_template(chat)
            options = ChatOptions(
                add_generation_prompt=req.add_generation_prompt and not req.continue_final_message,
                tools=listed,
                continue_final_message=req.continue_final_message,
                template_kwargs=req.template_kwargs(),
            )
            return self.engine.apply_chat_template(chat, options)
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

    def _max_tokens(
        self, prompt: list[int], max_tokens: int | None, default: float | int | None = None
    ) -> int:
        """The request's max_tokens, checked against the context; when it gives none, the
        rest of the context, capped by the model's `max_new_tokens` if it has one."""
        limit = self.engine.max_model_len
        if max_tokens is None:
            max_tokens = limit - len(prompt)
            if default is not None:
                max_tokens = max(1, min(max_tokens, int(default)))
        if max_tokens == 0:  # echo only (checked by the caller)
            return 0
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
    async def _prompt_choices(
        self, prep: Prepared, priority: int, prompt_index: int, choices: list[ChoiceAccumulator]
    ) -> AsyncGenerator[tuple[ChoiceAccumulator, SequenceDelta], None]:
        """(the choice so far, what it just gained) for prompt `prompt_index`'s n choices
        until each finished (its metrics on the way); closing it early aborts the rest in the
        engine. A request that does not stream gets one delta per choice, its whole answer."""
        request_id = f"{prep.request_id}-{prompt_index}"
        arrival = time.monotonic()
        num_tokens = [0] * prep.n
        unfinished = set(range(prep.n))
        first = prompt_index * prep.n
        prompt, params = prep.prompts[prompt_index], prep.params[prompt_index]
        media = None if prep.media is None else prep.media[prompt_index]
        generate = self.engine.generate(
            request_id, prompt, params, priority, stream=prep.stream, media=media
        )
        try:
            async with aclosing(generate) as deltas:
                async for delta in deltas:
                    index = delta.index
                    if delta.new_token_ids:
                        if not num_tokens[index]:
                            start = delta.first_token_time or time.monotonic()
                            self.metrics.ttft.observe(start - arrival)
                        num_tokens[index] += len(delta.new_token_ids)
                    choice = choices[first + index]
                    choice.add(delta)
                    if delta.finish_reason is not None:
                        unfinished.discard(index)
                        self.metrics.e2e.observe(time.monotonic() - arrival)
                        self.metrics.generation_tokens.inc(num_tokens[index])
                        self.metrics.requests_finished.labels(delta.finish_reason).inc()
                        _check_failed(delta)
                    yield choice, delta
            if unfinished:
                raise EngineDeadError(f"engine ended request {request_id} without finishing it")
        except APIError:  # the request's own (a choice failed): the others end as aborted
            raise
        except Exception as e:
            self.metrics.requests_finished.labels("error").inc(len(unfinished))
            raise _translate(e) from e
        finally:
            if unfinished:
                self.metrics.requests_finished.labels("abort").inc(len(unfinished))

    async def _merged(
        self, prep: Prepared, priority: int, choices: list[ChoiceAccumulator]
    ) -> AsyncGenerator[tuple[ChoiceAccumulator, SequenceDelta], None]:
        """Every prompt's (choice, delta) pairs, as they come (several prompts)."""
        Item = tuple[ChoiceAccumulator, SequenceDelta]
        queue: asyncio.Queue[Item | Exception | None] = asyncio.Queue()

        async def pump(prompt_index: int) -> None:
            try:
                pairs = self._prompt_choices(prep, priority, prompt_index, choices)
                async with aclosing(pairs) as items:
                    async for item in items:
                        queue.put_nowait(item)
                queue.put_nowait(None)
            except Exception as e:
                queue.put_nowait(e)

        tasks = [asyncio.create_task(pump(i)) for i in range(len(prep.prompts))]
        try:
            remaining = len(tasks)
            while remaining:
                item = await queue.get()
                if item is None:
                    remaining -= 1
                elif isinstance(item, Exception):
                    raise item
                else:
                    yield item
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    def outputs(
        self, prep: Prepared, priority: int
    ) -> AsyncGenerator[tuple[ChoiceAccumulator, SequenceDelta], None]:
        """(the choice so far, what it just gained) as deltas arrive; abort all on an early
        exit (close it). The choice's index is the response's (prompt index * n + sample).
        One prompt's pairs come straight from its own generator: no layer between."""
        choices = [ChoiceAccumulator(i) for i in range(prep.num_seqs)]
        self.metrics.prompt_tokens.inc(prep.num_prompt_tokens)
        if len(prep.prompts) == 1:
            return self._prompt_choices(prep, priority, 0, choices)
        return self._merged(prep, priority, choices)

    async def run(self, prep: Prepared, priority: int) -> BaseModel:
        """The whole (non-streaming) response body."""
        if prep.pooling is not None:
            try:
                return await run_job(
                    self.engine, prep.pooling, prep.request_id, prep.created, priority
                )
            except Exception as e:
                raise _translate(e) from e
        return self.body(prep, await self.run_choices(prep, priority))

    async def run_choices(self, prep: Prepared, priority: int) -> list[ChoiceAccumulator]:
        """Every choice run to its end, in choice order (token ids included)."""
        choices: dict[int, ChoiceAccumulator] = {}
        async with aclosing(self.outputs(prep, priority)) as outputs:
            async for choice, _ in outputs:
                choices[choice.index] = choice
        return [choices[i] for i in sorted(choices)]

    def body(
        self, prep: Prepared, choices: list[ChoiceAccumulator]
    ) -> Completion | ChatCompletion | Response:
        """The non-streaming response body of finished choices."""
        if prep.responses is not None:
            chat = self.chat_body(prep, choices)
            req = prep.responses
            return response_body(req, prep.request_id, prep.created, prep.model, chat)
        if prep.is_chat:
            return self.chat_body(prep, choices)
        return self.completion_body(prep, choices)

    def _usage(self, prep: Prepared, choices: list[ChoiceAccumulator]) -> Usage:
        num_generated = sum(len(c.token_ids) for c in choices)
        return usage(prep.num_prompt_tokens, num_generated, prep.num_cached_tokens(choices))

    def chat_body(self, prep: Prepared, choices: list[ChoiceAccumulator]) -> ChatCompletion:
        return ChatCompletion(
            id=prep.request_id,
            created=prep.created,
            model=prep.model,
            system_fingerprint=None,
            object="chat.completion",
            choices=[self.chat_choice(prep, choice) for choice in choices],
            usage=self._usage(prep, choices),
        )

    def completion_body(self, prep: Prepared, choices: list[ChoiceAccumulator]) -> Completion:
        return Completion(
            id=prep.request_id,
            created=prep.created,
            model=prep.model,
            system_fingerprint=None,
            object="text_completion",
            choices=[self.choice(prep, choice) for choice in choices],
            usage=self._usage(prep, choices),
        )

    def token_names(self, prep: Prepared) -> Callable[[Sequence[int]], str]:
        """How logprobs name tokens: their text, or "token_id:<id>" when asked."""
        if prep.tokens_as_ids:
            return lambda ids: "".join(f"token_id:{t}" for t in ids)
        return self.engine.decode

    def chat_choice(self, prep: Prepared, choice: ChoiceAccumulator) -> ChatChoice:
        logprobs = None
        if prep.num_logprobs is not None:
            names, entries = self.token_names(prep), choice.logprobs or []
            logprobs = chat_logprobs(names, choice.token_ids, entries, prep.num_logprobs)
        message, finish_reason = chat_answer(prep, choice, choice.finish_reason)
        return ChatChoice(
            index=choice.index,
            message=message,
            logprobs=logprobs,
            finish_reason=finish_reason,  # type: ignore[arg-type]
        )

    def choice(self, prep: Prepared, choice: ChoiceAccumulator) -> CompletionChoice:
        decode, names = self.engine.decode, self.token_names(prep)
        entries = choice.logprobs or []
        prompt_ids = prep.prompts[prep.prompt_index(choice)] if prep.echo else []
        prefix = decode(prompt_ids) if prep.echo else ""
        completion_lp = None
        if prep.num_logprobs is not None:
            completion_lp = completion_logprobs(
                decode,
                choice.token_ids,
                entries,
                prep.num_logprobs,
                0,
                prompt_ids,
                choice.prompt_logprobs,
                names,
            )
        return CompletionChoice(
            index=choice.index,
            text=prefix + choice.text,
            logprobs=completion_lp,
            finish_reason=choice.finish_reason,  # type: ignore[arg-type]
        )


def chat_answer(
    prep: Prepared, choice: ChoiceAccumulator, finish_reason: str | None
) -> tuple[AssistantMessage, str | None]:
    """A chat choice's whole answer as OpenAI's message: reasoning apart (when the model
    thinks aloud), tool calls read from the rest (when the request has tools), and the
    finish reason they make ("tool_calls"; "function_call" for the legacy `functions`).
    An answer cut by max_tokens keeps its whole calls and the cut one (its arguments as
    generated) with finish_reason "length" (server/openai/cut_calls.py).
    A call's id is a function of the request's id, so a batch line rerun writes the same."""
    text, plan = choice.text, prep.tools
    message = AssistantMessage(role="assistant", content=text)
    harmony = plan is not None and plan.parser == HARMONY_TOOLS
    if prep.reasoning is not None:
        split = split_reasoning(prep.reasoning, text, reads_calls=harmony)
        message.reasoning_content, message.content = split
    if plan is None:
        return message, finish_reason
    cut = finish_reason == "length"
    parsed = plan.answer(text if harmony else message.content or "", cut)
    if not parsed.calls and not plan.forces:
        return message, finish_reason
    message.content = parsed.content  # a forced answer cut inside its first name: none
    if not parsed.calls:
        return message, finish_reason
    if plan.legacy:
        first = parsed.calls[0]
        message.function_call = FunctionCallOut(name=first.name, arguments=first.arguments)
        return message, "function_call" if plan.mode != "named" and not cut else finish_reason
    message.tool_calls = [
        ToolCall(
            id=_call_id(prep.request_id, choice.index, k),
            type="function",
            function=FunctionCallOut(name=call.name, arguments=call.arguments),
        )
        for k, call in enumerate(parsed.calls)
    ]
    if plan.mode == "named" or finish_reason == "length":
        return message, finish_reason  # OpenAI's answer to a named choice: "stop"
    return message, "tool_calls"


def _call_id(request_id: str, index: int, k: int) -> str:
    digest = hashlib.sha256(f"{request_id}/{index}/{k}".encode()).hexdigest()
    return f"call_{digest[:24]}"


def _dump(value: Any) -> Any:
    """A request model's value as JSON values (None and plain values as they are)."""
    if isinstance(value, list):
        return [_dump(v) for v in value]
    return value.model_dump(exclude_none=True) if hasattr(value, "model_dump") else value


def _check_failed(delta: SequenceDelta) -> None:
    """A choice whose sampling failed inside a step (finish_reason 'error': a grammar the
    matcher could not follow, say) fails its request with a 400; the engine and the other
    requests go on. The request's other choices are aborted."""
    if delta.finish_reason == "error":
        raise invalid_request(
            f"generation failed: {delta.error or 'sampling error'}", code="sampling_failed"
        )


def _translate(e: Exception) -> APIError:
    """Engine-side failures as API errors."""
    if isinstance(e, APIError):
        return e
    if isinstance(e, EngineDeadError):
        return engine_unavailable()
    if isinstance(e, StorageUnavailableError):
        return offload_unavailable(str(e))
    if isinstance(e, ValueError):  # the scheduler's RequestError: the caller's 400
        return invalid_request(str(e))
    return APIError(500, f"generation failed: {e}", type="server_error", code="internal_error")
