"""Argument helpers shared by the rule families."""
from __future__ import annotations

import torch

from ..graph import example, is_tensor_node


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
