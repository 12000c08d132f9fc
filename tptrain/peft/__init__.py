"""LoRA adapters on tensor-parallel (or single-device) models, saved and loaded in the PEFT format (issue 4)."""
from tptrain.peft.config import LoraConfig
from tptrain.peft.model import PeftModel, get_peft_model

__all__ = ["LoraConfig", "PeftModel", "get_peft_model"]
