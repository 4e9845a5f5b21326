"""Collectives with autograd that ``torch.compile`` traces without graph breaks.

Each collective is a ``torch.library`` custom op (``autosp_lm::...``) with a fake (meta)
implementation, so Dynamo/AOTAutograd/Inductor treat it as one opaque node, and a registered
autograd formula, so the joint graph contains the matching backward collective. Process groups
are passed by name (``group.group_name``) because custom ops take only simple types.

Gradient conventions (the strategy contracts in the README): every rank back-propagates its own share of the loss and
parameter gradients are summed over the SP group afterwards. Hence

* ``all_to_all`` backward is the inverse all-to-all;
* ``all_gather`` backward is a reduce-scatter (sum of every rank's gradient for my shard);
* ``all_reduce`` backward is an all-reduce (every rank's use of the sum depends on my input);
* ``all_reduce_loss`` backward is the identity: for the final scalar loss, where each rank
  back-propagates ``local / N`` and the forward sum is only there so that every rank reports the
  same global value.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist
from torch.library import custom_op

try:  # stable across 2.11-2.13, private name
    from torch._C._distributed_c10d import _resolve_process_group
except ImportError:  # pragma: no cover
    _resolve_process_group = None


def group_name(group: Optional[dist.ProcessGroup] = None) -> str:
    """The registered name of ``group`` (default: the world group)."""
    if group is None:
        group = dist.group.WORLD
    return group.group_name


def resolve_group(name: str) -> dist.ProcessGroup:
    return _resolve_process_group(name)


def group_size(group: Optional[dist.ProcessGroup] = None) -> int:
    return dist.get_world_size(group)


# --------------------------------------------------------------------------------------------
# all-to-all
# --------------------------------------------------------------------------------------------
def _norm_dim(dim: int, ndim: int) -> int:
    return dim + ndim if dim < 0 else dim


@custom_op("autosp_lm::all_to_all", mutates_args=())
def _all_to_all_op(x: torch.Tensor, scatter_dim: int, gather_dim: int, group: str,
                   world: int) -> torch.Tensor:
    if world == 1:
        return x.clone()
    scatter_dim, gather_dim = _norm_dim(scatter_dim, x.dim()), _norm_dim(gather_dim, x.dim())
    # Put the scattered chunks first so one flat all_to_all_single moves them.
    chunks = x.chunk(world, dim=scatter_dim)
    send = torch.stack(chunks, dim=0).contiguous()  # [world, ...chunk]
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=resolve_group(group))
    # recv[r] is rank r's chunk for me: concatenate along the gather dimension.
    return torch.cat(recv.unbind(0), dim=gather_dim)


@_all_to_all_op.register_fake
def _(x, scatter_dim, gather_dim, group, world):
    scatter_dim, gather_dim = _norm_dim(scatter_dim, x.dim()), _norm_dim(gather_dim, x.dim())
    shape = list(x.shape)
    shape[scatter_dim] = shape[scatter_dim] // world
    shape[gather_dim] = shape[gather_dim] * world
    return x.new_empty(shape)


def _a2a_setup(ctx, inputs, output):
    _, ctx.scatter_dim, ctx.gather_dim, ctx.group, ctx.world = inputs


def _a2a_backward(ctx, grad):
    return (_all_to_all_op(grad.contiguous(), ctx.gather_dim, ctx.scatter_dim, ctx.group, ctx.world),
            None, None, None, None)


_all_to_all_op.register_autograd(_a2a_backward, setup_context=_a2a_setup)


def all_to_all(x: torch.Tensor, scatter_dim: int, gather_dim: int,
               group: Optional[dist.ProcessGroup] = None) -> torch.Tensor:
    """Split ``x`` along ``scatter_dim`` across the group, gather the pieces along ``gather_dim``.

    With ``x`` of shape ``[B, H, S/P, D]``, ``all_to_all(x, 1, 2)`` gives ``[B, H/P, S, D]``
    (local heads, whole sequence, sequence blocks in rank order) and ``all_to_all(y, 2, 1)``
    undoes it. ``x.size(scatter_dim)`` must divide by the group size.
    """
    world = group_size(group)
    if x.size(scatter_dim) % world:
        raise ValueError(f"all_to_all: dimension {scatter_dim} of size {x.size(scatter_dim)} is not "
                         f"divisible by the group size {world}")
    return _all_to_all_op(x.contiguous(), scatter_dim, gather_dim, group_name(group), world)


# --------------------------------------------------------------------------------------------
# all-gather / reduce-scatter
# --------------------------------------------------------------------------------------------
@custom_op("autosp_lm::all_gather", mutates_args=())
def _all_gather_op(x: torch.Tensor, dim: int, group: str, world: int) -> torch.Tensor:
    if world == 1:
        return x.clone()
    parts = [torch.empty_like(x) for _ in range(world)]
    dist.all_gather(parts, x.contiguous(), group=resolve_group(group))
    return torch.cat(parts, dim=dim)


@_all_gather_op.register_fake
def _(x, dim, group, world):
    shape = list(x.shape)
    shape[_norm_dim(dim, x.dim())] *= world
    return x.new_empty(shape)


@custom_op("autosp_lm::reduce_scatter", mutates_args=())
def _reduce_scatter_op(x: torch.Tensor, dim: int, group: str, world: int) -> torch.Tensor:
    if world == 1:
        return x.clone()
    parts = [c.contiguous() for c in x.chunk(world, dim=dim)]
    out = torch.empty_like(parts[0])
    pg = resolve_group(group)
    if dist.get_backend(pg) == "gloo":  # gloo has no reduce_scatter
        total = torch.stack(parts, 0)
        dist.all_reduce(total, group=pg)
        out.copy_(total[dist.get_rank(pg)])
    else:
        dist.reduce_scatter(out, parts, group=pg)
    return out


@_reduce_scatter_op.register_fake
def _(x, dim, group, world):
    shape = list(x.shape)
    shape[_norm_dim(dim, x.dim())] //= world
    return x.new_empty(shape)


def _ag_setup(ctx, inputs, output):
    _, ctx.dim, ctx.group, ctx.world = inputs


def _ag_backward(ctx, grad):
    return _reduce_scatter_op(grad.contiguous(), ctx.dim, ctx.group, ctx.world), None, None, None


def _rs_backward(ctx, grad):
    return _all_gather_op(grad.contiguous(), ctx.dim, ctx.group, ctx.world), None, None, None


_all_gather_op.register_autograd(_ag_backward, setup_context=_ag_setup)
_reduce_scatter_op.register_autograd(_rs_backward, setup_context=_ag_setup)


def all_gather(x: torch.Tensor, dim: int, group: Optional[dist.ProcessGroup] = None) -> torch.Tensor:
    """Concatenate every rank's ``x`` along ``dim`` (rank order); backward reduce-scatters."""
    return _all_gather_op(x.contiguous(), dim, group_name(group), group_size(group))


def reduce_scatter(x: torch.Tensor, dim: int, group: Optional[dist.ProcessGroup] = None) -> torch.Tensor:
    """Sum ``x`` over ranks and keep this rank's chunk along ``dim``; backward all-gathers."""
    world = group_size(group)
    if x.size(dim) % world:
        raise ValueError(f"reduce_scatter: dimension {dim} of size {x.size(dim)} is not divisible "
                         f"by the group size {world}")
    return _reduce_scatter_op(x.contiguous(), dim, group_name(group), world)


# --------------------------------------------------------------------------------------------
# all-reduce
# --------------------------------------------------------------------------------------------
@custom_op("autosp_lm::all_reduce_sum", mutates_args=())
def _all_reduce_op(x: torch.Tensor, group: str, world: int) -> torch.Tensor:
    out = x.clone()
    if world > 1:
        dist.all_reduce(out, group=resolve_group(group))
    return out


@_all_reduce_op.register_fake
def _(x, group, world):
    return torch.empty_like(x)


def _ar_setup(ctx, inputs, output):
    _, ctx.group, ctx.world = inputs


def _ar_backward(ctx, grad):
    return _all_reduce_op(grad.contiguous(), ctx.group, ctx.world), None, None


_all_reduce_op.register_autograd(_ar_backward, setup_context=_ar_setup)


@custom_op("autosp_lm::all_reduce_loss", mutates_args=())
def _all_reduce_loss_op(x: torch.Tensor, group: str, world: int) -> torch.Tensor:
    return _all_reduce_op(x, group, world)


@_all_reduce_loss_op.register_fake
def _(x, group, world):
    return torch.empty_like(x)


_all_reduce_loss_op.register_autograd(lambda ctx, grad: (grad, None, None),
                                      setup_context=lambda ctx, inputs, output: None)


def all_reduce(x: torch.Tensor, group: Optional[dist.ProcessGroup] = None) -> torch.Tensor:
    """Sum over the group; backward sums the gradients too (for intermediate values)."""
    return _all_reduce_op(x.contiguous(), group_name(group), group_size(group))


def all_reduce_loss(x: torch.Tensor, group: Optional[dist.ProcessGroup] = None) -> torch.Tensor:
    """Sum the per-rank loss shares so every rank holds the global loss; backward is the identity
    (each rank back-propagates its own share, gradients are summed over the group later)."""
    return _all_reduce_loss_op(x.contiguous(), group_name(group), group_size(group))


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
    dim = _norm_dim(dim, x.dim())
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
    dim = _norm_dim(dim, g.dim())
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
    shape[_norm_dim(dim, x.dim())] += left + right
    return x.new_empty(shape)


@custom_op("autosp_lm::seq_window_backward", mutates_args=())
def _seq_window_backward_op(g: torch.Tensor, dim: int, left: int, right: int, cyclic: bool,
                            group: str, world: int) -> torch.Tensor:
    return _window_backward(g, dim, left, right, cyclic, group, world)


@_seq_window_backward_op.register_fake
def _(g, dim, left, right, cyclic, group, world):
    shape = list(g.shape)
    shape[_norm_dim(dim, g.dim())] -= left + right
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
