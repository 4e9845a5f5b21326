"""What the rule families share: argument helpers, the Ulysses all-to-all, sequence layouts
(shifts, halo windows, masks of the logical sequence) and index items and slices of the sequence.

The one module of ``rules/`` that the others import helpers from; it imports no rule module, so
the rule modules form no cycle (tests/test_architecture.py)."""
from __future__ import annotations

import operator
from typing import Optional

import sympy
import torch
import torch.fx as fx

from ..graph import Shard, example, integer, is_tensor_node, op_name, static_int, target_key


def ndim(a) -> int:
    return example(a).dim()


def norm_dim(d, nd):
    return d + nd if d < 0 else d


def dim_arg(n, pos, default=None, key="dim"):
    """Argument ``key`` of ``n``: positional at ``pos`` or by keyword."""
    if len(n.args) > pos:
        return n.args[pos]
    return n.kwargs.get(key, default)


def sizes_arg(n, start=1):
    """The size list of view/reshape/expand/repeat given as varargs or one sequence."""
    rest = list(n.args[start:])
    if "size" in n.kwargs:
        rest = [n.kwargs["size"]]
    elif "shape" in n.kwargs:
        rest = [n.kwargs["shape"]]
    if len(rest) == 1 and isinstance(rest[0], (list, tuple, torch.Size)):
        return list(rest[0])
    return rest


def tensor_args(n, only_first=False):
    """The tensor operands of ``n`` (positional, keyword and inside lists), or just the first."""
    if only_first:
        return [n.args[0]] if is_tensor_node(n.args[0]) else []
    args = [a for a in list(n.args) + list(n.kwargs.values()) if is_tensor_node(a)]
    for a in list(n.args) + list(n.kwargs.values()):
        if isinstance(a, (list, tuple)):
            args += [x for x in a if is_tensor_node(x)]
    return args


def permutation(n, nd: int):
    """The dimension permutation of a transpose-like node ``n`` (``transpose`` / ``swapaxes`` /
    ``swapdims`` / ``permute`` / ``t`` / ``mT`` / ``adjoint`` / ``movedim``) of an ``nd``-dim
    value: ``out.dim(i)`` is ``in.dim(perm[i])``; None for any other op."""
    name = op_name(n)
    perm = list(range(nd))
    if name in ("transpose", "swapaxes", "swapdims"):
        a, b = ((n.args[1], n.args[2]) if len(n.args) >= 3
                else (n.kwargs.get("dim0"), n.kwargs.get("dim1")))
        a, b = norm_dim(a, nd), norm_dim(b, nd)
        perm[a], perm[b] = perm[b], perm[a]
    elif name == "permute":
        perm = [norm_dim(d, nd) for d in (sizes_arg(n) or n.kwargs.get("dims", []))]
    elif name in ("t", "mT", "adjoint"):
        perm[-1], perm[-2] = perm[-2], perm[-1]
    elif name in ("movedim", "moveaxis"):
        src, dst = n.args[1], n.args[2]
        src = [src] if isinstance(src, int) else list(src)
        dst = [dst] if isinstance(dst, int) else list(dst)
        src, dst = [norm_dim(d, nd) for d in src], [norm_dim(d, nd) for d in dst]
        rest = iter(d for d in range(nd) if d not in src)
        placed = dict(zip(dst, src))
        perm = [placed[i] if i in placed else next(rest) for i in range(nd)]
    else:
        return None
    return perm


def shared_state(rw, operands, nd: int, kind, align, same=None, refuse=None):
    """The distributed state every operand of ``kind`` (a state predicate) shares, aligned to
    an ``nd``-dim output by ``align(state, nd - ndim(operand))``; None when two differ (under
    ``same``, a key of a state: equality by default), no operand is of ``kind``, or an operand's
    state is refused by ``refuse``."""
    target = None
    for a in operands:
        s = rw.state(a)
        if refuse is not None and refuse(s):
            return None
        if kind(s):
            cand = align(s, nd - ndim(a))
            if target is None:
                target = cand
            elif (same(cand) != same(target)) if same else cand != target:
                return None
    return target


def normalizes_along(n, nd: int, d: int) -> bool:
    """Whether ``n`` is a softmax / log_softmax / topk over dim ``d`` of its ``nd``-dim result
    (or over a dim it does not state): per-row rules must not split that dim."""
    name = op_name(n)
    if name not in ("softmax", "log_softmax", "topk"):
        return False
    dim = dim_arg(n, 2 if name == "topk" else 1, -1 if name == "topk" else None)
    return dim is None or norm_dim(dim, nd) == d


def result_operands(rw, n, only_first: bool):
    """``(nd, operands)``: the dims of ``n``'s result and its tensor operands (only the first
    for casts); None when the result's shape is unknown."""
    shape = rw.info.shape(n)
    return None if shape is None else (len(shape), tensor_args(n, only_first))


# ========================================================================== the Ulysses all-to-all
def a2a(rw, x, scatter, gather_dim, requires_grad=True):
    """The Ulysses all-to-all: over the plan's Ulysses group (the whole SP group when the plan
    has no ring)."""
    plan = rw.plan
    if plan is not None and plan.ring_degree > 1:
        if plan.ulysses_degree == 1:
            return x  # ring only: every rank keeps all heads of its ring shard
        return rw.collective("all_to_all", rw.method("contiguous", x), scatter, gather_dim,
                             requires_grad=requires_grad, group=plan.ulysses_group,
                             world=plan.ulysses_degree)
    return rw.collective("all_to_all", rw.method("contiguous", x), scatter, gather_dim,
                         requires_grad=requires_grad)


# ========================================================== sequence layouts: shifts, halos, masks
def requires_grad(a) -> bool:
    return bool(getattr(example(a), "requires_grad", False))


def unmerge(rw, node, shard: Shard, x):
    """``x`` (this rank's value of ``node`` in ``shard``) with the sequence as its own axis:
    ``(x', d, redo)``, ``redo`` reshapes a result of the same shape back."""
    if not shard.merged:
        return x, shard.dim, (lambda y: y)
    shape = rw.info.shape(node)
    d = shard.dim
    pre = [static_int(s, f"dimension {i} of {node.name}") for i, s in enumerate(shape[:d])]
    post = [static_int(s, f"dimension {i} of {node.name}") for i, s in enumerate(shape[d + 1:])]
    x = rw.method("reshape", x, pre + [shard.outer, -1, shard.inner] + post)
    return x, d + 1, (lambda y: rw.method("reshape", y, pre + [-1] + post))


def layout_refusal(rw, n, what: str):
    """The fallback of ``n`` when the plan's sequence layout is not contiguous in rank order
    (:meth:`rw.contiguous_layout`), else None: every rule that exchanges rows with the
    neighbouring ranks or scans across them asks here first."""
    if rw.contiguous_layout():
        return None
    return rw.fallback(n, f"{what} needs each rank's rows contiguous and in rank order (halo "
                          f"exchange / exclusive scan), which this plan's sequence layout is not; "
                          f"use --ulysses-degree equal to the sequence-parallel size (autosp_compile(..., "
                          f"ulysses_degree=P)) where the heads allow it")


def blocks_refusal(rw, n, new: Shard):
    """The fallback of a reshape ``n`` that cuts the sequence into blocks (``new.block``) when
    each rank cannot hold whole blocks, else None; otherwise the report's length multiple grows
    to ``block * P`` (every later call is checked against it)."""
    from math import lcm
    if not rw.allowed("blocks", n):  # refuse_plans=("blocks",): to measure the gathered plan
        return rw.fallback(n, "cuts the sequence into blocks (plan refused by refuse_plans)")
    if not rw.contiguous_layout():
        return layout_refusal(rw, n, "cutting the sequence into blocks")
    P = rw.info.world
    need = new.block * P
    hint = rw.length_hint()
    if hint is not None and hint % need:
        return rw.fallback(n, f"cuts the sequence into blocks of {new.block}, and this call's "
                              f"length {hint} is not a multiple of {new.block} x "
                              f"sequence-parallel size {P} = {need}, so a rank cannot hold whole "
                              f"blocks; use a multiple of {need} to keep the blocks sharded")
    rw.report.length_multiple = lcm(rw.report.length_multiple, need)
    rw.note_rewrite("scans", n, f"sequence cut into blocks of {new.block}: local reshape, each "
                                f"rank holds whole blocks (length a multiple of {need})", None)
    return None


def window(rw, x, d: int, left: int, right: int, grad: bool, cyclic: bool = False):
    """``x`` with ``left`` halo rows before and ``right`` after along ``d`` (one seq_window)."""
    if not left and not right:
        return x
    return rw.collective("seq_window", rw.method("contiguous", x), d, left, right, cyclic,
                         requires_grad=grad)


def shift_local(rw, node, x, shard: Shard, delta: int, cyclic: bool = False):
    """``out[v] = x[v - delta]`` at this rank's virtual positions ``v`` (rows from outside the
    sequence are zeros, or wrap around with ``cyclic``)."""
    if not delta:
        return x
    x, d, redo = unmerge(rw, node, shard, x)
    w = window(rw, x, d, max(delta, 0), max(-delta, 0), requires_grad(node), cyclic)
    return redo(rw.call(torch.narrow, w, d, max(-delta, 0), rw.chunk_len()))


def realign(rw, a, target: Shard):
    """This rank's value of the sharded ``a`` in layout ``target`` (same logical length)."""
    s = rw.state(a)
    assert s.pad_left + s.pad_right == target.pad_left + target.pad_right, (s, target)
    return shift_local(rw, a, rw.value(a), s, target.pad_left - s.pad_left)


def same_length(s: Shard, t: Shard) -> bool:
    """Layouts of the same logical sequence that differ only by a shift."""
    return (s.dim, s.outer, s.inner) == (t.dim, t.outer, t.inner) and \
        s.pad_left + s.pad_right == t.pad_left + t.pad_right


def into_sequence(rw, a, s: Shard):
    """``(value, layout)`` of the overhanging ``a`` moved inside the virtual sequence, or None
    when it is longer than the sequence."""
    total = s.pad_left + s.pad_right
    if total < 0:
        return None
    pl = min(max(s.pad_left, 0), total)
    t = Shard(s.dim, s.outer, s.inner, pl, total - pl)
    return realign(rw, a, t), t


def bcast(rw, mask, d: int, nd: int):
    return rw.method("reshape", mask, [1] * d + [-1] + [1] * (nd - d - 1))


def in_range(rw, lo, hi):
    """Bool mask of this rank's virtual positions in ``[lo, hi)`` (expressions in S)."""
    pos = rw.positions()
    return rw.call(operator.and_, rw.call(operator.ge, pos, rw.sym(lo)),
                   rw.call(operator.lt, pos, rw.sym(hi)))


def logical_mask(rw, s: Shard):
    """This rank's rows that hold the logical sequence of layout ``s``."""
    return in_range(rw, sympy.Integer(s.pad_left), rw.info.symbol - s.pad_right)


# ========================================================== index items and slices of the sequence
def canon_value(rw, v):
    if isinstance(v, fx.Node):
        return rw.info.canon(example(v))
    return v


def seq_range(rw, s: Shard, start, stop, step=None):
    """``(start, stop)`` of a slice of the logical sequence of ``s`` as expressions in S (Python
    semantics: negative constants count from the end), or None (steps, odd bounds, and any
    part of a dimension that merges the batch with the sequence; all of it is a range)."""
    whole = (start is None or (isinstance(start, int) and start == 0)) and stop is None
    if step not in (None, 1) or (s.merged and not whole):
        return None
    L = rw.info.symbol - s.pad_left - s.pad_right
    start, stop = canon_value(rw, start), canon_value(rw, stop)
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
    result when it is a shift; else None (a merged layout too: the layout built here has no
    batch factor)."""
    if s.merged:
        return None
    key = target_key(u)
    if key is operator.getitem and u.args[0] is src:
        items = expand_index(u.args[1], ndim(src))
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
        stop = sympy.sympify(canon_value(rw, start)) + sympy.sympify(canon_value(rw, length))
        r = seq_range(rw, s, start, stop)
    else:
        return None
    return None if r is None else slice_layout(rw, s, *r)


def index_dims(items):
    """For the items of ``x[idx]`` (:func:`expand_index`): ``(keys, places, nd)``: the item of each
    input dim, the result dim each input dim becomes (None where an integer removes it) and the
    result's number of dims."""
    keys, places, out = [], [], 0
    for it in items:
        if it is None:
            out += 1
            continue
        keys.append(it)
        places.append(out if isinstance(it, slice) else None)
        out += isinstance(it, slice)
    return keys, places, out


def expand_index(idx, nd):
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

