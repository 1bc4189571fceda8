"""Request bodies of the OpenAI API (pydantic, strict types) and their `SamplingParams`.

Unknown fields are refused (OpenAI answers "Unrecognized request argument"). Every field
OpenAI or vLLM defines is accepted: implemented; or, where it has no meaning here (`store`,
`metadata`, `service_tier`...), accepted and ignored with one warning line naming it, the
first time it comes (`IGNORED`); or, where it would change the answer in a way nanoflex does
not implement (`use_beam_search`...), accepted at its neutral value only (`NEUTRAL`).
"""

from __future__ import annotations

import json
import logging
from typing import Annotated, Any, ClassVar, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, StringConstraints, ValidationError

from engine.core.sampling_params import MAX_LOGIT_BIAS, MAX_LOGPROBS, SamplingParams
from engine.core.structured import StructuredOutput, closed_schema
from server.openai.errors import APIError, invalid_request

logger = logging.getLogger("nanoflex.server")

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

IGNORED_FIELDS = frozenset(
    {
        # OpenAI's: storage, billing, routing and other modalities' settings
        "store",
        "metadata",
        "service_tier",
        "prompt_cache_key",
        "prompt_cache_retention",
        "safety_identifier",
        "verbosity",
        "prediction",
        "web_search_options",
        # vLLM's: scheduling, caching and multimodal settings of its own engine
        "priority",
        "request_id",
        "cache_salt",
        "kv_transfer_params",
        "vllm_xargs",
        "mm_processor_kwargs",
        "media_io_kwargs",
        "logits_processors",
        "guided_decoding_backend",
        "guided_whitespace_pattern",
        "structural_tag",
        "spaces_between_special_tokens",
        "length_penalty",
        "return_token_ids",
        "add_special_tokens",
        "documents",
        "chat_template",
        "thinking_token_budget",
        "max_thinking_tokens",
    }
)
"""Fields OpenAI or vLLM define that have no meaning here: accepted, ignored, named once
in the log (docs/api.md, "Accepted and ignored"). `chat_template`: the served model's own
template is always used."""
NEUTRAL_FIELDS: dict[str, Any] = {
    "use_beam_search": False,
    "include_stop_str_in_output": False,
    "prompt_logprobs": None,
    "truncate_prompt_tokens": None,
}
"""Fields that would change the answer in ways nanoflex does not implement: accepted at
these values only."""
MAX_TOOLS = 128


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
    skip_special_tokens: bool = True
    stop_token_ids: list[TokenId] | None = Field(default=None, max_length=MAX_STOP_TOKEN_IDS)
    bad_words: list[str] | None = Field(default=None, max_length=MAX_BAD_WORDS)
    allowed_token_ids: list[TokenId] | None = Field(
        default=None, min_length=1, max_length=MAX_ALLOWED_TOKEN_IDS
    )
    structured_outputs: StructuredOutputs | None = None
    guided_json: dict[str, Any] | str | None = None
    """vLLM's older names for `structured_outputs`' fields."""
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
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
        guided = {
            "json": self.guided_json,
            "regex": self.guided_regex,
            "choice": self.guided_choice,
            "grammar": self.guided_grammar,
        }
        if any(v is not None for v in guided.values()):
            if spec is not None:
                raise invalid_request(
                    "give structured_outputs or the guided_* fields, not both",
                    param="structured_outputs",
                )
            spec = StructuredOutputs.model_validate(
                {k: v for k, v in guided.items() if v is not None}
            )
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
        schema = json.dumps(closed_schema(fmt.json_schema.schema_))
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
            skip_special_tokens=self.skip_special_tokens,
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
    if kind == "json":
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except ValueError as e:
                raise invalid_request(
                    f"structured_outputs.json is not JSON: {e}", param="structured_outputs"
                ) from e
        value = json.dumps(closed_schema(value))
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

    add_special_tokens: bool = True
    """vLLM's: a text prompt gets the model's usual special tokens (BOS)."""

    IGNORED: ClassVar[frozenset[str]] = IGNORED_FIELDS - {
        "chat_template", "documents", "add_special_tokens"
    }  # fmt: skip
    NEUTRAL: ClassVar[dict[str, Any]] = NEUTRAL_FIELDS | {"prompt_embeds": None}


class FunctionCall(_Strict):
    name: str
    arguments: str | dict[str, Any] = ""


class ToolCallIn(BaseModel):
    """An assistant message's tool call, as a client sends it back."""

    model_config = ConfigDict(strict=True, extra="ignore")
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    role: Literal["system", "developer", "user", "assistant", "tool", "function"]
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    tool_calls: list[ToolCallIn] | None = None
    tool_call_id: str | None = None
    function_call: FunctionCall | None = None
    """The legacy form of an assistant's call."""
    reasoning_content: str | None = None


class FunctionDef(_Strict):
    name: Annotated[
        str, StringConstraints(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.\-]+$")
    ]
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(_Strict):
    type: Literal["function"]
    function: FunctionDef


class NamedFunction(_Strict):
    name: str


class NamedToolChoice(_Strict):
    type: Literal["function"]
    function: NamedFunction


class ChatCompletionRequest(_Sampling):
    """POST /v1/chat/completions."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)

    tools: list[Tool] | None = Field(default=None, max_length=MAX_TOOLS)
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    functions: list[FunctionDef] | None = Field(default=None, max_length=MAX_TOOLS)
    function_call: Literal["none", "auto"] | NamedFunction | None = None
    # vLLM's chat template controls
    chat_template_kwargs: dict[str, Any] | None = None
    """Extra variables for the chat template (`enable_thinking`, ...)."""
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    """The answer continues the last (assistant) message instead of starting a new one."""
    reasoning_effort: Literal["none", "minimal", "low", "medium", "high"] | None = None
    """Passed to the chat template as `reasoning_effort` (gpt-oss reads it)."""
    modalities: list[Literal["text"]] | None = None
    audio: None = None

    IGNORED: ClassVar[frozenset[str]] = IGNORED_FIELDS
    NEUTRAL: ClassVar[dict[str, Any]] = NEUTRAL_FIELDS | {"echo": False}

    def num_logprobs(self) -> int | None:
        if self.top_logprobs is not None and not self.logprobs:
            raise invalid_request("top_logprobs requires logprobs to be true", param="top_logprobs")
        return (self.top_logprobs or 0) if self.logprobs else None


BatchEndpoint = Literal[
    "/v1/completions",
    "/v1/chat/completions",
    "/v1/responses",
    "/v1/embeddings",
    "/v1/score",
    "/v1/rerank",
]
"""The routes a batch's lines may call (server/batch/lines.py's ENDPOINTS)."""


class BatchCreateRequest(_Strict):
    """POST /v1/batches."""

    input_file_id: str
    endpoint: BatchEndpoint
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
_warned: set[str] = set()


def _accept_known(model: type[BaseModel], body: dict[str, Any]) -> dict[str, Any]:
    """`body` without the fields nanoflex accepts and ignores (a warning line naming each,
    the first time it comes); a NEUTRAL field at another value is a 400 naming it."""
    neutral: dict[str, Any] = getattr(model, "NEUTRAL", {})
    for name, value in neutral.items():
        if name in body and body[name] != value and not (value is None and body[name] is None):
            raise invalid_request(
                f"{name} is not implemented by nanoflex; leave it out or send {json.dumps(value)}.",
                param=name,
                code="unsupported_parameter",
            )
    ignored: frozenset[str] = getattr(model, "IGNORED", frozenset())
    dropped = [name for name in body if name in ignored or name in neutral]
    if not dropped:
        return body
    new = sorted(n for n in dropped if n not in _warned and n in ignored)
    if new:
        _warned.update(new)
        logger.warning(
            "request fields accepted and ignored (no meaning in nanoflex; said once): %s",
            ", ".join(new),
        )
    return {k: v for k, v in body.items() if k not in dropped}


def parse_body(model: type[M], body: Any) -> M:
    """Validate a decoded JSON body; any problem becomes a 400 naming the field."""
    if not isinstance(body, dict):
        raise invalid_request("The request body must be a JSON object.", code="invalid_json")
    body = _accept_known(model, body)
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
    "modalities": "The served model answers in text only: modalities takes ['text']",
    "audio": "The served model answers in text only: leave audio out",
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
