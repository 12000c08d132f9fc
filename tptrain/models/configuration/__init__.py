"""Model configs: one typed dataclass per model_type, reading and writing Hugging Face `config.json`.

    cfg = AutoConfig.from_pretrained("path/to/checkpoint")   # or Qwen3Config.from_pretrained(...)
    cfg.save_pretrained("out/")                              # transformers' AutoConfig loads it too

`base.py` holds `PretrainedConfig` (the I/O, the shared fields and checks) and the decoder's TP/SP plans every family
starts from (`DECODER_TP_PLAN`, `DECODER_SP_PLAN`); each family is a small subclass in its own file (its fields,
defaults, checks and plan), re-exported here. A new family is such a file and its entry in `models/registry.py`.
"""
from tptrain.models.configuration.base import (CONFIG_NAME, DECODER_SP_PLAN, DECODER_TP_PLAN, SUPPORTED_ACTIVATIONS,
                                               SUPPORTED_LAYER_TYPES, SUPPORTED_ROPE_TYPES, PretrainedConfig,
                                               absorb_rope_parameters, load_config_dict, rope_type_of)
from tptrain.models.configuration.deepseek import DeepseekV3Config
from tptrain.models.configuration.gemma import Gemma2Config, Gemma3TextConfig
from tptrain.models.configuration.granite import GraniteConfig
from tptrain.models.configuration.llama import LlamaConfig, Qwen2Config, Qwen3Config
from tptrain.models.configuration.mistral import Ministral3Config, MinistralConfig, MistralConfig
from tptrain.models.configuration.moe import MixtralConfig, MoeConfig, OlmoeConfig, Qwen2MoeConfig, Qwen3MoeConfig
from tptrain.models.configuration.olmo import Olmo2Config, Olmo3Config
from tptrain.models.configuration.phi3 import Phi3Config
from tptrain.models.configuration.smollm3 import SmolLM3Config

__all__ = ["CONFIG_NAME", "DECODER_SP_PLAN", "DECODER_TP_PLAN", "SUPPORTED_ACTIVATIONS", "SUPPORTED_LAYER_TYPES", "SUPPORTED_ROPE_TYPES", "DeepseekV3Config",
           "Gemma2Config",
           "Gemma3TextConfig", "GraniteConfig", "LlamaConfig", "Ministral3Config", "MinistralConfig", "MistralConfig",
           "MixtralConfig", "MoeConfig", "Olmo2Config", "Olmo3Config", "OlmoeConfig", "Phi3Config", "PretrainedConfig",
           "Qwen2Config", "Qwen2MoeConfig", "Qwen3Config", "Qwen3MoeConfig", "SmolLM3Config", "absorb_rope_parameters",
           "load_config_dict", "rope_type_of"]
