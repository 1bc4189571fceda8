"""A held-out tiny LLaVA (a CLIP tower, LLaVA's MLP projector, a Llama language model), saved
whole with its processor (LlavaProcessor over a CLIP image processor and a byte-level
tokenizer with an <image> token, LLaVA-1.5's chat template), and transformers' greedy answer
for an image and a chat through that processor: the reference the LLaVA tests compare
against."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tests.engine.vision_models import TEXT, _byte_of, processor_generate

SPECIAL_TOKENS = ("<pad>", "<s>", "</s>", "<image>")
"""After the 256 byte tokens: ids 256..259."""
PAD, BOS, EOS, IMAGE = (256 + i for i in range(len(SPECIAL_TOKENS)))
VOCAB = 256 + len(SPECIAL_TOKENS) + 4
IMAGE_SIZE, PATCH_SIZE = 56, 14
TOKENS_PER_IMAGE = (IMAGE_SIZE // PATCH_SIZE) ** 2
"""16: one per patch, the class token dropped (vision_feature_select_strategy 'default')."""

CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{% if message['role'] != 'system' %}{{ message['role'].upper() + ': ' }}{% endif %}"
    "{% if message['content'] is string %}{{ message['content'] + ' ' }}{% else %}"
    "{% for item in message['content'] | selectattr('type', 'equalto', 'image') %}"
    "{{ '<image>\n' }}{% endfor %}"
    "{% for item in message['content'] | selectattr('type', 'equalto', 'text') %}"
    "{{ item['text'] + ' ' }}{% endfor %}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ 'ASSISTANT:' }}{% endif %}"
)
"""LLaVA-1.5's chat template: each image part an <image> line before the text, which the
processor widens to the image's tokens."""

SPEC: dict[str, Any] = {
    "model_type": "llava",
    "image_token_index": IMAGE,
    "vision_feature_layer": -2,
    "vision_feature_select_strategy": "default",
    "text_config": {
        **TEXT,
        "model_type": "llama",
        "vocab_size": VOCAB,
        "bos_token_id": BOS,
        "eos_token_id": EOS,
        "pad_token_id": PAD,
    },
    "vision_config": {
        "model_type": "clip_vision_model",
        "hidden_size": 32,
        "intermediate_size": 48,
        "num_hidden_layers": 3,
        "num_attention_heads": 2,
        "image_size": IMAGE_SIZE,
        "patch_size": PATCH_SIZE,
        "projection_dim": 32,
    },
}
"""Text: head_dim 16; vision: 4x4 patches of 14 px and a class token, three blocks of which
the projector reads the second's output (vision_feature_layer -2)."""

SCALED = {
    "multi_modal_projector.linear_2.weight": 30.0,
    "self_attn.q_proj.weight": 4.0,
    "self_attn.k_proj.weight": 4.0,
}
"""The projector's output scaled past the token embeddings' size, and the queries and keys so
that attention is peaked: at the random init's scale an image would move no greedy token
(the CLIP tower's q and k are scaled alike, which only sharpens its attention)."""


def build_tiny_llava(path: Path, seed: int = 0) -> Path:
    """The checkpoint, its processor (processor_config.json, preprocessor_config.json), its
    tokenizer and chat template saved at `path`."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import LlavaProcessor, PreTrainedTokenizerFast
    from transformers.models.clip.image_processing_pil_clip import CLIPImageProcessorPil

    from tests.engine.tiny_models import build_from_spec

    build_from_spec(SPEC, path, seed, SCALED, bos_token_id=BOS, eos_token_id=EOS, pad_token_id=PAD)
    chars = sorted(pre_tokenizers.ByteLevel.alphabet(), key=_byte_of)
    core = Tokenizer(models.BPE({c: i for i, c in enumerate(chars)}, []))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    core.decoder = decoders.ByteLevel()
    core.add_special_tokens(list(SPECIAL_TOKENS))
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=core, bos_token="<s>", eos_token="</s>", pad_token="<pad>"
    )
    images = CLIPImageProcessorPil(
        size={"shortest_edge": IMAGE_SIZE}, crop_size={"height": IMAGE_SIZE, "width": IMAGE_SIZE}
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    processor = LlavaProcessor(
        image_processor=images,
        tokenizer=tokenizer,
        patch_size=PATCH_SIZE,
        vision_feature_select_strategy="default",
        num_additional_image_tokens=1,
        chat_template=CHAT_TEMPLATE,
    )
    processor.save_pretrained(path)
    images.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def hf_llava_generate(
    model_dir: Path, images: list[bytes], text: str, max_new_tokens: int
) -> tuple[list[int], list[int], list[float]]:
    """transformers' LLaVA answer (`processor_generate`)."""
    from transformers import LlavaForConditionalGeneration

    model = LlavaForConditionalGeneration
    return processor_generate(model_dir, model, images, text, max_new_tokens, PAD)
