"""Hand-written Ulysses attention (``--ulysses``): all-to-all heads <-> sequence around attention.

Every rank holds a contiguous block of ``S/P`` tokens of every layer's activations. Around the
attention entry point of the model, one all-to-all per tensor turns ``q [B, H, S/P, D]`` into
``[B, H/P, S, D]`` (this rank's heads, the whole sequence, blocks in rank order), the unchanged
local attention (SDPA) runs on whole sequences, and the inverse all-to-all brings the output back
to ``[B, H, S/P, D]``. The collectives are ``autosp_lm::all_to_all`` custom ops with autograd
(backward: the inverse all-to-all), so ``torch.compile`` traces the layer without graph breaks.

Grouped-query attention (``Hkv < H`` key/value heads; query head ``h`` uses kv head
``h // (H/Hkv)``, SDPA's ``enable_gqa`` grouping): the head-split policy of
:mod:`autosp_lm.parallel.heads` (shared with the AutoSP compiler) repeats each kv head ``r``
times before the all-to-all where needed, so that rank ``r`` receives exactly the kv heads its
``H/P`` query heads use (autograd of the repeat sums the replicas' gradients); head counts that
cannot be split exactly are a ValueError naming the numbers and the sizes that would work.

``head_chunks`` (``--attention-head-chunks K``): UPipe's head chunking, each rank's heads
attended in ``K`` chunks one after the other (:mod:`autosp_lm.parallel.upipe`), so one chunk's
all-to-all buffers and attention intermediates are live at a time, in the forward and in the
backward.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from ..models.attention import AttentionFn, sdpa_attention
from . import collectives
from .heads import head_chunks, kv_replication
from .ring import full_documents
from .upipe import head_chunked_attention

class UlyssesAttention:
    """An attention implementation (``fn(q, k, v, causal=..., dropout_p=...)``) for
    :func:`autosp_lm.models.attention.use_attention` that wraps ``local_attention`` in
    all-to-alls over ``group``. Inputs are this rank's contiguous sequence block.

    ``ring``: the 2-D (Ulysses x Ring) hybrid: after the all-to-all over the ``U`` ranks of
    ``group`` this rank holds its ring shard for ``H/U`` heads, and ``ring`` (a
    :class:`~autosp_lm.parallel.ring.RingAttention` over the ring group, zigzag) computes its
    attention to every other ring shard.

    ``head_chunks``: 1, plain Ulysses; ``K > 1`` (0: the most the heads allow) UPipe's head
    chunks (not with the 2-D hybrid)."""

    def __init__(self, group: Optional[dist.ProcessGroup], sp_size: Optional[int] = None,
                 local_attention: AttentionFn = sdpa_attention, ring=None, head_chunks: int = 1):
        self.group = group
        self.sp_size = sp_size if sp_size is not None else (
            1 if group is None else dist.get_world_size(group))
        if head_chunks != 1 and ring is not None:
            raise ValueError("--attention-head-chunks runs the all-to-all over the whole "
                             "sequence-parallel group; the 2-D hybrid (--ulysses-degree below "
                             "it) has no head chunks: drop one of the two flags")
        self.head_chunks = head_chunks
        self.resolved_chunks: Optional[int] = None  # set by the strategy from the model's heads
        # resolved now (outside any compiled region) unless there is no group object yet
        self._group_name = "" if self.sp_size == 1 else None
        self.ring = ring
        self.local_attention = local_attention if ring is None else ring
        self.total_size = self.sp_size * (ring.sp_size if ring is not None else 1)
        self.kv_replication = None  # set at the first call
        self.document_ids: Optional[torch.Tensor] = None  # the whole sequence's, per forward

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool = True,
                 dropout_p: float = 0.0,
                 document_ids: Optional[torch.Tensor] = None) -> torch.Tensor:
        """``document_ids`` from the model are this rank's slice; after the all-to-all the
        sequence is whole, so the mask comes from the whole sequence's ids (``self.document_ids``,
        set by the strategy per forward)."""
        p = self.sp_size
        if self.ring is not None and self.ring.document_ids is not self.document_ids:
            self.ring.document_ids = self.document_ids
        if self.head_chunks != 1:
            return self._chunked(q, k, v, causal, dropout_p, document_ids)
        if p == 1:
            return self.local_attention(q, k, v, causal=causal, dropout_p=dropout_p,
                                        document_ids=document_ids)
        if self.ring is None:
            document_ids = full_documents(self.document_ids, document_ids,
                                          q.size(2) * self.total_size, "--ulysses")
        try:
            rep = kv_replication(q.size(1), k.size(1), p)
        except ValueError as e:
            raise ValueError(f"Ulysses: {e}; or use --ring, which has no head constraint") from None
        if self.kv_replication != rep:  # (a compiled checkpoint region allows no mutation)
            self.kv_replication = rep
        if rep > 1:
            k = k.repeat_interleave(rep, dim=1)  # kv head j at positions [j*rep, (j+1)*rep)
            v = v.repeat_interleave(rep, dim=1)
        q = collectives.all_to_all(q, 1, 2, self.group)  # [B, H/P, S, D]
        k = collectives.all_to_all(k, 1, 2, self.group)
        v = collectives.all_to_all(v, 1, 2, self.group)
        out = self.local_attention(q, k, v, causal=causal, dropout_p=dropout_p,
                                   document_ids=document_ids)
        return collectives.all_to_all(out, 2, 1, self.group)  # [B, H, S/P, D]

    @property
    def group_name(self) -> str:
        """The registered name of the SP group ("" for a single rank), looked up once."""
        if self._group_name is None:
            self._group_name = collectives.group_name(self.group)
        return self._group_name

    def chunks_for(self, num_heads: int, num_kv_heads: int) -> int:
        """The head chunks of a model with these heads (ValueError naming the numbers)."""
        return head_chunks(num_heads, num_kv_heads, self.sp_size, self.head_chunks)

    def _chunked(self, q, k, v, causal, dropout_p, document_ids):
        p = self.sp_size
        try:
            chunks = self.chunks_for(q.size(1), k.size(1))
            rep = kv_replication(q.size(1), k.size(1), p)
        except ValueError as e:
            raise ValueError(f"Ulysses: {e}") from None
        if p > 1:
            document_ids = full_documents(self.document_ids, document_ids, q.size(2) * p,
                                          "--ulysses")
        if rep > 1:  # kv head j at positions [j*rep, (j+1)*rep); autograd sums the replicas
            k = k.repeat_interleave(rep, dim=1)
            v = v.repeat_interleave(rep, dim=1)
        return head_chunked_attention(q, k, v, chunks=chunks, causal=causal, dropout_p=dropout_p,
                                      group=self.group_name, world=p, document_ids=document_ids,
                                      local_attention=self.local_attention)
