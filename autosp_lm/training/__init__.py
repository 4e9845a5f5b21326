"""Training loop, optimizer, LR schedule, checkpointing, metrics and logging."""
from .checkpoint import CheckpointError
from .trainer import Trainer, TrainingError, TrainResult

__all__ = ["Trainer", "TrainResult", "TrainingError", "CheckpointError"]
