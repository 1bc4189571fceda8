"""A held-out tiny Qwen2.5-VL checkpoint, saved whole with its processor (the image processor,
a byte-level tokenizer with Qwen's special tokens, the chat template), and transformers'
greedy answer for an image and a chat: the reference the vision tests compare against."""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

import torch

from engine.core.media import SeqMedia, VisionSpec, expand_image_tokens
from tests.engine.tiny_models import build_from_spec

SPECIAL_TOKENS = (
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|image_pad|>",
    "<|video_pad|>",
)
"""Qwen2.5-VL's special tokens, after the 256 byte tokens: ids 256..262."""
IMAGE_TOKEN_ID = 256 + SPECIAL_TOKENS.index("<|image_pad|>")
VOCAB = 256 + len(SPECIAL_TOKENS) + 9  # a few unused rows, as released vocabularies have

CHAT_TEMPLATE = (
    "{% set image_count = namespace(value=0) %}{% for message in messages %}"
    "{% if loop.first and message['role'] != 'system' %}<|im_start|>system\n"
    "You are a helpful assistant.<|im_end|>\n{% endif %}"
    "<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}<|im_end|>\n"
    "{% else %}{% for content in message['content'] %}"
    "{% if content['type'] == 'image' or 'image' in content or 'image_url' in content %}"
    "{% set image_count.value = image_count.value + 1 %}"
    "<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif 'text' in content %}{{ content['text'] }}{% endif %}{% endfor %}<|im_end|>\n"
    "{% endif %}{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
"""Qwen2.5-VL's chat template (images only): an image part becomes one image-pad token between
the vision markers, which the processor widens to the image's merged patches."""

TOKENS: dict[str, Any] = {
    "image_token_id": IMAGE_TOKEN_ID,
    "video_token_id": IMAGE_TOKEN_ID + 1,
    "vision_start_token_id": 256 + SPECIAL_TOKENS.index("<|vision_start|>"),
    "vision_end_token_id": 256 + SPECIAL_TOKENS.index("<|vision_end|>"),
    "tie_word_embeddings": False,
}
"""The special tokens' ids in a Qwen-VL config (and its untied head)."""
TEXT: dict[str, Any] = {
    "vocab_size": VOCAB,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 512,
    "bos_token_id": 256,
    "eos_token_id": 258,
    "pad_token_id": 256,
}
"""The tiny language model's shapes (head_dim 16), less its rotary."""

SPEC: dict[str, Any] = {
    "model_type": "qwen2_5_vl",
    **TOKENS,
    "text_config": {
        **TEXT,
        "rope_parameters": {
            "rope_type": "default",
            "rope_theta": 10000.0,
            "mrope_section": [2, 3, 3],
        },
    },
    "vision_config": {
        "depth": 3,
        "hidden_size": 32,
        "intermediate_size": 48,
        "num_heads": 2,
        "patch_size": 14,
        "spatial_merge_size": 2,
        "temporal_patch_size": 2,
        "window_size": 56,
        "out_hidden_size": 64,
        "fullatt_block_indexes": [1],
    },
}
"""Text: head_dim 16, M-RoPE sections 2+3+3 of its 8 frequencies; vision: head_dim 16, windows
of 2x2 merged patches (56 px) with block 1 attending over the whole image."""

SCALED = {
    "merger.mlp.2.weight": 100.0,
    "merger.mlp.2.bias": 100.0,
    "self_attn.q_proj.weight": 6.0,
    "self_attn.k_proj.weight": 6.0,
}
"""The merger's output scaled up past the token embeddings' size, and the language model's
queries and keys so that its attention is peaked (and so hangs on the positions): at the
random init's scale an image changed no greedy token (five images gave one answer) and the
image tokens' (h, w) positions moved no log-probability by 2e-5, so the tests could not tell
a right image path from a wrong one."""

MAX_PIXELS = 112 * 112
"""The processor's pixel budget: a tiny checkpoint's images stay a few dozen patches."""


def build_tiny_vl(
    path: Path,
    seed: int = 0,
    spec: dict[str, Any] = SPEC,
    scaled: dict[str, float] = SCALED,
    **processor: Any,
) -> Path:
    """The checkpoint of `spec` (Qwen2.5-VL's by default), its processor (its keywords
    `processor` over the defaults) and its chat template saved at `path`."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
        Qwen2VLImageProcessorPil,
    )

    build_from_spec(spec, path, seed, scaled, bos_token_id=256, eos_token_id=258, pad_token_id=256)
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    byte_chars = sorted(alphabet, key=lambda c: _byte_of(c))
    core = Tokenizer(models.BPE({c: i for i, c in enumerate(byte_chars)}, []))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    core.decoder = decoders.ByteLevel()
    core.add_special_tokens(list(SPECIAL_TOKENS))
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=core,
        bos_token=None,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
    )
    # the processor's parts (its video processor needs torchvision, which is not installed)
    sizes = {"min_pixels": 56 * 56, "max_pixels": MAX_PIXELS, **processor}
    Qwen2VLImageProcessorPil(**sizes).save_pretrained(path)
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(path)
    return path


def _byte_of(char: str) -> int:
    from tokenizers import pre_tokenizers  # noqa: F401  (the alphabet's order is GPT-2's)

    printable = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    others = [b for b in range(256) if b not in printable]
    code = ord(char)
    return code if code in printable else others[code - 0x100]


LOGPROB_TOLERANCE = 2e-5
"""How far nanoflex's float32 log-probabilities may lie from transformers' (they agree to 5e-7
here); at the same greedy tokens two of the tiny model's images differ by 1e-3 to 5e-3, and
text positions after an image one step off (or sequential, as transformers' own fallback
without `mm_token_type_ids`) by 1e-4 to 7e-4."""


def assert_same_answer(
    tokens: list[int], logprobs: list[float], want: tuple[list[int], list[float]]
) -> None:
    """The greedy tokens equal, and their log-probabilities within `LOGPROB_TOLERANCE`."""
    assert tokens == want[0]
    assert max(abs(a - b) for a, b in zip(logprobs, want[1], strict=True)) < LOGPROB_TOLERANCE


def png_bytes(width: int, height: int, seed: int) -> bytes:
    """A random RGB image of `width` x `height`, as PNG."""
    from PIL import Image

    g = torch.Generator().manual_seed(seed)
    pixels = torch.randint(0, 256, (height, width, 3), generator=g, dtype=torch.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels.numpy()).save(out, format="PNG")
    return out.getvalue()


def image_chat(text: str, num_images: int = 1) -> list[dict[str, Any]]:
    """One user message: `num_images` image parts, then the text."""
    parts: list[dict[str, Any]] = [{"type": "image"} for _ in range(num_images)]
    return [{"role": "user", "content": [*parts, {"type": "text", "text": text}]}]


def hf_vl_generate(
    model_dir: Path, images: list[bytes], text: str, max_new_tokens: int
) -> tuple[list[int], list[int], list[float]]:
    """(prompt token ids, transformers' greedy tokens, the log-probability of each) for the
    image(s) and the text, the prompt made by the checkpoint's own processor and template;
    EOS ignored. The log-probabilities tell one image from another where the tokens agree."""
    from PIL import Image
    from transformers import AutoImageProcessor, AutoModelForImageTextToText, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    chat = image_chat(text, len(images))
    prompt = str(tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=False))
    pictures = [Image.open(io.BytesIO(b)).convert("RGB") for b in images]
    inputs = dict(AutoImageProcessor.from_pretrained(model_dir)(pictures, return_tensors="pt"))
    # what Qwen2_5_VLProcessor does: each image pad widened to the image's merged patches
    for grid in inputs["image_grid_thw"]:
        pads = "<|placeholder|>" * int(grid.prod() // 4)
        prompt = prompt.replace("<|image_pad|>", pads, 1)
    prompt = prompt.replace("<|placeholder|>", "<|image_pad|>")
    inputs["input_ids"] = tokenizer(prompt, return_tensors="pt")["input_ids"]
    inputs["attention_mask"] = torch.ones_like(inputs["input_ids"])
    # the processor's marks of the image tokens: without them transformers cannot place the
    # M-RoPE positions and falls back to one position per token
    inputs["mm_token_type_ids"] = (inputs["input_ids"] == IMAGE_TOKEN_ID).int()
    model = AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32)
    return greedy_answer(model, dict(inputs), max_new_tokens, pad_token_id=256)


def processor_generate(
    model_dir: Path,
    model_class: Any,
    images: list[bytes],
    text: str,
    max_new_tokens: int,
    pad_token_id: int,
) -> tuple[list[int], list[int], list[float]]:
    """(prompt token ids, transformers' greedy tokens, the log-probability of each) of
    `model_class` (Gemma 3's, LLaVA's) for the image(s) and the text, the prompt and pixels
    made by the checkpoint's own processor (AutoProcessor) and template; EOS ignored."""
    from PIL import Image
    from transformers import AutoProcessor

    processor = AutoProcessor.from_pretrained(model_dir)
    chat = image_chat(text, len(images))
    prompt = processor.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
    pictures = [Image.open(io.BytesIO(b)).convert("RGB") for b in images]
    inputs = processor(text=prompt, images=pictures, return_tensors="pt")
    model = model_class.from_pretrained(model_dir, dtype=torch.float32)
    return greedy_answer(model, dict(inputs), max_new_tokens, pad_token_id)


def image_prompt(
    llm: Any, model_dir: Path, images: list[bytes], text: str
) -> tuple[list[int], SeqMedia | None]:
    """The chat's token ids through `llm`'s tokenizer and template, its image placeholders
    widened as the daemon widens them, and its media."""
    from PIL import Image

    assert llm.tokenizer is not None
    ids = llm.tokenizer.apply_chat_template(image_chat(text, len(images)))
    spec = VisionSpec.from_model_dir(model_dir)
    assert spec is not None
    sizes = [Image.open(io.BytesIO(b)).size for b in images]
    media = expand_image_tokens(ids, spec, [(b, w, h) for b, (w, h) in zip(images, sizes)])
    return ids, media


def greedy_answer(
    model: Any, inputs: dict[str, Any], max_new_tokens: int, pad_token_id: int
) -> tuple[list[int], list[int], list[float]]:
    """(prompt token ids, transformers' greedy tokens, the log-probability of each) of
    `model.generate` over `inputs`, EOS ignored."""
    model.generation_config.eos_token_id = None
    out = model.generate(
        **inputs,
        max_new_tokens=max_new_tokens,
        min_new_tokens=max_new_tokens,
        do_sample=False,
        pad_token_id=pad_token_id,
        output_logits=True,
        return_dict_in_generate=True,
    )
    prompt_ids = inputs["input_ids"][0].tolist()
    tokens = out.sequences[0, len(prompt_ids) :].tolist()
    logprobs = [
        float(torch.log_softmax(step[0].float(), -1)[t]) for step, t in zip(out.logits, tokens)
    ]
    return prompt_ids, tokens, logprobs


def chosen(logprobs: list[Any] | None) -> list[float]:
    """The log-probability of each chosen token of an engine output's `logprobs`."""
    assert logprobs is not None
    return [entry.logprob for entry in logprobs]
