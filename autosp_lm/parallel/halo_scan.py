"""Collectives over a sequence split in contiguous chunks, one per rank in rank order: the halo
exchange (``seq_window``: this rank's chunk with rows of its neighbours' chunks around it) and the
exclusive scan of per-rank totals (``exclusive_scan``: what the ranks before this one add up to).

The compiler's rules for short-range mixing (token shifts, causal convolutions:
:mod:`autosp_lm.compiler.rules.halo`) and for scans (``cumsum`` and kin:
:mod:`autosp_lm.compiler.rules.scans`) insert them, so a sharded graph keeps such ops local
instead of gathering the sequence. Like :mod:`.collectives` each is a ``torch.library`` custom op
(``autosp_lm::seq_window``, ``autosp_lm::exclusive_scan``) with a fake implementation and an
autograd formula whose backward is its own custom op (``..._backward``), so the joint graph holds
the backward communication. Split from :mod:`.collectives` where moving tensors between ranks
parts from knowing which positions of the sequence each rank holds: these two compute that
(:func:`window_segments`, the rank prefix of a scan) and talk point-to-point or gather per-rank
totals; the group helpers (``group_name``, ``resolve_group``, ``group_size``) they share stay
there.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist
from torch.library import custom_op

from .collectives import group_name, group_size, norm_dim, resolve_group


# --------------------------------------------------------------------------------------------
# halo exchange: a window of the virtual sequence around this rank's chunk
# --------------------------------------------------------------------------------------------
def window_segments(rank: int, world: int, chunk: int, left: int, right: int,
                    cyclic: bool) -> list:
    """Where the rows of rank ``rank``'s window come from: ``(out_row, src_rank, src_row, n)``
    runs (``src_rank`` None: outside the sequence, zeros). The window covers the virtual
    positions ``[rank*chunk - left, (rank+1)*chunk + right)`` of a sequence of ``world*chunk``
    rows held in contiguous chunks; ``cyclic`` wraps positions around the sequence."""
    total = world * chunk
    lo, hi = rank * chunk - left, (rank + 1) * chunk + right
    out, p = [], lo
    while p < hi:
        if not cyclic and (p < 0 or p >= total):
            n = (min(hi, 0) if p < 0 else hi) - p
            out.append((p - lo, None, 0, n))
            p += n
            continue
        q = p % total if cyclic else p
        src, row = divmod(q, chunk) if chunk else (0, 0)
        n = min(hi - p, chunk - row)
        out.append((p - lo, src, row, n))
        p += n
    return out


def _exchange(sends: dict, recv_shapes: dict, like: torch.Tensor, pg) -> dict:
    """Point-to-point: ``sends[q]`` goes to group rank ``q``; a tensor of ``recv_shapes[q]``
    comes back from each ``q``. One batched round of isend/irecv."""
    ops, recvs = [], {}
    for q, shape in recv_shapes.items():
        recvs[q] = like.new_empty(shape)
        ops.append(dist.P2POp(dist.irecv, recvs[q], dist.get_global_rank(pg, q), pg))
    for q, t in sends.items():
        ops.append(dist.P2POp(dist.isend, t.contiguous(), dist.get_global_rank(pg, q), pg))
    if ops:
        for w in dist.batch_isend_irecv(ops):
            w.wait()
    return recvs


def _window(x: torch.Tensor, dim: int, left: int, right: int, cyclic: bool, group: str,
            world: int) -> torch.Tensor:
    dim = norm_dim(dim, x.dim())
    c = x.size(dim)
    pg = resolve_group(group) if world > 1 else None
    r = dist.get_rank(pg) if world > 1 else 0
    mine = window_segments(r, world, c, left, right, cyclic)
    shape = list(x.shape)
    shape[dim] = c + left + right
    out = x.new_zeros(shape)
    sends, recv_shapes = {}, {}
    for q in range(world):
        if q == r:
            continue
        theirs = [x.narrow(dim, row, n) for _, src, row, n in
                  window_segments(q, world, c, left, right, cyclic) if src == r]
        if theirs:
            sends[q] = torch.cat(theirs, dim)
        n_in = sum(n for _, src, _, n in mine if src == q)
        if n_in:
            s = list(x.shape)
            s[dim] = n_in
            recv_shapes[q] = s
    recvs = _exchange(sends, recv_shapes, x, pg) if world > 1 else {}
    taken = {q: 0 for q in recvs}
    for off, src, row, n in mine:
        if src is None:
            continue
        if src == r:
            block = x.narrow(dim, row, n)
        else:
            block = recvs[src].narrow(dim, taken[src], n)
            taken[src] += n
        out.narrow(dim, off, n).copy_(block)
    return out


def _window_backward(g: torch.Tensor, dim: int, left: int, right: int, cyclic: bool,
                     group: str, world: int) -> torch.Tensor:
    dim = norm_dim(dim, g.dim())
    c = g.size(dim) - left - right
    pg = resolve_group(group) if world > 1 else None
    r = dist.get_rank(pg) if world > 1 else 0
    mine = window_segments(r, world, c, left, right, cyclic)
    shape = list(g.shape)
    shape[dim] = c
    out = g.new_zeros(shape)
    sends, recv_shapes = {}, {}
    for q in range(world):
        if q == r:
            continue
        blocks = [g.narrow(dim, off, n) for off, src, _, n in mine if src == q]
        if blocks:
            sends[q] = torch.cat(blocks, dim)
        n_in = sum(n for _, src, _, n in window_segments(q, world, c, left, right, cyclic)
                   if src == r)
        if n_in:
            s = list(g.shape)
            s[dim] = n_in
            recv_shapes[q] = s
    recvs = _exchange(sends, recv_shapes, g, pg) if world > 1 else {}
    for off, src, row, n in mine:
        if src == r:
            out.narrow(dim, row, n).add_(g.narrow(dim, off, n))
    for q, t in recvs.items():
        taken = 0
        for _, src, row, n in window_segments(q, world, c, left, right, cyclic):
            if src == r:
                out.narrow(dim, row, n).add_(t.narrow(dim, taken, n))
                taken += n
    return out


@custom_op("autosp_lm::seq_window", mutates_args=())
def _seq_window_op(x: torch.Tensor, dim: int, left: int, right: int, cyclic: bool, group: str,
                   world: int) -> torch.Tensor:
    return _window(x, dim, left, right, cyclic, group, world)


@_seq_window_op.register_fake
def _(x, dim, left, right, cyclic, group, world):
    shape = list(x.shape)
    shape[norm_dim(dim, x.dim())] += left + right
    return x.new_empty(shape)


@custom_op("autosp_lm::seq_window_backward", mutates_args=())
def _seq_window_backward_op(g: torch.Tensor, dim: int, left: int, right: int, cyclic: bool,
                            group: str, world: int) -> torch.Tensor:
    return _window_backward(g, dim, left, right, cyclic, group, world)


@_seq_window_backward_op.register_fake
def _(g, dim, left, right, cyclic, group, world):
    shape = list(g.shape)
    shape[norm_dim(dim, g.dim())] -= left + right
    return g.new_empty(shape)


def _win_setup(ctx, inputs, output):
    _, ctx.dim, ctx.left, ctx.right, ctx.cyclic, ctx.group, ctx.world = inputs


def _win_backward(ctx, grad):
    return (_seq_window_backward_op(grad.contiguous(), ctx.dim, ctx.left, ctx.right, ctx.cyclic,
                                    ctx.group, ctx.world),) + (None,) * 6


def _win_bwd_backward(ctx, grad):
    return (_seq_window_op(grad.contiguous(), ctx.dim, ctx.left, ctx.right, ctx.cyclic,
                           ctx.group, ctx.world),) + (None,) * 6


_seq_window_op.register_autograd(_win_backward, setup_context=_win_setup)
_seq_window_backward_op.register_autograd(_win_bwd_backward, setup_context=_win_setup)


def seq_window(x: torch.Tensor, dim: int, left: int, right: int = 0, cyclic: bool = False,
               group: Optional[dist.ProcessGroup] = None) -> torch.Tensor:
    """The halo exchange: this rank's chunk ``x`` (positions ``[r*c, (r+1)*c)`` of a sequence
    split in contiguous chunks of ``c = x.size(dim)`` rows) extended by the ``left`` rows before
    it and the ``right`` rows after it, fetched from the ranks that hold them (the neighbours
    when ``left, right <= c``). Rows outside the sequence are zeros, or wrap around with
    ``cyclic``. Backward: the halo rows' gradients are sent back and added to their owners."""
    return _seq_window_op(x.contiguous(), dim, left, right, cyclic, group_name(group),
                          group_size(group))


# --------------------------------------------------------------------------------------------
# exclusive scan of per-rank totals
# --------------------------------------------------------------------------------------------
SCAN_KINDS = ("sum", "prod", "logsumexp", "max", "min")


def _gather_stack(x: torch.Tensor, group: str, world: int) -> torch.Tensor:
    if world == 1:
        return x.unsqueeze(0).clone()
    parts = [torch.empty_like(x) for _ in range(world)]
    dist.all_gather(parts, x.contiguous(), group=resolve_group(group))
    return torch.stack(parts, 0)


def _identity(kind: str, like: torch.Tensor) -> torch.Tensor:
    ident = {"sum": 0, "prod": 1, "min": float("inf")}.get(kind, float("-inf"))
    return torch.full_like(like, ident)


def _prefix(kind: str, totals: torch.Tensor, upto: int) -> torch.Tensor:
    """Combination of ``totals[:upto]`` (the identity when ``upto == 0``)."""
    if upto == 0:
        return _identity(kind, totals[0])
    t = totals[:upto]
    if kind == "sum":
        return t.sum(0)
    if kind == "prod":
        return t.prod(0)
    if kind == "logsumexp":
        return torch.logsumexp(t, 0)
    return t.amax(0) if kind == "max" else t.amin(0)


def _winner(kind: str, totals: torch.Tensor, upto: int) -> torch.Tensor:
    """Per element, the last rank ``< upto`` whose total is the max (min) (ties: the later)."""
    t = totals[:upto]
    if kind == "min":
        t = -t
    best = t.amax(0, keepdim=True)
    ranks = torch.arange(upto, device=t.device).view([-1] + [1] * (t.dim() - 1))
    return torch.where(t == best, ranks, -1).amax(0)


@custom_op("autosp_lm::exclusive_scan", mutates_args=())
def _exclusive_scan_op(x: torch.Tensor, kind: str, group: str, world: int) -> torch.Tensor:
    r = dist.get_rank(resolve_group(group)) if world > 1 else 0
    return _prefix(kind, _gather_stack(x, group, world), r).contiguous()


@_exclusive_scan_op.register_fake
def _(x, kind, group, world):
    return torch.empty_like(x)


@custom_op("autosp_lm::exclusive_scan_backward", mutates_args=())
def _exclusive_scan_backward_op(x: torch.Tensor, g: torch.Tensor, kind: str, group: str,
                                world: int) -> torch.Tensor:
    r = dist.get_rank(resolve_group(group)) if world > 1 else 0
    both = _gather_stack(torch.stack([x, g.to(x.dtype)]), group, world)  # [P, 2, ...]
    totals, grads = both[:, 0], both[:, 1]
    out = torch.zeros_like(x)
    for q in range(r + 1, world):
        gq = grads[q]
        if kind == "sum":
            out = out + gq
        elif kind == "prod":  # d prod_{j<q} T_j / d T_r without dividing by T_r
            others = totals[:q].clone()
            others[r] = 1
            out = out + gq * others.prod(0)
        elif kind == "logsumexp":
            out = out + gq * torch.exp(x - torch.logsumexp(totals[:q], 0))
        else:
            out = out + torch.where(_winner(kind, totals, q) == r, gq, torch.zeros_like(gq))
    return out.to(g.dtype)


@_exclusive_scan_backward_op.register_fake
def _(x, g, kind, group, world):
    return torch.empty_like(g)


def _scan_setup(ctx, inputs, output):
    x, ctx.kind, ctx.group, ctx.world = inputs
    ctx.save_for_backward(x)


def _scan_backward(ctx, grad):
    (x,) = ctx.saved_tensors
    return (_exclusive_scan_backward_op(x, grad.contiguous(), ctx.kind, ctx.group, ctx.world),
            None, None, None)


_exclusive_scan_op.register_autograd(_scan_backward, setup_context=_scan_setup)


def exclusive_scan(x: torch.Tensor, kind: str = "sum",
                   group: Optional[dist.ProcessGroup] = None) -> torch.Tensor:
    """Rank ``r`` gets the combination (``kind``: sum, prod, logsumexp, max, min) of the ``x`` of
    ranks ``0..r-1`` (the identity on rank 0): with a local scan, the scan of a sequence split in
    contiguous chunks. One all-gather of the per-rank totals forward, one backward."""
    if kind not in SCAN_KINDS:
        raise ValueError(f"exclusive_scan: kind must be one of {SCAN_KINDS}, got {kind!r}")
    return _exclusive_scan_op(x.contiguous(), kind, group_name(group), group_size(group))
