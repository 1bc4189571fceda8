"""`CompletionServing`: POST /v1/completions, a prompt (text or token ids, one or several)
continued, and its answer written as a `Completion` (echo and logprobs included)."""

from __future__ import annotations

from collections.abc import AsyncGenerator
from typing import Any

from engine.core.outputs import ChoiceAccumulator
from server.openai.endpoints.generation import GenerateServing
from server.openai.endpoints.prepared import Prepared
from server.openai.errors import invalid_request
from server.openai.logprobs import completion_logprobs
from server.openai.requests import CompletionRequest, parse_body
from server.openai.responses import Completion, CompletionChoice, new_id, now
from server.openai.streaming import stream_chunks


class CompletionServing(GenerateServing):
    """Prepare, run and write completion requests."""

    def _prepare(self, body: Any) -> Prepared:
        self._precheck_prompt(body)
        req = parse_body(CompletionRequest, body)
        if req.best_of not in (None, req.n):
            raise invalid_request("best_of must equal n (or be omitted)", param="best_of")
        self._check_model(req.model)
        prompts = self._completion_prompts(req.prompt, req.n, req.add_special_tokens)
        params = self._sampling_params(req, prompts, req.max_tokens, req.logprobs, req.echo)
        return Prepared(
            is_chat=False,
            request_id=new_id("cmpl-"),
            created=now(),
            model=self.model_name,
            prompts=prompts,
            params=params,
            n=req.n,
            echo=req.echo,
            num_logprobs=req.logprobs,
            stream=req.stream,
            include_usage=req.include_usage(),
            tokens_as_ids=req.return_tokens_as_token_ids,
        )

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

    def body(self, prep: Prepared, choices: list[ChoiceAccumulator]) -> Completion:
        return Completion(
            id=prep.request_id,
            created=prep.created,
            model=prep.model,
            system_fingerprint=None,
            object="text_completion",
            choices=[self.choice(prep, choice) for choice in choices],
            usage=self._usage(prep, choices),
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

    def stream(self, prep: Prepared, priority: int) -> AsyncGenerator[bytes, None]:
        return stream_chunks(self, prep, priority)
