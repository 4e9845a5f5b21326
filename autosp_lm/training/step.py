"""One training step, the only copy: micro batches -> strategy loss -> backward -> gradient
reduction -> clip -> optimizer. The trainer and the benchmark tools all call these."""
from __future__ import annotations

import contextlib
from typing import Optional

import torch

from ..parallel.grads import reduce_gradients


def autocast_context(device: torch.device, bf16: bool):
    """bf16 autocast on ``device`` (fp32 master weights), or nothing."""
    return torch.autocast(device.type, dtype=torch.bfloat16) if bf16 else contextlib.nullcontext()


def forward_backward(strategy, batch: dict, *, bf16: bool = False, accumulation: int = 1,
                     device: Optional[torch.device] = None, saved_counter=None) -> torch.Tensor:
    """Forward one micro batch through ``strategy``, back-propagate ``loss / accumulation``; returns the
    reported (single-device, detached) loss. ``saved_counter``: a context manager wrapped around
    the forward only (e.g. :class:`~autosp_lm.training.memory.SavedTensorBytes`)."""
    device = device or next(iter(batch.values())).device
    with autocast_context(device, bf16):
        with saved_counter if saved_counter is not None else contextlib.nullcontext():
            loss, reported = strategy.forward_loss(batch)
    (loss / accumulation if accumulation != 1 else loss).backward()
    return reported


def finish_step(model: torch.nn.Module, optimizer, *, dp_size: int, clip_grad: float = 0.0,
                step: bool = True, sharding=None) -> torch.Tensor:
    """Reduce gradients (sum over SP, mean over DP), clip to ``clip_grad`` (0: no clipping) and
    take the optimizer step; returns the pre-clip global gradient norm. ``sharding``: the
    :class:`~autosp_lm.parallel.sharding.Sharding` of the model (None: whole state on every
    rank); with ``step=False`` the caller steps and then calls its ``after_optimizer_step()``."""
    max_norm = clip_grad if clip_grad > 0 else float("inf")
    if sharding is None:
        reduce_gradients(model.parameters(), dp_size)
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
    else:
        sharding.reduce_gradients()
        norm = sharding.clip_grad_norm_(max_norm)
    if step:
        optimizer.step()
        if sharding is not None:
            sharding.after_optimizer_step()
    return norm
