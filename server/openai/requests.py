"""Request bodies of the OpenAI API (pydantic, strict types) and their `SamplingParams`.

Unknown fields are refused (OpenAI answers "Unrecognized request argument");
accepted-but-unsupported fields must hold their neutral value.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, StringConstraints, ValidationError

from engine.core.sampling_params import MAX_LOGPROBS, SamplingParams
from server.openai.errors import APIError, invalid_request

MAX_N = 16
MAX_STOP = 64
"""Stop strings a request may give. OpenAI takes 4; vLLM has no cap, and evaluation
harnesses send every `until` string of a task plus the EOS text."""
MAX_STOP_TOKEN_IDS = 64
INT64 = 2**63


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")


class StreamOptions(_Strict):
    include_usage: bool = False


class _Sampling(_Strict):
    """Fields shared by completions and chat."""

    model: str
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    n: int = Field(default=1, ge=1, le=MAX_N)
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = Field(default=None, ge=-INT64, lt=INT64)
    user: str | None = None
    presence_penalty: float | None = Field(default=None, ge=0.0, le=0.0)
    frequency_penalty: float | None = Field(default=None, ge=0.0, le=0.0)
    # vLLM-style extensions
    top_k: int | None = Field(default=None, ge=-1, lt=INT64)
    ignore_eos: bool = False
    stop_token_ids: list[Annotated[int, Field(ge=0, lt=INT64)]] | None = Field(
        default=None, max_length=MAX_STOP_TOKEN_IDS
    )
    return_tokens_as_token_ids: bool = False
    """vLLM's: logprobs name each token "token_id:<id>" instead of its text, so that two
    tokens with the same text (pieces of one character, say) stay apart in `top_logprobs`."""

    def stop_strings(self) -> tuple[str, ...]:
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        if len(stop) > MAX_STOP:
            raise invalid_request(f"stop takes at most {MAX_STOP} sequences", param="stop")
        if any(not s for s in stop):
            raise invalid_request("stop sequences must be non-empty strings", param="stop")
        return tuple(stop)

    def include_usage(self) -> bool:
        if self.stream_options is not None and not self.stream:
            raise invalid_request(
                "stream_options is only allowed when stream is true", param="stream_options"
            )
        return bool(self.stream_options and self.stream_options.include_usage)

    def sampling_params(
        self, max_tokens: int, logprobs: int | None, echo: bool = False
    ) -> SamplingParams:
        """One prompt's settings: its n choices are fanned out by the engine client."""
        return SamplingParams(
            n=self.n,
            max_tokens=max_tokens,
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=self.top_k or 0,
            seed=self.seed,
            stop=self.stop_strings(),
            stop_token_ids=tuple(self.stop_token_ids or ()),
            ignore_eos=self.ignore_eos,
            logprobs=logprobs,
            echo=echo,  # with logprobs, the engine scores the prompt too
        )


class CompletionRequest(_Sampling):
    """POST /v1/completions."""

    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = Field(default=16, ge=1)
    logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    echo: bool = False
    best_of: int | None = Field(default=None, ge=1)
    suffix: None = None
    logit_bias: dict[str, float] | None = Field(default=None, max_length=0)


class TextPart(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(part.text for part in self.content)
        return self.content or ""


class ChatCompletionRequest(_Sampling):
    """POST /v1/chat/completions."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    response_format: dict[str, Any] | None = None
    logit_bias: dict[str, float] | None = Field(default=None, max_length=0)

    def num_logprobs(self) -> int | None:
        if self.top_logprobs is not None and not self.logprobs:
            raise invalid_request("top_logprobs requires logprobs to be true", param="top_logprobs")
        return (self.top_logprobs or 0) if self.logprobs else None

    def check_supported(self) -> None:
        fmt = (self.response_format or {}).get("type", "text")
        if fmt != "text":
            raise invalid_request(
                f"response_format type {fmt!r} is not supported; use 'text'",
                param="response_format",
            )


class BatchCreateRequest(_Strict):
    """POST /v1/batches."""

    input_file_id: str
    endpoint: Literal["/v1/completions", "/v1/chat/completions"]
    completion_window: Literal["24h"]
    metadata: (
        dict[
            Annotated[str, StringConstraints(max_length=64)],
            Annotated[str, StringConstraints(max_length=512)],
        ]
        | None
    ) = Field(default=None, max_length=16)
    """OpenAI's limits: 16 pairs, keys of up to 64 characters, values of up to 512."""


M = TypeVar("M", bound=BaseModel)


def parse_body(model: type[M], body: Any) -> M:
    """Validate a decoded JSON body; any problem becomes a 400 naming the field."""
    if not isinstance(body, dict):
        raise invalid_request("The request body must be a JSON object.", code="invalid_json")
    try:
        return model.model_validate(body)
    except ValidationError as e:
        first = e.errors()[0]
        param = _param(first["loc"])
        message = UNION_HINTS.get(param.split(".")[0]) or first["msg"]
        code = "unrecognized_argument" if first["type"] == "extra_forbidden" else "invalid_value"
        where = f" at '{param}'" if param else ""
        raise APIError(400, f"{message}{where}.", param=param or None, code=code) from e


UNION_HINTS = {
    "prompt": "prompt must be a string, a list of strings, a list of token ids "
    "or a list of token-id lists",
    "stop": "stop must be a string or a list of strings",
}


def _param(loc: tuple[int | str, ...]) -> str:
    """'messages.0.content' from pydantic's location, dropping union member tags."""
    parts: list[str] = []
    for part in loc:
        if isinstance(part, str) and (not part.isidentifier() or not part.islower()):
            break  # a union member tag such as 'list[int]' or 'TextPart'
        if part in ("str", "int", "float", "bool", "dict", "list", "none"):
            break
        parts.append(str(part))
    return ".".join(parts)


class TokenizeRequest(_Strict):
    """POST /tokenize (vLLM's): a completion prompt's text, or a chat's messages rendered
    with the model's template and the generation prompt."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    """With `prompt`: the model's usual special tokens (BOS), as a completion prompt gets."""


class DetokenizeRequest(_Strict):
    """POST /detokenize (vLLM's): token ids to text, special tokens skipped."""

    model: str | None = None
    tokens: list[Annotated[int, Field(ge=0, lt=INT64)]]
