"""`TokenizationServing`: the served tokenizer (vLLM's POST /tokenize, POST /detokenize and
GET /tokenizer_info), so that a harness counts and cuts with it instead of guessing one."""

from __future__ import annotations

from typing import Any

from engine.runtime.engine_client import EngineDeadError
from server.openai.chat_format import chat_ids, template_messages
from server.openai.endpoints.base import ServingBase
from server.openai.errors import engine_unavailable, invalid_request
from server.openai.requests import DetokenizeRequest, TokenizeRequest, parse_body
from server.openai.responses import Detokenized, Tokenized, TokenizerInfo


class TokenizationServing(ServingBase):
    """Tokenize, detokenize and describe the served tokenizer."""

    def tokenize(self, body: Any) -> Tokenized:
        """A prompt's token ids as a completion or chat request would get them."""
        try:
            req = parse_body(TokenizeRequest, body)
            if req.model is not None:
                self._check_model(req.model)
            if (req.prompt is None) == (req.messages is None):
                raise invalid_request("give one of prompt or messages", param="prompt")
            if req.messages is not None:
                messages = template_messages(req.messages)
                template = self.engine.tokenizer_info().get("chat_template")
                ids = chat_ids(self.engine, messages, template, self._check_text_bytes)
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
