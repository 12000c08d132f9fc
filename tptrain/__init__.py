"""tptrain: tensor-parallel training of Hugging Face-format language models on PyTorch."""
from tptrain.distributed import DistributedConfig
from tptrain.models import AutoConfig, AutoModelForCausalLM

__all__ = ["AutoConfig", "AutoModelForCausalLM", "DistributedConfig"]
