"""The run's typed configuration: :class:`RunConfig`, frozen, built once from the command line
(:func:`autosp_lm.config.build.build_run_config`) and handed down part by part.

Each part is the type its room reads, defined in that room so the room needs nothing of the
command line: the model (:class:`ModelSpec` around :class:`~autosp_lm.models.config.ModelConfig`,
resolved once: preset + shape flags, or ``--hf-checkpoint``'s ``config.json`` read once), the
parallel layout (:class:`~autosp_lm.parallel.config.ParallelConfig`), the strategy and its
options (the strategy's own ``Options`` dataclass), the data
(:class:`~autosp_lm.data.config.DataConfig`), and training: schedule, optimizer, checkpointing,
logging (:class:`~autosp_lm.training.config.TrainingConfig`). Field names are the flags' names.

Checkpoints store :meth:`RunConfig.to_dict`; :func:`stored_config` reads it back, also from
checkpoints written before it existed (their flags under ``args``).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Optional

from ..data.config import DataConfig
from ..models.config import ModelConfig, pad_vocab
from ..parallel.config import ParallelConfig
from ..training.config import CheckpointConfig, LoggingConfig, OptimizerConfig, TrainingConfig

#: ``metadata.json``'s ``config_version`` of checkpoints that store :meth:`RunConfig.to_dict`
CONFIG_VERSION = 1


@dataclass(frozen=True)
class ModelSpec:
    """The model part: its config, resolved once, and where it came from."""
    config: ModelConfig
    name: str  # the --model preset, or the --hf-checkpoint directory
    hf_checkpoint: Optional[str] = None
    vocab_size: Optional[int] = None  # --vocab-size (None: the tokenizer's, padded)
    make_vocab_size_divisible_by: int = 128

    def with_vocab(self, tokenizer_vocab: int, mock: bool) -> ModelConfig:
        """The model config for data whose tokenizer has ``tokenizer_vocab`` entries: the flag's
        vocabulary, else the tokenizer's padded to a multiple (mock data: as it is). Raises
        ValueError where the flag's vocabulary is too small."""
        if self.vocab_size and self.vocab_size < tokenizer_vocab:
            raise ValueError(f"--vocab-size {self.vocab_size} is smaller than the tokenizer's "
                             f"vocabulary {tokenizer_vocab}; drop the flag or raise it")
        if self.hf_checkpoint:
            return self.config
        vocab = self.vocab_size or (tokenizer_vocab if mock else
                                    pad_vocab(tokenizer_vocab, self.make_vocab_size_divisible_by))
        return dataclasses.replace(self.config, vocab_size=vocab)


@dataclass(frozen=True)
class RunConfig:
    model: ModelSpec
    parallel: ParallelConfig
    strategy: str  # none, autosp, ulysses, ring
    strategy_options: Any  # the strategy's Options dataclass
    data: DataConfig
    training: TrainingConfig
    seed: int = 1234
    memory_budget_gb: Optional[float] = None  # --autosp: the memory plan AutoSP chooses to fit
    recipe: Optional[str] = None  # the --recipe the flags started from

    @property
    def sac(self) -> bool:
        return bool(getattr(self.strategy_options, "sac", False))

    def to_dict(self) -> dict:
        """JSON-ready nested dict: what checkpoints and the metrics' config store."""
        out = {"config_version": CONFIG_VERSION}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if isinstance(value, ModelSpec):
                value = {**{k: getattr(value, k) for k in ("name", "hf_checkpoint", "vocab_size",
                                                             "make_vocab_size_divisible_by")},
                         "config": value.config.to_dict()}
            elif dataclasses.is_dataclass(value):
                value = dataclasses.asdict(value)
            out[f.name] = value
        return out


_TRAINING_PARTS = {"optimizer": OptimizerConfig, "checkpoint": CheckpointConfig,
                   "logging": LoggingConfig}


def stored_config(meta: dict) -> dict:
    """A checkpoint's run configuration as :meth:`RunConfig.to_dict` lays it out. Checkpoints
    written before the typed configuration stored the flags (``args``): their values are put
    in the parts that own them today (the fields keep the flags' names)."""
    if "config" in meta:
        return meta["config"]
    flat = dict(meta.get("args") or {})
    if not flat:
        return {}

    def part(cls):
        names = {f.name for f in dataclasses.fields(cls)}
        return {k: v for k, v in flat.items() if k in names}

    training = part(TrainingConfig)
    training.update({name: part(cls) for name, cls in _TRAINING_PARTS.items()})
    return {"config_version": 0, "model": {"name": flat.get("hf_checkpoint") or flat.get("model"),
                                           "hf_checkpoint": flat.get("hf_checkpoint"),
                                           "vocab_size": flat.get("vocab_size")},
            "parallel": part(ParallelConfig), "strategy": flat.get("strategy"),
            "data": part(DataConfig), "training": training, "seed": flat.get("seed")}


__all__ = ["RunConfig", "ModelSpec", "stored_config", "CONFIG_VERSION"]
