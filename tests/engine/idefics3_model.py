"""Held-out tiny Idefics3 and SmolVLM checkpoints (a SigLIP-like tower over image tiles, the
pixel-shuffle connector, a Llama language model), saved whole with their processors (the
image processor that splits an image into tiles and a global image, a byte-level tokenizer
with the row/column markers and a merge of two newlines as SmolLM2's has, SmolVLM's chat
template), and transformers' greedy answer for images and a chat: the reference the Idefics3
tests compare against."""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

import torch

from tests.engine.vision_models import TEXT, _byte_of, greedy_answer, image_chat

NEWLINE = "Ċ"
"""The byte-level alphabet's newline; id 256 is two of them, as one token."""
SPECIAL_TOKENS = (
    "<|endoftext|>",
    "<|im_start|>",
    "<end_of_utterance>",
    "<fake_token_around_image>",
    "<image>",
    "<global-img>",
    *(f"<row_{r}_col_{c}>" for r in range(1, 7) for c in range(1, 7)),
)
"""After the 256 byte tokens and the two-newline token: ids 257.. (the processor looks up
the row and column markers of up to 6x6 tiles)."""
PAD, START, EOU, FAKE, IMAGE, GLOBAL = (257 + i for i in range(6))
VOCAB = 257 + len(SPECIAL_TOKENS) + 3
TILE, PATCH, SCALE = 56, 7, 2
TOKENS_PER_TILE = (TILE // PATCH) ** 2 // SCALE**2
"""16: the 8x8 patches of a tile, pixel-shuffled 2x2 into one token each."""

CHAT_TEMPLATE = (
    "<|im_start|>{% for message in messages %}{{message['role'] | capitalize}}"
    "{% if message['content'] is string %}{{': ' + message['content']}}{% else %}"
    "{% if message['content'][0]['type'] == 'image' %}{{':'}}{% else %}{{': '}}{% endif %}"
    "{% for line in message['content'] %}{% if line['type'] == 'text' %}{{line['text']}}"
    "{% elif line['type'] == 'image' %}{{ '<image>' }}{% endif %}{% endfor %}{% endif %}"
    "<end_of_utterance>\n{% endfor %}{% if add_generation_prompt %}{{ 'Assistant:' }}{% endif %}"
)
"""SmolVLM's chat template (transformers' `DEFAULT_CHAT_TEMPLATE`): an image part is <image>,
which the processor widens to the image's tiles with their markers."""


def spec(model_type: str) -> dict[str, Any]:
    """The tiny config of `model_type` ('idefics3' or 'smolvlm'): text head_dim 16; vision
    8x8 patches of 7 px per 56-px tile, two blocks."""
    return {
        "model_type": model_type,
        "image_token_id": IMAGE,
        "scale_factor": SCALE,
        "tie_word_embeddings": False,
        "text_config": {
            **TEXT,
            "model_type": "llama",
            "vocab_size": VOCAB,
            "bos_token_id": START,
            "eos_token_id": EOU,
            "pad_token_id": PAD,
        },
        "vision_config": {
            "hidden_size": 32,
            "intermediate_size": 48,
            "num_hidden_layers": 2,
            "num_attention_heads": 2,
            "image_size": TILE,
            "patch_size": PATCH,
        },
    }


SCALED = {
    "modality_projection.proj.weight": 30.0,
    "self_attn.q_proj.weight": 4.0,
    "self_attn.k_proj.weight": 4.0,
}
"""The connector's output scaled past the token embeddings' size, and the queries and keys so
that attention is peaked: at the random init's scale an image would move no greedy token."""


def build_tiny_idefics3(path: Path, model_type: str = "idefics3", tiles: int = 2) -> Path:
    """The checkpoint of `model_type`, its processor files (preprocessor_config.json; the
    processor's own config where transformers can build it here), its tokenizer and chat
    template saved at `path`; the image processor resizes an image's longest edge to
    `tiles` tiles."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    from transformers.models.idefics3.image_processing_pil_idefics3 import (
        Idefics3ImageProcessorPil,
    )
    from transformers.models.smolvlm.image_processing_pil_smolvlm import (
        SmolVLMImageProcessorPil,
    )

    from tests.engine.tiny_models import build_from_spec

    ids = {"bos_token_id": START, "eos_token_id": EOU, "pad_token_id": PAD}
    build_from_spec(spec(model_type), path, 0, SCALED, **ids)
    chars = sorted(pre_tokenizers.ByteLevel.alphabet(), key=_byte_of)
    vocab = {c: i for i, c in enumerate(chars)} | {NEWLINE * 2: 256}
    core = Tokenizer(models.BPE(vocab, [(NEWLINE, NEWLINE)]))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    core.decoder = decoders.ByteLevel()
    core.add_special_tokens(list(SPECIAL_TOKENS))
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=core,
        bos_token="<|im_start|>",
        eos_token="<end_of_utterance>",
        pad_token="<|endoftext|>",
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    sizes = {"size": {"longest_edge": TILE * tiles}, "max_image_size": {"longest_edge": TILE}}
    if model_type == "idefics3":
        from transformers import Idefics3Processor

        images = Idefics3ImageProcessorPil(**sizes)
        processor = Idefics3Processor(
            images, tokenizer, image_seq_len=TOKENS_PER_TILE, chat_template=CHAT_TEMPLATE
        )
        processor.save_pretrained(path)
    else:  # SmolVLMProcessor needs num2words and a video processor (torchvision): not here
        images = SmolVLMImageProcessorPil(**sizes)
    images.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def hf_idefics3_prompt(model_dir: Path, images: list[bytes], text: str = TEXT) -> dict[str, Any]:
    """The model inputs transformers' processor makes of the image(s) and the chat: Idefics3's
    through AutoProcessor; SmolVLM's through its image processor and its processor module's
    own prompt function (`get_image_prompt_string`), as `SmolVLMProcessor` joins them."""
    from PIL import Image
    from transformers import AutoImageProcessor, AutoProcessor, AutoTokenizer

    pictures = [Image.open(io.BytesIO(b)).convert("RGB") for b in images]
    chat = image_chat(text, len(images))
    if (model_dir / "processor_config.json").is_file():
        processor = AutoProcessor.from_pretrained(model_dir)
        prompt = processor.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
        return dict(processor(text=prompt, images=pictures, return_tensors="pt"))
    from transformers.models.smolvlm.processing_smolvlm import get_image_prompt_string

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    prompt = str(tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=False))
    inputs = AutoImageProcessor.from_pretrained(model_dir)(
        [pictures], return_row_col_info=True, return_tensors="pt"
    )
    pieces = prompt.split("<image>")
    rows, cols = inputs.pop("rows")[0], inputs.pop("cols")[0]
    prompt = pieces[0]
    for piece, r, c in zip(pieces[1:], rows, cols, strict=True):
        tokens = ("<fake_token_around_image>", "<image>", "<global-img>")
        prompt += get_image_prompt_string(r, c, TOKENS_PER_TILE, *tokens) + piece
    encoded = tokenizer(prompt, return_tensors="pt")
    return dict(inputs) | dict(encoded)


def hf_idefics3_generate(
    model_dir: Path, images: list[bytes], text: str, max_new_tokens: int
) -> tuple[list[int], list[int], list[float]]:
    """(prompt token ids, transformers' greedy tokens, the log-probability of each) of the
    checkpoint's `...ForConditionalGeneration` for the image(s) and the text; EOS ignored."""
    from transformers import AutoModelForImageTextToText

    inputs = hf_idefics3_prompt(model_dir, images, text)
    model = AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32)
    return greedy_answer(model, inputs, max_new_tokens, PAD)
