"""Megatron-style bf16: bf16 parameters for compute, fp32 main parameters for the optimizer.

``--bf16`` (as Megatron-LM's ``--bf16`` and torchtitan's FSDP2 mixed precision): every parameter
the model computes with is bf16 -- embeddings and norms included -- so the residual stream and
everything saved from it is bf16. The optimizer steps fp32 *main* copies; gradients accumulate
across micro batches in fp32 and are reduced in fp32. Autocast stays on around the forward (the
ops it keeps in fp32 -- softmax, cross entropy, layer norm -- keep doing so; matmuls of bf16
inputs are bf16 either way), and buffers (RoPE's frequencies) stay fp32.

``--bf16 --fp32-residual-connection``: parameters stay fp32 and autocast casts the matmul inputs
(the behaviour before Megatron-style bf16): the residual stream and what is saved from it are fp32.

Each sharding implements the mode for its layout (:mod:`.sharding`: unsharded, FSDP2, graph FSDP,
distributed optimizer); :func:`cast_parameters` is the single-device form (tests, tools).
"""
from __future__ import annotations

import torch
import torch.nn as nn


def cast_parameters(model: nn.Module, dtype: torch.dtype = torch.bfloat16) -> nn.Module:
    """Every floating parameter of ``model`` in ``dtype``, in place (tied parameters stay one
    object; buffers keep their dtype)."""
    seen = set()
    for p in model.parameters():
        if id(p) in seen or not p.is_floating_point():
            continue
        seen.add(id(p))
        p.data = p.data.to(dtype)
    return model


def fp32_accumulator(store: dict, key, main: nn.Parameter):
    """A post-accumulate-grad hook for a low-precision parameter: its gradient is added to
    ``main.grad`` in fp32 (across micro batches) and dropped from the parameter."""

    def hook(p):
        g = p.grad
        p.grad = None
        if main.grad is None:
            main.grad = g.float() if g.dtype != torch.float32 else g.clone()
        else:
            main.grad.add_(g)  # upcast element by element, no fp32 copy
        store[key] = True

    return hook


__all__ = ["cast_parameters", "fp32_accumulator"]
