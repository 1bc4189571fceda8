"""The one table of model families: per `model_type`, the layers that run it, the reader of its
config, the config fields that reader honours, its rotary scalings, how the planner prices it
and the name of its GGUF files.

Torch-free and transformers-free, so both layers read it: the engine builds and reads a model
from its row (engine/models/__init__.py, engine/models/hf_config.py, engine/loading/gguf_*.py),
the planner prices a config.json by it (policy/hf_spec.py). A new family is its module in
engine/models/ plus one row here. The engine's classes and readers are named as
'module:attribute' strings (imported when used; policy imports nothing of the engine), and a
test imports every one of them (tests/engine/models/test_registry.py).
"""

from __future__ import annotations

from dataclasses import dataclass

from policy.config_fields import (
    COMMON,
    FALCON_H1,
    GATED_DELTA_NET,
    GEMMA,
    GRANITE_HYBRID,
    GROUPED_MOE,
    LLAMA4,
    MLA,
    MOE,
    NEMOTRON_H,
    OPT,
    QWEN_MOE,
    WINDOWS,
)

_MODELS = "engine.models"
_READERS = "engine.models.hf_readers"
_HYBRID_READERS = "engine.models.hf_hybrid_readers"
_LLAMA_ROPE = ("default", "linear", "llama3")
"""The rotary scalings of most Llama-family readers (engine/models/rotary.py)."""


@dataclass(frozen=True)
class Family:
    """One `model_type` nanoflex runs."""

    model_type: str
    implementation: str = f"{_MODELS}.llama:LlamaModel"
    """The layer-wise model class ('module:Class', engine/models/); '' for a checkpoint with a
    vision tower read as its language model (`text_config`), which that row builds."""
    reader: str = f"{_READERS}:llama"
    """The function from a transformers config to `ModelConfig` fields ('module:function');
    '' where `implementation` is."""
    honoured: frozenset[str] | None = COMMON
    """The config fields the reader honours (any other off its default is refused by name);
    None: the reader refuses what it does not honour itself (Qwen2.5-VL, of its text config)."""
    rope_types: tuple[str, ...] = _LLAMA_ROPE
    """Rotary scaling types the reader accepts; (): the family reads no rotary scaling."""
    text_config: str = ""
    """A checkpoint with a vision tower: the `model_type` of its `text_config`; '': a text
    model."""
    priced_as: str = ""
    """The row whose shapes the planner prices this type by (Qwen2.5-VL's language model as
    Qwen2); '': `text_config` where set, else this row."""
    arch: str = "llama"
    """The planner's architecture: 'opt', or 'llama' (RMSNorm, RoPE, gated MLP and their
    variants)."""
    hybrid: bool = False
    """Some layers keep a per-sequence state instead of KV pages (policy/hybrid.py)."""
    tied_by_default: bool = False
    """The config class ties the LM head to the embeddings unless the config says otherwise."""
    aliases: tuple[str, ...] = ()
    """Model types whose checkpoints are this architecture under a name transformers does not
    know (Kimi K2: DeepSeek-V3's), read with this type's config class."""
    gguf_architecture: str = ""
    """The `general.architecture` of this family's GGUF files (llama.cpp's name); '': none
    (Mistral's and Mixtral's files are `llama`, OLMo 3's `olmo2` with a window)."""

    @property
    def is_vision_wrapper(self) -> bool:
        """A checkpoint with a vision tower whose language model (its `text_config` row) is
        what nanoflex runs; the vision tower is not loaded."""
        return bool(self.text_config) and not self.implementation

    @property
    def planned_as(self) -> str:
        """The row the planner reads this type's config.json (or its text_config) as."""
        return self.priced_as or self.text_config or self.model_type


def _vision_wrapper(model_type: str, text_config: str) -> Family:
    return Family(
        model_type, implementation="", reader="", honoured=frozenset(), text_config=text_config
    )


def _qwen_vl(model_type: str, implementation: str, priced_as: str) -> Family:
    """A Qwen vision-language checkpoint run whole (its tower by the vision encoder): its
    reader (named as the type) refuses what it does not honour of its text config; the
    planner prices its language model as `priced_as`."""
    return Family(
        model_type,
        f"{_MODELS}.{implementation}",
        f"{_READERS}:{model_type}",
        honoured=None,
        rope_types=("default",),
        text_config=f"{model_type}_text",
        priced_as=priced_as,
    )


_ROWS = (
    Family("opt", f"{_MODELS}.opt:OPTModel", f"{_READERS}:opt", OPT, (), arch="opt"),
    Family("llama", honoured=COMMON | {"attention_bias", "mlp_bias"}, gguf_architecture="llama"),
    Family("mistral", honoured=COMMON | WINDOWS),
    Family("qwen2", honoured=COMMON | WINDOWS, gguf_architecture="qwen2"),
    _qwen_vl("qwen2_5_vl", "qwen2_5_vl:Qwen25VLModel", "qwen2"),
    _qwen_vl("qwen3_vl", "qwen3_vl:Qwen3VLModel", "qwen3"),
    _qwen_vl("qwen3_vl_moe", "qwen3_vl:Qwen3VLMoeModel", "qwen3_moe"),
    Family(
        "qwen3",
        f"{_MODELS}.qwen3:Qwen3Model",
        honoured=COMMON | WINDOWS | {"attention_bias"},
        gguf_architecture="qwen3",
    ),
    Family(
        "gemma2",
        f"{_MODELS}.gemma:GemmaModel",
        f"{_READERS}:gemma",
        COMMON | WINDOWS | GEMMA,
        ("default", "linear"),
        tied_by_default=True,
        gguf_architecture="gemma2",
    ),
    Family(
        "gemma3_text",
        f"{_MODELS}.gemma:GemmaModel",
        f"{_READERS}:gemma",
        COMMON | WINDOWS | GEMMA,
        ("default", "linear"),
        tied_by_default=True,
        gguf_architecture="gemma3",
    ),
    Family(
        "gemma3",
        f"{_MODELS}.gemma:GemmaModel",
        f"{_READERS}:gemma3",
        honoured=None,
        rope_types=("default", "linear"),
        text_config="gemma3_text",
        tied_by_default=True,
    ),
    Family(
        "llava",
        f"{_MODELS}.llava:LlavaModel",
        f"{_READERS}:llava",
        honoured=None,
        text_config="llama",
    ),
    *(
        Family(
            model_type,
            f"{_MODELS}.idefics3:Idefics3Model",
            f"{_MODELS}.idefics3:read_config",
            honoured=None,
            text_config="llama",
        )
        for model_type in ("idefics3", "smolvlm")
    ),
    Family(
        "phi3",
        f"{_MODELS}.phi3:Phi3Model",
        honoured=COMMON | WINDOWS | {"original_max_position_embeddings"},
        rope_types=("default", "longrope"),
        gguf_architecture="phi3",
    ),
    Family(
        "olmo2",
        f"{_MODELS}.olmo2:Olmo2Model",
        honoured=COMMON | {"attention_bias"},
        gguf_architecture="olmo2",
    ),
    Family(
        "olmo3",
        f"{_MODELS}.olmo2:Olmo2Model",
        f"{_READERS}:olmo3",
        COMMON | WINDOWS | {"attention_bias"},
        (*_LLAMA_ROPE, "yarn"),
    ),
    Family(
        "smollm3",
        reader=f"{_READERS}:smollm3",
        honoured=COMMON
        | WINDOWS
        | {"attention_bias", "mlp_bias", "no_rope_layers", "no_rope_layer_interval"},
        rope_types=(*_LLAMA_ROPE, "yarn"),
        gguf_architecture="smollm3",
    ),
    Family("mixtral", f"{_MODELS}.moe:MixtralModel", f"{_READERS}:moe", COMMON | WINDOWS | MOE),
    Family(
        "qwen2_moe",
        f"{_MODELS}.moe:MoeModel",
        f"{_READERS}:moe",
        COMMON | WINDOWS | MOE | QWEN_MOE | {"qkv_bias"},
        gguf_architecture="qwen2moe",
    ),
    Family(
        "qwen3_moe",
        f"{_MODELS}.moe:Qwen3MoeModel",
        f"{_READERS}:moe",
        COMMON | WINDOWS | MOE | QWEN_MOE | {"attention_bias"},
        gguf_architecture="qwen3moe",
    ),
    Family(
        "olmoe",
        f"{_MODELS}.moe:OlmoeModel",
        f"{_READERS}:moe",
        COMMON | MOE | {"attention_bias"},
        gguf_architecture="olmoe",
    ),
    Family(
        "glm4_moe",
        f"{_MODELS}.moe:Glm4MoeModel",
        f"{_READERS}:glm4_moe",
        COMMON | MOE | GROUPED_MOE | {"attention_bias", "use_qk_norm"},
        (*_LLAMA_ROPE, "yarn"),
        gguf_architecture="glm4moe",
    ),
    Family(
        "deepseek_v3",
        f"{_MODELS}.deepseek:DeepseekV3Model",
        f"{_READERS}:deepseek_v3",
        COMMON | MOE | GROUPED_MOE | MLA,
        ("default", "linear", "yarn"),
        aliases=("kimi_k2",),
        gguf_architecture="deepseek2",
    ),
    Family(
        "gpt_oss",
        f"{_MODELS}.gpt_oss:GptOssModel",
        f"{_READERS}:gpt_oss",
        COMMON | WINDOWS | MOE | {"attention_bias", "swiglu_alpha", "swiglu_limit"},
        ("default", "yarn"),
        gguf_architecture="gpt-oss",
    ),
    Family(
        "llama4_text",
        f"{_MODELS}.llama4:Llama4Model",
        f"{_READERS}:llama4_text",
        COMMON | MOE | LLAMA4,
        gguf_architecture="llama4",
    ),
    _vision_wrapper("llama4", "llama4_text"),
    Family(
        "qwen3_next",
        f"{_MODELS}.qwen3_next:Qwen3NextModel",
        f"{_HYBRID_READERS}:gated_delta_net",
        COMMON | WINDOWS | MOE | QWEN_MOE | GATED_DELTA_NET,
        ("default", "linear", "yarn"),
        hybrid=True,
    ),
    _vision_wrapper("qwen3_5", "qwen3_5_text"),
    Family(
        "qwen3_5_text",
        f"{_MODELS}.qwen3_next:Qwen3NextModel",
        f"{_HYBRID_READERS}:gated_delta_net",
        COMMON | {"layer_types"} | GATED_DELTA_NET,
        ("default",),
        hybrid=True,
    ),
    _vision_wrapper("qwen3_5_moe", "qwen3_5_moe_text"),
    Family(
        "qwen3_5_moe_text",
        f"{_MODELS}.qwen3_next:Qwen3NextModel",
        f"{_HYBRID_READERS}:gated_delta_net",
        COMMON | {"layer_types"} | MOE | {"shared_expert_intermediate_size"} | GATED_DELTA_NET,
        ("default",),
        hybrid=True,
    ),
    Family(
        "granitemoehybrid",
        f"{_MODELS}.granite_hybrid:GraniteHybridModel",
        f"{_HYBRID_READERS}:granite_hybrid",
        COMMON | GRANITE_HYBRID,
        hybrid=True,
    ),
    Family(
        "nemotron_h",
        f"{_MODELS}.nemotron_h:NemotronHModel",
        f"{_HYBRID_READERS}:nemotron_h",
        NEMOTRON_H,
        (),
        hybrid=True,
    ),
    Family(
        "falcon_h1",
        f"{_MODELS}.falcon_h1:FalconH1Model",
        f"{_HYBRID_READERS}:falcon_h1",
        FALCON_H1,
        hybrid=True,
    ),
)

FAMILIES: dict[str, Family] = {row.model_type: row for row in _ROWS}
"""model_type -> its row, in the order nanoflex lists the types it runs."""
ALIASES: dict[str, str] = {alias: row.model_type for row in _ROWS for alias in row.aliases}
"""Model types transformers does not know -> the row whose architecture they are."""


def rope_types(model_type: str) -> tuple[str, ...]:
    """The rotary scalings the reader of `model_type` accepts: its row's, or, for the text
    config of a checkpoint read by its own reader (Qwen2.5-VL's), that checkpoint's row's."""
    row = FAMILIES.get(model_type)
    if row is None:
        row = next(r for r in _ROWS if r.text_config == model_type and r.reader)
    return row.rope_types


def gguf_model_types() -> dict[str, str]:
    """GGUF architecture -> the model type its files convert to, in table order."""
    return {row.gguf_architecture: row.model_type for row in _ROWS if row.gguf_architecture}
