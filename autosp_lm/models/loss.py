"""Language-model cross entropy shared by the models and the strategies that split the loss."""
from __future__ import annotations

import torch
import torch.nn.functional as F

IGNORE_INDEX = -100


def lm_cross_entropy(logits: torch.Tensor, labels: torch.Tensor, reduction: str = "mean") -> torch.Tensor:
    """Cross entropy of ``logits [B, S, V]`` against aligned ``labels [B, S]``.

    Tokens labelled ``-100`` are ignored. ``reduction="mean"`` averages over the non-ignored
    tokens (the single-device loss); ``"sum"`` returns their sum, which sequence-parallel
    strategies divide by the global token count.
    """
    return F.cross_entropy(logits.float().reshape(-1, logits.size(-1)), labels.reshape(-1),
                           ignore_index=IGNORE_INDEX, reduction=reduction)
