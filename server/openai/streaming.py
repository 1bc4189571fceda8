"""Server-sent events for `stream: true`: a chunk per delta, an optional usage chunk, `[DONE]`.

Each chunk carries what one choice just gained (`SequenceDelta`): its new text, exactly as
the engine handed it out, so the chunks of a choice join to the text the same request
gets without `stream`. A choice's first chunk carries the chat role or the echoed prompt.
(The Responses API's events: server/openai/endpoints/responses.py.)
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, Callable
from contextlib import aclosing
from json.encoder import encode_basestring
from typing import Any

from engine.core.outputs import ChoiceAccumulator, SequenceDelta
from server.openai.chat_answer import chat_answer
from server.openai.endpoints.generation import GenerateServing
from server.openai.endpoints.prepared import Prepared
from server.openai.errors import APIError
from server.openai.logprobs import chat_logprobs, completion_logprobs
from server.openai.responses import (
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatDelta,
    ChatLogprobs,
    CompletionChoice,
    CompletionChunk,
    CompletionLogprobs,
    sse,
    usage,
)
from server.openai.stream_answer import AnswerStream

_PLACEHOLDER = "\ue000text\ue000"
"""Text no chunk carries verbatim in its other fields (private-use characters)."""
_PLACEHOLDER_JSON = encode_basestring(_PLACEHOLDER).encode()


class _Chunks:
    """The chunks of one streamed request, built with `model_construct`: their fields come
    from the engine and the validated request, so validating each of a stream's thousands of
    chunks again would only cost time (tests/server/test_fuzz.py checks them against the
    schema)."""

    def __init__(self, serving: GenerateServing, prep: Prepared) -> None:
        self.serving, self.prep = serving, prep
        self.sent_chars: dict[int, int] = {}
        """Per choice that has started: characters streamed (the echoed prompt included),
        counted where logprobs need the offsets."""
        head: dict[str, Any] = {"id": prep.request_id, "created": prep.created}
        head |= {"model": prep.model, "system_fingerprint": None}
        if prep.include_usage:
            head["usage"] = None
        self.head = head
        """The fields every chunk starts with (written with `exclude_unset`, as every
        answer is: a chunk leaves out what OpenAI's leave out)."""
        self.answers: dict[int, AnswerStream] = {}
        """Per choice, when its answer is read (reasoning, tools): what it holds back."""
        self._text_only: dict[int, tuple[bytes, bytes]] = {}
        """Per choice: the bytes around the text of a chunk that carries text alone (no
        logprobs, no finish reason), the chunk most of a stream's are."""

    def _text_chunk(self, index: int, text: str, render: Callable[[int, str], bytes]) -> bytes:
        """A text-only chunk of choice `index`: the choice's chunk rendered once with a
        placeholder, then only the text encoded per chunk (the placeholder's JSON string
        swapped for the text's)."""
        around = self._text_only.get(index)
        if around is None:
            before, found, after = render(index, _PLACEHOLDER).partition(_PLACEHOLDER_JSON)
            assert found, "the placeholder is in the rendered chunk"
            around = self._text_only[index] = (before, after)
        return around[0] + encode_basestring(text).encode() + around[1]

    def _chat_text(self, index: int, text: str) -> bytes:
        return self._chat_chunk(index, ChatDelta.model_construct(content=text), None, None)

    def _completion_text(self, index: int, text: str) -> bytes:
        return self._completion_chunk(index, text, None, None)

    def chat(self, choice: ChoiceAccumulator, delta: SequenceDelta) -> bytes:
        """The chunks for what a chat choice gained: its role first, then its text."""
        prep, out = self.prep, b""
        if choice.index not in self.sent_chars:
            self.sent_chars[choice.index] = 0
            role = ChatDelta(role="assistant", content="")
            out = self._chat_chunk(choice.index, role, None, None)
        text = delta.new_text
        if prep.tools is not None or prep.reasoning is not None:
            return out + self._read_chat(choice, delta)
        if prep.num_logprobs is None and delta.finish_reason is None:
            return out + self._text_chunk(choice.index, text, self._chat_text)
        logprobs = self._chat_logprobs(delta)
        fields: dict[str, Any] = {"content": text} if text or not delta.finished else {}
        content = ChatDelta.model_construct(**fields)
        return out + self._chat_chunk(choice.index, content, logprobs, delta.finish_reason)

    def _chat_logprobs(self, delta: SequenceDelta) -> ChatLogprobs | None:
        prep = self.prep
        if prep.num_logprobs is None or not delta.new_token_ids:
            return None
        names, entries = self.serving.token_names(prep), delta.new_logprobs or []
        return chat_logprobs(names, delta.new_token_ids, entries, prep.num_logprobs)

    def _read_chat(self, choice: ChoiceAccumulator, delta: SequenceDelta) -> bytes:
        """The chunks of a choice whose answer is read (reasoning apart, tool calls): the
        delta's logprobs ride on its first chunk, the finish reason on its last."""
        prep = self.prep
        answer = self.answers.get(choice.index)
        if answer is None:
            answer = self.answers[choice.index] = AnswerStream(prep.reasoning, prep.tools)
        deltas = answer.feed(delta.new_text)
        finish_reason = None
        if delta.finish_reason is not None:
            message, finish_reason = chat_answer(prep, choice, delta.finish_reason)
            deltas += answer.finish(message)
        logprobs = self._chat_logprobs(delta)
        if not deltas and (logprobs is not None or finish_reason is not None):
            deltas = [ChatDelta()]
        out = b""
        for k, part in enumerate(deltas):
            last = k == len(deltas) - 1
            lp = logprobs if k == 0 else None
            out += self._chat_chunk(choice.index, part, lp, finish_reason if last else None)
        return out

    def _chat_chunk(
        self, index: int, delta: ChatDelta, logprobs: ChatLogprobs | None, finish_reason: Any
    ) -> bytes:
        choice = ChatChunkChoice.model_construct(
            index=index, delta=delta, logprobs=logprobs, finish_reason=finish_reason
        )
        chunk = ChatCompletionChunk.model_construct(
            **self.head, object="chat.completion.chunk", choices=[choice]
        )
        return sse(chunk)

    def completion(self, choice: ChoiceAccumulator, delta: SequenceDelta) -> bytes:
        """The chunk for what a completion choice gained (none when that is nothing)."""
        prep, serving = self.prep, self.serving
        offset = self.sent_chars.get(choice.index)
        text, prompt_ids, going = delta.new_text, [], delta.finish_reason is None
        if offset is None:  # its first chunk: the echoed prompt, even without text
            if prep.echo:
                prompt_ids = prep.prompts[prep.prompt_index(choice)]
                text = serving.engine.decode(prompt_ids) + text
        elif not text and going and not delta.new_token_ids:
            return b""
        elif prep.num_logprobs is None and going:  # the offsets count for logprobs only
            return self._text_chunk(choice.index, text, self._completion_text)
        logprobs = None
        if prep.num_logprobs is not None:
            logprobs = completion_logprobs(
                serving.engine.decode,
                delta.new_token_ids,
                delta.new_logprobs or [],
                prep.num_logprobs,
                offset or 0,
                prompt_ids,
                choice.prompt_logprobs if prompt_ids else None,
                serving.token_names(prep),
            )
        self.sent_chars[choice.index] = (offset or 0) + len(text)
        return self._completion_chunk(choice.index, text, logprobs, delta.finish_reason)

    def _completion_chunk(
        self, index: int, text: str, logprobs: CompletionLogprobs | None, finish_reason: Any
    ) -> bytes:
        rendered = CompletionChoice.model_construct(
            index=index, text=text, logprobs=logprobs, finish_reason=finish_reason
        )
        chunk = CompletionChunk.model_construct(
            **self.head, object="text_completion", choices=[rendered]
        )
        return sse(chunk)

    def usage(self, choices: dict[int, ChoiceAccumulator]) -> bytes:
        """The last chunk: no choice, the usage of all."""
        prep = self.prep
        generated = sum(len(c.token_ids) for c in choices.values())
        total = usage(prep.num_prompt_tokens, generated, prep.num_cached_tokens(choices.values()))
        head = {**self.head, "usage": total}
        chunk: CompletionChunk | ChatCompletionChunk
        if prep.is_chat:
            chunk = ChatCompletionChunk(**head, object="chat.completion.chunk", choices=[])
        else:
            chunk = CompletionChunk(**head, object="text_completion", choices=[])
        return sse(chunk)


async def stream_chunks(
    serving: GenerateServing, prep: Prepared, priority: int
) -> AsyncGenerator[bytes, None]:
    """SSE bytes for one completion or chat request (`serving`: its endpoint). Errors raised
    before the first chunk propagate as `APIError`; later ones are sent as a final
    `data: {"error": ...}` event."""
    chunks = _Chunks(serving, prep)
    render = chunks.chat if prep.is_chat else chunks.completion
    choices: dict[int, ChoiceAccumulator] = {}
    sent_any = False
    try:
        async with aclosing(serving.outputs(prep, priority)) as outputs:
            async for choice, delta in outputs:
                choices[choice.index] = choice
                chunk = render(choice, delta)
                if chunk:
                    yield chunk
                    sent_any = True
    except APIError as e:
        if not sent_any:
            raise
        yield sse(e.body())
        return
    if prep.include_usage:
        yield chunks.usage(choices)
    yield sse("[DONE]")
