"""Layer-wise model implementations (OPT, the Llama family and the families built on it: Qwen 3,
Gemma 2/3, Phi-3/4, OLMo 2/3, SmolLM3, and the mixture-of-experts Mixtral, Qwen2/3-MoE, OLMoE,
GLM-4.5, DeepSeek-V3, gpt-oss and Llama 4; the hybrids Qwen3-Next, Qwen3.5, Granite 4,
Nemotron-H and Falcon-H1), built for placement and offloading."""

from engine.models.base import Model
from engine.models.config import ModelConfig


def build_model(config: ModelConfig) -> Model:
    """The implementation for `config.model_type` (validated by ModelConfig.from_hf)."""
    if config.is_opt:
        from engine.models.opt import OPTModel

        return OPTModel(config)
    if config.model_type == "qwen2_5_vl":
        from engine.models.qwen2_5_vl import Qwen25VLModel

        return Qwen25VLModel(config)
    if config.model_type == "qwen3":
        from engine.models.qwen3 import Qwen3Model

        return Qwen3Model(config)
    if config.model_type in ("gemma2", "gemma3_text"):
        from engine.models.gemma import GemmaModel

        return GemmaModel(config)
    if config.model_type == "phi3":
        from engine.models.phi3 import Phi3Model

        return Phi3Model(config)
    if config.model_type in ("olmo2", "olmo3"):
        from engine.models.olmo2 import Olmo2Model

        return Olmo2Model(config)
    if config.model_type in ("mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "glm4_moe"):
        from engine.models import moe

        return {
            "mixtral": moe.MixtralModel,
            "qwen2_moe": moe.MoeModel,
            "qwen3_moe": moe.Qwen3MoeModel,
            "olmoe": moe.OlmoeModel,
            "glm4_moe": moe.Glm4MoeModel,
        }[config.model_type](config)
    if config.model_type == "falcon_h1":
        from engine.models.falcon_h1 import FalconH1Model

        return FalconH1Model(config)
    if config.model_type == "nemotron_h":
        from engine.models.nemotron_h import NemotronHModel

        return NemotronHModel(config)
    if config.is_mamba:
        from engine.models.granite_hybrid import GraniteHybridModel

        return GraniteHybridModel(config)
    if config.is_hybrid:
        from engine.models.qwen3_next import Qwen3NextModel

        return Qwen3NextModel(config)
    if config.model_type == "gpt_oss":
        from engine.models.gpt_oss import GptOssModel

        return GptOssModel(config)
    if config.model_type == "llama4_text":
        from engine.models.llama4 import Llama4Model

        return Llama4Model(config)
    if config.model_type == "deepseek_v3":
        from engine.models.deepseek import DeepseekV3Model

        return DeepseekV3Model(config)
    from engine.models.llama import LlamaModel

    return LlamaModel(config)
