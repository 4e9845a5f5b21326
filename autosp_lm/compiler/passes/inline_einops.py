"""Graph pass — inline einops.

Expects: the Dynamo graph. On torch versions where einops registers ``rearrange``/``reduce``/
``repeat`` with ``allow_in_graph`` (einops 0.8 compares version strings, so it does so on torch
2.10 and 2.11), they are opaque ``call_function`` nodes of those function objects; elsewhere
Dynamo traces through them and this pass finds nothing.

Rewrites: each such node whose pattern is a plain string (with ``...``, ``()``, ``1`` and number
axes, lengths from keyword arguments) into the tensor methods einops itself applies, derived
from the pattern: ``unflatten`` of every input group (one ``-1`` per group, so no size is baked in
and a symbolic sequence length stays symbolic), ``squeeze`` of unit groups, the reduction
(``sum``/``mean``/``amax``/``amin``/``prod``) of axes missing on the right, ``permute`` into the
output order, ``unsqueeze`` + ``expand`` of the new axes of ``repeat``, and ``flatten`` of the
output groups. Each new node gets the example value of its op on its input's example value.

Afterwards: the sharding rules see ordinary views (the einops call node is gone); a node this
pass cannot derive (a callable reduction, a list input, a group on the right holding ``...``)
stays, and the sharding pass falls back for it (the report names it).
"""
from __future__ import annotations

import contextlib
import sys

import torch
import torch.fx as fx

from ..graph import example

_REDUCE = {"sum": "sum", "mean": "mean", "max": "amax", "min": "amin", "prod": "prod"}


def _targets() -> dict:
    """The einops functions the graph may call (only when the model imported einops)."""
    mod = sys.modules.get("einops")
    if mod is None:
        return {}
    return {getattr(mod, k): k for k in ("rearrange", "reduce", "repeat") if hasattr(mod, k)}


def _axes(expr: str, nd=None):
    """The groups of one side of a pattern: a list of lists of axis keys (names, or ``("n", k)``
    for a number axis, ``("...", i)`` for the i-th axis under the ellipsis); None if unsupported."""
    from einops.parsing import ParsedExpression, _ellipsis
    parsed = ParsedExpression(expr)
    groups = []
    for g in parsed.composition:
        if g == _ellipsis:
            if nd is None:
                groups.append("...")
                continue
            n_ell = nd - (len(parsed.composition) - 1)
            if n_ell < 0:
                return None
            groups += [[("...", i)] for i in range(n_ell)]
            continue
        out = []
        for a in g:
            if a == _ellipsis:
                return None  # (...) inside a group
            out.append(a if isinstance(a, str) else ("n", int(a.value)))
        groups.append(out)
    return groups


def _recipe(op: str, pattern: str, nd: int, lengths: dict, reduction):
    """The list of ``(method, args)`` applying the einops call, or None."""
    if not isinstance(pattern, str) or "->" not in pattern:
        return None
    lhs, rhs = (t.strip() for t in pattern.split("->"))
    left = _axes(lhs, nd)
    if left is None or len(left) != nd:
        return None
    right = _axes(rhs)
    n_ell = sum(1 for g in left for a in g if isinstance(a, tuple) and a[0] == "...")
    if right is None:
        return None
    out_groups = []
    for g in right:
        if g == "...":
            out_groups += [[("...", i)] for i in range(n_ell)]
        else:
            out_groups.append(g)

    def size(a):
        if isinstance(a, tuple) and a[0] == "n":
            return a[1]
        return lengths.get(a)

    steps, flat = [], []
    for d in range(nd - 1, -1, -1):  # input groups into elementary axes, last first
        g = left[d]
        if len(g) == 0:
            steps.append(("squeeze", (d,)))
        elif len(g) > 1:
            sizes = [size(a) for a in g]
            if sum(v is None for v in sizes) > 1:
                return None
            steps.append(("unflatten", (d, [(-1 if v is None else v) for v in sizes])))
        flat = list(g) + flat
    out_axes = [a for g in out_groups for a in g]
    reduced = [i for i, a in enumerate(flat) if a not in out_axes]
    if reduced:
        if op != "reduce" or not isinstance(reduction, str) or reduction not in _REDUCE:
            return None
        steps.append((_REDUCE[reduction], (reduced,)))
        flat = [a for i, a in enumerate(flat) if i not in reduced]
    kept = [a for a in out_axes if a in flat]
    new = [a for a in out_axes if a not in flat]
    if new and op != "repeat":
        return None
    perm = [flat.index(a) for a in kept]
    if perm != list(range(len(perm))):
        steps.append(("permute", (perm,)))
    if new:  # repeat: new axes as broadcast dims, then expanded
        order = list(kept)
        for i, a in enumerate(out_axes):
            if a in new:
                order.insert(i, a)
                steps.append(("unsqueeze", (i,)))
        sizes = [size(a) if a in new else -1 for a in order]
        if any(v is None for v in sizes):
            return None
        steps.append(("expand", (sizes,)))
    pos, merges = 0, []
    for g in out_groups:
        merges.append((pos, len(g)))
        pos += len(g)
    for start, k in reversed(merges):
        if k == 0:
            steps.append(("unsqueeze", (start,)))
        elif k > 1:
            steps.append(("flatten", (start, start + k - 1)))
    return steps


def inline_einops(gm: fx.GraphModule) -> int:
    """Replace the einops call nodes this pass can derive; returns how many."""
    targets = _targets()
    if not targets:
        return 0
    done = 0
    for n in list(gm.graph.nodes):
        try:
            op = targets.get(n.target) if n.op == "call_function" else None
        except TypeError:  # an unhashable target
            op = None
        if op is None or len(n.args) < 2 or not isinstance(n.args[0], fx.Node):
            continue
        x = n.args[0]
        ev = example(x)
        if not isinstance(ev, torch.Tensor):
            continue
        kwargs = dict(n.kwargs)
        reduction = n.args[2] if len(n.args) > 2 else kwargs.pop("reduction", None)
        # axis lengths: ints, or symbolic sizes the graph computed (a chunk count, say)
        lengths = {k: v for k, v in kwargs.items() if isinstance(v, int) or (
            isinstance(v, fx.Node) and isinstance(example(v), (int, torch.SymInt)))}
        if len(lengths) != len(kwargs) or len(n.args) > (3 if op == "reduce" else 2):
            continue
        try:
            steps = _recipe(op, n.args[1], ev.dim(), lengths, reduction)
        except Exception:  # noqa: BLE001 - an einops pattern error: leave it to einops
            steps = None
        if steps is None:
            continue
        cur, val = x, ev
        mode = getattr(ev, "fake_mode", None) or contextlib.nullcontext()
        with gm.graph.inserting_before(n), mode:
            for name, args in steps:
                val = getattr(val, name)(*fx.node.map_arg(args, example))
                cur = gm.graph.call_method(name, (cur,) + args)
                cur.meta.update({k: v for k, v in n.meta.items() if k != "example_value"})
                cur.meta["example_value"] = val
        n.replace_all_uses_with(cur)
        gm.graph.erase_node(n)
        done += 1
    if done:
        gm.recompile()
    return done
