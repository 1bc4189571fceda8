"""The engine on a trained model (SmolLM2-135M-Instruct, the default): for chat prompts, every
greedy token equals transformers' argmax over the same weights, teacher-forced on our tokens
(a full forward over prompt + output, stricter than comparing with `generate()`, whose cached
path can drift on near-ties), whatever the placement."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from engine import LLM, SamplingParams
from engine.core.tokenizer import Tokenizer
from policy import Policy
from policy.catalog import resolve_model_spec
from policy.specs import ModelSpec
from tests.engine.chats import CHATS

MAX_TOKENS = 16  # the first chat's answer (8 tokens with EOS) ends well within it
DISK_MAX_TOKENS = 8  # every step reads all 651 MB of float32 weights (head and embedding
# each whole) back from disk; the first chat's answer is 7 tokens and EOS, which wins a tie
# with max_tokens (Sequence.append_token), so it still ends with "stop"

PLACEMENTS: dict[str, dict[str, object]] = {
    "all-on-device": {},
    "weights-on-disk": dict(weights_frac=(0.0, 0.0, 1.0), gpu_batch_size=2, num_gpu_batches=2),
    "kv-split-across-tiers": dict(kv_frac=(0.4, 0.3, 0.3), act_frac=(0.3, 0.3, 0.4)),
    "cpu-attention": dict(kv_frac=(0.0, 1.0, 0.0), cpu_attention=True, gpu_batch_size=2),
    "overlap-off": dict(overlap=False, weights_frac=(0.2, 0.8, 0.0), kv_frac=(0.5, 0.5, 0.0)),
}


@pytest.fixture(scope="module")
def reference(smollm2_dir: Path):
    """transformers' LlamaForCausalLM on the converted weights (which equal transformers' own
    reading of the GGUF: tests/engine/loading/test_gguf.py)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32)
    model.eval()
    return model


def teacher_forced_argmax(model, prompt: list[int], tokens: list[int]) -> list[int]:
    """transformers' argmax at every output position, fed prompt + our tokens in one forward."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt + tokens])).logits[0]
    return logits[len(prompt) - 1 : len(prompt) - 1 + len(tokens)].argmax(-1).tolist()


@pytest.mark.parametrize("placement", list(PLACEMENTS))
def test_greedy_chat_equals_transformers_argmax(smollm2_dir, reference, tmp_path, placement):
    prompts = [Tokenizer(smollm2_dir).apply_chat_template(chat) for chat in CHATS]
    policy = Policy(**PLACEMENTS[placement])  # type: ignore[arg-type]
    max_tokens = DISK_MAX_TOKENS if placement == "weights-on-disk" else MAX_TOKENS
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    with LLM(str(smollm2_dir), policy=policy, offload_dir=tmp_path, device="cpu") as llm:
        outputs = [out.outputs[0] for out in llm.generate(prompts, params)]
    for prompt, out in zip(prompts, outputs, strict=True):
        assert len(out.token_ids) > 3
        assert out.token_ids == teacher_forced_argmax(reference, prompt, out.token_ids)
    assert outputs[0].text == "The capital of France is Paris."
    assert outputs[0].finish_reason == "stop"  # EOS (<|im_end|>) ends the answer


def test_the_planners_builtin_spec_is_the_converted_checkpoint(smollm2_dir: Path) -> None:
    """`nanoflex plan` knows the default model without a download: its built-in spec is
    exactly what the converted checkpoint's config.json says (134,515,008 parameters)."""
    config = json.loads((smollm2_dir / "config.json").read_text())
    from_checkpoint = ModelSpec.from_hf_config(config, name="smollm2-135m-instruct")
    assert resolve_model_spec("smollm2-135m-instruct") == from_checkpoint
    assert resolve_model_spec("HuggingFaceTB/SmolLM2-135M-Instruct") == from_checkpoint
    assert from_checkpoint.total_params == 134_515_008
