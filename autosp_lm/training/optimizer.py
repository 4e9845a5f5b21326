"""AdamW with Megatron's parameter groups; NVIDIA apex FusedAdam when present on CUDA, torch's
fused AdamW otherwise (CUDA and CPU).

On CPU torch's fused AdamW (one kernel per parameter, CPU support since torch 2.4; checked on
2.11 and 2.13, plain and DTensor parameters) updates the parameter and its two moments in place
and allocates nothing, where the single-tensor AdamW (``foreach=False``) allocates two
temporaries of each parameter's size (``sqrt`` of the second moment and the quotient), so the
step's peak memory carried 2 x the largest parameter. The two agree to fp32 rounding (the fused
kernel evaluates the same update in a different order: tests/training/test_optimizer.py). Where
the fused kernel is refused (a device or dtype it does not support) the single-tensor AdamW is
used.
"""
from __future__ import annotations

import torch


def param_groups(model: torch.nn.Module, weight_decay: float) -> list[dict]:
    """Weight decay on matrices only: norms, biases (all 1-D parameters) get none."""
    decay, no_decay, seen = [], [], set()
    for _, p in model.named_parameters():
        if not p.requires_grad or id(p) in seen:
            continue
        seen.add(id(p))
        (no_decay if p.dim() < 2 else decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay},
            {"params": no_decay, "weight_decay": 0.0}]


def apex_fused_adam():
    """NVIDIA apex's FusedAdam class, or None when apex is not built here."""
    try:
        from apex.optimizers import FusedAdam  # NVIDIA apex, built from source on GPU clusters
        return FusedAdam
    except Exception:  # ImportError, or a broken/unrelated `apex` package
        return None


def fused_adamw_supported(device: torch.device) -> bool:
    """torch's fused AdamW has a kernel for this device type (CUDA; CPU from torch 2.4 on)."""
    try:  # the list torch.optim itself checks fused=True against
        from torch.utils._foreach_utils import _get_fused_kernels_supported_devices
    except ImportError:
        return device.type == "cuda"
    return device.type in _get_fused_kernels_supported_devices()


def build_optimizer(model: torch.nn.Module, *, lr: float, weight_decay: float, betas=(0.9, 0.95),
                    eps: float = 1e-8, device: torch.device = torch.device("cpu"),
                    sharded: bool = False):
    """AdamW over ``model``'s parameters. ``sharded``: the parameters are DTensor shards
    (``--use-torch-fsdp2``, ``--use-distributed-optimizer``), which apex does not know: torch's
    fused AdamW (DTensor has its sharding rule). Off CUDA: torch's fused AdamW where the device
    has its kernel (CPU), else the single-tensor AdamW."""
    groups = param_groups(model, weight_decay)
    if device.type == "cuda":
        fused = apex_fused_adam() if not sharded else None
        if fused is not None:
            return fused(groups, lr=lr, betas=betas, eps=eps, adam_w_mode=True)
        return torch.optim.AdamW(groups, lr=lr, betas=betas, eps=eps, fused=True)
    if fused_adamw_supported(device):
        try:
            return torch.optim.AdamW(groups, lr=lr, betas=betas, eps=eps, fused=True)
        except RuntimeError:  # a parameter the fused kernel does not take (device or dtype)
            pass
    return torch.optim.AdamW(groups, lr=lr, betas=betas, eps=eps, foreach=False)
