"""Small custom ops the AutoSP passes insert (traceable, with autograd)."""
from __future__ import annotations

import torch
from torch.library import custom_op


@custom_op("autosp_lm::grad_scale", mutates_args=())
def grad_scale(x: torch.Tensor, scale: float) -> torch.Tensor:
    """Identity in the forward; multiplies the gradient by ``scale`` in the backward.

    Used where a replicated value that requires grad meets the per-rank loss share: every rank
    back-propagates it fully, so its gradient is scaled by ``1/P`` to keep the sum over the SP
    group exact.
    """
    return x.clone()


@grad_scale.register_fake
def _(x, scale):
    return torch.empty_like(x)


def _setup(ctx, inputs, output):
    ctx.scale = inputs[1]


def _backward(ctx, grad):
    return grad * ctx.scale, None


grad_scale.register_autograd(_backward, setup_context=_setup)
