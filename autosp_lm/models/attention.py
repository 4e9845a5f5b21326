"""The single attention entry point every model calls.

Models pass ``q`` as ``[batch, heads, seq, head_dim]`` and ``k``/``v`` as
``[batch, kv_heads, seq, head_dim]`` (kv_heads divides heads: grouped-query attention) and get
``[batch, heads, seq, head_dim]`` back. With ``document_ids`` (``[batch, seq]`` ints: the document
of each token in a packed sample, ``--reset-attention-mask``) attention stays within each document,
causal inside it.

The default implementation, :func:`sdpa_attention`:

* without documents: ``F.scaled_dot_product_attention(is_causal=causal)``;
* with documents on CUDA: FlexAttention with a block mask built directly from the document
  boundaries (:func:`document_block_mask`: ``O((S/128)^2)`` integers, never an ``S x S``
  matrix), so fully masked blocks are skipped;
* with documents elsewhere (CPU): SDPA with a boolean ``[batch, 1, S, S]`` mask
  (:func:`document_mask`). That is ``S^2`` bytes per sample: meant for tests and small runs.

Hand-written sequence-parallel baselines replace the implementation from outside with
:func:`use_attention`; model code never changes.
"""
from __future__ import annotations

import contextlib
from typing import Callable, Optional

import torch
import torch.nn.functional as F

AttentionFn = Callable[..., torch.Tensor]

#: FlexAttention's block size (both axes); the block mask of a packed batch is built at it
FLEX_BLOCK = 128


def document_mask(document_ids: torch.Tensor, causal: bool = True,
                  kv_document_ids: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``[B, 1, Sq, Sk]`` bool: query ``i`` may see key ``j`` when both are in the same document
    (and ``j <= i`` when ``causal``; positions are the tensors' indices)."""
    kv = document_ids if kv_document_ids is None else kv_document_ids
    same = document_ids[:, :, None] == kv[:, None, :]
    if causal:
        sq, sk = document_ids.size(-1), kv.size(-1)
        same = same & torch.ones(sq, sk, dtype=torch.bool, device=same.device).tril()
    return same.unsqueeze(1)


def document_block_mask(document_ids: torch.Tensor, causal: bool = True,
                        block: int = FLEX_BLOCK):
    """A FlexAttention ``BlockMask`` for causal attention within documents, built from the
    document ranges of each block (no ``S x S`` evaluation): a key block is listed for a query
    block when their document-id ranges overlap (and it is not in the future); blocks wholly
    inside one document (and below the diagonal) are *full* blocks, which skip the mask function.
    Document ids must be non-decreasing along the sequence (packed samples are)."""
    from torch.nn.attention.flex_attention import BlockMask
    B, S = document_ids.shape
    nb = -(-S // block)
    pad = nb * block - S
    doc = F.pad(document_ids, (0, pad), value=-1) if pad else document_ids
    blocks = doc.view(B, nb, block)
    lo = blocks[..., 0]  # ids are non-decreasing: the first token holds the smallest
    hi = blocks.amax(-1)  # the padding (-1) never raises the largest
    qi = torch.arange(nb, device=doc.device)
    overlap = (lo[:, :, None] <= hi[:, None, :]) & (lo[:, None, :] <= hi[:, :, None])
    single = (lo == hi)
    full = overlap & single[:, :, None] & single[:, None, :] & (lo[:, :, None] == lo[:, None, :])
    if causal:
        below = qi[:, None] > qi[None, :]
        overlap = overlap & (qi[:, None] >= qi[None, :])
        full = full & below
    partial = overlap & ~full
    if pad:  # a block with padding is never full: the mask function hides the padding
        partial[:, -1, :] |= full[:, -1, :]
        partial[:, :, -1] |= full[:, :, -1]
        full[:, -1, :] = False
        full[:, :, -1] = False

    def indices(m):
        counts = m.sum(-1).to(torch.int32)
        order = torch.argsort((~m).to(torch.int8), dim=-1, stable=True).to(torch.int32)
        return counts.unsqueeze(1), order.unsqueeze(1)

    kv_num, kv_idx = indices(partial)
    full_num, full_idx = indices(full)

    def mask_mod(b, h, q, k):
        same = document_ids[b, q.clamp(max=S - 1)] == document_ids[b, k.clamp(max=S - 1)]
        ok = same & (q < S) & (k < S)
        return ok & (k <= q) if causal else ok

    return BlockMask.from_kv_blocks(kv_num, kv_idx, full_num, full_idx, BLOCK_SIZE=block,
                                    mask_mod=mask_mod, seq_lengths=(S, S))


_compiled_flex = None


def _flex():
    """FlexAttention: as it is inside a compiled region (the outer compile fuses it), compiled
    on its own otherwise (eager FlexAttention materializes the scores)."""
    global _compiled_flex
    from torch.nn.attention.flex_attention import flex_attention
    if torch.compiler.is_compiling():
        return flex_attention
    if _compiled_flex is None:
        _compiled_flex = torch.compile(flex_attention, dynamic=False)
    return _compiled_flex


def _use_flex(q: torch.Tensor, dropout_p: float) -> bool:
    if not q.is_cuda or dropout_p:
        return False
    try:
        import torch.nn.attention.flex_attention  # noqa: F401
    except ImportError:  # pragma: no cover - very old torch
        return False
    return True


def sdpa_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool = True,
                   dropout_p: float = 0.0,
                   document_ids: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Plain single-device attention (see the module docstring for the paths)."""
    gqa = k.size(1) != q.size(1)
    if document_ids is None:
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal, dropout_p=dropout_p,
                                              enable_gqa=gqa)
    if _use_flex(q, dropout_p):
        return _flex()(q, k, v, block_mask=document_block_mask(document_ids, causal),
                       enable_gqa=gqa)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=document_mask(document_ids, causal),
                                          dropout_p=dropout_p, enable_gqa=gqa)


_impl: Optional[AttentionFn] = None


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool = True,
              dropout_p: float = 0.0, document_ids: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Compute attention with the current implementation (SDPA unless replaced)."""
    if _impl is None:
        return sdpa_attention(q, k, v, causal=causal, dropout_p=dropout_p,
                              document_ids=document_ids)
    if document_ids is None:  # implementations written before document masking keep working
        return _impl(q, k, v, causal=causal, dropout_p=dropout_p)
    return _impl(q, k, v, causal=causal, dropout_p=dropout_p, document_ids=document_ids)


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
