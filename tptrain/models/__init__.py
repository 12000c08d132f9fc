"""Single-device model code: configs, the decoder, rotary embeddings and the model_type registry."""
from tptrain.models.auto import MODEL_REGISTRY, AutoConfig, AutoModelForCausalLM
from tptrain.models.configuration import MixtralConfig, MoeConfig, OlmoeConfig, Qwen2MoeConfig, Qwen3MoeConfig
from tptrain.models.decoder import MixtralForCausalLM, OlmoeForCausalLM, Qwen2MoeForCausalLM, Qwen3MoeForCausalLM
from tptrain.models.configuration import (Gemma2Config, Gemma3TextConfig, GraniteConfig, LlamaConfig,
                                          MinistralConfig, MistralConfig, Olmo2Config, Olmo3Config, Phi3Config,
                                          PretrainedConfig, Qwen2Config, Qwen3Config, SmolLM3Config)
from tptrain.models.decoder import (CausalLMOutput, DecoderForCausalLM, DecoderModel, Gemma2ForCausalLM,
                                    Gemma3ForCausalLM, GraniteForCausalLM, LlamaForCausalLM, MinistralForCausalLM,
                                    MistralForCausalLM, Olmo2ForCausalLM, Olmo3ForCausalLM, Phi3ForCausalLM,
                                    Qwen2ForCausalLM,
                                    Qwen3ForCausalLM, RMSNorm, SmolLM3ForCausalLM, causal_lm_loss)

__all__ = [
    "MODEL_REGISTRY", "AutoConfig", "AutoModelForCausalLM",
    "PretrainedConfig", "LlamaConfig", "Qwen2Config", "Qwen3Config", "MistralConfig", "MinistralConfig",
    "GraniteConfig", "SmolLM3Config", "Olmo2Config", "Olmo3Config", "Gemma2Config", "Gemma3TextConfig",
    "Phi3Config",
    "CausalLMOutput", "DecoderForCausalLM", "DecoderModel", "RMSNorm", "causal_lm_loss",
    "LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM", "MistralForCausalLM", "MinistralForCausalLM",
    "GraniteForCausalLM", "SmolLM3ForCausalLM", "Olmo2ForCausalLM", "Olmo3ForCausalLM", "Gemma2ForCausalLM",
    "Gemma3ForCausalLM", "Phi3ForCausalLM",
    "MoeConfig", "Qwen3MoeConfig", "MixtralConfig", "Qwen2MoeConfig", "OlmoeConfig",
    "Qwen3MoeForCausalLM", "MixtralForCausalLM", "Qwen2MoeForCausalLM", "OlmoeForCausalLM",
]
