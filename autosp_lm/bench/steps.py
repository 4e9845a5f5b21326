"""What a measuring process does, shared by the benchmark's cells (``job``) and the GPU check's
workers (``gpu/``): a batch of the mock dataset and one training step."""
from __future__ import annotations

import torch


def mock_batch(vocab_size: int, seq: int, n: int, seed: int, device,
               keys=("input_ids", "labels")) -> dict:
    """The first ``n`` samples of the mock dataset (``seq`` tokens each), stacked on ``device``."""
    from autosp_lm.data.mock import MockGPTDataset
    data = MockGPTDataset(vocab_size, seq, n, seed=seed)
    return {k: torch.stack([data[i][k] for i in range(n)]).to(device) for k in keys}


def train_step(strategy, model, optimizer, batch: dict, *, bf16: bool, device, dp_size: int = 1,
               sharding=None, zero: bool = True, saved_counter=None):
    """One training step: zero the gradients (``zero``; through ``sharding`` where there is
    one), forward and backward (``saved_counter`` around the forward), reduce the gradients,
    the optimizer step; on CUDA, wait for it. Returns the reported loss."""
    from autosp_lm.training.step import finish_step, forward_backward
    if zero:
        if sharding is not None:
            sharding.zero_grad(optimizer)
        else:
            optimizer.zero_grad(set_to_none=True)
    reported = forward_backward(strategy, batch, bf16=bf16, device=device,
                                saved_counter=saved_counter)
    finish_step(model, optimizer, dp_size=dp_size, sharding=sharding)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return reported
