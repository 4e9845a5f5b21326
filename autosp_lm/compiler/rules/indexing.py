"""Rules: indexing. A slice of the sequence dimension that is a shift (``x[:, 1:]``,
``x[:, :-1]``) becomes a padded layout (no data movement); other indexing of the sequence falls
back; ``narrow``/``select`` on other dims keep the layout."""
from __future__ import annotations

import operator
from typing import Optional

import sympy
import torch.fx as fx

from ..graph import Shard, example, integer, is_shard, is_tensor_node, op_name, torch_ops
from .args import dim_arg, ndim, norm_dim
from .registry import rule


@rule(operator.getitem)
def getitem(rw, n):
    x, idx = n.args
    s = rw.state(x)
    if not is_shard(s):
        return rw.fallback(n, "indexing with a sharded index")
    nd = ndim(x)
    items = list(idx) if isinstance(idx, tuple) else [idx]
    if any(isinstance(i, fx.Node) and is_tensor_node(i) for i in items) or any(
            isinstance(i, (list, bool)) for i in items):
        return rw.fallback(n, "advanced indexing of a sharded tensor")
    consumed = sum(1 for i in items if i is not None and i is not Ellipsis)
    if Ellipsis in items:
        k = items.index(Ellipsis)
        items = items[:k] + [slice(None)] * (nd - consumed) + items[k + 1:]
    items += [slice(None)] * (nd - sum(1 for i in items if i is not None))
    in_dim = out_dim = 0
    new_items, new_shard = [], None
    for it in items:
        if it is None:
            new_items.append(None)
            out_dim += 1
            continue
        if in_dim == s.dim:
            if not isinstance(it, slice):
                return rw.fallback(n, "selecting single positions of the sequence")
            shifted = shift(rw, s, it)
            if shifted is None:
                return rw.fallback(n, "a slice of the sequence that is not a shift")
            new_shard = shifted.with_dim(out_dim)
            new_items.append(slice(None))
        else:
            new_items.append(it)
        in_dim += 1
        if isinstance(it, slice):
            out_dim += 1
    if all(isinstance(i, slice) and i == slice(None) for i in new_items):
        rw.bind(n, rw.value(x))
    else:
        rw.bind(n, rw.emit(n, (rw.value(x), rw.map(tuple(new_items))), {}))
    return new_shard


def shift(rw, s: Shard, sl: slice) -> Optional[Shard]:
    """The layout of ``x[sl]`` along the sequence when the slice drops ``a`` positions in front
    and ``b`` at the end (a shift by padding), else None."""
    if s.merged or sl.step not in (None, 1):
        return None
    pl, pr = s.pad_left, s.pad_right
    L = rw.info.symbol - pl - pr
    start, stop = sl.start, sl.stop
    if isinstance(start, fx.Node) or isinstance(stop, fx.Node):
        def val(v):
            return rw.info.canon(example(v)) if isinstance(v, fx.Node) else v
        start, stop = val(start), val(stop)
    if start is None:
        start = 0
    start = sympy.sympify(start)
    if start.is_Integer:
        if start < 0:
            return None
        a = int(start)
    else:  # start given as an expression in S, e.g. S - k, not a shift
        return None
    if stop is None:
        b = 0
    else:
        stop = sympy.sympify(stop)
        if stop.is_Integer:
            if stop >= 0:
                return None
            b = -int(stop)
        else:
            k = integer(L - stop)
            if k is None or k < 0:
                return None
            b = k
    return Shard(s.dim, 1, 1, pl + a, pr + b)


@rule(*torch_ops("narrow", "select"))
def narrow(rw, n):
    x = n.args[0]
    s = rw.state(x)
    nd = ndim(x)
    dim = dim_arg(n, 1, 0)
    if not is_shard(s) or norm_dim(dim, nd) == s.dim:
        return rw.fallback(n, f"{op_name(n)} on the sequence dimension")
    rw.emit_local(n)
    if op_name(n) == "select" and norm_dim(dim, nd) < s.dim:
        return s.with_dim(s.dim - 1)
    return s
