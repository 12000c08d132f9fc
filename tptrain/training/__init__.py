"""Training: Trainer, TrainingArguments, ParallelismConfig (TP x FSDP2 / HSDP / DDP), data, checkpoints."""
from tptrain.training.args import ParallelismConfig, TrainingArguments
from tptrain.training.trainer import Trainer, TrainOutput

__all__ = ["ParallelismConfig", "Trainer", "TrainOutput", "TrainingArguments"]
