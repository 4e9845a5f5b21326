"""Rules: counts over tokens (mixture of experts) — global where the model means all tokens,
this rank's own where they group this rank's rows.

Expects ``histc`` of token values (expert ids: sharded tokens, or rank-local rows sorted by
expert, :mod:`.tokens`), a ``scatter_add``/``index_add`` of tokens into replicated bins
(``zeros(E)``), ``cumsum`` of such counts into group offsets, ``bincount``.

Rewrites: counts of tokens are local counts + ``all_reduce_sum`` (the load-balancing loss's
statistics: on one device they count every token). A ``histc`` of rank-local sorted rows whose
every use (through casts and ``cumsum``) is the ``offsets`` argument of a registered grouped
kernel (``grouped_mm``'s ``offs``, :mod:`autosp_lm.compiler.kernels`) stays local: it is the
group sizes of this rank's own rows, which is what this rank's grouped kernel needs; it is
tagged ``("counts", order)`` so that only such a kernel of the same rows accepts it.
``bincount`` has a length that depends on the values: no rule, a named fallback.
"""
from __future__ import annotations

import operator

import torch
import torch.fx as fx

from ..graph import REP, example, is_rows, is_shard, op_name, target_key, torch_ops
from ..kernels import bind, spec_of
from .common import bcast, dim_arg, logical_mask, ndim, norm_dim
from .pointwise import CAST_LIKE
from .registry import rule

CAST = frozenset(torch_ops(*CAST_LIKE, "long", "int", "float", "contiguous", "clone", "detach"))
HISTC = frozenset(torch_ops("histc"))
CUMSUM = frozenset(torch_ops("cumsum"))


def index_tag(rw, a):
    """``(space, plan)`` of a value holding rank-local indices: ``space`` is the Shard layout
    (or ``("rows", order)``) it indexes, ``plan`` the node name of the sort that made it."""
    return rw.tags.get(("index", a)) if isinstance(a, fx.Node) else None



@rule(*torch_ops("histc"))
def histc(rw, n):
    x = n.args[0]
    s = rw.state(x)
    bins = dim_arg(n, 1, 100, key="bins")
    lo, hi = dim_arg(n, 2, 0, key="min"), dim_arg(n, 3, 0, key="max")
    if not (is_shard(s) or is_rows(s)) or lo == hi:
        return rw.fallback(n, "histc with a data-dependent range")
    xl = rw.value(x)
    if is_shard(s) and s.padded:  # padding rows fall outside the range
        xl = rw.call(torch.where, bcast(rw, logical_mask(rw, s), s.dim, ndim(x)), xl, lo - 1)
    local = rw.call(torch.histc, xl, bins=bins, min=lo, max=hi)
    out = rw.collective("all_reduce_sum", local, requires_grad=False)
    rw.bind(n, out)
    rw.note_rewrite("token routing", n, "counts of this rank's tokens + all_reduce_sum", out)
    return REP


def scatter_counts(rw, n, target, d, idx, src):
    """A scatter over tokens into replicated bins: local scatter + all_reduce_sum."""
    zeros = rw.call(torch.zeros_like, rw.value(target))
    name = op_name(n).rstrip("_")
    part = rw.call(getattr(torch, name), zeros, d, rw.value(idx), local_value(rw, src))
    total = rw.collective("all_reduce_sum", part,
                          requires_grad=bool(example(n).requires_grad))
    if name.startswith("index_copy") or (name == "scatter" and "reduce" not in n.kwargs):
        return None
    out = rw.call(operator.add, rw.value(target), total)
    if op_name(n).endswith("_"):  # in place: the target node's value is the result
        rw.call(torch.Tensor.copy_, rw.value(target), out)
        out = rw.value(target)
    rw.bind(n, out)
    rw.note_rewrite("token routing", n, "scatter of this rank's tokens into bins + "
                                        "all_reduce_sum", total)
    return REP


def local_value(rw, a):
    if not isinstance(a, fx.Node):
        return a
    return rw.value(a)


def offsets_only(n: fx.Node) -> bool:
    """Every use of ``n`` (through casts and ``cumsum``) is the ``offsets`` argument of a
    registered grouped kernel (``grouped_mm``'s ``offs``)."""
    todo = [n]
    while todo:
        u = todo.pop()
        for user in u.users:
            key = target_key(user)
            if key in CAST or key in CUMSUM:
                todo.append(user)
                continue
            spec = spec_of(user)
            if spec is None or spec.offsets is None or bind(user).get(spec.offsets) is not u:
                return False
    return True


def count_rows(rw, n):
    """``histc`` of rank-local rows (expert ids sorted by this rank): the group sizes of this
    rank's rows when they only feed a grouped kernel's offsets (then local, tagged
    ``("counts", order)``), else the counts of all tokens (local counts + all_reduce_sum)."""
    x = n.args[0]
    s = rw.state(x)
    if not is_rows(s) or index_tag(rw, x) is not None:
        return NotImplemented
    if not offsets_only(n):
        return histc(rw, n)
    rw.emit_local(n)
    rw.tags[("index", n)] = (("counts", s.order), s.order)
    rw.note_rewrite("token routing", n, "group sizes of this rank's own rows (the offsets of "
                                        "its grouped kernel)", rw.value(n))
    return REP


def cumsum_counts(rw, n):
    """``cumsum`` of local group sizes: this rank's group offsets."""
    tag = index_tag(rw, n.args[0])
    if tag is None or tag[0][0] != "counts" or norm_dim(dim_arg(n, 1, 0), ndim(n.args[0])):
        return NotImplemented
    rw.emit_local(n)
    rw.tags[("index", n)] = tag
    return REP



@rule(*torch_ops("bincount"))
def bincount(rw, n):
    """No rule (its length, ``max(minlength, max + 1)``, depends on the values): the fallback,
    named with the spellings that take the routing plan."""
    return rw.fallback(n, "bincount has a length that depends on the values, no sharding rule; "
                          "Fix: count with torch.histc(ids.float(), bins=E, min=0, max=E-1) or "
                          "torch.zeros(E).scatter_add(0, ids, ones)")
