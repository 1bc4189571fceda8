"""A GGUF file's metadata as Python values, and what several families read alike from it: the
rotary base and scaling."""

from __future__ import annotations

from typing import Any

from engine.core.model_files import ModelLoadError
from engine.loading.gguf_tensors import GgufTensors
from engine.models.hf_config import UnsupportedModelError

NO_ROPE_LAYER_STEP = 4
"""SmolLM3 and Llama 4: every fourth layer has no rotary, as llama.cpp assumes (no key says)."""
YARN_KEYS = {
    "yarn_beta_fast": "beta_fast",
    "yarn_beta_slow": "beta_slow",
    "yarn_attn_factor": "attention_factor",
}
"""llama.cpp's YaRN keys -> transformers' rope parameters."""


class Metadata:
    """`<arch>.<key>` fields of a GGUF file, as Python values."""

    def __init__(self, tensors: GgufTensors) -> None:
        self.arch = tensors.architecture
        self.path = tensors.path
        self._fields = tensors.reader.fields

    def get(self, key: str, default: Any = None) -> Any:
        """`<arch>.<key>`, or `key` itself when it names another namespace (tokenizer.*)."""
        name = key if key.startswith(("tokenizer.", "general.")) else f"{self.arch}.{key}"
        field = self._fields.get(name)
        return default if field is None else field.contents()

    def __getitem__(self, key: str) -> Any:
        value = self.get(key)
        if value is None:
            raise ModelLoadError(f"{self.path.name} lacks the metadata key {self.arch}.{key}")
        return value


def read_rope(meta: Metadata, theta_key: str = "rope.freq_base") -> dict[str, Any]:
    """transformers' rope parameters for the file's rotary base and scaling (none, linear or
    YaRN; its betas and magnitude where the file gives them, else transformers' defaults, which
    are llama.cpp's: 32, 1 and 0.1 ln(factor) + 1)."""
    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": float(meta.get(theta_key, 1e4))}
    kind = meta.get("rope.scaling.type", "none")
    if kind == "linear":
        rope.update(rope_type="linear", factor=float(meta["rope.scaling.factor"]))
    elif kind == "yarn":
        rope.update(
            rope_type="yarn",
            factor=float(meta["rope.scaling.factor"]),
            original_max_position_embeddings=int(meta["rope.scaling.original_context_length"]),
        )
        for key, name in YARN_KEYS.items():
            if meta.get(f"rope.scaling.{key}") is not None:
                rope[name] = float(meta[f"rope.scaling.{key}"])
    elif kind != "none":
        raise UnsupportedModelError(
            f"{meta.path.name} asks for rope scaling {kind!r}, which nanoflex does not convert "
            "from GGUF (it reads none, linear and yarn)"
        )
    return rope
