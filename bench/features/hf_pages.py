"""`HfPageReader`: transformers' side of the page-images benchmark: one page image and a
prompt through a Qwen2.5-VL checkpoint's greedy `generate`, under a JSON schema applied as
the engine applies it (llguidance's token mask, engine/executor/grammar.py), in float32."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from transformers import LogitsProcessor

from engine.core.structured import StructuredOutput
from engine.executor.grammar import GrammarBank


class _SchemaMask(LogitsProcessor):
    """Every step, the tokens the schema's matcher allows next (one sequence)."""

    def __init__(self, bank: GrammarBank, prompt_len: int) -> None:
        self.bank, self.prompt_len = bank, prompt_len

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        from llguidance.torch import apply_token_bitmask_inplace

        if input_ids.shape[1] > self.prompt_len:  # the token chosen last step
            error = self.bank.advance(0, int(input_ids[0, -1]))
            if error:
                raise RuntimeError(error)
        bits, errors = self.bank.masks([0])
        if errors:
            raise RuntimeError(errors[0])
        apply_token_bitmask_inplace(scores, bits.to(scores.device))
        return scores


class HfPageReader:
    """A checkpoint loaded once; `answer` reads one page."""

    def __init__(self, checkpoint: Path, schema: str) -> None:
        from transformers import (
            AutoImageProcessor,
            AutoTokenizer,
            Qwen2_5_VLForConditionalGeneration,
        )

        self.tokenizer = AutoTokenizer.from_pretrained(checkpoint)
        self.processor = AutoImageProcessor.from_pretrained(checkpoint)
        self.model = Qwen2_5_VLForConditionalGeneration.from_pretrained(
            checkpoint, dtype=torch.float32
        )
        config = json.loads((checkpoint / "config.json").read_text())
        self.image_token_id = int(config["image_token_id"])
        eos = self.model.generation_config.eos_token_id
        self.eos_ids = tuple(eos if isinstance(eos, list) else [eos] if eos is not None else [])
        self.spec = StructuredOutput("json", schema)
        self.checkpoint = checkpoint

    def _inputs(self, page: Path, prompt: str) -> dict[str, Any]:
        """What Qwen2_5_VLProcessor makes: the chat template's one image pad widened to the
        image's merged patches, the pixel patches and their grid, the image tokens marked."""
        from PIL import Image

        parts: list[dict[str, str]] = [{"type": "image"}, {"type": "text", "text": prompt}]
        chat: list[dict[str, Any]] = [{"role": "user", "content": parts}]
        text = str(
            self.tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
        )
        picture = Image.open(page).convert("RGB")
        inputs = dict(self.processor([picture], return_tensors="pt"))
        merge = int(self.processor.merge_size)
        pad = str(self.tokenizer.convert_ids_to_tokens(self.image_token_id))
        pads = pad * int(inputs["image_grid_thw"][0].prod() // (merge * merge))
        inputs["input_ids"] = self.tokenizer(text.replace(pad, pads, 1), return_tensors="pt")[
            "input_ids"
        ]
        inputs["attention_mask"] = torch.ones_like(inputs["input_ids"])
        inputs["mm_token_type_ids"] = (inputs["input_ids"] == self.image_token_id).int()
        return inputs

    def answer(self, page: Path, prompt: str, max_tokens: int) -> tuple[str, int]:
        """(the answer's text, its tokens) for `page`: greedy, stopped at EOS or max_tokens."""
        inputs = self._inputs(page, prompt)
        prompt_len = inputs["input_ids"].shape[1]
        vocab = self.model.config.get_text_config().vocab_size
        bank = GrammarBank(self.checkpoint / "tokenizer.json", vocab, self.eos_ids, num_threads=1)
        bank.add(0, self.spec)
        try:
            with torch.inference_mode():
                out = self.model.generate(
                    **inputs,
                    max_new_tokens=max_tokens,
                    do_sample=False,
                    logits_processor=[_SchemaMask(bank, prompt_len)],
                )
        finally:
            bank.close()
        tokens = out[0, prompt_len:].tolist()  # EOS counted, as the daemon's usage counts it
        text = str(
            self.tokenizer.decode(
                [t for t in tokens if t not in self.eos_ids], skip_special_tokens=True
            )
        )
        return text, len(tokens)
