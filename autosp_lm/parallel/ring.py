"""Hand-written ring attention (``--ring``), load balanced (zigzag), exact against one device.

Each of the ``P`` ranks keeps its query block; key/value blocks travel around the ring (rank
``r`` sends to ``r+1`` and receives from ``r-1``) with point-to-point ``batch_isend_irecv``
issued *before* the block computation, so the transfer of the next block overlaps the attention
of the current one. The partial results of the blocks are merged exactly with an online softmax:
the attention kernel returns ``(out_b, lse_b)`` (the log-sum-exp of each query row's scores) and

    lse = logaddexp(lse_a, lse_b),   out = exp(lse_a - lse) * out_a + exp(lse_b - lse) * out_b.

**Zigzag split and causal masking.** The sequence is cut into ``2P`` chunks and rank ``r`` holds
chunks ``r`` and ``2P-1-r`` (``q = [q0 | q1]``, likewise the kv blocks). For the kv block of rank
``j`` (chunks ``j`` and ``2P-1-j``):

* ``j == r`` (diagonal): ordinary causal attention over the local ``2c`` tokens (chunk ``r``
  precedes chunk ``2P-1-r``, so the local token order is the global order);
* ``j < r``: both query chunks see kv chunk ``j`` entirely and neither sees ``2P-1-j``
  (``> 2P-1-r``): full attention of all local queries to the first half of the block;
* ``j > r``: ``q0`` (chunk ``r < j``) sees nothing, ``q1`` (chunk ``2P-1-r >= P > j`` and
  ``> 2P-1-j``) sees the whole block: full attention of the second half of the queries.

So every rank computes one causal diagonal plus ``P-1`` half-size full blocks: equal work.

**Backward** is exact and stores only the local ``q, k, v``, the merged ``out`` and ``lse``
(O(S/P) activation memory per rank): with the *global* ``out`` and ``lse`` a flash-attention
backward kernel run on one block returns exactly that block's contribution to ``dq, dk, dv``
(the softmax probabilities ``exp(s - lse)`` and the row terms ``rowsum(dout * out)`` are then the
global ones). K/V travel the ring again; the ``dk/dv`` accumulators travel with them (one step
behind, overlapped with the next block) and a final send returns each block's gradient to its
owner.

**Grouped-query attention**: the ring sends the ``Hkv`` un-repeated kv heads; each block is
expanded to the query heads just before the kernel (query head ``h`` uses kv head
``h // (H/Hkv)``) and the kernel's kv gradients are summed back over each group.

**Kernels** (chosen per device, dtype and head dim, verified once against the math path):
CPU ``aten._scaled_dot_product_flash_attention_for_cpu`` (+ ``_backward``); CUDA
``aten._scaled_dot_product_flash_attention`` for fp16/bf16, ``_scaled_dot_product_efficient_attention``
otherwise; an explicit math implementation as the fallback (``kernel="math"``).

**torch.compile**: forward and backward are ``torch.library`` custom ops
(``autosp_lm::ring_attention`` with a registered autograd formula calling
``autosp_lm::ring_attention_backward``) with fake implementations, so Dynamo/AOTAutograd/Inductor
treat the whole ring as one opaque node in the forward and backward graphs: no graph breaks.
"""
from __future__ import annotations

import math
from typing import Optional

import torch
import torch.distributed as dist
from torch.library import custom_op

from . import collectives
from .ring_kernels import (KERNELS, acc_dtype, cuda_aux, block_backward, block_forward,
                           select_kernel, selected_kernels)

aten = torch.ops.aten

# --------------------------------------------------------------------------------------------
# the ring
# --------------------------------------------------------------------------------------------
class _Ring:
    """Point-to-point neighbours of this rank in the SP group ``group`` (by registered name)."""

    def __init__(self, group: str):
        if not group:
            self.pg, self.world, self.rank = None, 1, 0
            return
        self.pg = collectives.resolve_group(group)
        self.world = dist.get_world_size(self.pg)
        self.rank = dist.get_rank(self.pg)
        ranks = dist.get_process_group_ranks(self.pg)
        self.next = ranks[(self.rank + 1) % self.world]
        self.prev = ranks[(self.rank - 1) % self.world]

    def shift(self, send: torch.Tensor, tag: int):
        """Start sending ``send`` to the next rank and receiving the previous rank's into a new
        buffer; returns ``(buffer, requests)``."""
        recv = torch.empty_like(send)
        ops = [dist.P2POp(dist.isend, send, self.next, self.pg, tag),
               dist.P2POp(dist.irecv, recv, self.prev, self.pg, tag)]
        return recv, dist.batch_isend_irecv(ops)


def _wait(reqs) -> None:
    for r in reqs:
        r.wait()


def ring_blocks(rank: int, src: int, length: int, causal: bool, zigzag: bool):
    """The (query slice, key slice, causal) pieces rank ``rank`` computes against the kv block of
    rank ``src`` (``length`` local tokens); empty when the block is entirely masked."""
    every = slice(0, length)
    if not causal:
        return [(every, every, False)]
    if src == rank:
        return [(every, every, True)]
    if not zigzag:  # contiguous blocks: earlier ranks fully visible, later ones masked
        return [(every, every, False)] if src < rank else []
    half = length // 2
    if src < rank:
        return [(every, slice(0, half), False)]
    return [(slice(half, length), every, False)]


def ring_positions(rank: int, world: int, length: int, zigzag: bool, device=None) -> torch.Tensor:
    """The global positions of the ``length`` local tokens of ring rank ``rank``: chunks ``rank``
    and ``2*world-1-rank`` of ``2*world`` (zigzag), or block ``rank`` of ``world``."""
    if not zigzag or world == 1:
        return torch.arange(rank * length, (rank + 1) * length, device=device)
    half = length // 2
    j = 2 * world - 1 - rank
    return torch.cat([torch.arange(rank * half, (rank + 1) * half, device=device),
                      torch.arange(j * half, (j + 1) * half, device=device)])


def block_mask(qpos: torch.Tensor, kpos: torch.Tensor, causal: bool,
               doc: Optional[torch.Tensor], mask: Optional[torch.Tensor]) -> torch.Tensor:
    """Bool ``[B|1, H|1, Lq, Lk]``: which of the keys at global positions ``kpos`` the queries at
    ``qpos`` see: causality by position, the same document (``doc [B, S]``), a model's mask
    (``mask [B|1, H|1, S, S]`` over global positions, True: visible)."""
    m = (kpos[None, :] <= qpos[:, None])[None, None] if causal else None
    if doc is not None:
        same = (doc[:, qpos][:, :, None] == doc[:, kpos][:, None, :]).unsqueeze(1)
        m = same if m is None else m & same
    if mask is not None:
        sub = mask.index_select(-2, qpos).index_select(-1, kpos)
        m = sub if m is None else m & sub
    return m


def _expand(x: torch.Tensor, groups: int) -> torch.Tensor:
    return x if groups == 1 else x.repeat_interleave(groups, dim=1)


def _reduce_groups(dx: torch.Tensor, groups: int) -> torch.Tensor:
    if groups == 1:
        return dx
    b, h, s, d = dx.shape
    return dx.reshape(b, h // groups, groups, s, d).sum(2)


def _pieces(ring, src: int, length: int, causal: bool, zigzag: bool, doc, mask, device):
    """The (query slice, key slice, kernel causal flag, block mask or None) pieces this rank
    computes against the kv block of ``src``; pieces whose mask hides everything are dropped."""
    pieces = ring_blocks(ring.rank, src, length, causal, zigzag)
    if doc is None and mask is None:
        return [(qs, ks, c, None) for qs, ks, c in pieces]
    qpos = ring_positions(ring.rank, ring.world, length, zigzag, device)
    kpos = ring_positions(src, ring.world, length, zigzag, device)
    out = []
    for qs, ks, _ in pieces:
        m = block_mask(qpos[qs], kpos[ks], causal, doc, mask)
        if bool(m.any()):
            out.append((qs, ks, False, m))
    return out


def _merge(out, lse, qs, o_b, l_b):
    """Online-softmax merge of one block's ``(o_b, l_b)`` into the running ``out``/``lse`` rows
    ``qs`` (rows that have seen nothing yet keep ``lse = -inf``; no NaN)."""
    l_old = lse[:, :, qs]
    l_new = torch.logaddexp(l_old, l_b)
    finite = torch.isfinite(l_new)
    safe = torch.where(finite, l_new, 0.0)
    w_old = torch.where(finite, torch.exp(l_old - safe), 0.0).unsqueeze(-1)
    w_new = torch.where(finite, torch.exp(l_b - safe), 0.0).unsqueeze(-1)
    out[:, :, qs] = w_old * out[:, :, qs] + w_new * o_b.to(out.dtype)
    lse[:, :, qs] = l_new


def _ring_forward(q, k, v, doc, mask, causal: bool, zigzag: bool, scale: float, group: str,
                  kernel: str):
    ring = _Ring(group)
    masked = doc is not None or mask is not None
    kernel = select_kernel(q.device, q.dtype, q.size(-1), kernel, masked=masked)
    groups = q.size(1) // k.size(1)
    length = q.size(2)
    acc = acc_dtype(q.dtype)
    out = torch.zeros(q.shape, dtype=acc, device=q.device)
    lse = torch.full(q.shape[:3], float("-inf"), dtype=acc, device=q.device)
    kv = torch.stack([k, v])  # one message per step: [2, B, Hkv, L, D]
    for step in range(ring.world):
        if step + 1 < ring.world:
            nxt, reqs = ring.shift(kv, tag=0)
        src = (ring.rank - step) % ring.world
        kk, vv = _expand(kv[0], groups), _expand(kv[1], groups)
        for qs, ks, blk_causal, m in _pieces(ring, src, length, causal, zigzag, doc, mask,
                                             q.device):
            o_b, l_b = block_forward(kernel, q[:, :, qs].contiguous(), kk[:, :, ks].contiguous(),
                                     vv[:, :, ks].contiguous(), blk_causal, scale, m)
            _merge(out, lse, qs, o_b, l_b)
        if step + 1 < ring.world:
            _wait(reqs)
            kv = nxt
    return out.to(q.dtype).contiguous(), lse.contiguous()


def _ring_backward(dout, q, k, v, out, lse, doc, mask, causal: bool, zigzag: bool, scale: float,
                   group: str, kernel: str):
    ring = _Ring(group)
    masked = doc is not None or mask is not None
    kernel = select_kernel(q.device, q.dtype, q.size(-1), kernel, masked=masked)
    aux = cuda_aux(kernel, q, k, v) if kernel.startswith("cuda") else None
    groups = q.size(1) // k.size(1)
    length = q.size(2)
    acc = acc_dtype(q.dtype)
    dq = torch.zeros(q.shape, dtype=acc, device=q.device)
    kv = torch.stack([k, v])
    dkv_recv = dkv_reqs = dkv_sent = None
    for step in range(ring.world):
        if step + 1 < ring.world:
            nxt, kv_reqs = ring.shift(kv, tag=1)
        src = (ring.rank - step) % ring.world
        kk, vv = _expand(kv[0], groups), _expand(kv[1], groups)
        dkv = torch.zeros(kv.shape, dtype=acc, device=q.device)  # grads for the block of `src`
        for qs, ks, blk_causal, m in _pieces(ring, src, length, causal, zigzag, doc, mask,
                                             q.device):
            dq_b, dk_b, dv_b = block_backward(
                kernel, dout[:, :, qs].contiguous(), q[:, :, qs].contiguous(),
                kk[:, :, ks].contiguous(), vv[:, :, ks].contiguous(), out[:, :, qs].contiguous(),
                lse[:, :, qs].contiguous(), blk_causal, scale, aux, m)
            dq[:, :, qs] += dq_b
            dkv[0, :, :, ks] += _reduce_groups(dk_b.to(acc), groups)
            dkv[1, :, :, ks] += _reduce_groups(dv_b.to(acc), groups)
        if ring.world > 1:
            if dkv_reqs is not None:  # the accumulator for `src` from the previous rank
                _wait(dkv_reqs)
                dkv += dkv_recv
            dkv_sent = dkv
            dkv_recv, dkv_reqs = ring.shift(dkv_sent, tag=2)
        if step + 1 < ring.world:
            _wait(kv_reqs)
            kv = nxt
    if ring.world > 1:  # after P steps the accumulator of my own block arrives from rank r-1
        _wait(dkv_reqs)
        dkv = dkv_recv
    del dkv_sent
    # separate storages for dk and dv (outputs of a custom op must not alias each other)
    return dq.to(q.dtype), dkv[0].to(k.dtype, copy=True), dkv[1].to(v.dtype, copy=True)


# --------------------------------------------------------------------------------------------
# custom ops (one opaque node each for torch.compile) and autograd
# --------------------------------------------------------------------------------------------
@custom_op("autosp_lm::ring_attention", mutates_args=())
def _ring_attention_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                       doc: Optional[torch.Tensor], mask: Optional[torch.Tensor], causal: bool,
                       zigzag: bool, scale: float, group: str,
                       kernel: str) -> tuple[torch.Tensor, torch.Tensor]:
    return _ring_forward(q, k, v, doc, mask, causal, zigzag, scale, group, kernel)


@_ring_attention_op.register_fake
def _(q, k, v, doc, mask, causal, zigzag, scale, group, kernel):
    return q.new_empty(q.shape), q.new_empty(q.shape[:3], dtype=acc_dtype(q.dtype))


@custom_op("autosp_lm::ring_attention_backward", mutates_args=())
def _ring_attention_backward_op(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                                v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
                                doc: Optional[torch.Tensor], mask: Optional[torch.Tensor],
                                causal: bool, zigzag: bool, scale: float, group: str,
                                kernel: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return _ring_backward(dout, q, k, v, out, lse, doc, mask, causal, zigzag, scale, group,
                          kernel)


@_ring_attention_backward_op.register_fake
def _(dout, q, k, v, out, lse, doc, mask, causal, zigzag, scale, group, kernel):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def _setup_context(ctx, inputs, output):
    q, k, v, doc, mask, ctx.causal, ctx.zigzag, ctx.scale, ctx.group, ctx.kernel = inputs
    out, lse = output
    ctx.mark_non_differentiable(lse)
    ctx.save_for_backward(q, k, v, out, lse, doc, mask)


def _backward(ctx, dout, _dlse):
    q, k, v, out, lse, doc, mask = ctx.saved_tensors
    dq, dk, dv = _ring_attention_backward_op(dout.contiguous(), q, k, v, out, lse, doc, mask,
                                             ctx.causal, ctx.zigzag, ctx.scale, ctx.group,
                                             ctx.kernel)
    return dq, dk, dv, None, None, None, None, None, None, None


_ring_attention_op.register_autograd(_backward, setup_context=_setup_context)


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool = True,
                   group: Optional[dist.ProcessGroup] = None, zigzag: bool = True,
                   kernel: str = "auto", scale: Optional[float] = None,
                   sp_size: Optional[int] = None, document_ids: Optional[torch.Tensor] = None,
                   mask: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Exact attention of this rank's queries to the keys/values of every rank of ``group``.

    ``q [B, H, L, D]``, ``k``/``v`` ``[B, Hkv, L, D]`` hold this rank's ``L`` tokens: with
    ``zigzag`` (the load-balanced split of :mod:`slicing`) chunks ``r`` and ``2P-1-r`` of ``2P``,
    otherwise contiguous block ``r`` of ``P``. Returns ``[B, H, L, D]``. ``group=None`` (or a
    group of one) is plain local attention through the same kernels.

    ``document_ids [B, S]`` (the *whole* sequence's, ``S = P*L``) keeps attention within
    documents; ``mask [B|1, H|1, S, S]`` (bool, True: visible; over global positions) is any
    other mask. Each block then gets its own mask from the global positions of its query and key
    chunks; blocks that see nothing are skipped (their kv still travels the ring: every later
    rank needs it).
    """
    world = sp_size if sp_size is not None else (1 if group is None else dist.get_world_size(group))
    name = collectives.group_name(group) if world > 1 else ""
    return _ring_attention(q, k, v, causal, zigzag, kernel, name, world, scale, document_ids,
                           mask)


def _ring_attention(q, k, v, causal: bool, zigzag: bool, kernel: str, group_name: str, world: int,
                    scale: Optional[float] = None, document_ids=None, mask=None) -> torch.Tensor:
    if k.shape != v.shape or q.dim() != 4 or k.dim() != 4:
        raise ValueError(f"ring attention expects q [B, H, L, D] and k, v [B, Hkv, L, D]; got "
                         f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    if q.size(1) % k.size(1):
        raise ValueError(f"ring attention: {q.size(1)} query heads are not a multiple of "
                         f"{k.size(1)} key/value heads")
    if q.size(2) != k.size(2):
        raise ValueError(f"ring attention: local query length {q.size(2)} differs from the local "
                         f"key length {k.size(2)}")
    if causal and zigzag and world > 1 and q.size(2) % 2:
        raise ValueError(f"ring attention: the zigzag split needs an even local length (two "
                         f"chunks per rank), got {q.size(2)}")
    total = q.size(2) * world
    for name, t, dims in (("document_ids", document_ids, (-1,)), ("mask", mask, (-2, -1))):
        if t is not None and any(t.size(d) != total for d in dims):
            raise ValueError(f"ring attention: {name} of shape {tuple(t.shape)} does not cover "
                             f"the whole sequence of {total} tokens ({world} ranks x {q.size(2)})")
    scale = 1.0 / math.sqrt(q.size(-1)) if scale is None else float(scale)
    out, _ = _ring_attention_op(q.contiguous(), k.contiguous(), v.contiguous(),
                                None if document_ids is None else document_ids.contiguous(),
                                None if mask is None else mask.contiguous(), causal, zigzag,
                                scale, group_name, kernel)
    return out


class RingAttention:
    """An attention implementation for :func:`autosp_lm.models.attention.use_attention`:
    :func:`ring_attention` over ``group``. Attention dropout cannot be made exact and is refused."""

    def __init__(self, group: Optional[dist.ProcessGroup], sp_size: Optional[int] = None,
                 zigzag: bool = True, kernel: str = "auto"):
        if kernel not in KERNELS:
            raise ValueError(f"unknown ring attention kernel {kernel!r}; choose one of {KERNELS}")
        self.group = group
        self.sp_size = sp_size if sp_size is not None else (
            1 if group is None else dist.get_world_size(group))
        # resolved now (outside any compiled region) unless there is no group object yet
        self._group_name = ("" if self.sp_size == 1 else
                            collectives.group_name(group) if group is not None else None)
        self.zigzag = zigzag
        self.kernel = kernel
        self.document_ids: Optional[torch.Tensor] = None  # the whole sequence's, per forward

    @property
    def group_name(self) -> str:
        """The registered name of the SP group ("" for a single rank), looked up once."""
        if self._group_name is None:
            self._group_name = collectives.group_name(self.group)
        return self._group_name

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool = True,
                 dropout_p: float = 0.0,
                 document_ids: Optional[torch.Tensor] = None) -> torch.Tensor:
        """``document_ids`` from the model are this rank's slice; the masks are built from the
        whole sequence's ids, which the strategy sets as ``self.document_ids`` per forward."""
        if dropout_p:
            raise ValueError(f"--ring: attention dropout ({dropout_p}) is not supported by the ring "
                             f"attention baseline; train with --hidden-dropout 0")
        doc = full_documents(self.document_ids, document_ids, q.size(2) * self.sp_size, "--ring")
        return _ring_attention(q, k, v, causal, self.zigzag, self.kernel, self.group_name,
                               self.sp_size, document_ids=doc)


def full_documents(full: Optional[torch.Tensor], local: Optional[torch.Tensor], total: int,
                   who: str) -> Optional[torch.Tensor]:
    """The whole sequence's document ids for a hand-written baseline's attention: ``full`` (set
    by the strategy from the batch) when the model passes its local ids, None when it passes
    none."""
    if local is None:
        return None
    if full is None or full.size(-1) != total:
        raise ValueError(f"{who}: the model passed document_ids but the strategy holds no "
                         f"document ids of the whole sequence ({total} tokens); give the batch "
                         f"'document_ids' (--reset-attention-mask)")
    return full


__all__ = ["ring_attention", "RingAttention", "select_kernel", "selected_kernels",
           "block_forward", "block_backward", "ring_blocks", "ring_positions", "block_mask",
           "full_documents", "KERNELS"]
