"""Hand-written Ulysses attention (``--ulysses``): all-to-all heads <-> sequence around attention.

Every rank holds a contiguous block of ``S/P`` tokens of every layer's activations. Around the
attention entry point of the model, one all-to-all per tensor turns ``q [B, H, S/P, D]`` into
``[B, H/P, S, D]`` (this rank's heads, the whole sequence, blocks in rank order), the unchanged
local attention (SDPA) runs on whole sequences, and the inverse all-to-all brings the output back
to ``[B, H, S/P, D]``. The collectives are ``autosp_lm::all_to_all`` custom ops with autograd
(backward: the inverse all-to-all), so ``torch.compile`` traces the layer without graph breaks.

Grouped-query attention (``Hkv < H`` key/value heads; query head ``h`` uses kv head
``h // (H/Hkv)``, SDPA's ``enable_gqa`` grouping):

* ``Hkv % P == 0``: kv heads are split like query heads; rank ``r`` gets query heads
  ``[r*H/P, (r+1)*H/P)`` and exactly the kv heads ``[r*Hkv/P, (r+1)*Hkv/P)`` they use;
* ``P % Hkv == 0``: each kv head is repeated ``P/Hkv`` times before the all-to-all, so rank ``r``
  receives kv head ``r // (P/Hkv)``, the one its ``H/P`` query heads use (autograd of the repeat
  sums the replicas' gradients);
* otherwise the head counts cannot be split exactly and a ValueError names the numbers.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from ..models.attention import AttentionFn, sdpa_attention
from . import collectives
from .slicing import CONTIGUOUS, SlicedSPStrategy

SPLIT = "split"
REPLICATE = "replicate"


def kv_head_mode(num_heads: int, num_kv_heads: int, sp_size: int) -> str:
    """How Ulysses distributes heads over ``sp_size`` ranks: ``"split"`` or ``"replicate"`` kv heads.

    Raises a ValueError naming the numbers when it cannot be done exactly.
    """
    if num_heads % sp_size:
        raise ValueError(
            f"Ulysses: {num_heads} attention heads are not divisible by the sequence-parallel size "
            f"{sp_size} (every rank must own the same number of heads); use a sequence-parallel "
            f"size that divides {num_heads}, or --ring, which has no head constraint")
    if num_kv_heads <= 0 or num_heads % num_kv_heads:
        raise ValueError(f"Ulysses: {num_heads} query heads are not a multiple of {num_kv_heads} "
                         f"key/value heads")
    if num_kv_heads % sp_size == 0:
        return SPLIT
    if sp_size % num_kv_heads == 0:
        return REPLICATE
    raise ValueError(
        f"Ulysses: {num_kv_heads} key/value heads cannot be split over sequence-parallel size "
        f"{sp_size}: the kv head count must be a multiple of the SP size (split) or divide it "
        f"(each kv head replicated {sp_size}/kv-heads times); use a sequence-parallel size that "
        f"divides or is a multiple of {num_kv_heads}, or change --num-query-groups")


class UlyssesAttention:
    """An attention implementation (``fn(q, k, v, causal=..., dropout_p=...)``) for
    :func:`autosp_lm.models.attention.use_attention` that wraps ``local_attention`` in
    all-to-alls over ``group``. Inputs are this rank's contiguous sequence block."""

    def __init__(self, group: Optional[dist.ProcessGroup], sp_size: Optional[int] = None,
                 local_attention: AttentionFn = sdpa_attention):
        self.group = group
        self.sp_size = sp_size if sp_size is not None else (
            1 if group is None else dist.get_world_size(group))
        self.local_attention = local_attention

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool = True,
                 dropout_p: float = 0.0) -> torch.Tensor:
        p = self.sp_size
        if p == 1:
            return self.local_attention(q, k, v, causal=causal, dropout_p=dropout_p)
        mode = kv_head_mode(q.size(1), k.size(1), p)
        if mode == REPLICATE:
            rep = p // k.size(1)
            k = k.repeat_interleave(rep, dim=1)  # kv head j at positions [j*rep, (j+1)*rep)
            v = v.repeat_interleave(rep, dim=1)
        q = collectives.all_to_all(q, 1, 2, self.group)  # [B, H/P, S, D]
        k = collectives.all_to_all(k, 1, 2, self.group)
        v = collectives.all_to_all(v, 1, 2, self.group)
        out = self.local_attention(q, k, v, causal=causal, dropout_p=dropout_p)
        return collectives.all_to_all(out, 2, 1, self.group)  # [B, H, S/P, D]


class UlyssesStrategy(SlicedSPStrategy):
    """``--ulysses``: contiguous sequence blocks, attention swapped for :class:`UlyssesAttention`.

    Options (besides ``compile``): ``backend`` (torch.compile backend, default inductor) and
    ``fullgraph`` (fail on any graph break).
    """

    name = "ulysses"
    layout = CONTIGUOUS

    def make_attention(self, model: torch.nn.Module) -> AttentionFn:
        cfg = getattr(model, "config", None)
        if cfg is not None and self.ps.sp_size > 1:
            self.head_mode = kv_head_mode(cfg.num_attention_heads, cfg.num_query_groups, self.ps.sp_size)
        else:
            self.head_mode = SPLIT
        return UlyssesAttention(self.ps.sp_group if self.ps.sp_size > 1 else None, self.ps.sp_size)

    def describe(self) -> str:
        kv = ("kv heads split" if self.head_mode == SPLIT
              else "kv heads replicated to one per rank")
        return f"all-to-all heads<->sequence, contiguous {self.ps.sp_size}-way split, {kv}"
