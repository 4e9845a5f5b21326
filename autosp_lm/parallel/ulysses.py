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
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from ..models.attention import AttentionFn, sdpa_attention
from . import collectives
from .heads import kv_replication
from .ring import full_documents

class UlyssesAttention:
    """An attention implementation (``fn(q, k, v, causal=..., dropout_p=...)``) for
    :func:`autosp_lm.models.attention.use_attention` that wraps ``local_attention`` in
    all-to-alls over ``group``. Inputs are this rank's contiguous sequence block.

    ``ring``: the 2-D (Ulysses x Ring) hybrid: after the all-to-all over the ``U`` ranks of
    ``group`` this rank holds its ring shard for ``H/U`` heads, and ``ring`` (a
    :class:`~autosp_lm.parallel.ring.RingAttention` over the ring group, zigzag) computes its
    attention to every other ring shard."""

    def __init__(self, group: Optional[dist.ProcessGroup], sp_size: Optional[int] = None,
                 local_attention: AttentionFn = sdpa_attention, ring=None):
        self.group = group
        self.sp_size = sp_size if sp_size is not None else (
            1 if group is None else dist.get_world_size(group))
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
