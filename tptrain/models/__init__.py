"""Single-device model code: configs, the decoder, rotary embeddings and the model_type registry."""
from tptrain.models.auto import MODEL_REGISTRY, AutoConfig, AutoModelForCausalLM
from tptrain.models.configuration import (Gemma2Config, Gemma3TextConfig, GraniteConfig, LlamaConfig, Ministral3Config,
                                          MinistralConfig, MistralConfig, MixtralConfig, MoeConfig, Olmo2Config,
                                          Olmo3Config, OlmoeConfig, Phi3Config, PretrainedConfig, Qwen2Config,
                                          Qwen2MoeConfig, Qwen3Config, Qwen3MoeConfig, SmolLM3Config)
from tptrain.models.decoder import (CausalLMOutput, DecoderForCausalLM, DecoderModel, Gemma2ForCausalLM,
                                    Gemma3ForCausalLM, GraniteForCausalLM, LlamaForCausalLM, Ministral3ForCausalLM,
                                    MinistralForCausalLM, MistralForCausalLM, MixtralForCausalLM, Olmo2ForCausalLM,
                                    Olmo3ForCausalLM, OlmoeForCausalLM, Phi3ForCausalLM, Qwen2ForCausalLM,
                                    Qwen2MoeForCausalLM, Qwen3ForCausalLM, Qwen3MoeForCausalLM, RMSNorm,
                                    SmolLM3ForCausalLM, causal_lm_loss)

__all__ = [
    "MODEL_REGISTRY", "AutoConfig", "AutoModelForCausalLM",
    "PretrainedConfig", "LlamaConfig", "Qwen2Config", "Qwen3Config", "MistralConfig", "MinistralConfig",
    "Ministral3Config",
    "GraniteConfig", "SmolLM3Config", "Olmo2Config", "Olmo3Config", "Gemma2Config", "Gemma3TextConfig",
    "Phi3Config",
    "CausalLMOutput", "DecoderForCausalLM", "DecoderModel", "RMSNorm", "causal_lm_loss",
    "LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM", "MistralForCausalLM", "MinistralForCausalLM",
    "Ministral3ForCausalLM",
    "GraniteForCausalLM", "SmolLM3ForCausalLM", "Olmo2ForCausalLM", "Olmo3ForCausalLM", "Gemma2ForCausalLM",
    "Gemma3ForCausalLM", "Phi3ForCausalLM",
    "MoeConfig", "Qwen3MoeConfig", "MixtralConfig", "Qwen2MoeConfig", "OlmoeConfig",
    "Qwen3MoeForCausalLM", "MixtralForCausalLM", "Qwen2MoeForCausalLM", "OlmoeForCausalLM",
]
