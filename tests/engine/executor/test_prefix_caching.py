"""Prefix caching through the real executor: cached KV reused, spilled down the tiers and
loaded back, with greedy tokens equal to transformers' and to the cache switched off."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from engine import LLM, SamplingParams
from policy import Policy
from tests.engine.tiny_models import NEW_FAMILIES, TINY_CONFIGS, hf_greedy, random_prompts

GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)


def prompts_sharing(kind: str) -> list[list[int]]:
    """A 40-token system prompt (2 full pages and a half) with different tails, an exact
    duplicate, and a prompt that is a prefix of another."""
    vocab = int(TINY_CONFIGS[kind]["vocab_size"])  # type: ignore[call-overload]
    system = random_prompts(1, vocab, 40, 40, seed=1)[0]
    tails = random_prompts(4, vocab, 1, 20, seed=2)
    out = [system + tail for tail in tails]
    return [*out, out[0], out[1][:33], out[1] + tails[3]]


def generate_one_by_one(llm: LLM, prompts: list[list[int]]) -> list[tuple[list[int], int]]:
    """(tokens, num_cached_tokens) per prompt, each after the previous one finished."""
    out = []
    for prompt in prompts:
        result = llm.generate([prompt], GREEDY)[0]
        out.append((result.outputs[0].token_ids, result.num_cached_tokens))
    return out


def assert_cached_prefixes_give_transformers_tokens(
    model_dir: Path, kind: str, policy: Policy
) -> None:
    """`prompts_sharing(kind)` one after another with the prefix cache on: transformers'
    tokens, and every prompt after the first reads at least 32 cached tokens back."""
    prompts = prompts_sharing(kind)
    with LLM(str(model_dir), policy=policy, device="cpu", enable_prefix_caching=True) as llm:
        results = generate_one_by_one(llm, prompts)
    assert [tokens for tokens, _ in results] == [hf_greedy(model_dir, p, 6) for p in prompts]
    assert all(hits >= 32 for _, hits in results[1:])


@pytest.mark.parametrize("kind", ["llama", "opt", "mistral", *NEW_FAMILIES])
def test_cached_prefixes_give_transformers_tokens(tiny_model, tmp_path: Path, kind: str) -> None:
    model = str(tiny_model(kind))
    prompts = prompts_sharing(kind)
    results = {}
    for on in (True, False):
        with LLM(model, policy=Policy(), device="cpu", enable_prefix_caching=on) as llm:
            results[on] = generate_one_by_one(llm, prompts)
    expected = [hf_greedy(Path(model), p, 6) for p in prompts]
    assert [t for t, _ in results[True]] == [t for t, _ in results[False]] == expected
    hits = [n for _, n in results[True]]
    assert hits[0] == 0 and all(n >= 32 for n in hits[1:]) and hits[4] == 48
    assert all(n == 0 for _, n in results[False])


def test_spilled_to_disk_and_loaded_back(tiny_model, tmp_path: Path) -> None:
    assert_spilled_to_disk_and_loaded_back(tiny_model("llama"), "llama", Policy(), tmp_path)


def assert_spilled_to_disk_and_loaded_back(
    model_dir: Path, kind: str, policy: Policy, tmp_path: Path
) -> None:
    """A gpu pool of 8 pages and a cpu pool of 4: earlier prompts' pages spill to cpu and
    disk (real files); asking again loads them back, layer by layer, same tokens
    (transformers')."""
    vocab = int(TINY_CONFIGS[kind]["vocab_size"])  # type: ignore[call-overload]
    prompts = random_prompts(6, vocab, 34, 40, seed=5)  # 2 full pages each
    with LLM(
        str(model_dir),
        policy=dataclasses.replace(policy, gpu_batch_size=2),
        device="cpu",
        offload_dir=tmp_path,
        kv_capacity_pages={"gpu": 8, "cpu": 4, "disk": 64},
    ) as llm:
        first = generate_one_by_one(llm, prompts)
        stats = llm.scheduler.page_manager.stats
        assert stats.spilled_pages["cpu"] > 0 and stats.spilled_pages["disk"] > 0
        again = generate_one_by_one(llm, prompts[:3])  # the oldest: on disk by now
        assert stats.loaded_pages["disk"] > 0
        assert list(tmp_path.glob("kv-*.bin"))
    expected = [hf_greedy(model_dir, p, 6) for p in prompts]
    assert [t for t, _ in first] == expected
    assert [t for t, _ in again] == expected[:3]
    assert all(n == 32 for _, n in again)


def test_n_choices_and_a_batch_of_duplicates(tiny_model) -> None:
    model = str(tiny_model("llama"))
    prompt = prompts_sharing("llama")[0]
    sampling = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True, n=3)
    with LLM(model, policy=Policy(), device="cpu") as llm:
        llm.generate([prompt], GREEDY)
        out = llm.generate([prompt, prompt], sampling)
    expected = hf_greedy(Path(model), prompt, 5)
    assert all(c.token_ids == expected for o in out for c in o.outputs)
    assert all(o.num_cached_tokens == (len(prompt) - 1) // 16 * 16 for o in out)


def test_the_disk_cache_outlives_the_engine_and_a_corrupt_page_is_a_miss(
    tiny_model, tmp_path: Path
) -> None:
    """KV homed on disk in an offload dir of ours: a second engine on the same directory
    finds the first one's cached pages (checked against their checksums); a page corrupted
    in between is a miss, recomputed, never wrong tokens."""
    model = str(tiny_model("llama"))
    prompt = prompts_sharing("llama")[1]
    policy = Policy(kv_frac=(0.0, 0.0, 1.0))
    expected = hf_greedy(Path(model), prompt, 6)

    def once() -> tuple[list[int], int, int]:
        with LLM(model, policy=policy, device="cpu", offload_dir=tmp_path) as llm:
            found = len(llm.executor.describe().disk_cache)
            out = llm.generate([prompt], GREEDY)[0]
        return out.outputs[0].token_ids, out.num_cached_tokens, found

    first = once()
    assert first == (expected, 0, 0)
    assert (tmp_path / "kv-cache-index.json").is_file()
    second = once()
    full_pages = (len(prompt) - 1) // 16
    assert second[0] == expected and second[1] == 16 * full_pages and second[2] >= full_pages
    index = json.loads((tmp_path / "kv-cache-index.json").read_text())
    page = min(int(p) for p, (h, _) in index["pages"].items())
    row_bytes, page_tokens = index["row_bytes"], index["page_tokens"]
    with open(tmp_path / "kv-0001.bin", "r+b") as f:  # the second decoder layer's file
        f.seek(page * page_tokens * row_bytes + 5)
        f.write(b"\xff\x00\xff")
    third = once()
    assert third[0] == expected and third[2] < second[2]
