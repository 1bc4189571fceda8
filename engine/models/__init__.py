"""Layer-wise model implementations (OPT, the Llama family and the families built on it: Qwen 3,
Gemma 2/3, Phi-3/4, OLMo 2/3, SmolLM3, and the mixture-of-experts Mixtral, Qwen2/3-MoE, OLMoE,
GLM-4.5, DeepSeek-V3, gpt-oss and Llama 4; the hybrids Qwen3-Next, Qwen3.5, Granite 4,
Nemotron-H and Falcon-H1), built for placement and offloading."""

from engine.models.base import Model
from engine.models.config import ModelConfig
from engine.models.registry import implementation_of


def build_model(config: ModelConfig) -> Model:
    """The implementation the family table (policy/families.py) names for `config.model_type`
    (validated by ModelConfig.from_hf)."""
    model: Model = implementation_of(config.model_type)(config)
    return model
