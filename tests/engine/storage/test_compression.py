"""4-bit paths: measured agreement with the fp path, and exactness across placements.

Tolerances are set from measurements on the demo model (random weights, the worst
case: its logits are nearly flat, so any perturbation can flip the argmax); the
figures and the command that produced them are in docs/compression.md.
"""

from __future__ import annotations

import pytest
import torch

from engine import LLM, SamplingParams
from engine.core.engine_args import EngineArgs
from engine.core.model_files import DEMO_MODEL
from engine.executor.executor import Executor
from policy import Policy
from tests.engine.tiny_models import random_prompts

PREFILL_LEN = 16  # later positions are fed one token per step, so they read the KV cache back


def agreement(base: list[torch.Tensor], got: list[torch.Tensor]) -> tuple[float, float]:
    """(top-1 agreement, max absolute logit error) over every position."""
    same = sum(int((a.argmax(-1) == b.argmax(-1)).sum()) for a, b in zip(base, got, strict=True))
    total = sum(a.shape[0] for a in base)
    return same / total, max(float((a - b).abs().max()) for a, b in zip(base, got, strict=True))


@pytest.fixture(scope="module")
def scored():
    prompts = random_prompts(4, 2048, 48, 80, seed=7)

    def score(**policy: object) -> list[torch.Tensor]:
        executor = Executor(EngineArgs(model=DEMO_MODEL, device="cpu"), Policy(**policy))  # type: ignore[arg-type]
        try:
            return executor.score(prompts, prefill_len=PREFILL_LEN)
        finally:
            executor.close()

    return score(), score


def test_decode_reads_back_exactly_what_prefill_computed(scored):
    base, score = scored
    top1, max_err = agreement(base, score(kv_frac=(0.0, 1.0, 0.0), cpu_attention=True))
    assert top1 == 1.0 and max_err < 1e-4


@pytest.mark.parametrize(
    ("policy", "min_top1", "max_logit_err"),
    [
        (dict(compress_kv=True), 0.85, 0.25),
        (dict(compress_kv=True, kv_frac=(0.0, 1.0, 0.0), cpu_attention=True), 0.85, 0.25),
        (dict(compress_weights=True), 0.40, 1.0),
        (dict(compress_weights=True, compress_kv=True), 0.40, 1.0),
    ],
    ids=["kv", "kv-cpu-attention", "weights", "both"],
)
def test_compressed_agreement_within_tolerance(scored, policy, min_top1, max_logit_err):
    base, score = scored
    top1, max_err = agreement(base, score(**policy))
    assert top1 >= min_top1, f"top-1 agreement {top1:.3f}"
    assert 0.0 < max_err <= max_logit_err, f"max logit error {max_err:.3f}"


def test_compressed_tokens_identical_across_placements(tmp_path):
    """Quantized values are the same wherever they live: placement and overlap change nothing."""
    prompts = random_prompts(5, 2048, 4, 30, seed=3)
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    results = []
    for extra in (
        dict(overlap=False),
        dict(weights_frac=(0.0, 0.5, 0.5), kv_frac=(0.0, 0.5, 0.5), act_frac=(0.0, 0.0, 1.0)),
        dict(kv_frac=(0.0, 1.0, 0.0), cpu_attention=True, gpu_batch_size=2, num_gpu_batches=3),
    ):
        policy = Policy(compress_weights=True, compress_kv=True, **extra)  # type: ignore[arg-type]
        with LLM(DEMO_MODEL, policy=policy, offload_dir=tmp_path / "off", device="cpu") as llm:
            results.append([o.outputs[0].token_ids for o in llm.generate(prompts, params)])
    assert results[0] == results[1] == results[2]
