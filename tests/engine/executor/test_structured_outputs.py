"""Structured outputs on the default (trained) model: every output of a JSON-schema request
parses and validates against its schema, greedy and sampled, through preemption; regex,
choice and grammar constraints hold; a constraint that fails inside a step fails its own
request alone."""

from __future__ import annotations

import json
import re
from pathlib import Path

import jsonschema
import pytest

from engine import LLM, SamplingParams
from engine.core.outputs import ChoiceAccumulator
from engine.core.structured import StructuredOutput, StructuredOutputError, check
from engine.core.tokenizer import Tokenizer
from policy import Policy

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "minLength": 2, "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "height_m": {"type": "number"},
        "role": {"enum": ["admin", "user", "guest"]},
        "quote": {"type": "string", "maxLength": 40},
        "address": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 16},
                "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
            },
            "required": ["city", "zip"],
            "additionalProperties": False,
        },
        "tags": {
            "type": "array",
            "items": {"type": "string", "maxLength": 10},
            "minItems": 1,
            "maxItems": 3,
        },
    },
    "required": ["name", "age", "height_m", "role", "quote", "address", "tags"],
    "additionalProperties": False,
}
ASKS = [
    "Describe a fictional person as JSON.",
    'Give me a user record; put a quote with "double quotes" and a \\ backslash in it.',
    "Invent an admin who lives in Paris.",
    "A guest, 7 years old, with three tags.",
]


@pytest.fixture(scope="module")
def llm(smollm2_dir: Path):
    """The default model with a block of 8: every ask greedy and sampled in one batch."""
    with LLM(str(smollm2_dir), policy=Policy(gpu_batch_size=8, num_gpu_batches=1)) as llm:
        yield llm


def chat(llm: LLM, text: str) -> list[int]:
    assert llm.tokenizer is not None
    return llm.tokenizer.apply_chat_template([{"role": "user", "content": text}])


def json_params(**kw: object) -> SamplingParams:
    spec = StructuredOutput("json", json.dumps(PERSON))
    # every string and array is bounded: an output ends within max_tokens whatever it samples
    return SamplingParams(**{"max_tokens": 300, "structured": spec, **kw})  # type: ignore[arg-type]


def test_json_schema_outputs_parse_and_validate(llm):
    """Every ask greedy (temperature 0) and sampled (temperature 1), all eight in one batch."""
    temperatures = [0.0] * len(ASKS) + [1.0] * len(ASKS)
    params = [json_params(temperature=t, seed=i % len(ASKS)) for i, t in enumerate(temperatures)]
    outputs = llm.generate([chat(llm, a) for a in ASKS + ASKS], params)
    assert len(outputs) == 2 * len(ASKS)
    for out in outputs:
        choice = out.outputs[0]
        assert choice.finish_reason == "stop", choice.text
        jsonschema.validate(json.loads(choice.text), PERSON)


def test_masks_beside_the_layers_give_the_same_tokens(llm):
    """The GPU's setting (masks built on a worker while the layers run) and the CPU's (built
    after them, on the step's thread) give the same tokens; the first overlaps, the second
    waits for every mask it builds."""
    sampler = llm.executor.sampler
    params = [json_params(temperature=0.0, max_tokens=20) for _ in ASKS]
    prompts = [chat(llm, a) for a in ASKS]
    texts = {}
    for overlap in (False, True):
        sampler.overlap_masks = overlap
        sampler.mask_seconds = sampler.mask_wait_seconds = 0.0
        texts[overlap] = [out.outputs[0].text for out in llm.generate(prompts, params)]
        assert sampler.mask_seconds > 0
        if not overlap:  # every mask is built while the step waits for it
            assert sampler.mask_wait_seconds >= sampler.mask_seconds
    sampler.overlap_masks = False
    assert texts[True] == texts[False]


def test_json_survives_preemption_and_recompute(smollm2_dir):
    """Short requests first teach admission that outputs are 2 tokens long (NanoFlow's
    estimate); then four long constrained ones join on 20 KV pages and outgrow them: some
    are preempted, their KV dropped, and recomputed; each new matcher replays the output so
    far, and every answer still validates."""
    policy = Policy(gpu_batch_size=4, num_gpu_batches=1)
    with LLM(str(smollm2_dir), policy=policy, device="cpu", kv_capacity_pages={"gpu": 20}) as llm:
        llm.generate([chat(llm, a) for a in ASKS], SamplingParams(max_tokens=2))
        # each alone fits 20 pages (320 tokens); four of them at ~100 tokens each do not
        params = [json_params(temperature=0.8, seed=10 + i, max_tokens=200) for i in range(4)]
        outputs = llm.generate([chat(llm, a) for a in ASKS], params)
        assert llm.scheduler.num_preemptions > 0, "the test should preempt"
    for out in outputs:
        jsonschema.validate(json.loads(out.outputs[0].text), PERSON)


def test_regex_choice_and_grammar(llm):
    prompts = [chat(llm, "What is the capital of France? Answer in one word.")] * 4
    specs = [
        StructuredOutput("regex", r"[A-Z][a-z]+, (19|20)\d\d"),
        StructuredOutput("choice", json.dumps(["yes", "no", "maybe so"])),
        StructuredOutput("grammar", 'start: "(" NUMBER ("," NUMBER)* ")"\n%import common.NUMBER'),
        StructuredOutput("grammar", 'root ::= "A" | "B" "C"'),  # GBNF, converted
    ]
    outputs = llm.generate(prompts, [SamplingParams(max_tokens=30, structured=s) for s in specs])
    texts = [o.outputs[0].text for o in outputs]
    assert re.fullmatch(r"[A-Z][a-z]+, (19|20)\d\d", texts[0])
    assert texts[1] in ("yes", "no", "maybe so")
    assert re.fullmatch(r"\(\d+(\.\d+)?(,\d+(\.\d+)?)*\)", texts[2]), texts[2]
    assert texts[3] in ("A", "BC")


def test_json_object_gives_an_object(llm):
    # greedy: an open object sampled at temperature 1 may well outrun any max_tokens
    spec = StructuredOutput("json_object")
    params = SamplingParams(max_tokens=120, temperature=0.0, structured=spec)
    out = llm.generate([chat(llm, "Any JSON, please.")], params)[0].outputs[0]
    assert out.finish_reason == "stop", out.text
    assert isinstance(json.loads(out.text), dict)


def test_bad_constraints_are_refused_before_they_run(llm):
    for spec, words in [
        (StructuredOutput("regex", "(unclosed"), "invalid regex constraint"),
        (StructuredOutput("json", '{"type": "strin"}'), "invalid json constraint"),
        (StructuredOutput("json", "[1, 2"), "invalid json constraint"),
        (StructuredOutput("choice", "[]"), "choice must be a list"),
        (StructuredOutput("grammar", "start: undefined_rule"), "invalid grammar constraint"),
    ]:
        with pytest.raises(StructuredOutputError, match=words):
            check(spec)
        with pytest.raises(StructuredOutputError):
            llm.generate(["x"], SamplingParams(structured=spec))
    with pytest.raises(StructuredOutputError, match="kind must be one of"):
        StructuredOutput("yaml", "")


def test_a_request_whose_constraint_fails_in_a_step_fails_alone(llm, smollm2_dir):
    """Only "yes" or "no" is grammatical, and only token 0 allowed: nothing is left, so that
    request ends with finish_reason 'error'; the others in the same step finish normally."""
    yes = Tokenizer(smollm2_dir).encode("yes", add_special_tokens=False)
    doomed = SamplingParams(
        max_tokens=5,
        structured=StructuredOutput("choice", '["yes", "no"]'),
        allowed_token_ids=(0,),
    )
    fine = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)
    bad_bias = SamplingParams(max_tokens=5, logit_bias={10**9: 1.0})  # past the vocabulary
    prompts = [chat(llm, "Yes or no?")] * 3
    core = llm.step_loop  # past LLM.generate's checks, as a request crossing a process would be
    from engine.core.sequence import Request

    for i, p in enumerate([doomed, fine, bad_bias]):
        core.add_request(Request(f"r{i}", prompts[i], p))
    finished = {f"r{i}": ChoiceAccumulator(0) for i in range(3)}
    while core.has_unfinished():
        for delta in core.step():
            finished[delta.request_id].add(delta)
    assert finished["r0"].finish_reason == "error"
    assert "no token is allowed" in (finished["r0"].error or "")
    assert finished["r1"].finish_reason == "length" and len(finished["r1"].token_ids) == 5
    assert finished["r2"].finish_reason == "error"
    assert "sampling settings" in (finished["r2"].error or "")
    assert yes  # the grammar's words are real tokens of this model
