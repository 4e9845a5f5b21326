"""Data: tokenizer, indexed datasets, GPT samples, blending, the built-in corpus, the loader.

``build_data`` is what ``pretrain.py`` calls with the run's data part (:class:`DataConfig`); it
picks the source:
``--mock-data`` (synthetic tokens), ``--data-path`` (Megatron indexed datasets, optionally a
weighted blend), or neither (the built-in corpus made from Python's standard library sources).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional


from .config import DataConfig


def __getattr__(name):
    # Lazy: the tools' tokenizer workers import autosp_lm.data.* and should not pay for torch.
    if name in ("MicroBatchSampler", "build_loader"):
        from . import loader
        return getattr(loader, name)
    if name == "MockGPTDataset":
        from .mock import MockGPTDataset
        return MockGPTDataset
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


@dataclass
class DataBundle:
    train: Any
    valid: Optional[Any]
    test: Optional[Any]
    vocab_size: int  # the tokenizer's vocabulary size (before padding for the model)
    eod_id: Optional[int] = None
    tokenizer: Optional[Any] = None
    description: str = ""


def build_data(config: DataConfig, num_samples: tuple[int, int, int], *, mock_vocab_size: int, rank: int = 0,
               barrier=None) -> DataBundle:
    """Build train/valid/test datasets with at least ``num_samples`` samples each.

    ``rank`` and ``barrier`` let one process build shared caches while the others wait.
    """
    n_train, n_valid, n_test = num_samples
    if config.mock_data:
        from .mock import MockGPTDataset
        mk = lambda n, split: MockGPTDataset(mock_vocab_size, config.seq_length, max(n, 1),
                                             seed=config.seed, split=split)
        return DataBundle(mk(n_train, 0), mk(n_valid, 1), mk(n_test, 2), mock_vocab_size,
                          description=f"mock data (vocab {mock_vocab_size})")
    if config.data_path:
        from .gpt_dataset import build_gpt_datasets
        return build_gpt_datasets(config, num_samples, rank=rank, barrier=barrier)
    from .builtin_corpus import build_builtin_datasets
    return build_builtin_datasets(config, num_samples, rank=rank, barrier=barrier)


__all__ = ["DataConfig", "DataBundle", "build_data", "build_loader", "MicroBatchSampler", "MockGPTDataset"]
