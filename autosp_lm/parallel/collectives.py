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

These move whole tensors between the ranks of a group, whatever the tensors hold. The two
collectives that read the sequence's layout (the halo exchange and the exclusive scan: the
sequence split in contiguous chunks, in rank order) are in :mod:`.halo_scan`, built on the group
helpers here.
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
def norm_dim(dim: int, ndim: int) -> int:
    """``dim`` counted from the front (a negative ``dim`` counts from the back)."""
    return dim + ndim if dim < 0 else dim


@custom_op("autosp_lm::all_to_all", mutates_args=())
def _all_to_all_op(x: torch.Tensor, scatter_dim: int, gather_dim: int, group: str,
                   world: int) -> torch.Tensor:
    if world == 1:
        return x.clone()
    scatter_dim, gather_dim = norm_dim(scatter_dim, x.dim()), norm_dim(gather_dim, x.dim())
    # Put the scattered chunks first so one flat all_to_all_single moves them.
    chunks = x.chunk(world, dim=scatter_dim)
    send = torch.stack(chunks, dim=0).contiguous()  # [world, ...chunk]
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=resolve_group(group))
    # recv[r] is rank r's chunk for me: concatenate along the gather dimension.
    return torch.cat(recv.unbind(0), dim=gather_dim)


@_all_to_all_op.register_fake
def _(x, scatter_dim, gather_dim, group, world):
    scatter_dim, gather_dim = norm_dim(scatter_dim, x.dim()), norm_dim(gather_dim, x.dim())
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
    shape[norm_dim(dim, x.dim())] *= world
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
    shape[norm_dim(dim, x.dim())] //= world
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
