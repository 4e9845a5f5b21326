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
from typing import Optional

import sympy
import torch
import torch.fx as fx

from ..graph import (REP, Shard, example, integer, is_shard, is_tensor_node, op_name,
                     target_key, torch_ops)
from .args import dim_arg, ndim, norm_dim
from .registry import rule

SHAPE_ONLY = frozenset(torch_ops("zeros_like", "ones_like", "empty_like", "full_like", "size",
                                 "dim", "numel", "new_zeros", "new_ones", "new_empty",
                                 "new_full"))


def _val(rw, v):
    if isinstance(v, fx.Node):
        return rw.info.canon(example(v))
    return v


def seq_range(rw, s: Shard, start, stop, step=None):
    """``(start, stop)`` of a slice of the logical sequence of ``s`` as expressions in S (Python
    semantics: negative constants count from the end), or None (steps, odd bounds)."""
    if step not in (None, 1) or s.merged:
        return None
    L = rw.info.symbol - s.pad_left - s.pad_right
    start, stop = _val(rw, start), _val(rw, stop)
    start = sympy.Integer(0) if start is None else sympy.sympify(start)
    stop = L if stop is None else sympy.sympify(stop)
    if start.is_Integer and start < 0:
        start = L + start
    if stop.is_Integer and stop < 0:
        stop = L + stop
    over = integer(stop - L)
    if over is not None and over > 0:
        stop = L
    return start, stop


def slice_layout(rw, s: Shard, start, stop) -> Optional[Shard]:
    """The layout of the shift ``[start, stop)`` of ``s`` (None when not a shift)."""
    L = rw.info.symbol - s.pad_left - s.pad_right
    a, b = integer(start), integer(L - stop)
    if a is None or b is None or a < 0 or b < 0:
        return None
    return Shard(s.dim, 1, 1, s.pad_left + a, s.pad_right + b)


def seq_slice_layout(rw, u: fx.Node, src: fx.Node, s: Shard) -> Optional[Shard]:
    """For a user ``u`` of ``src`` (layout ``s``) that slices only the sequence, the layout of the
    result when it is a shift; else None."""
    key = target_key(u)
    if key is operator.getitem and u.args[0] is src:
        items = _expand(u.args[1], ndim(src))
        if items is None or any(i != slice(None) for k, i in enumerate(items) if k != s.dim):
            return None
        it = items[s.dim]
        if not isinstance(it, slice):
            return None
        r = seq_range(rw, s, it.start, it.stop, it.step)
    elif op_name(u) == "narrow" and u.args[0] is src:
        d, start, length = dim_arg(u, 1), dim_arg(u, 2, key="start"), dim_arg(u, 3, key="length")
        if not isinstance(d, int) or norm_dim(d, ndim(src)) != s.dim:
            return None
        r = seq_range(rw, s, start, sympy.sympify(_val(rw, start)) + sympy.sympify(_val(rw, length)))
    else:
        return None
    return None if r is None else slice_layout(rw, s, *r)


def _expand(idx, nd):
    """Index items of ``x[idx]`` padded to one per input dim (None entries kept); None when
    advanced indexing is involved."""
    items = list(idx) if isinstance(idx, tuple) else [idx]
    if any(isinstance(i, fx.Node) and is_tensor_node(i) for i in items) or any(
            isinstance(i, (list, bool)) for i in items):
        return None
    consumed = sum(1 for i in items if i is not None and i is not Ellipsis)
    if Ellipsis in items:
        k = items.index(Ellipsis)
        items = items[:k] + [slice(None)] * (nd - consumed) + items[k + 1:]
    return items + [slice(None)] * (nd - sum(1 for i in items if i is not None))


def rows_origin(rw, node):
    """``(x, virtual_start)`` when ``node`` is a constant-length slice of the sharded ``x``
    along its sequence only (the cat rule then shifts ``x`` into place instead)."""
    return rw.tags.get(("rows", node))


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


@rule(operator.getitem, accepts=("overhang",))
def getitem(rw, n):
    x, idx = n.args
    s = rw.state(x)
    if not is_shard(s) or any(is_tensor_node(i) for i in (idx if isinstance(idx, tuple)
                                                           else (idx,))):
        from .tokens import _gather_rows
        out = _gather_rows(rw, n)  # a replicated table looked up by per-token ids
        if out is not NotImplemented:
            return out
        return rw.fallback(n, "indexing with a sharded index" if not is_shard(s) else
                           "advanced indexing of a sharded tensor")
    nd = ndim(x)
    items = _expand(idx, nd)
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
    if single:
        i = sympy.sympify(_val(rw, seq_item))
        rng = seq_range(rw, s, i, None if integer(i) == -1 else i + 1)
    elif isinstance(seq_item, slice):
        rng = seq_range(rw, s, seq_item.start, seq_item.stop, seq_item.step)
    else:
        return rw.fallback(n, "indexing the sequence")
    if rng is None:
        return rw.fallback(n, "a slice of the sequence with a step (x[:, ::k]) takes rows from "
                              "every rank's chunk; Fix: sub-sample outside the model, or use "
                              "x.unflatten(1, (-1, k))[:, :, 0]")
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
        i = sympy.sympify(_val(rw, dim_arg(n, 2, key="index")))
        rng = seq_range(rw, s, i, None if integer(i) == -1 else i + 1)
        return _rep_rows(rw, n, x, s, s.dim, nd, rw.value(x), rng[0], 1, False, single=True)
    start, length = dim_arg(n, 2, key="start"), dim_arg(n, 3, key="length")
    rng = seq_range(rw, s, start, sympy.sympify(_val(rw, start)) + sympy.sympify(_val(rw, length)))
    L = integer(rng[1] - rng[0])
    layout = slice_layout(rw, s, *rng)
    if layout is not None:
        rw.bind(n, rw.value(x))
        return layout
    if L is not None and L >= 0:
        return _rep_rows(rw, n, x, s, s.dim, nd, rw.value(x), rng[0], L, True)
    return rw.fallback(n, "narrow of the sequence")
