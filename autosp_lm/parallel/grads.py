"""Gradient reduction shared by every strategy: sum over the SP group, mean over data-parallel.

Each SP rank's gradient holds the contribution of its own tokens, so the single-device gradient
is their sum; data-parallel replicas computed different batches, so they are averaged. Both
happen in one all-reduce over the whole world followed by a division by the data-parallel size,
on gradients flattened into buckets so the number of collectives stays small.
"""
from __future__ import annotations

from typing import Iterable

import torch
import torch.distributed as dist

BUCKET_BYTES = 64 * 1024 * 1024  # the gradient buckets of one reduction (also the planner's)


def _buckets(tensors: list[torch.Tensor], limit: int):
    bucket, size = [], 0
    for t in tensors:
        key_ok = not bucket or (bucket[0].dtype == t.dtype and bucket[0].device == t.device)
        if bucket and (not key_ok or size + t.numel() * t.element_size() > limit):
            yield bucket
            bucket, size = [], 0
        bucket.append(t)
        size += t.numel() * t.element_size()
    if bucket:
        yield bucket


def reduce_gradients(params: Iterable[torch.nn.Parameter], dp_size: int, group=None,
                     bucket_bytes: int = BUCKET_BYTES) -> None:
    """All-reduce (sum) gradients over ``group`` (default: world) and divide by ``dp_size``.

    Parameters without a gradient take part with zeros so every rank issues the same collectives.
    """
    params = [p for p in params if p.requires_grad]
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size(group) == 1:
        if dp_size != 1:
            for p in params:
                if p.grad is not None:
                    p.grad.div_(dp_size)
        return
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    grads = [p.grad for p in params]
    for bucket in _buckets(grads, bucket_bytes):
        flat = torch.cat([g.reshape(-1) for g in bucket])
        dist.all_reduce(flat, group=group)
        if dp_size != 1:
            flat.div_(dp_size)
        offset = 0
        for g in bucket:
            n = g.numel()
            g.copy_(flat[offset:offset + n].view_as(g))
            offset += n
        del flat  # before the next bucket's cat: one bucket is live at a time, not two
