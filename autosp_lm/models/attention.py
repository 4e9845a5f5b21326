"""The single attention entry point every model calls.

Models pass ``q`` as ``[batch, heads, seq, head_dim]`` and ``k``/``v`` as
``[batch, kv_heads, seq, head_dim]`` (kv_heads divides heads: grouped-query attention) and get
``[batch, heads, seq, head_dim]`` back. The default implementation is PyTorch's
``F.scaled_dot_product_attention``. Hand-written sequence-parallel baselines replace the
implementation from outside with :func:`use_attention`; model code never changes.
"""
from __future__ import annotations

import contextlib
from typing import Callable, Optional

import torch
import torch.nn.functional as F

AttentionFn = Callable[..., torch.Tensor]


def sdpa_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool = True,
                   dropout_p: float = 0.0) -> torch.Tensor:
    """Plain single-device attention through ``F.scaled_dot_product_attention``."""
    gqa = k.size(1) != q.size(1)
    return F.scaled_dot_product_attention(q, k, v, is_causal=causal, dropout_p=dropout_p,
                                          enable_gqa=gqa)


_impl: Optional[AttentionFn] = None


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool = True,
              dropout_p: float = 0.0) -> torch.Tensor:
    """Compute attention with the current implementation (SDPA unless replaced)."""
    if _impl is None:
        return sdpa_attention(q, k, v, causal=causal, dropout_p=dropout_p)
    return _impl(q, k, v, causal=causal, dropout_p=dropout_p)


def set_attention(fn: Optional[AttentionFn]) -> Optional[AttentionFn]:
    """Install ``fn`` as the attention implementation (None restores SDPA); returns the old one."""
    global _impl
    old, _impl = _impl, fn
    return old


def get_attention() -> Optional[AttentionFn]:
    return _impl


@contextlib.contextmanager
def use_attention(fn: Optional[AttentionFn]):
    """Context manager form of :func:`set_attention`."""
    old = set_attention(fn)
    try:
        yield
    finally:
        set_attention(old)
