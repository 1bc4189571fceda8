"""`GenerateServing`: an endpoint that generates (completions, chat, responses): its requests'
sampling settings, their prompts run as engine requests and their choices added up.

Each prompt is one engine request of n choices (`<request id>-<prompt index>`, fanned out by
the engine client); choice j of prompt i is the response's choice i * n + j, and one
`ChoiceAccumulator` each adds up its deltas. An unfinished request is aborted whenever its
consumer goes away.
"""

from __future__ import annotations

import abc
import asyncio
import time
from collections.abc import AsyncGenerator, Callable, Sequence
from contextlib import aclosing
from dataclasses import replace

from pydantic import BaseModel

from engine.core.outputs import ChoiceAccumulator, SequenceDelta
from engine.core.sampling_params import SamplingParams
from engine.core.structured import (
    StructuredOutput,
    StructuredOutputError,
    after_harmony_analysis,
    after_reasoning,
)
from engine.runtime.engine_client import EngineDeadError
from server.openai.endpoints.base import Endpoint, api_error
from server.openai.endpoints.prepared import Prepared
from server.openai.errors import APIError, invalid_request
from server.openai.parsers.reasoning import HARMONY
from server.openai.requests import ChatCompletionRequest, CompletionRequest
from server.openai.responses import ChatCompletion, Completion, Usage, usage
from server.openai.responses_api import Response


class GenerateServing(Endpoint):
    """Prepare the sampling settings of, run and add up a generating request."""

    # -- preparation -----------------------------------------------------------------
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
                        check_failed(delta)
                    yield choice, delta
            if unfinished:
                raise EngineDeadError(f"engine ended request {request_id} without finishing it")
        except APIError:  # the request's own (a choice failed): the others end as aborted
            raise
        except Exception as e:
            self.metrics.requests_finished.labels("error").inc(len(unfinished))
            raise api_error(e) from e
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
        return self.body(prep, await self.run_choices(prep, priority))

    async def run_choices(self, prep: Prepared, priority: int) -> list[ChoiceAccumulator]:
        """Every choice run to its end, in choice order (token ids included)."""
        choices: dict[int, ChoiceAccumulator] = {}
        async with aclosing(self.outputs(prep, priority)) as outputs:
            async for choice, _ in outputs:
                choices[choice.index] = choice
        return [choices[i] for i in sorted(choices)]

    @abc.abstractmethod
    def body(
        self, prep: Prepared, choices: list[ChoiceAccumulator]
    ) -> Completion | ChatCompletion | Response:
        """The non-streaming response body of finished choices."""

    def _usage(self, prep: Prepared, choices: list[ChoiceAccumulator]) -> Usage:
        num_generated = sum(len(c.token_ids) for c in choices)
        return usage(prep.num_prompt_tokens, num_generated, prep.num_cached_tokens(choices))

    def token_names(self, prep: Prepared) -> Callable[[Sequence[int]], str]:
        """How logprobs name tokens: their text, or "token_id:<id>" when asked."""
        if prep.tokens_as_ids:
            return lambda ids: "".join(f"token_id:{t}" for t in ids)
        return self.engine.decode


def check_failed(delta: SequenceDelta) -> None:
    """A choice whose sampling failed inside a step (finish_reason 'error': a grammar the
    matcher could not follow, say) fails its request with a 400; the engine and the other
    requests go on. The request's other choices are aborted."""
    if delta.finish_reason == "error":
        raise invalid_request(
            f"generation failed: {delta.error or 'sampling error'}", code="sampling_failed"
        )
