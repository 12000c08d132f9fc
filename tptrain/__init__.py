"""tptrain: tensor-parallel training of Hugging Face-format language models on PyTorch."""
from tptrain.distributed import DistributedConfig
from tptrain.models import AutoConfig, AutoModelForCausalLM

__all__ = ["AutoConfig", "AutoModelForCausalLM", "DistributedConfig", "ParallelismConfig", "Trainer",
           "TrainingArguments"]
_TRAINING = ("ParallelismConfig", "Trainer", "TrainingArguments")


def __getattr__(name: str):
    # The training names pull in FSDP and DCP; imported on first use so `import tptrain` stays light.
    if name in _TRAINING:
        import tptrain.training

        return getattr(tptrain.training, name)
    raise AttributeError(f"module 'tptrain' has no attribute {name!r}")
