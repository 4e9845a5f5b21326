"""Ops inside a region split along an independent dim (:class:`~autosp_lm.compiler.graph.Heads`:
an attention region or a head-parallel region) that act along other dims: scans, sorts, flips,
rolls, pads, narrows and index selects. The sequence is whole inside, so any of them is exact
per head; the split dim must not be one they act along."""
from __future__ import annotations

from ..graph import REP, example, is_heads, is_tensor_node, op_name, target_key, torch_ops
from .common import dim_arg, ndim, norm_dim


def record_op(rw, region, n):
    rec = rw.tags.get(("region", region))
    if rec is not None:
        name = op_name(n)
        if not rec.ops or rec.ops[-1] != name:
            rec.ops.append(name)


_SCAN = frozenset(torch_ops("cumsum", "cumprod", "logcumsumexp", "cummax", "cummin", "argsort",
                            "sort"))
ALONG = frozenset(torch_ops("flip", "roll", "pad", "narrow", "index_select")) | _SCAN


def _acting_dims(n, nd):
    """The dims along which ``n`` (an op of :data:`ALONG` on an ``nd``-dim value) combines or
    moves entries; None when unknown (a roll without dims, a non-constant pad)."""
    name = op_name(n)
    if name == "pad":
        pad = dim_arg(n, 1, None, key="pad")
        if not isinstance(pad, (list, tuple)) or len(pad) % 2:
            return None
        return [nd - 1 - i for i in range(len(pad) // 2)]
    if name == "flip":
        dims = dim_arg(n, 1, None, key="dims")
    elif name == "roll":
        dims = dim_arg(n, 2, None, key="dims")
    elif name in ("argsort", "sort"):
        dims = dim_arg(n, 1, -1)
    else:
        dims = dim_arg(n, 1, None)
    dims = [dims] if isinstance(dims, int) else dims
    if not isinstance(dims, (list, tuple)) or not dims or not all(isinstance(d, int) for d in dims):
        return None
    return [norm_dim(d, nd) for d in dims]


def along(rw, n):
    """Scans, sorts, flips, rolls, pads, narrows and index selects of a region value along dims
    other than the split one: per head, so the region goes on. The query dim stays only where
    the op leaves it in place (a scan along it does; a pad, flip or roll of it does not)."""
    x = n.args[0]
    s = rw.state(x)
    if not is_heads(s) or any(a is not x and rw.state(a) is not REP for a in n.all_input_nodes):
        return NotImplemented
    acting = _acting_dims(n, ndim(x))
    if acting is None or s.dim in acting:
        return NotImplemented
    if any(rw.is_full(a) for a in n.all_input_nodes if a is not x):
        return NotImplemented  # an index over the sequence: positions, not a per-head value
    moved = s.qdim in acting and target_key(n) not in _SCAN
    out = s.renumber(s.dim, None if moved else s.qdim)
    rw.emit_local(n)
    record_op(rw, s.region, n)
    ev = example(n)
    return tuple(out for _ in ev) if isinstance(ev, (tuple, list)) else out


BATCHED = frozenset(torch_ops("solve_triangular", "cholesky", "cholesky_solve", "inv", "solve"))


def batched(rw, n):
    """Solves and factorizations of the last two dims: per head when every tensor operand is in
    the region, split along the same batch dim (aligned from the right)."""
    ops = [a for a in n.all_input_nodes if is_tensor_node(a)]
    nd = ndim(n)
    dims = {rw.state(a).dim + nd - ndim(a) if is_heads(rw.state(a)) else None for a in ops}
    if len(dims) != 1 or None in dims or any(ndim(a) < 2 for a in ops):
        return NotImplemented
    (d,) = dims
    if d >= nd - 2:
        return NotImplemented
    s = rw.state(ops[0])
    rw.emit_local(n)
    record_op(rw, s.region, n)
    return s.renumber(d, None if s.qdim is None else s.qdim + nd - ndim(ops[0]))
