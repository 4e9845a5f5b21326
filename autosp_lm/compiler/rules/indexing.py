"""Rules: indexing the sequence dimension.

* A slice that is a shift (``x[:, 1:]``, ``x[:, :-1]``, ``x[:, 2:S-3]``) becomes a padded
  layout (no data movement).
* A slice of constant length (``x[:, :1]``, ``k[:, :, -w:]`` — a prefix, a suffix, a generation
  cache's last keys — or one position ``x[:, -1]``) is a small replicated value: each rank
  contributes the rows it holds and one ``all_reduce_sum`` of those few rows gives them to every
  rank (backward: each rank's gradient for its rows). Used only for its shape
  (``torch.zeros_like(x[:, :1])``), it costs nothing: an empty tensor of that shape.
* ``narrow`` along the sequence follows the same cases; ``narrow``/``select`` on other dims keep
  the layout. Any other indexing of the sequence (steps, tensor indices) falls back.
"""
from __future__ import annotations

import operator

import sympy
import torch
import torch.fx as fx

from ..graph import (REP, Shard, example, integer, is_shard, is_tensor_node, op_name,
                     target_key, torch_ops)
from .common import canon_value, dim_arg, expand_index, ndim, norm_dim, seq_range, slice_layout
from .registry import rule
from .tokens import gather_rows

SHAPE_ONLY = frozenset(torch_ops("zeros_like", "ones_like", "empty_like", "full_like", "size",
                                 "dim", "numel", "new_zeros", "new_ones", "new_empty",
                                 "new_full"))



def take_rows(rw, x, d: int, nd: int, vstart, length: int, grad: bool):
    """The rows ``[vstart, vstart + length)`` (virtual positions) of the sharded local value
    ``x`` (``nd`` dims) along ``d``, on every rank: the local ones, zeros elsewhere, summed over
    the group."""
    pos = rw.call(torch.arange, length, device=rw.device)
    if rw.contiguous_layout():
        idx = rw.call(operator.sub, rw.call(operator.add, pos, rw.sym(vstart)), rw.chunk_start())
        valid = rw.call(operator.and_, rw.call(operator.ge, idx, 0),
                        rw.call(operator.lt, idx, rw.chunk_len()))
        safe = rw.call(torch.clamp, idx, 0, rw.call(operator.sub, rw.chunk_len(), 1))
    else:  # a ring plan's layout: look the wanted positions up among this rank's own
        want = rw.call(operator.add, pos, rw.sym(vstart))
        hits = rw.call(operator.eq, rw.method("unsqueeze", want, 1),
                       rw.method("unsqueeze", rw.local_positions(), 0))
        valid = rw.method("any", hits, 1)
        safe = rw.method("argmax", rw.method("int", hits), 1)
    rows = rw.call(torch.index_select, x, d, safe)
    mask = rw.method("reshape", valid, [1] * d + [-1] + [1] * (nd - d - 1))
    rows = rw.call(torch.where, mask, rows, 0)
    return rw.collective("all_reduce_sum", rw.method("contiguous", rows), requires_grad=grad)


def _shape_only(n: fx.Node) -> bool:
    return bool(n.users) and all(target_key(u) in SHAPE_ONLY and u.args and u.args[0] is n
                                 for u in n.users)


def _rep_rows(rw, n, x, s, d, nd, inter, start, length, pure_seq, single=False):
    """A constant-length slice: a small replicated value (or an empty one for shape-only use)."""
    ev = example(n)
    if _shape_only(n):
        rw.bind(n, rw.call(torch.empty, [int(v) for v in ev.shape], dtype=ev.dtype,
                           device=rw.device))
        return REP
    vstart = s.pad_left + start
    rows = take_rows(rw, inter, d, nd, vstart, length, bool(ev.requires_grad))
    if pure_seq and not single:
        rw.tags[("rows", n)] = (x, vstart)
    out = rw.call(torch.select, rows, d, 0) if single else rows
    rw.bind(n, out)
    rw.note_rewrite("slices", n, f"{length} position(s) of the sequence: the ranks holding them "
                                 f"share them (all_reduce_sum of {length} row(s))", rows)
    return REP


@rule(operator.getitem, accepts=("overhang", "blocks"))
def getitem(rw, n):
    x, idx = n.args
    s = rw.state(x)
    if not is_shard(s) or any(is_tensor_node(i) for i in (idx if isinstance(idx, tuple)
                                                           else (idx,))):
        out = gather_rows(rw, n)  # a replicated table looked up by per-token ids
        if out is not NotImplemented:
            return out
        return rw.fallback(n, "indexing with a sharded index" if not is_shard(s) else
                           "advanced indexing of a sharded tensor")
    nd = ndim(x)
    items = expand_index(idx, nd)
    if items is None:
        return rw.fallback(n, "advanced indexing of a sharded tensor")
    in_dim = out_dim = 0
    new_items, seq_item, seq_out = [], None, None
    for it in items:
        if it is None:
            new_items.append(None)
            out_dim += 1
            continue
        if in_dim == s.dim:
            seq_item, seq_out = it, out_dim
            new_items.append(slice(None))
        else:
            new_items.append(it)
        in_dim += 1
        if isinstance(it, slice) or in_dim - 1 == s.dim:
            out_dim += 1
    single = isinstance(seq_item, int) or (isinstance(seq_item, fx.Node)
                                           and not is_tensor_node(seq_item))
    if s.block != 1:  # blocks: only indexing the other dims keeps them
        if seq_item != slice(None):
            return rw.fallback(n, "a part of a sequence cut into blocks")
        rw.bind(n, rw.emit(n, (rw.value(x), rw.map(tuple(new_items))), {}))
        return s.with_dim(seq_out)
    if single:
        i = sympy.sympify(canon_value(rw, seq_item))
        rng = seq_range(rw, s, i, None if integer(i) == -1 else i + 1)
    elif isinstance(seq_item, slice):
        rng = seq_range(rw, s, seq_item.start, seq_item.stop, seq_item.step)
    else:
        return rw.fallback(n, "indexing the sequence")
    if rng is None and isinstance(seq_item, slice) and seq_item.step not in (None, 1):
        return rw.fallback(n, "a slice of the sequence with a step (x[:, ::k]) takes rows from "
                              "every rank's chunk; Fix: sub-sample outside the model, or use "
                              "x.unflatten(1, (-1, k))[:, :, 0]")
    if rng is None:  # a piece of a dimension that holds the batch and the sequence (x.flatten(0, 1))
        return rw.fallback(n, "a part of a dimension that merges the batch with the sequence takes "
                              "rows of several samples; Fix: index before merging them, or "
                              "x.unflatten(0, (batch, -1))[:, ...]")
    pure = all(i == slice(None) for k, i in enumerate(new_items) if k != seq_out)
    if all(isinstance(i, slice) and i == slice(None) for i in new_items):
        inter = rw.value(x)
    else:
        inter = rw.emit(n, (rw.value(x), rw.map(tuple(new_items))), {})
    start, stop = rng
    layout = None if single else slice_layout(rw, s, start, stop)
    if layout is not None:
        if s.merged and (layout.pad_left, layout.pad_right) != (s.pad_left, s.pad_right):
            return rw.fallback(n, "a shift of a merged sequence")
        rw.bind(n, inter)
        return Shard(seq_out, s.outer, s.inner, layout.pad_left, layout.pad_right)
    length = integer(stop - start)
    if length is None or length < 0:
        return rw.fallback(n, "a cut of the sequence whose length grows with S (neither a shift "
                              "like x[:, 1:] nor a constant-length piece like x[:, -k:]) would "
                              "leave the ranks uneven shards; Fix: cut the batch before the "
                              "model, or use a shift or a constant-length piece")
    if s.merged:
        return rw.fallback(n, "positions of a merged sequence")
    return _rep_rows(rw, n, x, s, seq_out, out_dim, inter, start, length, pure, single)


@rule(*torch_ops("narrow", "select"), accepts=("overhang",))
def narrow(rw, n):
    x = n.args[0]
    s = rw.state(x)
    nd = ndim(x)
    dim = dim_arg(n, 1, 0)
    name = op_name(n)
    if not is_shard(s) or not isinstance(dim, int):
        return rw.fallback(n, f"{name} of a sharded tensor")
    if norm_dim(dim, nd) != s.dim:
        if s.overhang:
            return rw.fallback(n, f"{name} of an overhanging sequence")
        rw.emit_local(n)
        if name == "select" and norm_dim(dim, nd) < s.dim:
            return s.with_dim(s.dim - 1)
        return s
    if s.merged:
        return rw.fallback(n, f"{name} of a merged sequence")
    if name == "select":
        i = sympy.sympify(canon_value(rw, dim_arg(n, 2, key="index")))
        rng = seq_range(rw, s, i, None if integer(i) == -1 else i + 1)
        return _rep_rows(rw, n, x, s, s.dim, nd, rw.value(x), rng[0], 1, False, single=True)
    start, length = dim_arg(n, 2, key="start"), dim_arg(n, 3, key="length")
    stop = sympy.sympify(canon_value(rw, start)) + sympy.sympify(canon_value(rw, length))
    rng = seq_range(rw, s, start, stop)
    L = integer(rng[1] - rng[0])
    layout = slice_layout(rw, s, *rng)
    if layout is not None:
        rw.bind(n, rw.value(x))
        return layout
    if L is not None and L >= 0:
        return _rep_rows(rw, n, x, s, s.dim, nd, rw.value(x), rng[0], L, True)
    return rw.fallback(n, "narrow of the sequence")
