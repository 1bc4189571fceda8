"""A held-out tiny Gemma 3 with its vision tower, saved whole with its processor (Gemma 3's
image processor, a byte-level tokenizer with Gemma's special tokens whose merges join newline
runs as Gemma's does, Gemma's chat template), and transformers' greedy answer for an image and
a chat through that processor: the reference the Gemma 3 vision tests compare against."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from tests.engine.tiny_models import build_from_spec
from tests.engine.vision_models import _byte_of, processor_generate

NEWLINE = "Ċ"
"""The byte-level alphabet's newline."""
NEWLINE_RUNS = 4
"""The tokenizer has one token for each run of 1 to 4 newlines (ids 256..258 for 2..4)."""
SPECIAL_TOKENS = (
    "<pad>",
    "<bos>",
    "<eos>",
    "<start_of_turn>",
    "<end_of_turn>",
    "<start_of_image>",
    "<end_of_image>",
    "<image_soft_token>",
)
FIRST_SPECIAL = 256 + NEWLINE_RUNS - 1
BOI, EOI, IMAGE = (FIRST_SPECIAL + SPECIAL_TOKENS.index(t) for t in SPECIAL_TOKENS[5:])
VOCAB = FIRST_SPECIAL + len(SPECIAL_TOKENS) + 5
TOKENS_PER_IMAGE = 16

CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "<start_of_turn>{{ 'model' if message['role'] == 'assistant' else message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] | trim }}"
    "{% else %}{% for item in message['content'] %}"
    "{% if item['type'] == 'image' %}<start_of_image>"
    "{% elif item['type'] == 'text' %}{{ item['text'] | trim }}{% endif %}"
    "{% endfor %}{% endif %}<end_of_turn>\n{% endfor %}"
    "{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"
)
"""Gemma 3's chat template (its image and text parts): an image part is <start_of_image>,
which the processor widens to two newlines, the marker, the image's tokens, <end_of_image> and
two newlines."""

SPEC: dict[str, Any] = {
    "model_type": "gemma3",
    "mm_tokens_per_image": TOKENS_PER_IMAGE,
    "boi_token_index": BOI,
    "eoi_token_index": EOI,
    "image_token_index": IMAGE,
    "text_config": {
        "vocab_size": VOCAB,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "query_pre_attn_scalar": 16,
        "sliding_window": 24,
        "layer_types": ["sliding_attention", "full_attention"],
        "max_position_embeddings": 512,
        "bos_token_id": FIRST_SPECIAL + 1,
        "eos_token_id": FIRST_SPECIAL + 4,
        "pad_token_id": FIRST_SPECIAL,
    },
    "vision_config": {
        "hidden_size": 32,
        "intermediate_size": 48,
        "num_hidden_layers": 2,
        "num_attention_heads": 2,
        "image_size": 56,
        "patch_size": 7,
        "vision_use_head": False,
    },
}
"""Text: head_dim 16, a sliding layer whose window (24) is shorter than the prompt, then a
global one; vision: 8x8 patches of 7 px, pooled 2x2 into 16 image tokens."""

SCALED = {
    "mm_input_projection_weight": 30.0,
    "self_attn.q_proj.weight": 4.0,
    "self_attn.k_proj.weight": 4.0,
}
"""The projector's output scaled past the token embeddings' size (times sqrt(hidden)), and the
queries and keys so that attention is peaked: at the random init's scale an image would move
no greedy token, nor would the image tokens' two-way attention."""


def build_tiny_gemma3(path: Path, seed: int = 0) -> Path:
    """The checkpoint, its processor (processor_config.json, preprocessor_config.json), its
    tokenizer and chat template saved at `path`."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import Gemma3Processor, PreTrainedTokenizerFast
    from transformers.models.gemma3.image_processing_pil_gemma3 import (
        Gemma3ImageProcessorPil,
    )

    ids = {"bos_token_id": FIRST_SPECIAL + 1, "eos_token_id": FIRST_SPECIAL + 4}
    build_from_spec(SPEC, path, seed, None, pad_token_id=FIRST_SPECIAL, **ids)
    _randomize_projector(path, seed, SCALED)
    chars = sorted(pre_tokenizers.ByteLevel.alphabet(), key=_byte_of)
    vocab = {c: i for i, c in enumerate(chars)}
    runs = [NEWLINE * n for n in range(2, NEWLINE_RUNS + 1)]
    vocab.update({run: 256 + i for i, run in enumerate(runs)})
    merges = [(NEWLINE, NEWLINE), (NEWLINE * 2, NEWLINE), (NEWLINE * 2, NEWLINE * 2)]
    core = Tokenizer(models.BPE(vocab, merges))
    # no pre-tokenizer split, as Gemma's SentencePiece model: newline runs merge anywhere
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    core.decoder = decoders.ByteLevel()
    core.add_special_tokens(list(SPECIAL_TOKENS))
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=core,
        bos_token="<bos>",
        eos_token="<end_of_turn>",
        pad_token="<pad>",
        extra_special_tokens={
            "boi_token": "<start_of_image>",
            "eoi_token": "<end_of_image>",
            "image_token": "<image_soft_token>",
        },
    )
    images = Gemma3ImageProcessorPil(size={"height": 56, "width": 56})
    tokenizer.chat_template = CHAT_TEMPLATE
    processor = Gemma3Processor(
        image_processor=images,
        tokenizer=tokenizer,
        chat_template=CHAT_TEMPLATE,
        image_seq_length=TOKENS_PER_IMAGE,
    )
    processor.save_pretrained(path)
    images.save_pretrained(path)  # preprocessor_config.json, as the hub's Gemma 3 ships it
    tokenizer.save_pretrained(path)
    return path


def _randomize_projector(path: Path, seed: int, scaled: dict[str, float]) -> None:
    """transformers initializes the projector's matrix to zeros (every image the same): a
    random one, and the scales of `scaled` applied, written back into the checkpoint."""
    from safetensors.torch import load_file, save_file

    file = path / "model.safetensors"
    tensors = load_file(file)
    g = torch.Generator().manual_seed(seed)
    for name, t in tensors.items():
        if name.endswith("mm_input_projection_weight"):
            tensors[name] = torch.randn(t.shape, generator=g) * 0.02
        for part, factor in scaled.items():
            if part in name:
                tensors[name] = tensors[name] * factor
    save_file(tensors, file, metadata={"format": "pt"})


def hf_gemma3_generate(
    model_dir: Path, images: list[bytes], text: str, max_new_tokens: int
) -> tuple[list[int], list[int], list[float]]:
    """transformers' Gemma 3 answer (`processor_generate`)."""
    from transformers import Gemma3ForConditionalGeneration

    model = Gemma3ForConditionalGeneration
    return processor_generate(model_dir, model, images, text, max_new_tokens, FIRST_SPECIAL)
