"""Dummy weights: a model directory with only a config, whose tensors are generated on demand.

`LLM(model="dummy:facebook/opt-30b")` runs the shape of OPT-30B with no download and
no checkpoint on disk, as FlexGen's `--path _DUMMY_` does: for benchmarks, where only
the shapes matter. The directory (under `$NANOFLEX_CACHE/dummy/`) holds a
transformers `config.json` and a marker file; `DummyReader` serves every tensor a
`save_pretrained` checkpoint of that config would hold, by the same names and shapes.

Values are deterministic and cheap to make at 30B scale: a pool of seeded uniform
values in [-INIT_SCALE, INIT_SCALE], read cyclically from an offset that depends on
the tensor's name. Norm weights are ones and norm biases zeros, so activations stay
in range through any number of layers.
"""

from __future__ import annotations

import hashlib
import json
import math
import zlib
from pathlib import Path
from typing import Any

import torch

from engine.core.cache import cache_root, publish_dir
from engine.core.model_files import ModelLoadError
from engine.models.config import read_hf_config

MARKER = "nanoflex-dummy.json"
PROCESSOR = "preprocessor_config.json"
"""A vision model's image processor config (engine/core/media.py `has_image_processor`)."""
INIT_SCALE = 0.02
POOL_SIZE = 1_048_573  # prime, so no row length divides it and rows differ
DEFAULT_SEED = 0


def is_dummy(model_dir: Path) -> bool:
    return (model_dir / MARKER).is_file()


def hf_config_dict(name: str) -> dict[str, Any]:
    """A transformers config for a built-in shape (policy.specs) or a directory's config.json."""
    from policy.catalog import builtin_spec

    path = Path(name).expanduser()
    if path.is_dir():
        path = path / "config.json"
    if path.is_file():
        return dict(json.loads(path.read_text()))
    spec = builtin_spec(name)
    if spec is None:
        raise ModelLoadError(
            f"dummy weights need a built-in model name (e.g. facebook/opt-30b, llama-3-8b) "
            f"or a directory with a config.json, got {name!r}"
        )
    return _config_from_spec(spec)


def _config_from_spec(spec: Any) -> dict[str, Any]:
    """The transformers config of a built-in shape: OPT, Llama (Llama 2/3, Qwen 2 and the demo
    and default models have Llama's layout), or the family it names (Mistral, Qwen 3, Gemma,
    Phi-3, OLMo 2) with its window, whose own config class places the local layers."""
    from transformers import AutoConfig, LlamaConfig, OPTConfig

    config: Any
    if spec.arch == "opt":
        config = OPTConfig(
            vocab_size=spec.vocab_size,
            hidden_size=spec.hidden_size,
            num_hidden_layers=spec.num_layers,
            ffn_dim=spec.intermediate_size,
            num_attention_heads=spec.num_heads,
            max_position_embeddings=spec.max_position_embeddings - 2,  # the table has 2 extra
            word_embed_proj_dim=spec.word_embed_dim or spec.hidden_size,
            tie_word_embeddings=spec.tie_word_embeddings,
            dtype="float16",
        )
    else:
        shape = dict(
            vocab_size=spec.vocab_size,
            hidden_size=spec.hidden_size,
            intermediate_size=spec.intermediate_size,
            num_hidden_layers=spec.num_layers,
            num_attention_heads=spec.num_heads,
            num_key_value_heads=spec.num_kv_heads,
            head_dim=spec.head_dim,
            max_position_embeddings=8192,
            tie_word_embeddings=spec.tie_word_embeddings,
            dtype="float16",
        )
        if spec.model_type in ("llama", "qwen2"):
            config = LlamaConfig(**shape, attention_bias=spec.qkv_bias)
        else:
            window = {"sliding_window": spec.sliding_window} if spec.num_local_layers else {}
            experts = _moe_fields(spec)
            if spec.num_experts and spec.model_type in ("mixtral", "olmoe"):
                shape["intermediate_size"] = spec.moe_intermediate_size  # their experts' width
            config = AutoConfig.for_model(
                spec.model_type, pad_token_id=0, **shape, **window, **experts
            )
    config.architectures = [type(config).__name__.replace("Config", "ForCausalLM")]
    return dict(config.to_dict())


def _moe_fields(spec: Any) -> dict[str, Any]:
    """A MoE shape's expert fields in its family's config names (none for a dense model)."""
    if not spec.num_experts:
        return {}
    fields: dict[str, Any] = {"num_experts_per_tok": spec.num_experts_per_tok}
    if spec.model_type == "mixtral":
        return {**fields, "num_local_experts": spec.num_experts}
    fields["num_experts"] = spec.num_experts
    if spec.model_type in ("qwen2_moe", "qwen3_moe"):
        dense = [j for j in range(spec.num_layers) if j not in spec.moe_layer_ids]
        fields |= {"moe_intermediate_size": spec.moe_intermediate_size}
        fields |= {"decoder_sparse_step": 1, "mlp_only_layers": dense}
        if spec.model_type == "qwen2_moe":
            fields["shared_expert_intermediate_size"] = spec.shared_expert_intermediate_size
    return fields


def dummy_model_dir(name: str, seed: int = DEFAULT_SEED) -> Path:
    """The directory for `dummy:<name>`: config.json plus the marker, written once per shape
    (and a source directory's image processor config, which a vision tower needs)."""
    config = hf_config_dict(name)
    text = json.dumps(config, indent=2, sort_keys=True)
    source = Path(name).expanduser()
    processor = source / PROCESSOR if source.is_dir() else None
    images = processor.read_text() if processor is not None and processor.is_file() else ""
    digest = hashlib.sha256(f"{text}{seed}{images}".encode()).hexdigest()[:12]
    label = source.name if source.exists() else name
    final = cache_root() / "dummy" / f"{label.split('/')[-1].lower()}-{digest}"

    def build(tmp: Path) -> None:
        (tmp / "config.json").write_text(text + "\n")
        if images:  # a vision model's tower is built only beside its image processor
            (tmp / PROCESSOR).write_text(images)
        (tmp / MARKER).write_text(json.dumps({"source": name, "seed": seed}) + "\n")

    return publish_dir(final, build, MARKER)


class DummyReader:
    """CheckpointReader's interface (names, numel, get) over generated tensors.

    hf_config: a transformers PretrainedConfig; the names and shapes are those of
    `AutoModelForCausalLM.from_config(hf_config)` built on the meta device (tied
    parameters once, under their first name, and persistent buffers such as DeepSeek-V3's
    expert-score correction bias, as `save_pretrained` writes them).
    dtype: of the returned tensors (default float16). The values are float16 numbers
    whatever the dtype, so a float32 reader and a float16 one agree after casting.
    """

    def __init__(
        self, hf_config: Any, *, seed: int = DEFAULT_SEED, dtype: torch.dtype | None = None
    ) -> None:
        from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

        # a vision model transformers keeps apart from causal LMs (LLaVA, Qwen2.5-VL): its own
        causal = type(hf_config) in AutoModelForCausalLM._model_mapping
        kind = AutoModelForCausalLM if causal else AutoModelForImageTextToText
        with torch.device("meta"):
            model = kind.from_config(hf_config)
        self._shapes = {name: tuple(p.shape) for name, p in model.named_parameters()}
        saved = model.state_dict().keys()  # persistent buffers too (DeepSeek-V3's bias)
        self._shapes |= {n: tuple(b.shape) for n, b in model.named_buffers() if n in saved}
        self.dtype = dtype or torch.float16
        generator = torch.Generator().manual_seed(seed)
        pool = (
            torch.rand(POOL_SIZE, generator=generator, dtype=torch.float64) * 2 - 1
        ) * INIT_SCALE
        self._pool = pool.to(torch.float16).to(self.dtype)

    @classmethod
    def from_model_dir(cls, model_dir: Path, dtype: torch.dtype | None = None) -> DummyReader:
        marker = json.loads((model_dir / MARKER).read_text())
        return cls(
            read_hf_config(model_dir), seed=int(marker.get("seed", DEFAULT_SEED)), dtype=dtype
        )

    @property
    def names(self) -> list[str]:
        return list(self._shapes)

    def shape(self, name: str) -> tuple[int, ...]:
        return self._shapes[name]

    def numel(self, name: str) -> int:
        return math.prod(self._shapes[name])

    def get(self, name: str) -> torch.Tensor:
        shape = self._shapes[name]
        if _is_norm(name) and len(shape) == 1:
            return (torch.ones if name.endswith(".weight") else torch.zeros)(
                shape, dtype=self.dtype
            )
        numel = math.prod(shape)
        offset = zlib.crc32(name.encode()) % POOL_SIZE
        # out[i] = pool[(offset + i) % POOL_SIZE]: one pool period, then doubling copies
        out = torch.empty(numel, dtype=self.dtype)
        period = min(numel, POOL_SIZE)
        head = min(period, POOL_SIZE - offset)
        out[:head].copy_(self._pool[offset : offset + head])
        out[head:period].copy_(self._pool[: period - head])
        filled = period  # a multiple of POOL_SIZE from here on, or numel
        while filled < numel:
            n = min(filled, numel - filled)
            out[filled : filled + n].copy_(out[:n])
            filled += n
        return out.view(shape)


def _is_norm(name: str) -> bool:
    module = name.rpartition(".")[0]
    return "norm" in module.rpartition(".")[2]
