"""Request bodies of the OpenAI API (pydantic, strict types) and their `SamplingParams`.

Unknown fields are refused (OpenAI answers "Unrecognized request argument");
accepted-but-unsupported fields must hold their neutral value.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, StringConstraints, ValidationError

from engine.core.sampling_params import MAX_LOGIT_BIAS, MAX_LOGPROBS, SamplingParams
from engine.core.structured import StructuredOutput
from server.openai.errors import APIError, invalid_request

MAX_N = 16
MAX_STOP = 64
"""Stop strings a request may give. OpenAI takes 4; vLLM has no cap, and evaluation
harnesses send every `until` string of a task plus the EOS text."""
MAX_STOP_TOKEN_IDS = 64
MAX_LOGIT_BIAS_ENTRIES = 1024
"""Tokens one request may bias (OpenAI's cap is 300; vLLM has none)."""
MAX_BAD_WORDS = 256
MAX_ALLOWED_TOKEN_IDS = 1 << 20
INT64 = 2**63
TokenId = Annotated[int, Field(ge=0, lt=INT64)]


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")


class StreamOptions(_Strict):
    include_usage: bool = False


class JsonSchema(BaseModel):
    """`response_format.json_schema`: OpenAI's named schema."""

    model_config = ConfigDict(strict=True, extra="forbid", populate_by_name=True)
    name: str = Field(default="response", max_length=64)
    description: str | None = None
    schema_: dict[str, Any] = Field(default_factory=dict, alias="schema")
    strict: bool | None = None
    """Accepted either way: the output always follows the schema (llguidance's JSON
    grammar), as vLLM does."""


class ResponseFormat(_Strict):
    """OpenAI's `response_format`: text, any JSON object, or JSON following a schema."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchema | None = None


class StructuredOutputs(_Strict):
    """vLLM's `structured_outputs`: exactly one of these constrains the output."""

    json_: dict[str, Any] | str | None = Field(default=None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None


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
    presence_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    logit_bias: dict[str, float] | None = Field(default=None, max_length=MAX_LOGIT_BIAS_ENTRIES)
    response_format: ResponseFormat | None = None
    # vLLM-style extensions
    top_k: int | None = Field(default=None, ge=-1, lt=INT64)
    min_p: float | None = Field(default=None, ge=0.0, le=1.0)
    repetition_penalty: float | None = Field(default=None, gt=0.0, le=100.0)
    min_tokens: int = Field(default=0, ge=0, lt=INT64)
    ignore_eos: bool = False
    stop_token_ids: list[TokenId] | None = Field(default=None, max_length=MAX_STOP_TOKEN_IDS)
    bad_words: list[str] | None = Field(default=None, max_length=MAX_BAD_WORDS)
    allowed_token_ids: list[TokenId] | None = Field(
        default=None, min_length=1, max_length=MAX_ALLOWED_TOKEN_IDS
    )
    structured_outputs: StructuredOutputs | None = None
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

    def logit_biases(self) -> dict[int, float]:
        """`logit_bias` by token id (OpenAI's keys are token ids written as strings)."""
        biases: dict[int, float] = {}
        for key, bias in (self.logit_bias or {}).items():
            if not key.isdigit() or int(key) >= INT64:
                raise invalid_request(
                    f"logit_bias keys must be token ids, got {key!r}", param="logit_bias"
                )
            if not -MAX_LOGIT_BIAS <= bias <= MAX_LOGIT_BIAS:
                raise invalid_request(
                    f"logit_bias values must be in [-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}], "
                    f"got {bias} for token {key}",
                    param="logit_bias",
                )
            biases[int(key)] = bias
        return biases

    def structured(self) -> tuple[StructuredOutput | None, str]:
        """The output constraint and the field that asked for it (`response_format` or
        `structured_outputs`), which a 400 about it names."""
        fmt, spec = self.response_format, self.structured_outputs
        if fmt is not None and fmt.type != "text" and spec is not None:
            raise invalid_request(
                "give response_format or structured_outputs, not both",
                param="structured_outputs",
            )
        if spec is not None:
            return _structured_outputs(spec), "structured_outputs"
        if fmt is None or fmt.type == "text":
            return None, "response_format"
        if fmt.type == "json_object":
            return StructuredOutput("json_object"), "response_format"
        if fmt.json_schema is None:
            raise invalid_request(
                "response_format of type json_schema needs its json_schema",
                param="response_format",
            )
        schema = json.dumps(fmt.json_schema.schema_)
        return StructuredOutput("json", schema), "response_format"

    def sampling_params(
        self,
        max_tokens: int,
        logprobs: int | None,
        echo: bool = False,
        defaults: dict[str, float | int] | None = None,
        structured: StructuredOutput | None = None,
    ) -> SamplingParams:
        """One prompt's settings: its n choices are fanned out by the engine client. A field
        the request leaves out takes `defaults` (the model's generation_config.json), then
        the neutral value. `structured`: the constraint `structured()` read."""
        model = defaults or {}

        def pick(name: str, neutral: float) -> Any:
            value = getattr(self, name)
            return value if value is not None else model.get(name, neutral)

        return SamplingParams(
            n=self.n,
            max_tokens=max_tokens,
            temperature=pick("temperature", 1.0),
            top_p=pick("top_p", 1.0),
            top_k=pick("top_k", 0),
            min_p=pick("min_p", 0.0),
            seed=self.seed,
            stop=self.stop_strings(),
            stop_token_ids=tuple(self.stop_token_ids or ()),
            ignore_eos=self.ignore_eos,
            min_tokens=self.min_tokens,
            presence_penalty=pick("presence_penalty", 0.0),
            frequency_penalty=pick("frequency_penalty", 0.0),
            repetition_penalty=pick("repetition_penalty", 1.0),
            logit_bias=self.logit_biases(),
            allowed_token_ids=(
                None if self.allowed_token_ids is None else tuple(self.allowed_token_ids)
            ),
            bad_words=tuple(self.bad_words or ()),
            structured=structured,
            logprobs=logprobs,
            echo=echo,  # with logprobs, the engine scores the prompt too
        )


def _structured_outputs(spec: StructuredOutputs) -> StructuredOutput:
    given = spec.model_dump(exclude_none=True, by_alias=True)
    if given.get("json_object") is False:
        del given["json_object"]
    if len(given) != 1:
        raise invalid_request(
            "structured_outputs takes exactly one of json, regex, choice, grammar, json_object",
            param="structured_outputs",
        )
    kind, value = next(iter(given.items()))
    if kind == "json_object":
        return StructuredOutput("json_object")
    if kind == "choice":
        return StructuredOutput("choice", json.dumps(value))
    if kind == "json" and not isinstance(value, str):
        value = json.dumps(value)
    return StructuredOutput(kind, value)


class CompletionRequest(_Sampling):
    """POST /v1/completions."""

    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = Field(default=16, ge=0)
    """0 only with `echo`: the prompt's logprobs, nothing generated (vLLM's)."""
    logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    echo: bool = False
    best_of: int | None = Field(default=None, ge=1)
    suffix: None = None


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

    def num_logprobs(self) -> int | None:
        if self.top_logprobs is not None and not self.logprobs:
            raise invalid_request("top_logprobs requires logprobs to be true", param="top_logprobs")
        return (self.top_logprobs or 0) if self.logprobs else None


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
