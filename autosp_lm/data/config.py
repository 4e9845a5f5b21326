"""The data part of a run's configuration: what :func:`autosp_lm.data.build_data` and the dataset
builders read. Built once from the command line by :mod:`autosp_lm.config` (field names are the
flags' names); a test or a tool builds one directly, without argparse."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

DEFAULT_SPLIT = "969,30,1"


@dataclass(frozen=True)
class DataConfig:
    seq_length: int = 1024
    seed: int = 1234  # sample order (and --mock-data's tokens)
    mock_data: bool = False
    #: indexed dataset prefixes, or a blend ``(W1, PREFIX1, W2, PREFIX2, ...)``; None: the
    #: built-in corpus (or mock data)
    data_path: Optional[tuple] = None
    split: str = DEFAULT_SPLIT
    tokenizer_model: Optional[str] = None
    tokenizer_type: Optional[str] = None
    data_cache_path: Optional[str] = None
    eod_mask_loss: bool = False
    reset_position_ids: bool = False
    reset_attention_mask: bool = False
    num_workers: int = 0

    def __post_init__(self):
        if self.data_path is not None and not isinstance(self.data_path, tuple):
            object.__setattr__(self, "data_path", tuple(self.data_path))


__all__ = ["DataConfig", "DEFAULT_SPLIT"]
