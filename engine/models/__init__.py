"""Layer-wise model implementations (OPT, Llama family) built for placement and offloading."""

from engine.models.base import Model
from engine.models.config import ModelConfig


def build_model(config: ModelConfig) -> Model:
    """The implementation for `config.model_type` (validated by ModelConfig.from_hf)."""
    if config.is_opt:
        from engine.models.opt import OPTModel

        return OPTModel(config)
    from engine.models.llama import LlamaModel

    return LlamaModel(config)
