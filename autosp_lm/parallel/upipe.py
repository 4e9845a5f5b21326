"""Head-chunked ("untied") Ulysses attention: UPipe's head chunking (arXiv 2602.21196) by hand.

Plain Ulysses exchanges every head at once: ``q [B, H, S/P, D]`` becomes ``[B, H/P, S, D]``
through one all-to-all, attention runs on all of a rank's heads, and the output comes back
through one inverse all-to-all, so the exchange buffers of whole tensors (a send copy, the
receive buffer, the reassembled result) and the kernel's outputs and gradients of all ``H/P``
heads are live together, in the forward and again in the backward. Here each rank's ``H/P``
query heads are attended in ``K`` chunks, one after the other: for chunk ``c`` the all-to-all of
that chunk's q (and of the kv heads it uses), the model's local attention (SDPA), and the inverse
all-to-all of its output straight into the whole output. Only one chunk's exchange buffers and
kernel intermediates exist at a time, in the forward and in the backward.

**Layout.** Chunk ``c`` holds heads ``j*H/P + c*h + t`` (``h = H/(P K)``, ``t < h``) of every
rank ``j``: one all-to-all delivers each rank ``h`` consecutive heads of its own Ulysses share,
and the output goes back to the same head positions, so every head sees exactly what it sees in
plain Ulysses (and on one device). With grouped-query attention the kv heads are first
replicated as :func:`~autosp_lm.parallel.heads.kv_replication` says for ``P`` ranks (rank ``j``
then holds ``hk`` kv heads serving its ``H/P`` query heads); a chunk uses whole kv heads of its
own (``K`` divides ``hk``: the kv heads are exchanged in ``K`` chunks alongside) or a share of one
kv head (``hk`` divides ``K``: that kv head is exchanged once for the ``K/hk`` chunks that use it,
UPipe's GQA schedule): :func:`~autosp_lm.parallel.heads.head_chunks` checks it.

**What autograd keeps, and when it lets go.** Two custom ops do the exchanges of all chunks,
one after the other: :func:`chunks_to_sequence` (``[B, H, S/P, D] -> K x [B, h, S, D]``) and its
inverse :func:`chunks_to_heads` (``K x [B, h, S, D] -> [B, H, S/P, D]``, written straight into
the one output: no per-chunk pieces to concatenate); each one's backward is the other. Between
them, the local attention runs once per chunk under autograd, so it saves each chunk's exchanged
q, k, v, output and log-sum-exp as separate tensors: in total what plain Ulysses' SDPA saves, no
more. In the backward the gradient of the output is exchanged per chunk, and each chunk's
attention backward runs on its own and then releases that chunk's saved tensors, so the saved
set shrinks while the gradients grow (plain Ulysses holds every head's saved tensors and every
head's gradients at its one kernel call). Measured on one rank of SP 2, fp32, 8 heads of 64,
2,048 tokens (``tests/parallel/test_upipe.py``, docs/baselines.md): the attention's transient
peak (above its inputs, what it saves and its output) falls as ``1/K``.

A rank-local variant (one custom ``autograd.Function`` saving the local ``q, k, v`` and output and
re-exchanging them per chunk in the backward) was measured and dropped: it saves nothing in the
forward, but its backward must hold the whole local ``q, k, v``, output and output gradient
until its last chunk while the whole ``dq, dk, dv`` are filled, 8/K of a ``q`` above plain
Ulysses' backward peak (``K = 2``: 12.0 against plain's 10.5 ``q``-sizes, MHA).
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist
from torch.library import custom_op

from ..models.attention import AttentionFn, sdpa_attention
from . import collectives


# --------------------------------------------------------------------------------------------
# the exchanges of every chunk, one after the other
# --------------------------------------------------------------------------------------------
def _to_sequence(x: torch.Tensor, chunks: int, world: int, pg) -> list:
    B, H, L, D = x.shape
    h = H // (world * chunks)
    parts = x.view(B, world, chunks, h, L, D)
    out = []
    for c in range(chunks):
        part = parts[:, :, c]  # [B, P, h, L, D]: block j goes to rank j
        if world == 1:
            out.append(part[:, 0].contiguous())
            continue
        send = part.transpose(0, 1).contiguous()  # [P, B, h, L, D]
        recv = torch.empty_like(send)
        dist.all_to_all_single(recv, send, group=pg)
        del send
        # recv[j]: this rank's heads of the chunk over rank j's block of the sequence
        out.append(recv.permute(1, 2, 0, 3, 4).reshape(B, h, world * L, D))
        del recv
    return out


def _to_heads(ys: list, world: int, pg) -> torch.Tensor:
    B, h, S, D = ys[0].shape
    chunks, L = len(ys), S // world
    x = ys[0].new_empty(B, world * chunks * h, L, D)
    parts = x.view(B, world, chunks, h, L, D)
    for c, y in enumerate(ys):
        into = parts[:, :, c]  # [B, P, h, L, D]
        if world == 1:
            into[:, 0].copy_(y)
            continue
        send = y.reshape(B, h, world, L, D).permute(2, 0, 1, 3, 4).contiguous()  # block j -> j
        recv = torch.empty_like(send)
        dist.all_to_all_single(recv, send, group=pg)
        del send
        into.copy_(recv.transpose(0, 1))  # recv[j]: rank j's heads of the chunk over my block
        del recv
    return x


def _pg(group: str, world: int):
    return collectives.resolve_group(group) if world > 1 else None


@custom_op("autosp_lm::chunks_to_sequence", mutates_args=())
def _chunks_to_sequence_op(x: torch.Tensor, chunks: int, group: str,
                           world: int) -> list[torch.Tensor]:
    return _to_sequence(x, chunks, world, _pg(group, world))


@_chunks_to_sequence_op.register_fake
def _(x, chunks, group, world):
    B, H, L, D = x.shape
    return [x.new_empty(B, H // (world * chunks), L * world, D) for _ in range(chunks)]


@custom_op("autosp_lm::chunks_to_heads", mutates_args=())
def _chunks_to_heads_op(ys: list[torch.Tensor], group: str, world: int) -> torch.Tensor:
    return _to_heads(list(ys), world, _pg(group, world))


@_chunks_to_heads_op.register_fake
def _(ys, group, world):
    B, h, S, D = ys[0].shape
    return ys[0].new_empty(B, world * len(ys) * h, S // world, D)


def _setup(ctx, inputs, output):
    ctx.group, ctx.world = inputs[-2], inputs[-1]
    ctx.chunk_shapes = [tuple(y.shape) for y in output]


def _to_sequence_backward(ctx, grads):
    ref = next(g for g in grads if g is not None)
    grads = [ref.new_zeros(s) if g is None else g.contiguous()
             for g, s in zip(grads, ctx.chunk_shapes)]
    return _chunks_to_heads_op(grads, ctx.group, ctx.world), None, None, None


def _to_heads_backward(ctx, grad):
    chunks = len(ctx.chunk_shapes)
    return _chunks_to_sequence_op(grad.contiguous(), chunks, ctx.group, ctx.world), None, None


def _setup_to_heads(ctx, inputs, output):
    ys, ctx.group, ctx.world = inputs
    ctx.chunk_shapes = [tuple(y.shape) for y in ys]


_chunks_to_sequence_op.register_autograd(_to_sequence_backward, setup_context=_setup)
_chunks_to_heads_op.register_autograd(_to_heads_backward, setup_context=_setup_to_heads)


def chunks_to_sequence(x: torch.Tensor, chunks: int, group: str = "",
                       world: int = 1) -> list[torch.Tensor]:
    """``x [B, H, L, D]`` (this rank's ``L`` tokens, every head) -> ``chunks`` tensors
    ``[B, H/(P chunks), P L, D]``: chunk ``c`` is heads ``j*H/P + c*h + t`` of every rank ``j``
    exchanged over the group named ``group`` (``P = world``), so this rank holds ``h``
    consecutive heads of its own share over the whole sequence. Backward:
    :func:`chunks_to_heads`."""
    if x.dim() != 4 or x.size(1) % (world * chunks):
        raise ValueError(f"chunks_to_sequence: {tuple(x.shape)} has no head dimension (1) "
                         f"divisible by {world} ranks x {chunks} chunks")
    return _chunks_to_sequence_op(x.contiguous(), chunks, group, world)


def chunks_to_heads(ys: list, group: str = "", world: int = 1) -> torch.Tensor:
    """The inverse of :func:`chunks_to_sequence`: ``K x [B, h, P L, D]`` -> ``[B, P K h, L, D]``,
    each chunk exchanged back and written into its heads of the one result."""
    if not ys or any(y.shape != ys[0].shape for y in ys) or ys[0].size(2) % world:
        raise ValueError(f"chunks_to_heads: {[tuple(y.shape) for y in ys]} are not chunks of one "
                         f"shape whose sequence divides by {world} ranks")
    return _chunks_to_heads_op([y.contiguous() for y in ys], group, world)


def head_chunked_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, chunks: int,
                           causal: bool = True, dropout_p: float = 0.0, group: str = "",
                           world: int = 1, document_ids: Optional[torch.Tensor] = None,
                           local_attention: AttentionFn = sdpa_attention) -> torch.Tensor:
    """Ulysses attention of this rank's ``q [B, H, L, D]`` and ``k``/``v`` ``[B, Hk, L, D]`` (its
    contiguous block of ``L = S/P`` tokens; the kv heads already replicated for ``P = world``
    ranks: ``world`` divides ``Hk`` and ``Hk`` divides ``H``) in ``chunks`` head chunks over the
    process group named ``group``; returns ``[B, H, L, D]``. ``document_ids [B, S]``: the whole
    sequence's documents (attention within each), passed to ``local_attention``."""
    if q.dim() != 4 or k.dim() != 4 or k.shape != v.shape or q.shape[::2] != k.shape[::2]:
        raise ValueError(f"head-chunked attention expects q [B, H, L, D] and k, v [B, Hk, L, D]; "
                         f"got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    H, Hk = q.size(1), k.size(1)
    hq, hk = H // world, Hk // world
    if H % world or Hk % world or H % Hk or hq % chunks or not (
            hk % chunks == 0 or chunks % hk == 0):
        raise ValueError(f"head-chunked attention: {H} query heads and {Hk} key/value heads "
                         f"over {world} ranks do not split into {chunks} chunks of whole kv "
                         f"heads or of one kv head's share (parallel.heads.head_chunks)")
    kv_chunks = min(chunks, hk)
    per_kv = chunks // kv_chunks
    qs = chunks_to_sequence(q, chunks, group, world)
    ks = chunks_to_sequence(k, kv_chunks, group, world)
    vs = chunks_to_sequence(v, kv_chunks, group, world)
    kw = {} if document_ids is None else {"document_ids": document_ids}
    outs = [local_attention(qs[c], ks[c // per_kv], vs[c // per_kv], causal=causal,
                            dropout_p=dropout_p, **kw) for c in range(chunks)]
    return chunks_to_heads(outs, group, world)


__all__ = ["head_chunked_attention", "chunks_to_sequence", "chunks_to_heads"]
