"""AdamW with Megatron's parameter groups; NVIDIA apex FusedAdam when present on CUDA."""
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


def build_optimizer(model: torch.nn.Module, *, lr: float, weight_decay: float, betas=(0.9, 0.95),
                    eps: float = 1e-8, device: torch.device = torch.device("cpu"),
                    sharded: bool = False):
    """AdamW over ``model``'s parameters. ``sharded``: the parameters are DTensor shards
    (``--use-torch-fsdp2``, ``--use-distributed-optimizer``), which apex does not know: torch's
    fused AdamW on CUDA (DTensor has its sharding rule)."""
    groups = param_groups(model, weight_decay)
    if device.type == "cuda":
        fused = apex_fused_adam() if not sharded else None
        if fused is not None:
            return fused(groups, lr=lr, betas=betas, eps=eps, adam_w_mode=True)
        return torch.optim.AdamW(groups, lr=lr, betas=betas, eps=eps, fused=True)
    return torch.optim.AdamW(groups, lr=lr, betas=betas, eps=eps, foreach=False)
