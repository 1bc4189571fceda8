"""Tiny random checkpoints written by transformers, and transformers' own greedy output for them."""

from __future__ import annotations

from pathlib import Path

import torch

MAX_TOKENS = 8
"""Greedy tokens generated per prompt in the correctness tests."""
TINY_CONFIGS: dict[str, dict[str, object]] = {
    # OPT: pre-norm, ReLU, learned positions, tied embeddings, head_dim 12
    "opt": dict(
        model_type="opt",
        vocab_size=251,
        hidden_size=48,
        num_hidden_layers=3,
        ffn_dim=80,
        num_attention_heads=4,
        max_position_embeddings=256,
        word_embed_proj_dim=48,
    ),
    # Llama with GQA (6 heads over 2 KV heads), untied embeddings, odd sizes
    "llama": dict(
        model_type="llama",
        vocab_size=307,
        hidden_size=72,
        intermediate_size=100,
        num_hidden_layers=3,
        num_attention_heads=6,
        num_key_value_heads=2,
        max_position_embeddings=256,
        tie_word_embeddings=False,
        rms_norm_eps=1e-5,
    ),
    # Llama 3.1-style rope scaling, tied embeddings
    "llama3": dict(
        model_type="llama",
        vocab_size=256,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=1,
        max_position_embeddings=512,
        tie_word_embeddings=True,
        rope_theta=500000.0,
        rope_scaling=dict(
            rope_type="llama3",
            factor=8.0,
            low_freq_factor=1.0,
            high_freq_factor=4.0,
            original_max_position_embeddings=64,
        ),
    ),
    # Qwen2: q/k/v biases
    "qwen2": dict(
        model_type="qwen2",
        vocab_size=280,
        hidden_size=64,
        intermediate_size=88,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        tie_word_embeddings=False,
    ),
    # Mistral with a sliding window shorter than the test sequences
    "mistral": dict(
        model_type="mistral",
        vocab_size=260,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        sliding_window=24,
        tie_word_embeddings=False,
    ),
}


def build_tiny(kind: str, path: Path, seed: int = 0) -> Path:
    from transformers import AutoConfig, AutoModelForCausalLM

    spec = dict(TINY_CONFIGS[kind])
    model_type = spec.pop("model_type")
    config = AutoConfig.for_model(
        model_type, bos_token_id=1, eos_token_id=2, pad_token_id=0, **spec
    )
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():  # HF initializes biases and norms to constants; make them matter
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
    model.save_pretrained(path)
    return path


def hf_greedy(model_dir: Path, prompt: list[int], max_new_tokens: int) -> list[int]:
    """transformers' own generate(), greedy, EOS ignored: the reference tokens."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model.generation_config.eos_token_id = None
    out = model.generate(
        torch.tensor([prompt]),
        max_new_tokens=max_new_tokens,
        min_new_tokens=max_new_tokens,
        do_sample=False,
        pad_token_id=0,
    )
    return out[0, len(prompt) :].tolist()


def random_prompts(num: int, vocab: int, min_len: int, max_len: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(min_len, max_len + 1, (num,), generator=g).tolist()
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in lengths]
