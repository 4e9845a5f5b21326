"""Rules: views, reshapes and layout ops. The layout is carried by stride matching (the sequence
may merge with batch: ``[B, S, V] -> [B*S, V]``); explicit sizes are rewritten (the sequence dim
becomes -1, so it is the local length ``S/P``); transposes, permutes, expand, cat, stack, chunk,
unbind and flip on other dims keep the layout; ``cat``/``pad``/``roll`` along the sequence are
in :mod:`.halo`."""
from __future__ import annotations

import math
from typing import Optional

import sympy
import torch
import torch.fx as fx

from ..graph import REP, Shard, example, is_shard, is_tensor_node, op_name, static_int, torch_ops
from .common import blocks_refusal, canon_value, dim_arg, ndim, norm_dim, permutation, sizes_arg
from .halo import assemble
from .registry import rule


def map_view(rw, s: Shard, in_shape, out_shape) -> Optional[Shard]:
    """Layout after a row-major reshape ``in_shape -> out_shape`` (None: the sequence is split
    other than into whole blocks). Each position spans ``inner * prod(later dims) / block``
    consecutive elements; the output dim where that span starts a whole number of entries holds
    the sequence, as ``inner`` positions' rows per entry or, for a fraction ``1/k``, blocks of
    ``k`` positions (``[B, S, H, D] -> [B, S/k, k, H, D]``: a chunked scan's cut)."""
    info = rw.info
    L = info.symbol - s.pad_left - s.pad_right
    t_in = sympy.Rational(s.inner, s.block) * math.prod(in_shape[s.dim + 1:])
    before_in = s.outer * math.prod(in_shape[:s.dim])
    suffix = sympy.Integer(1)
    for od in reversed(range(len(out_shape))):
        ratio = sympy.cancel(t_in / suffix)
        if ratio.is_Rational and ratio > 0 and (ratio.is_Integer or ratio.p == 1):
            q = sympy.cancel(out_shape[od] / (L * ratio))
            if q.is_Integer and q >= 1:
                if sympy.cancel(math.prod(out_shape[:od]) * q - before_in) == 0:
                    if ratio.is_Integer:
                        return Shard(od, int(q), int(ratio), s.pad_left, s.pad_right)
                    if s.padded or q != 1:  # blocks of a shifted or batch-merged sequence
                        return None
                    return Shard(od, 1, 1, 0, 0, int(ratio.q))
        suffix = suffix * out_shape[od]
    return None


@rule(*torch_ops("view", "reshape", "flatten", "unflatten", "squeeze", "unsqueeze", "view_as",
                 "reshape_as", "ravel", "atleast_1d", "atleast_2d", "atleast_3d"),
      accepts=("blocks",))
def view_like(rw, n):
    x = n.args[0]
    s = rw.state(x)
    if not is_shard(s):
        return rw.fallback(n, "sequence operand is not the reshaped tensor")
    in_shape, out_shape = rw.info.shape(x), rw.info.shape(n)
    new = map_view(rw, s, in_shape, out_shape)
    if new is None:
        return rw.fallback(n, "reshape splits the sequence dimension")
    if new.block > 1 and new.block != s.block:
        refused = blocks_refusal(rw, n, new)
        if refused is not None:
            return refused
    sizes = [-1 if i == new.dim else static_int(sz, f"dimension {i} of {n.name}")
             for i, sz in enumerate(out_shape)]
    rw.bind(n, rw.method("reshape", rw.value(x), sizes))
    return new


@rule(*torch_ops("view_as_complex", "view_as_real"))
def complex_view(rw, n):
    x = n.args[0]
    s = rw.state(x)
    if not is_shard(s) or s.dim >= ndim(x) - 1:
        return rw.fallback(n, "complex view over the sequence dimension")
    rw.bind(n, rw.emit(n, (rw.value(x),), {}))
    return s


@rule(*torch_ops("transpose", "swapaxes", "swapdims", "permute", "t", "movedim", "moveaxis",
                 "adjoint", "mT"), accepts=("blocks",))
def transpose_like(rw, n):
    x = n.args[0]
    s = rw.state(x)
    if not is_shard(s):
        return rw.fallback(n, "unexpected sharded argument")
    nd = ndim(x)
    perm = permutation(n, nd)
    rw.emit_local(n)
    return s.with_dim(perm.index(s.dim))


@rule(*torch_ops("expand", "expand_as", "broadcast_to"), accepts=("blocks",))
def expand(rw, n):
    x = n.args[0]
    s = rw.state(x)
    if not is_shard(s):
        return rw.fallback(n, "expanding to the sequence length")
    out_shape = rw.info.shape(n)
    od = s.dim + len(out_shape) - ndim(x)
    sizes = [-1 if i == od else static_int(sz, f"dimension {i} of {n.name}")
             for i, sz in enumerate(out_shape)]
    rw.bind(n, rw.method("expand", rw.value(x), sizes))
    return s.with_dim(od)


@rule(*torch_ops("repeat"), accepts=("blocks",))
def repeat(rw, n):
    x = n.args[0]
    s = rw.state(x)
    reps = sizes_arg(n)
    od = s.dim + len(reps) - ndim(x) if is_shard(s) else None
    if od is None or not isinstance(reps[od], int) or reps[od] != 1:
        return rw.fallback(n, "repeat along the sequence")
    rw.emit_local(n)
    return s.with_dim(od)


@rule(*torch_ops("repeat_interleave"), accepts=("blocks",))
def repeat_interleave(rw, n):
    x = n.args[0]
    s = rw.state(x)
    dim = dim_arg(n, 2)
    reps = dim_arg(n, 1, key="repeats")
    if not is_shard(s) or dim is None or isinstance(reps, fx.Node):
        return rw.fallback(n, "repeat_interleave along the sequence")
    if norm_dim(dim, ndim(x)) == s.dim:
        if not isinstance(reps, int) or s.block != 1:
            return rw.fallback(n, "repeat_interleave along the sequence by a tensor")
        # every row (of the outer x L x inner layout) repeated: inner grows by the factor
        rw.emit_local(n)
        return Shard(s.dim, s.outer, s.inner * reps, s.pad_left, s.pad_right)
    rw.emit_local(n)
    return s


@rule(*torch_ops("chunk", "split", "tensor_split", "unbind", "split_with_sizes"))
def split_like(rw, n):
    x = n.args[0]
    s = rw.state(x)
    name = op_name(n)
    nd = ndim(x)
    dim = dim_arg(n, 1 if name == "unbind" else 2, 0)
    if is_shard(s) and isinstance(dim, int) and norm_dim(dim, nd) == s.dim:
        pieces = _whole_or_empty(rw, n, s)
        if pieces is not None:  # e.g. a tail of a length that is 0 peeled off the sequence
            local = rw.method("size", rw.value(x), s.dim)
            cuts = [local if whole_before else 0 for whole_before in _cut_positions(pieces)]
            rw.bind(n, rw.emit(n, (rw.value(x), cuts), {"dim": s.dim}))
            return tuple(s if whole else REP for whole in pieces)
    if not is_shard(s) or not isinstance(dim, int) or norm_dim(dim, nd) == s.dim:
        return rw.fallback(n, f"{name} along the sequence")
    dim = norm_dim(dim, nd)
    rw.emit_local(n)
    out = s.with_dim(s.dim - 1) if (name == "unbind" and dim < s.dim) else s
    return tuple(out for _ in example(n))


@rule(*torch_ops("cat", "concat", "concatenate", "stack", "hstack", "vstack"))
def cat(rw, n):
    name = op_name(n)
    tensors = list(n.args[0] if n.args else n.kwargs["tensors"])
    dim = dim_arg(n, 1, 0)
    if name in ("cat", "concat", "concatenate"):
        # empty operands (an empty KV cache: torch.cat([torch.tensor([]), k])) add nothing
        kept = [t for t in tensors if not (is_tensor_node(t) and example(t).numel() == 0
                                           and not any(rw.info.has_seq(s)
                                                       for s in example(t).shape))]
        if len(kept) == 1 and is_shard(rw.state(kept[0])):
            rw.bind(n, rw.value(kept[0]))
            return rw.state(kept[0])
    if name in ("hstack", "vstack") or not isinstance(dim, int):
        return rw.fallback(n, f"{name}")
    out_nd = len(rw.info.shape(n))
    dim = norm_dim(dim, out_nd)
    target = None
    for t in tensors:
        s = rw.state(t)
        if is_shard(s):
            od = s.dim + (1 if name == "stack" and s.dim >= dim else 0)
            cand = s.with_dim(od)
            if target is None:
                target = cand
            elif cand != target and not (name != "stack" and cand.dim == dim == target.dim):
                return rw.fallback(n, "operands sharded differently")
    if target is None:
        return rw.fallback(n, f"{name} along the sequence")
    if name != "stack" and target.dim == dim:
        return assemble(rw, n, tensors, dim)
    new_list = []
    for t in tensors:
        s = rw.state(t)
        if is_shard(s) or not rw.is_full(t):
            new_list.append(rw.value(t))
        else:
            td = target.dim - (1 if name == "stack" and target.dim > dim else 0)
            new_list.append(rw.localize(t, target.with_dim(td)))
    args = (new_list,) + tuple(rw.map(list(n.args[1:])))
    kwargs = {k: v for k, v in rw.map(n.kwargs).items() if k != "tensors"}
    rw.bind(n, rw.emit(n, args, kwargs))
    return target


@rule(*torch_ops("flip"))
def flip_roll(rw, n):
    x = n.args[0]
    s = rw.state(x)
    name = op_name(n)
    dims = dim_arg(n, 1 if name == "flip" else 2, None, key="dims")
    if dims is None and name == "flip":
        dims = sizes_arg(n)
    if isinstance(dims, int):
        dims = [dims]
    if not is_shard(s) or dims is None or s.dim in [norm_dim(d, ndim(x)) for d in dims]:
        return rw.fallback(n, f"{name} over the sequence")
    rw.emit_local(n)
    return s


def _whole_or_empty(rw, n, s: Shard):
    """For ``tensor_split`` of the sequence at indices that are each 0 or the whole length (code
    that splits off a tail whose length is 0 in this call, as transformers' Qwen3-Next does with
    its intermediate recurrent states): per piece, True for the whole sequence, False for an
    empty piece; None for any other split."""
    if op_name(n) != "tensor_split" or s.merged or s.pad_left or s.pad_right:
        return None
    idx = n.args[1] if len(n.args) > 1 else n.kwargs.get("indices")
    if not isinstance(idx, (list, tuple)) or not idx:
        return None
    length = rw.info.symbol
    cuts = []
    for i in idx:
        v = canon_value(rw, i)
        if v is None or isinstance(v, (fx.Node, torch.Tensor)):
            return None
        e = sympy.sympify(v)
        if e == 0:
            cuts.append(0)
        elif sympy.simplify(e - length) == 0:
            cuts.append(1)
        else:
            return None
    bounds = [0] + cuts + [1]
    if bounds != sorted(bounds):
        return None
    return [b - a == 1 for a, b in zip(bounds, bounds[1:])]


def _cut_positions(pieces: list) -> list:
    """The split indices (as "after the whole sequence" flags) that produce ``pieces``."""
    out, seen_whole = [], False
    for piece in pieces[:-1]:
        seen_whole |= piece
        out.append(seen_whole)
    return out
