"""Nemotron-H's MoE layers in the half types, as transformers computes them: the router in
float32 over float32 weights (its `_keep_in_fp32_modules_strict`), the routed experts'
weighted rows added up in float32 and the sum cast back (`NemotronHExperts`), then the
shared MLP added in the model's dtype.

The layer alone is compared bit for bit with transformers' `NemotronHMoE`, on the rows
transformers' own forward pass feeds it and with the weights as nanoflex stores them. The
whole model is compared by the project's rule for low precision, teacher-forced: each greedy
token of nanoflex's is transformers' argmax over prompt + nanoflex's tokens, or within
`LOGIT_TOLERANCE` of it. The Mamba-2 and attention layers round their own way in bfloat16
(the dense nemotron_h checkpoint's logits are 0.03 from transformers'), so the whole-model
test tells a router rounded to bfloat16 apart, not the order of the experts' sum; the layer
test does that."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from engine import LLM, SamplingParams
from engine.core.engine_args import EngineArgs
from engine.executor.executor import Executor
from engine.models.nemotron_h import NemotronHModel
from policy import Policy
from tests.engine.tiny_models import hf_reference, random_prompts, vocab_size

KINDS = ("nemotron_h-moe", "nemotron_h-latent")
"""Nemotron 3's MoE layers, and Nemotron 3 Super's over a latent."""
MOE_LAYERS = (1, 5)
"""The 'moe' layers of both checkpoints (0-based, transformers' numbering)."""


def _moe_inputs_and_outputs(
    reference: Any, prompts: list[list[int]]
) -> list[tuple[int, torch.Tensor, torch.Tensor]]:
    """(layer, input rows, output rows) of each MoE layer, per prompt, in transformers'
    forward pass."""
    seen: list[tuple[int, torch.Tensor, torch.Tensor]] = []
    hooks = [
        reference.model.layers[i].mixer.register_forward_hook(
            lambda _m, args, out, i=i: seen.append((i, args[0][0], out[0]))
        )
        for i in MOE_LAYERS
    ]
    try:
        with torch.no_grad():
            for prompt in prompts:
                reference(torch.tensor([prompt]))
    finally:
        for hook in hooks:
            hook.remove()
    return seen


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("kind", KINDS)
def test_moe_layer_equals_transformers_bit_for_bit(tiny_model, kind, dtype):
    """Both of transformers' expert paths on the CPU ('eager': per expert, `index_add_` into
    float32; 'grouped_mm', its default: one grouped GEMM, the top-k rows summed in float32)
    agree with nanoflex's bit for bit. Adding each expert's rows in the model's dtype, as the
    other families do, is off by up to 0.03 in bfloat16; a router rounded to it picks other
    experts."""
    model_dir = tiny_model(kind)
    prompts = random_prompts(4, vocab_size(kind), 20, 40, seed=3)
    reference = hf_reference(model_dir, dtype).eval()
    args = EngineArgs(  # no saved states of prefixes, as before the args were passed whole
        model=str(model_dir),
        device="cpu",
        dtype=str(dtype).removeprefix("torch."),
        prefix_state_slots=0,
    )
    executor = Executor(args, Policy())
    try:
        model = executor.model
        assert isinstance(model, NemotronHModel)
        weights = {i: executor.device.wait(executor.weights.load(i + 1)) for i in MOE_LAYERS}
        assert {weights[i]["router.weight"].dtype for i in MOE_LAYERS} == {torch.float32}
        for implementation in ("eager", "grouped_mm"):
            reference.set_experts_implementation(implementation)
            for i, x, want in _moe_inputs_and_outputs(reference, prompts):
                got = model.mlp(weights[i], x)
                assert got.dtype == dtype
                assert torch.equal(got, want), (implementation, i)
    finally:
        executor.close()


LOGIT_TOLERANCE = 2.0
"""How far below transformers' best logit nanoflex's greedy token may be, in bfloat16. Where a
MoE layer's input differs in its last bits (here: the Mamba-2 and attention layers' decode
steps against transformers' one forward pass), a row near a tie between two experts may be
routed to another, and its logits move by up to ~2. Measured on 12 prompts of seeds 1 and
5: transformers' own generate() is up to 1.69 below its forward pass's argmax (moe
checkpoint; latent: 0.05), nanoflex up to 1.42 (latent: 0.16), the same under every
placement below. With the experts' rows added in bfloat16 and the router's weights rounded
to it, as before, nanoflex measured up to 0.54 (latent: 0.16): this test cannot tell that
from the fix, the layer test above does."""
OFF_ARGMAX_SHARE = 0.05
"""The share of tokens that may be off transformers' argmax: measured up to 9 of 288 (3.1%),
for transformers' own generate() and for nanoflex alike (before the fix: 12 of 288)."""
PLACEMENTS: dict[str, tuple[dict[str, Any], dict[str, Any]]] = {
    "all-on-device": ({}, {}),
    "experts-disk-grouped-block": (
        dict(
            weights_frac=(0.0, 0.0, 1.0),
            experts_frac=(0.0, 0.0, 1.0),
            gpu_batch_size=2,
            num_gpu_batches=3,
        ),
        {},
    ),
    "experts-cpu-run-there": (
        dict(experts_frac=(0.0, 1.0, 0.0), cpu_experts=True, gpu_batch_size=2, num_gpu_batches=3),
        dict(cpu_expert_rows=2),
    ),
}
"""Policy fields and engine options: everything on the compute device; weights and experts on
disk, a block of three GPU batches grouped per expert; experts in host memory, those few rows
reach computed on the CPU where they lie, the others loaded."""


@pytest.fixture(scope="module")
def bf16_references(tiny_model: Callable[[str], Path]) -> Callable[[str], Any]:
    """kind -> transformers' model of the tiny checkpoint in bfloat16."""
    cache: dict[str, Any] = {}

    def get(kind: str) -> Any:
        if kind not in cache:
            cache[kind] = hf_reference(tiny_model(kind), torch.bfloat16).eval()
        return cache[kind]

    return get


@pytest.mark.parametrize("placement", list(PLACEMENTS))
@pytest.mark.parametrize("kind", KINDS)
def test_bfloat16_greedy_tokens_are_transformers_teacher_forced(
    tiny_model, bf16_references, tmp_path, kind, placement
):
    model_dir: Path = tiny_model(kind)
    prompts = random_prompts(12, vocab_size(kind), 2, 40, seed=1)
    policy, options = PLACEMENTS[placement]
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    with LLM(
        str(model_dir),
        policy=Policy(**policy),
        device="cpu",
        dtype="bfloat16",
        offload_dir=tmp_path,
        **options,
    ) as llm:
        outputs = [out.outputs[0].token_ids for out in llm.generate(prompts, params)]
    reference = bf16_references(kind)
    gaps = []
    for prompt, tokens in zip(prompts, outputs, strict=True):
        with torch.no_grad():
            logits = reference(torch.tensor([prompt + tokens])).logits[0].float()
        rows = logits[len(prompt) - 1 : len(prompt) - 1 + len(tokens)]
        gaps.append(rows.max(-1).values - rows[torch.arange(len(tokens)), tokens])
    gap = torch.cat(gaps)
    assert gap.max().item() <= LOGIT_TOLERANCE
    assert (gap > 0).float().mean().item() <= OFF_ARGMAX_SHARE
