"""Rules: reductions. Over feature dims the layout is kept; ``sum``/``mean`` over the sequence
become a local sum plus ``all_reduce_loss`` (REDUCED: the global value on every rank in the
forward, each rank's share in the backward); other reductions over the sequence fall back."""
from __future__ import annotations

import math
import operator

import torch

from ..graph import REDUCED, example, is_shard, is_tensor_node, op_name, torch_ops
from .common import dim_arg, ndim, norm_dim
from .pointwise import pointwise
from .registry import rule

REDUCTIONS = ("sum", "mean", "amax", "amin", "max", "min", "argmax", "argmin", "std", "var",
              "logsumexp", "prod", "all", "any", "norm", "nansum", "nanmean", "count_nonzero",
              "std_mean", "var_mean", "aminmax")


@rule(*torch_ops(*REDUCTIONS), accepts=("blocks",))
def reduction(rw, n):
    name = op_name(n)
    x = n.args[0]
    if name in ("max", "min") and len(n.args) > 1 and is_tensor_node(n.args[1]):
        return pointwise(rw, n)  # the binary (elementwise) form
    s = rw.state(x)
    if not is_shard(s):
        return rw.fallback(n, "unexpected sharded argument")
    nd = ndim(x)
    dim = dim_arg(n, 2 if name == "norm" else 1, None)
    if name == "norm":
        dim = n.kwargs.get("dim", dim)
    if isinstance(dim, torch.dtype):
        dim = None
    keepdim = n.kwargs.get("keepdim", n.args[2] if len(n.args) > 2 and name != "norm" else False)
    dims = None if dim is None else ([dim] if isinstance(dim, int) else list(dim))
    if dims is not None and not all(isinstance(d, int) for d in dims):
        return rw.fallback(n, "reduction over symbolic dims")
    dims = list(range(nd)) if dims is None or dims == [] else [norm_dim(d, nd) for d in dims]
    if s.dim not in dims:
        rw.emit_local(n)
        new = s if keepdim else s.with_dim(s.dim - sum(1 for d in dims if d < s.dim))
        ev = example(n)
        return tuple(new for _ in ev) if isinstance(ev, (tuple, list)) else new
    if name not in ("sum", "mean", "nansum", "nanmean"):
        return rw.fallback(n, f"{name} over the sequence")
    if s.block != 1:
        return rw.fallback(n, f"{name} over the blocks of a sequence cut into blocks")
    return reduce_sequence(rw, n, x, s, dims, bool(keepdim), mean=name in ("mean", "nanmean"))


def valid_mask(rw, s, nd: int):
    """Bool tensor marking this rank's logical (non-padding) positions, broadcastable to the
    local tensor of layout ``s``."""
    pos = rw.local_positions()
    lo = rw.call(operator.ge, pos, s.pad_left)
    hi = rw.call(operator.lt, pos, rw.sym(rw.info.symbol - s.pad_right))
    valid = rw.call(operator.and_, lo, hi)
    if s.merged:
        valid = rw.method("reshape", valid, [1, -1, 1])
        valid = rw.method("expand", valid, [s.outer, -1, s.inner])
        valid = rw.method("reshape", valid, [-1])
    return rw.method("reshape", valid, [1] * s.dim + [-1] + [1] * (nd - s.dim - 1))


def reduce_sequence(rw, n, x, s, dims, keepdim, mean):
    """sum/mean over dims that include the sequence: local sum, divide by the global count,
    all_reduce_loss (forward: the global value on every rank; backward: each rank its share)."""
    xl = rw.value(x)
    if s.padded:
        xl = rw.call(torch.where, valid_mask(rw, s, ndim(x)), xl, 0)
    kwargs = {k: v for k, v in rw.map(n.kwargs).items() if k in ("dtype",)}
    local = rw.call(torch.sum, xl, dims, keepdim, **kwargs)
    if mean:
        shape = rw.info.shape(x)
        count = math.prod(shape[d] for d in dims)
        local = rw.call(operator.truediv, local, rw.sym(count))
    out = rw.collective("all_reduce_loss", rw.method("contiguous", local),
                        requires_grad=bool(example(x).requires_grad))
    rw.report.loss_rewrite(n, f"{'mean' if mean else 'sum'} over the sequence -> local sum + "
                              f"all_reduce_loss")
    rw.bind(n, out)
    return REDUCED
