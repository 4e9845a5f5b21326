"""Rules: token routing (mixture of experts) — run the block on the rank's own tokens.

Expects a token-routed block over flattened tokens: a router, ``topk`` over the experts, then
``sort``/``argsort`` of the tokens' expert ids, ``x[perm // k]`` / ``index_select`` gathers,
expert weights gathered per row (``W[expert_ids]``) and batched matmuls, and the way back:
``index_add``/``scatter_add`` into token positions, ``y[inverse]`` with ``inverse[perm] =
arange(n)`` or ``argsort(perm)``; plus ``histc``/``scatter_add`` counts of the load-balancing loss.

Rewrites: a sort of sharded tokens sorts this rank's tokens only. Its results are rank-local rows
(:class:`~autosp_lm.compiler.graph.Rows`, in this rank's own order) and their indices are
rank-local (tagged ``rw.tags[("index", node)]``); every op between the sort and the way back must
be per row (pointwise with rows of the same order, casts, views that keep the row dimension,
``linear``/``matmul``/``bmm`` with replicated weights, per-row gathers of expert weights,
reductions over other dimensions); the way back puts rows at their tokens' positions, in the
token layout again. Each token's output depends only on that token, so this is exact: on one
device the same rows are computed in another order. Counts over tokens (``histc``, a
``scatter_add`` into expert bins) are local counts plus ``all_reduce_sum`` and group sizes of a
rank's own sorted rows stay local (:mod:`.counts`); means over tokens of the router
probabilities are the usual sequence reductions.

Anything else on rank-local rows or indices (an op without a rule here, using index values as
numbers, returning them) makes the rewriter refuse the plan at its sort (``rw.replan``): that
sort then takes the fallback (gather) and the report says so. ``bincount`` has a data-dependent
length and is not traceable in one graph; use ``histc`` or ``scatter_add`` into ``zeros(E)``.
"""
from __future__ import annotations

import operator

import torch
import torch.fx as fx

from ..graph import (REP, Rows, Shard, example, is_rows, is_shard, is_tensor_node, op_name,
                     static_int, target_key, torch_ops)
from .common import (dim_arg, expand_index, index_dims, ndim, norm_dim, normalizes_along,
                     result_operands, shared_state, tensor_args)
from .counts import CAST, CUMSUM, HISTC, count_rows, cumsum_counts, index_tag, scatter_counts
from .features import along_dim
from .meta import size_query
from .pointwise import POINTWISE, UNARY_LIKE
from .reductions import REDUCTIONS
from .registry import rule, state_rule

_SIZE = frozenset(torch_ops("size", "dim", "numel", "nelement", "ndimension"))

_POINTWISE = frozenset(torch_ops(*POINTWISE, *UNARY_LIKE, "softmax", "log_softmax", "topk",
                                 "where", "masked_fill"))
_CAST = CAST
_VIEWS = frozenset(torch_ops("view", "reshape", "unsqueeze", "squeeze", "expand", "expand_as",
                             "flatten"))
_MATMUL = frozenset(torch_ops("linear", "matmul", "bmm", "mm"))
_SPLIT = frozenset(torch_ops("chunk", "split", "unbind"))
_INDEX = frozenset(torch_ops("index_select", "gather")) | {operator.getitem}
_SCATTER = frozenset(torch_ops("index_add", "index_add_", "scatter_add", "scatter_add_",
                               "index_copy", "index_copy_", "scatter", "scatter_"))
_FLOORDIV = frozenset(torch_ops("floor_divide")) | {operator.floordiv}
_REMAINDER = frozenset(torch_ops("remainder")) | {operator.mod}
_ARANGE = frozenset(torch_ops("arange"))
_LIKE = frozenset(torch_ops("empty_like", "zeros_like", "ones_like", "full_like"))


def _plan(rw, n):
    for a in n.all_input_nodes:
        s = rw.state(a)
        if is_rows(s):
            return s.order
        t = index_tag(rw, a)
        if t is not None:
            return t[1]
    return None


# ============================================================================ entering: sorts
@rule(*torch_ops("sort", "argsort", "msort"))
def sort(rw, n):
    x = n.args[0]
    s = rw.state(x)
    name = op_name(n)
    dim = dim_arg(n, 1, -1 if name != "msort" else 0)
    if isinstance(dim, bool):  # torch.sort(x, descending) positional quirk
        dim = -1
    if not is_shard(s) or norm_dim(dim, ndim(x)) != s.dim:
        return along_dim(rw, n)
    if s.padded or not rw.allowed("rows", n) or ndim(x) != 1:
        return rw.fallback(n, f"{name} over the sequence")
    rw.emit_local(n)
    rows = Rows(s.dim, n.name)
    rw.tags[("index_elem", n)] = ((1 if name == "sort" else None), (s, n.name))
    if name == "argsort":
        rw.tags[("index", n)] = (s, n.name)
    rw.note_rewrite("token routing", n, f"{name} of this rank's tokens only (rank-local rows; "
                                        f"exact because the block is per token)", rw.value(n))
    return (rows, rows) if name == "sort" else rows


# ============================================================================ rows and indices
def _same_order(rw, operands, nd):
    """The Rows state all distributed operands share (aligned to ``nd`` output dims)."""
    return shared_state(rw, operands, nd, is_rows, lambda s, off: s.with_dim(s.dim + off),
                        refuse=is_shard)


def _rows_pointwise(rw, n):
    got = result_operands(rw, n, target_key(n) in _CAST)
    if got is None:
        return NotImplemented
    nd, operands = got
    if any(index_tag(rw, a) is not None for a in operands):
        return NotImplemented
    target = _same_order(rw, operands, nd)
    if target is None:
        return NotImplemented
    for a in operands:  # replicated operands must not carry the row dimension
        if rw.state(a) is REP:
            ad = target.dim - (nd - ndim(a))
            if 0 <= ad and static_int(rw.info.shape(a)[ad], "size") != 1:
                return NotImplemented
    if normalizes_along(n, nd, target.dim):
        return NotImplemented
    rw.emit_local(n)
    ev = example(n)
    return tuple(target for _ in ev) if isinstance(ev, (tuple, list)) else target


def _cast(rw, n):
    x = n.args[0]
    s = rw.state(x)
    rw.emit_local(n)
    tag = index_tag(rw, x)
    if tag is not None:
        rw.tags[("index", n)] = tag
    return s


def _view(rw, n):
    """Views that keep the row dimension (its size and the product before it)."""
    x = n.args[0]
    s = rw.state(x)
    if not (is_rows(s) or is_shard(s)):
        return NotImplemented
    in_shape, out_shape = rw.info.shape(x), rw.info.shape(n)
    pre = 1
    for e in in_shape[:s.dim]:
        pre = pre * e
    acc, od = 1, None
    for j, e in enumerate(out_shape):
        if (acc - pre) == 0 and (e - in_shape[s.dim]) == 0:
            od = j
            break
        acc = acc * e
    if od is None:
        return NotImplemented
    sizes = []
    for j, e in enumerate(out_shape):
        sizes.append(-1 if j == od else static_int(e, f"dimension {j} of {n.name}"))
    name = op_name(n)
    if name in ("expand", "expand_as"):
        rw.bind(n, rw.method("expand", rw.value(x), sizes))
    elif name in ("unsqueeze", "squeeze", "flatten"):
        rw.emit_local(n)
    else:
        rw.bind(n, rw.method("reshape", rw.value(x), sizes))
    tag = index_tag(rw, x)
    if tag is not None:
        rw.tags[("index", n)] = tag
    return s.with_dim(od)


def _matmul(rw, n):
    operands = tensor_args(n)
    nd = len(rw.info.shape(n))
    target = _same_order(rw, operands, nd)
    if target is None or any(index_tag(rw, a) is not None for a in operands):
        return NotImplemented
    name = op_name(n)
    for a in operands:
        s = rw.state(a)
        if is_rows(s):
            if name in ("linear",) and a is not n.args[0]:
                return NotImplemented
            if name in ("matmul", "bmm", "mm") and s.dim >= ndim(a) - (1 if a is n.args[0]
                                                                       else 2):
                return NotImplemented  # the rows would be contracted
        elif rw.is_full(a):
            return NotImplemented
    rw.emit_local(n)
    return target


def _split(rw, n):
    x = n.args[0]
    s = rw.state(x)
    dim = dim_arg(n, 1 if op_name(n) == "unbind" else 2, 0)
    if not is_rows(s) or not isinstance(dim, int) or norm_dim(dim, ndim(x)) == s.dim:
        return NotImplemented
    rw.emit_local(n)
    out = s.with_dim(s.dim - 1) if op_name(n) == "unbind" and norm_dim(dim, ndim(x)) < s.dim \
        else s
    return tuple(out for _ in example(n))


def _floordiv(rw, n):
    idx, k = n.args[0], n.args[1]
    tag = index_tag(rw, idx)
    if tag is None or not isinstance(k, int) or isinstance(tag[0], tuple):
        return NotImplemented
    space = tag[0]
    if space.inner % k:
        return NotImplemented
    rw.emit_local(n)
    rw.tags[("index", n)] = (Shard(space.dim, space.outer, space.inner // k), tag[1])
    return rw.state(idx)


def _remainder(rw, n):
    idx, k = n.args[0], n.args[1]
    tag = index_tag(rw, idx)
    if tag is None or not isinstance(k, int) or isinstance(tag[0], tuple) or tag[0].inner % k:
        return NotImplemented
    rw.emit_local(n)  # the position inside the inner block: the same value on one device
    return rw.state(idx)


def _same_space(space, s) -> bool:
    if isinstance(space, tuple):
        return space[0] == "rows" and is_rows(s) and s.order == space[1]
    return is_shard(s) and not s.padded and (space.outer, space.inner) == (s.outer, s.inner)


def gather_rows(rw, n):
    """``x[idx]`` / ``index_select(x, d, idx)`` / ``gather(x, d, idx)``."""
    key = target_key(n)
    x = n.args[0]
    if key is operator.getitem:
        items = list(n.args[1]) if isinstance(n.args[1], tuple) else [n.args[1]]
        tens = [i for i, it in enumerate(items) if is_tensor_node(it)]
        if not tens:
            return _basic_getitem(rw, n)
        if len(tens) != 1 or any(it is None or it is Ellipsis for it in items) or any(
                it != slice(None) for i, it in enumerate(items) if i != tens[0]):
            return NotImplemented
        d, idx = tens[0], items[tens[0]]
    else:
        d, idx = norm_dim(dim_arg(n, 1), ndim(x)), dim_arg(n, 2, key="index")
    si, sx = rw.state(idx), rw.state(x)
    tag = index_tag(rw, idx)
    if tag is None:  # plain values (expert ids) looking up a replicated table
        if sx is not REP or rw.is_full(x) or not (is_rows(si) or is_shard(si)):
            return NotImplemented
        rw.emit_local(n)
        return si.with_dim(si.dim + d) if key is operator.getitem else si
    if not _same_space(tag[0], sx.with_dim(sx.dim) if (is_rows(sx) or is_shard(sx)) else sx) \
            or sx.dim != d:
        return NotImplemented
    if key in frozenset(torch_ops("gather")) and si.dim != sx.dim:
        return NotImplemented
    rw.emit_local(n)
    out = si.with_dim(si.dim + d) if key is operator.getitem else si
    rw.note_rewrite("token routing", n, "gather by rank-local indices", rw.value(n))
    return out


def _basic_getitem(rw, n):
    """Slicing rows (``w[:, None]``) without touching the row dimension."""
    x = n.args[0]
    s = rw.state(x)
    if not is_rows(s) or index_tag(rw, x) is not None:
        return NotImplemented
    items = expand_index(n.args[1], ndim(x))
    if items is None:
        return NotImplemented
    keys, places, _ = index_dims(items)
    if keys[s.dim] != slice(None):
        return NotImplemented
    rw.emit_local(n)
    return s.with_dim(places[s.dim])


def _scatter(rw, n):
    """``index_add``/``scatter_add``/``index_copy``/``scatter``: rows back to their tokens."""
    name = op_name(n)
    target, d = n.args[0], dim_arg(n, 1)
    idx = dim_arg(n, 2, key="index")
    src = dim_arg(n, 3, key="source" if name.startswith("index") else "src")
    st, tag = rw.state(target), index_tag(rw, idx)
    if st is REP and not rw.is_full(target) and tag is None and (is_shard(rw.state(idx))
                                                                 or is_rows(rw.state(idx))):
        out = scatter_counts(rw, n, target, d, idx, src)
        return NotImplemented if out is None else out
    if tag is None or not isinstance(d, int) or not is_shard(st) or not _same_space(tag[0], st) \
            or norm_dim(d, ndim(target)) != st.dim:
        return NotImplemented
    ss = rw.state(src) if isinstance(src, fx.Node) else REP
    if not (is_rows(ss) and ss.order == rw.state(idx).order):
        return NotImplemented
    rw.emit_local(n)
    rw.note_rewrite("token routing", n, "rank-local rows back to their tokens", rw.value(n))
    return st


def _setitem(rw, n):
    """``inverse[perm] = torch.arange(n)`` (the inverse permutation), or rows put back."""
    target, idx, src = n.args
    tag, st = index_tag(rw, idx), rw.state(target)
    if tag is None or not isinstance(idx, fx.Node) or not is_rows(rw.state(idx)):
        return NotImplemented
    order = rw.state(idx).order
    if isinstance(src, fx.Node) and target_key(src) in _ARANGE and rw.is_full(src) and len(
            src.args) == 1 and is_rows(st) and not isinstance(tag[0], tuple):
        iota = rw.call(torch.arange, rw.method("size", rw.value(idx), 0), device=rw.device)
        rw.call(operator.setitem, rw.value(target), rw.value(idx), iota)
        rw.restate(target, tag[0])  # token order now, holding positions of the sorted rows
        rw.tags[("index", target)] = (("rows", order), tag[1])
        rw.note_rewrite("token routing", n, "inverse of a rank-local permutation",
                        rw.value(target))
        return REP
    ss = rw.state(src) if isinstance(src, fx.Node) else REP
    if is_shard(st) and _same_space(tag[0], st) and is_rows(ss) and ss.order == order:
        rw.call(operator.setitem, rw.value(target), rw.value(idx), rw.value(src))
        return REP
    return NotImplemented


def _argsort_inverse(rw, n):
    """``argsort(perm)`` of a rank-local permutation: its inverse, in token order."""
    x = n.args[0]
    tag, s = index_tag(rw, x), rw.state(x)
    if tag is None or not is_rows(s) or isinstance(tag[0], tuple) or ndim(x) != 1:
        return NotImplemented
    rw.emit_local(n)
    rw.tags[("index", n)] = (("rows", s.order), tag[1])
    return tag[0]


def _reduce_rows(rw, n):
    if op_name(n) not in REDUCTIONS:
        return NotImplemented
    x = n.args[0]
    s = rw.state(x)
    if not is_rows(s) or index_tag(rw, x) is not None:
        return NotImplemented
    dim = dim_arg(n, 1, None)
    dims = None if dim is None else ([dim] if isinstance(dim, int) else list(dim))
    if dims is None or not all(isinstance(d, int) for d in dims):
        return NotImplemented
    dims = [norm_dim(d, ndim(x)) for d in dims]
    if s.dim in dims:
        return NotImplemented
    keep = n.kwargs.get("keepdim", n.args[2] if len(n.args) > 2 else False)
    rw.emit_local(n)
    return s if keep else s.with_dim(s.dim - sum(1 for d in dims if d < s.dim))


def _like(rw, n):
    """A new tensor shaped like rows: same layout, no index meaning."""
    if not is_rows(rw.state(n.args[0])):
        return NotImplemented
    rw.emit_local(n)
    return rw.state(n.args[0])


def _size(rw, n):  # sizes are global: no need to leave the region / the rows
    return size_query(rw, n)


# op family -> its rule on rows, first match wins (anything else: a reduction over other dims)
_ON_ROWS = ((_SIZE, _size), (HISTC, count_rows), (CUMSUM, cumsum_counts),
            ({operator.setitem}, _setitem), (_INDEX, gather_rows),
            (_SCATTER, _scatter), (_FLOORDIV, _floordiv), (_REMAINDER, _remainder),
            (frozenset(torch_ops("argsort")), _argsort_inverse), (_LIKE, _like),
            (_CAST, _cast), (_VIEWS, _view), (_MATMUL, _matmul), (_SPLIT, _split),
            (_POINTWISE, _rows_pointwise))


@state_rule("rows")
def on_rows(rw, n):
    """Ops with rank-local rows or indices among their operands."""
    key = target_key(n)
    for family, handler in _ON_ROWS:
        if key in family:
            return handler(rw, n)
    return _reduce_rows(rw, n)


# ============================================================================ op rules
@rule(*torch_ops("index_select", "gather"))
def index_rule(rw, n):
    out = gather_rows(rw, n)
    return rw.fallback(n, "indexing the sequence") if out is NotImplemented else out


@rule(*_SCATTER)
def scatter_rule(rw, n):
    out = _scatter(rw, n)
    return rw.fallback(n, "scatter into the sequence") if out is NotImplemented else out
