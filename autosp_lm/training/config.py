"""The training part of a run's configuration: the schedule, the optimizer, checkpointing and
the logging interval; what :class:`~autosp_lm.training.trainer.Trainer` reads. Built once from
the command line by :mod:`autosp_lm.config` (field names are the flags' names); a test builds
one directly, without argparse."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional


@dataclass(frozen=True)
class OptimizerConfig:
    """AdamW and its learning-rate schedule (warm-up and decay already resolved)."""
    lr: float = 1e-3
    min_lr: float = 1e-4
    lr_decay_style: str = "cosine"
    lr_warmup_iters: int = 0
    lr_decay_iters: int = 100
    weight_decay: float = 0.1
    clip_grad: float = 1.0
    adam_beta1: float = 0.9
    adam_beta2: float = 0.95
    adam_eps: float = 1e-8


@dataclass(frozen=True)
class CheckpointConfig:
    save: Optional[str] = None
    load: Optional[str] = None
    save_interval: Optional[int] = None
    ckpt_format: str = "torch"
    async_save: bool = False

    @property
    def auto_resume(self) -> bool:
        """``--load`` equal to ``--save``: resume when a checkpoint is there, else start fresh."""
        return bool(self.load) and self.load == self.save


@dataclass(frozen=True)
class LoggingConfig:
    log_interval: int = 10
    metrics_file: Optional[str] = None
    wandb_project: Optional[str] = None
    wandb_exp_name: Optional[str] = None
    wandb_save_dir: Optional[str] = None


@dataclass(frozen=True)
class TrainingConfig:
    train_iters: int = 100
    micro_batch_size: int = 1
    global_batch_size: int = 1
    grad_accum_steps: int = 1  # global batch / (micro batch x data-parallel size)
    seq_length: int = 1024
    bf16: bool = False
    fp32_residual_connection: bool = False
    eval_interval: int = 1000
    eval_iters: int = 10
    exit_interval: Optional[int] = None
    num_workers: int = 0
    #: what the first iteration compiles, for the log (None: an eager strategy)
    compiling: Optional[str] = None
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)


__all__ = ["TrainingConfig", "OptimizerConfig", "CheckpointConfig", "LoggingConfig"]
