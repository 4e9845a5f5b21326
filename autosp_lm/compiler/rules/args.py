"""Argument helpers shared by the rule families."""
from __future__ import annotations

import torch

from ..graph import example, is_tensor_node, op_name


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
