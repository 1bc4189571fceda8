"""Structured outputs: what a request constrains its output to, as an llguidance grammar.

The grammar engine is llguidance (PyPI `llguidance`): Rust, no dependencies, no torch, so
the torch-free daemon can check a request's grammar before it is accepted, and the engine
process builds each sequence's matcher from the same text (`engine/executor/grammar.py`).
It compiles lazily (no per-schema precomputation over the vocabulary, which xgrammar does
and caches), so a new schema costs its first tokens a little, not a compile step, and it
bounds the work of each token (`LLParserLimits`). xgrammar, the other engine vLLM ships,
needs torch and triton.
"""

from __future__ import annotations

import functools
import json
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from typing import Any

from base.errors import UserError

KINDS = ("json", "json_object", "regex", "choice", "grammar")
"""vLLM's `structured_outputs` fields; OpenAI's `response_format` maps onto the first two."""
CHECK_SECONDS = 10.0
"""The most a request's grammar may take to build and check before it is refused."""
MAX_CHOICES = 1024
END_OF_THINKING = "</think>"


class StructuredOutputError(UserError, ValueError):
    """A grammar, schema, regex or choice list that cannot be used (the request's fault)."""


@dataclass(frozen=True, slots=True)
class StructuredOutput:
    """One request's constraint: `kind` (KINDS) and its text: a JSON schema as JSON (json),
    nothing (json_object: any JSON object), a regex, a JSON list of strings (choice), or a
    Lark grammar (grammar; GBNF, as llama.cpp writes it, is converted; llguidance's JSON
    form of several named grammars passes as it is)."""

    kind: str
    value: str = ""

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise StructuredOutputError(f"structured output kind must be one of {KINDS}")

    @property
    def grammar(self) -> str:
        """llguidance's grammar text for this constraint (checked by `check`)."""
        return _grammar(self)


@functools.lru_cache(maxsize=1024)
def _grammar(spec: StructuredOutput) -> str:
    from llguidance import LLMatcher

    if spec.kind == "json":
        try:
            return LLMatcher.grammar_from_json_schema(spec.value)
        except ValueError as e:
            raise StructuredOutputError(f"the JSON schema is not a JSON object: {e}") from e
    if spec.kind == "json_object":
        return LLMatcher.grammar_from_json_schema('{"type": "object"}')
    if spec.kind == "regex":
        return LLMatcher.grammar_from_regex(spec.value)
    if spec.kind == "choice":
        try:
            choices = json.loads(spec.value)
        except ValueError as e:
            raise StructuredOutputError(f"choice is not a JSON list: {e}") from e
        if (
            not isinstance(choices, list)
            or not choices
            or len(choices) > MAX_CHOICES
            or not all(isinstance(c, str) and c for c in choices)
        ):
            raise StructuredOutputError(
                f"choice must be a list of 1 to {MAX_CHOICES} non-empty strings"
            )
        lark = "start: " + " | ".join(json.dumps(c) for c in dict.fromkeys(choices))
        return LLMatcher.grammar_from_lark(lark)
    text = spec.value
    if text.lstrip().startswith("{"):  # llguidance's JSON form, as `after_reasoning` nests
        return text
    if "::=" in text:  # GBNF (llama.cpp, xgrammar): llguidance's own converter
        from llguidance.gbnf_to_lark import gbnf_to_lark

        try:
            text = gbnf_to_lark(text)
        except Exception as e:  # the converter raises plain exceptions on bad input
            raise StructuredOutputError(f"the GBNF grammar cannot be read: {e}") from e
    return LLMatcher.grammar_from_lark(text)


@functools.cache
def _pool() -> ThreadPoolExecutor:
    return ThreadPoolExecutor(2, thread_name_prefix="nanoflex-grammar")


@functools.lru_cache(maxsize=1024)
def _validate(spec: StructuredOutput) -> str:
    from llguidance import LLMatcher

    return LLMatcher.validate_grammar(spec.grammar)


def check(spec: StructuredOutput, timeout: float = CHECK_SECONDS) -> None:
    """Build and check `spec`'s grammar off the caller's thread, cached by spec, within
    `timeout` seconds; StructuredOutputError saying what is wrong (or too slow)."""
    future = _pool().submit(_validate, spec)
    try:
        error = future.result(timeout)
    except FutureTimeout as e:
        raise StructuredOutputError(
            f"the {spec.kind} constraint took over {timeout:g} s to build; simplify it"
        ) from e
    if error:
        raise StructuredOutputError(f"invalid {spec.kind} constraint: {error.strip()}")


_SUBSCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
_SUBSCHEMA_MAPS = ("properties", "$defs", "definitions", "patternProperties")
_SUBSCHEMAS = ("items", "additionalProperties", "not", "if", "then", "else", "contains")


def closed_schema(schema: Any) -> Any:
    """`schema` with every object that declares `properties` but says nothing of
    `additionalProperties` closed to undeclared keys: vLLM's default backend (xgrammar,
    strict mode) reads such a schema so, and without it a model may add keys until
    max_tokens. A schema that states `additionalProperties` keeps it (docs/api.md)."""
    if isinstance(schema, list):
        return [closed_schema(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    for key in _SUBSCHEMA_LISTS:
        if isinstance(out.get(key), list):
            out[key] = [closed_schema(s) for s in out[key]]
    for key in _SUBSCHEMA_MAPS:
        if isinstance(out.get(key), dict):
            out[key] = {name: closed_schema(s) for name, s in out[key].items()}
    for key in _SUBSCHEMAS:
        if isinstance(out.get(key), dict):
            out[key] = closed_schema(out[key])
    stated = "additionalProperties" in out or "unevaluatedProperties" in out
    if isinstance(out.get("properties"), dict) and not stated:
        out["additionalProperties"] = False
    return out


def after_reasoning(spec: StructuredOutput, opened: bool) -> StructuredOutput:
    """`spec` applied to a thinking model's answer only: first a think block of any text up
    to `</think>` (optional, opening with `<think>`, unless the prompt `opened` it), then
    blanks, then the answer `spec` constrains, as vLLM enables the grammar only once the
    reasoning has ended. A Lark or GBNF `grammar` keeps its own rules: it is nested whole as
    the answer's sub-grammar (llguidance's `@name` reference in its JSON form); one that
    spells `</think>` itself (a grammar that bounds the reasoning too) holds the whole
    output, as it is."""
    if spec.kind == "grammar" and END_OF_THINKING in spec.value:
        return spec
    answer = "@answer" if spec.kind == "grammar" else _answer_rule(spec)
    think = "think" if opened else '("<think>" think)?'
    lark = (
        f'start: {think} /[ \\t\\r\\n]*/ answer\nthink[stop="{END_OF_THINKING}"]: /(?s:.*)/\n'
        f"answer: {answer}\n"
    )
    if spec.kind == "grammar":
        nested = {"name": "answer", "lark_grammar": spec.grammar}
        return StructuredOutput(
            "grammar", json.dumps({"grammars": [{"lark_grammar": lark}, nested]})
        )
    return StructuredOutput("grammar", lark)


def after_harmony_analysis(spec: StructuredOutput) -> StructuredOutput:
    """`spec` applied to gpt-oss's final channel only: an optional analysis message of any
    text (harmony's special tokens around it: `<|channel|>analysis<|message|>` ...
    `<|end|><|start|>assistant`), then `<|channel|>final<|message|>` and the answer `spec`
    constrains. A Lark or GBNF `grammar` stays as it is."""
    if spec.kind == "grammar":
        return spec
    lark = (
        'start: analysis? <|channel|> "final" <|message|> answer\n'
        f"{_HARMONY_ANALYSIS}\n"
        f"answer: {_answer_rule(spec)}\n"
    )
    return StructuredOutput("grammar", lark)


_HARMONY_ANALYSIS = (
    'analysis: <|channel|> "analysis" <|message|> /(?s:.*)/ <|end|> <|start|> "assistant"'
)
"""An analysis message of any text, then the next message's start (a Lark rule)."""


def harmony_calls(schemas: dict[str, str], parallel: bool) -> StructuredOutput:
    """gpt-oss's forced tool call: an optional analysis message, then a call, a commentary
    message to `functions.<name>` whose JSON arguments follow that function's schema
    (`schemas`: name to JSON schema text), ended by `<|call|>`; more calls after it when
    `parallel` (gpt-oss stops at `<|call|>`, a stop token, so it writes one)."""
    rules = [
        f"call_{k}: <|channel|> {json.dumps(f'commentary to=functions.{name} ')} <|constrain|> "
        f'"json" <|message|> %json {schema} <|call|>'
        for k, (name, schema) in enumerate(schemas.items())
    ]
    calls = 'call (<|start|> "assistant" call)*' if parallel else "call"
    lark = (
        f"start: analysis? {calls}\n{_HARMONY_ANALYSIS}\n"
        f"call: {' | '.join(f'call_{k}' for k in range(len(rules)))}\n" + "\n".join(rules) + "\n"
    )
    return StructuredOutput("grammar", lark)


def _answer_rule(spec: StructuredOutput) -> str:
    """A json, json_object, choice or regex `spec` as the body of a Lark rule."""
    if spec.kind in ("json", "json_object"):
        return "%json " + (spec.value if spec.kind == "json" else '{"type": "object"}')
    if spec.kind == "choice":
        return " | ".join(json.dumps(c) for c in dict.fromkeys(json.loads(spec.value)))
    return "/" + spec.value.replace("/", "\\/") + "/"
