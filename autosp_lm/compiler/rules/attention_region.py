"""Rules: hand-written attention — a region that mixes the sequence, independent across heads.

Expects attention written out: scores from ``q @ k.transpose(-1, -2)`` / ``torch.matmul`` /
``torch.bmm`` / ``torch.einsum("bhqd,bhkd->bhqk", ...)`` of two sequence-sharded operands, then
any per-head computation on the ``[.., S, S]`` scores (scale, additive position biases, tanh
soft-capping, ``tril``/``triu``/``masked_fill``/``where`` causal or sliding-window masks,
softmax, dropout, casts), then ``probs @ v``.

Rewrites: at the scores op (the region's entry) both operands go through the same Ulysses
all-to-all as SDPA (:func:`.common.a2a`: scatter an independent dimension — the heads,
``B*H`` for ``bmm``, or the einsum letter present in both operands and the output — gather the
sequence), so the region runs on the whole sequence for ``1/P`` of the heads
(:class:`~autosp_lm.compiler.graph.Heads`). Sequence-sharded operands that join inside
(``v``, a per-token bias) take the same all-to-all; replicated ones (masks, ``[H, S, S]`` biases,
per-head slopes) are narrowed to the local heads when they have that dimension. A value leaves
the region at the first op without a rule here (typically ``transpose(1, 2).reshape(B, S, H*D)``):
one all-to-all back to the sequence layout on the query dimension.

Also here: a matmul that contracts the sequence of sharded operands (``k.transpose(-1, -2) @ v``
of non-causal linear attention) becomes a local product plus ``all_reduce_sum``; einsums (region
entries, per-token einsums, contractions) are in :mod:`.einsum`.

Afterwards: per region 2-3 all-to-alls in (q, k, v) and one out, as for SDPA, and the same in the
backward. The independent dimension must be divisible by the SP size; otherwise the op falls back.
"""
from __future__ import annotations

import operator

import sympy
import torch
import torch.fx as fx

from ..graph import (REP, describe, Heads, Shard, example, integer, is_heads, is_shard,
                     mutated_operand, op_name, static_int, target_key, torch_ops)
from .common import (a2a, dim_arg, expand_index, index_dims, ndim, norm_dim, normalizes_along,
                     permutation, result_operands, shared_state)
from .heads_ops import ALONG, BATCHED, along, batched, record_op
from .meta import size_query
from .pointwise import CAST_LIKE, POINTWISE, UNARY_LIKE
from .reductions import REDUCTIONS
from .registry import lookup, state_rule

_SIZE = frozenset(torch_ops("size", "dim", "numel", "nelement", "ndimension"))

_POINTWISE = frozenset(torch_ops(*POINTWISE, *UNARY_LIKE, "tril", "triu", "softmax",
                                 "log_softmax", "dropout", "masked_fill", "where"))
_CAST = frozenset(torch_ops(*CAST_LIKE))
_REDUCE = frozenset(torch_ops(*REDUCTIONS))
_TRANSPOSE = frozenset(torch_ops("transpose", "swapaxes", "swapdims", "permute", "t", "mT",
                                 "movedim", "moveaxis"))
_VIEW = frozenset(torch_ops("view", "reshape", "unsqueeze", "squeeze", "flatten", "unflatten",
                            "expand", "expand_as", "contiguous", "clone", "view_as", "reshape_as"))
_MATMUL = frozenset(torch_ops("matmul", "bmm", "einsum"))
_CAT = frozenset(torch_ops("cat", "concat", "concatenate"))


# ============================================================================ entering, leaving
def _size(rw, node, d) -> int:
    return static_int(rw.info.shape(node)[d], f"dimension {d} of {node.name}")


def to_heads(rw, a, d: int):
    """This rank's value of operand ``a`` inside a region split along ``a``'s dimension ``d``
    (None: ``a`` has no such dimension or it broadcasts; ``a`` is split along another dimension;
    ``a`` is sharded with merged or shifted rows). A sequence-sharded operand takes the Ulysses
    all-to-all (one per operand, dimension and layout, reused)."""
    s = rw.state(a)
    if is_heads(s):
        return rw.value(a) if d == s.dim else None
    has = d is not None and 0 <= d < ndim(a) and integer(rw.info.shape(a)[d]) not in (None, 1)
    if is_shard(s):
        if s.padded or s.outer != 1 or s.inner != 1:
            return None
        if not has:  # broadcast along the heads: every rank needs all of it
            return rw.gather(a)
        key = ("heads_in", rw.value(a), d, s.dim)
        if key not in rw.tags:  # whole blocks arrive in rank order: the chunks in order
            rw.tags[key] = a2a(rw, rw.value(a), d, s.dim, bool(example(a).requires_grad))
        return rw.tags[key]
    if not has:
        return rw.value(a)
    n = _size(rw, a, d)
    P = rw.info.world
    return rw.call(torch.narrow, rw.value(a), d, rw.info.rank * (n // P), n // P)


def sequence_layout(rw, a, s: Heads):
    """The dimension and layout in which region value ``a`` goes back to the sequence layout: the
    query dimension, else any dimension of the sequence's length (or of its number of blocks);
    None when it has none. Any such dimension is exact: the all-to-all splits it in ``P``
    contiguous pieces in rank order, which is what the layout says each rank holds."""
    shape = rw.info.shape(a)
    order = ([s.qdim] if s.qdim is not None else []) + list(range(len(shape)))
    for j in order:
        if j == s.dim:
            continue
        ratio = sympy.cancel(shape[j] / rw.info.symbol)
        if ratio == 1:
            return j, Shard(j)
        if ratio.is_Rational and ratio.p == 1 and ratio.q > 1 and \
                rw.report.length_multiple % (ratio.q * rw.info.world) == 0:
            return j, Shard(j, block=int(ratio.q))
    return None


def numel_at(rw, a, length: int = 1 << 20) -> float:
    """The number of elements of node ``a`` at sequence length ``length`` (its full shape;
    infinite when a size depends on more than the length)."""
    total = sympy.Integer(1)
    for e in rw.info.shape(a):
        total = total * e
    try:
        return float(sympy.sympify(total).subs(rw.info.symbol, length))
    except TypeError:
        return float("inf")


def leave(rw, a):
    """``(value, state)`` of the region value ``a`` back in the sequence layout (one all-to-all
    from the heads to a dimension of the sequence's length, :func:`sequence_layout`), or
    replicated (an all_gather of the heads) when it has no such dimension."""
    s = rw.state(a)
    x = rw.method("contiguous", rw.value(a))
    rg = bool(example(a).requires_grad)
    back = sequence_layout(rw, a, s)
    if back is None:
        return rw.collective("all_gather", x, s.dim, requires_grad=rg), REP
    return a2a(rw, x, back[0], s.dim, rg), back[1]


def start_region(rw, n, split_size):
    P = rw.info.world
    rec = rw.report.region(n, split=split_size, per_rank=split_size // P, ops=[op_name(n)])
    rw.tags[("region", n.name)] = rec
    return rec


def region_allowed(rw, n) -> bool:
    """Whether a hand-written attention region may start at ``n``: not refused by an earlier
    attempt, and the plan splits attention over heads only (a ring over arbitrary score code is
    not supported; then the scores op falls back)."""
    return rw.allowed("region", n) and rw.heads_split_only()


def ring_refusal(rw, n, what: str):
    """The fallback of a region entry ``n`` under a plan with a ring degree, else None."""
    if rw.heads_split_only() or not rw.allowed("region", n):
        return None
    rw.report.ring_refused_regions.append(describe(n))
    return rw.fallback(n, f"{what} would start a hand-written attention region (the whole "
                          f"sequence for a share of the heads), which a plan with a ring degree "
                          f"(R > 1) does not support; use --ulysses-degree equal to the "
                          f"sequence-parallel size (autosp_compile(..., ulysses_degree=P)) "
                          f"where the heads allow it")


def choose_split(rw, cands):
    """The independent dimension to split: ``cands`` are ``(size, both_have_it, position)``;
    divisible by P, preferably in both operands, nearest the matrix dims."""
    P = rw.info.world
    ok = [c for c in cands if c[0] is not None and c[0] % P == 0 and c[0] >= P]
    if not ok:
        return None
    return max(ok, key=lambda c: (c[1], c[2]))


# ============================================================================ matmul / bmm
def matmul_region(rw, n):
    """``a @ b`` with sharded or region operands that mixes the sequence; None: not one."""
    a, b = n.args[0], n.args[1]
    sa, sb = rw.state(a), rw.state(b)
    na, nb = ndim(a), ndim(b)
    if na < 2 or nb < 2:
        return None
    out_nd = len(rw.info.shape(n))
    mixing = (is_shard(sa) and sa.dim == na - 2 and is_shard(sb) and sb.dim == nb - 1) or \
        is_heads(sa) or is_heads(sb)
    if not mixing:
        return None
    if is_heads(sa) or is_heads(sb):
        h, src = (sa, a) if is_heads(sa) else (sb, b)
        od = h.dim + out_nd - ndim(src)
        if od >= out_nd - 2:
            return None
        region, rec = h.region, rw.tags.get(("region", h.region))
        if is_heads(sa):
            qdim = (None if sa.qdim is None else out_nd - 2 if sa.qdim == na - 2
                    else sa.qdim + out_nd - na if sa.qdim < na - 2 else None)
        else:
            qdim = out_nd - 2 if is_shard(sa) and sa.dim == na - 2 else None
    else:
        shape_a, shape_b = rw.info.shape(a), rw.info.shape(b)
        cands = []
        for od in range(out_nd - 2):
            da, db = od - (out_nd - na), od - (out_nd - nb)
            za = integer(shape_a[da]) if da >= 0 else 1
            zb = integer(shape_b[db]) if db >= 0 else 1
            size = max(za or 0, zb or 0) if za and zb else None
            cands.append((size, za == zb, od))
        pick = choose_split(rw, cands)
        if pick is None or sa.padded or sb.padded or sa.merged or sb.merged:
            return None
        if not region_allowed(rw, n):
            return ring_refusal(rw, n, "the scores matmul")
        od, region, qdim, rec = pick[2], n.name, out_nd - 2, None
    la = to_heads(rw, a, od - (out_nd - na))
    lb = to_heads(rw, b, od - (out_nd - nb))
    if la is None or lb is None:
        return None
    if rec is None and region == n.name:
        start_region(rw, n, _size(rw, n, od))
    record_op(rw, region, n)
    rw.bind(n, rw.emit(n, (la, lb) + tuple(rw.map(list(n.args[2:]))), rw.map(n.kwargs)))
    return Heads(od, qdim, region)


def contract_sequence(rw, n, la, lb):
    """A product that sums over the sequence of sharded operands: local product, then
    ``all_reduce_sum`` (backward: the same for the gradient)."""
    part = rw.emit(n, (la, lb) + tuple(rw.map(list(n.args[2:]))), rw.map(n.kwargs))
    return sum_partial(rw, n, part, "contracts the sequence: local product")


def sum_partial(rw, n, part, what: str):
    """Bind ``n`` to the sum over the ranks of ``part``, this rank's partial product
    (``all_reduce_sum``, the gradient the same), replicated; noted as ``what``."""
    out = rw.collective("all_reduce_sum", rw.method("contiguous", part),
                        requires_grad=bool(example(n).requires_grad))
    rw.bind(n, out)
    rw.note_rewrite("attention region", n, f"{what} + all_reduce_sum", out)
    return REP


# ============================================================================ inside a region
def _target(rw, n, operands, nd):
    """The operands' shared split dim aligned to ``n``'s ``nd``-dim result (None: they differ),
    with the query dim they agree on (None when none has one or two differ)."""
    def align(s, off):
        return s.renumber(s.dim + off, None if s.qdim is None else s.qdim + off)
    target = shared_state(rw, operands, nd, is_heads, align, same=lambda s: s.dim)
    if target is None:
        return None
    qdims = {align(rw.state(a), nd - ndim(a)).qdim for a in operands if is_heads(rw.state(a))}
    qdims.discard(None)
    return target.renumber(target.dim, qdims.pop() if len(qdims) == 1 else None)


def _pointwise(rw, n):
    only_first = target_key(n) in _CAST
    got = result_operands(rw, n, only_first)
    if got is None:
        return NotImplemented
    nd, operands = got
    target = _target(rw, n, operands, nd)
    if target is None:
        return NotImplemented
    name = op_name(n)
    if normalizes_along(n, nd, target.dim):
        return NotImplemented
    if name in ("tril", "triu") and target.dim >= nd - 2:
        return NotImplemented
    repl = {}
    for a in operands:
        if a in repl or is_heads(rw.state(a)):
            continue
        v = to_heads(rw, a, target.dim - (nd - ndim(a)))
        if v is None:
            return NotImplemented
        repl[a] = v

    def f(x):
        return repl[x] if x in repl else rw.value(x)

    if only_first:
        args = (rw.value(n.args[0]),) + tuple(rw.map(list(n.args[1:]), rw.original_value))
        kwargs = rw.map(n.kwargs, rw.original_value)
    else:
        args, kwargs = rw.map(n.args, f), rw.map(n.kwargs, f)
    record_op(rw, target.region, n)
    rw.bind(n, rw.emit(n, args, kwargs))
    return target


def _reduce(rw, n):
    x = n.args[0]
    s = rw.state(x)
    if not is_heads(s) or any(is_heads(rw.state(a)) for a in n.all_input_nodes if a is not x):
        return NotImplemented
    nd = ndim(x)
    dim = dim_arg(n, 1, None)
    if dim is None or isinstance(dim, torch.dtype):
        return NotImplemented
    dims = [dim] if isinstance(dim, int) else list(dim)
    if not all(isinstance(d, int) for d in dims):
        return NotImplemented
    dims = [norm_dim(d, nd) for d in dims]
    keep = n.kwargs.get("keepdim", n.args[2] if len(n.args) > 2 else False)
    if s.dim in dims:
        return NotImplemented
    rw.emit_local(n)
    record_op(rw, s.region, n)

    def nd_(d):
        return d if keep or d is None else d - sum(1 for r in dims if r < d)
    out = s.renumber(nd_(s.dim), None if s.qdim in dims else nd_(s.qdim))
    ev = example(n)
    return tuple(out for _ in ev) if isinstance(ev, (tuple, list)) else out


def _transpose(rw, n):
    x = n.args[0]
    s = rw.state(x)
    if not is_heads(s):
        return NotImplemented
    perm = permutation(n, ndim(x))
    if perm is None:
        return NotImplemented
    rw.emit_local(n)
    record_op(rw, s.region, n)
    return s.renumber(perm.index(s.dim), None if s.qdim is None else perm.index(s.qdim))


def _local_sizes(rw, n, s: Heads):
    P = rw.info.world
    out = []
    for i, e in enumerate(rw.info.shape(n)):
        if i == s.dim:
            out.append(static_int(e, "heads") // P)
        elif rw.info.has_seq(e):
            out.append(rw.sym(e))
        else:
            out.append(static_int(e, f"dimension {i} of {n.name}"))
    return out


def _view(rw, n):
    x = n.args[0]
    s = rw.state(x)
    if not is_heads(s):
        return NotImplemented
    name = op_name(n)
    if name in ("contiguous", "clone"):
        rw.emit_local(n)
        return s
    in_shape, out_shape = rw.info.shape(x), rw.info.shape(n)

    def locate(d):  # the output dim holding input dim d unchanged (same prefix product)
        if d is None:
            return None
        pre = 1
        for e in in_shape[:d]:
            pre = pre * e
        acc = 1
        for j, e in enumerate(out_shape):
            if integer(acc - pre) == 0 and integer(e - in_shape[d]) == 0:
                return j
            acc = acc * e
        return -1

    od, oq = locate(s.dim), locate(s.qdim)
    if od == -1 or oq == -1:
        return NotImplemented
    new = s.renumber(od, oq)
    if name in ("unsqueeze", "squeeze", "flatten", "unflatten"):
        rw.emit_local(n)
    elif name in ("expand", "expand_as"):
        rw.bind(n, rw.method("expand", rw.value(x), _local_sizes(rw, n, new)))
    else:
        rw.bind(n, rw.method("reshape", rw.value(x), _local_sizes(rw, n, new)))
    record_op(rw, s.region, n)
    return new


def _getitem(rw, n):
    x, idx = n.args
    s = rw.state(x)
    if not is_heads(s) or target_key(n) is not operator.getitem:
        return NotImplemented
    nd = ndim(x)
    items = expand_index(idx, nd)
    if items is None:
        return NotImplemented
    keys, places, _ = index_dims(items)
    if keys[s.dim] != slice(None):
        return NotImplemented
    new_d = places[s.dim]
    new_q = places[s.qdim] if s.qdim is not None and keys[s.qdim] == slice(None) else None
    rw.emit_local(n)
    record_op(rw, s.region, n)
    return s.renumber(new_d, new_q)


def _cat(rw, n):
    """A concatenation along a dim other than the heads, e.g. a learned per-head sink logit
    appended to the scores as one more key (GPT-OSS), or a zero state put before the chunk states
    of a scan: replicated operands are narrowed to this rank's heads, sequence-sharded ones join
    by the all-to-all. Along the queries the result is no longer the query positions."""
    tensors = n.args[0] if n.args else n.kwargs.get("tensors")
    if not isinstance(tensors, (list, tuple)) or not all(isinstance(t, fx.Node) for t in tensors):
        return NotImplemented
    nd = ndim(n)
    dim = dim_arg(n, 1, 0)
    target = _target(rw, n, tensors, nd)
    if target is None or not isinstance(dim, int) or any(ndim(t) != nd for t in tensors):
        return NotImplemented
    dim = norm_dim(dim, nd)
    if dim == target.dim:
        return NotImplemented
    if dim == target.qdim:  # the whole sequence and more: no longer the query positions
        target = target.renumber(target.dim, None)
    values = []
    for t in tensors:
        v = to_heads(rw, t, target.dim)
        if v is None:
            return NotImplemented
        values.append(v)
    record_op(rw, target.region, n)
    rw.bind(n, rw.emit(n, (values, dim), {}))
    return target


def _setitem(rw, n):
    """``x[idx] = v`` into a region value, with ``idx`` whole along the split dim: ``v`` joins the
    region aligned to the indexed view (replicated: narrowed; sharded: the all-to-all)."""
    x, idx, v = n.args
    s = rw.state(x)
    items = expand_index(idx, ndim(x))
    if items is None or not isinstance(v, fx.Node):
        return NotImplemented
    keys, places, out_nd = index_dims(items)
    if keys[s.dim] != slice(None):
        return NotImplemented
    local = to_heads(rw, v, places[s.dim] - (out_nd - ndim(v)))
    if local is None:
        return NotImplemented
    record_op(rw, s.region, n)
    rw.bind(n, rw.call(operator.setitem, rw.value(x), rw.map(idx), local))
    return REP


@state_rule("heads")
def inside_region(rw, n):
    """Ops with an operand inside an attention region: stay in the region when they are per
    head; otherwise NotImplemented (the operands leave the region). An in-place op stays only
    when the value it writes into is inside the region already."""
    key = target_key(n)
    if key in _SIZE:  # sizes are global: no need to leave the region / the rows
        return size_query(rw, n)
    written = mutated_operand(n)
    if written is not None and not is_heads(rw.state(written)):
        return NotImplemented
    if key is operator.setitem:
        return _setitem(rw, n)
    if key in _MATMUL:
        if op_name(n) == "einsum":
            return lookup(n)(rw, n)  # the einsum rule (rules/einsum.py builds on this module)
        out = matmul_region(rw, n)
        return NotImplemented if out is None else out
    if key is operator.getitem:
        return _getitem(rw, n)
    if key in _POINTWISE or key in _CAST:
        return _pointwise(rw, n)
    if key in _REDUCE:
        return _reduce(rw, n)
    if key in _TRANSPOSE:
        return _transpose(rw, n)
    if key in _VIEW:
        return _view(rw, n)
    if key in _CAT:
        return _cat(rw, n)
    if key in ALONG:
        return along(rw, n)
    if key in BATCHED:
        return batched(rw, n)
    return NotImplemented
