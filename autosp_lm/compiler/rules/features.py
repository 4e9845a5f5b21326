"""Rules: per-token ops over feature dimensions: linear and matmul (contraction over features),
GPT-2's ``addmm``, embedding, norms, and ops along a non-sequence dim (softmax, sort, topk ...).
The sequence dimension passes through unchanged."""
from __future__ import annotations

from ..graph import REP, example, is_shard, is_tensor_node, op_name, torch_ops
from .attention_region import contract_sequence, matmul_region
from .common import dim_arg, ndim, norm_dim
from .registry import rule


@rule(*torch_ops("linear"))
def linear(rw, n):
    x = n.args[0]
    s = rw.state(x)
    others = [a for a in n.all_input_nodes if a is not x]
    if not is_shard(s) or s.dim == ndim(x) - 1 or any(
            is_shard(rw.state(a)) or rw.is_full(a) for a in others):
        return rw.fallback(n, "linear over the sequence dimension")
    rw.emit_local(n)
    return s


@rule(*torch_ops("embedding"))
def embedding(rw, n):
    ids = n.args[0]
    s = rw.state(ids)
    if not is_shard(s) or any(is_shard(rw.state(a)) for a in n.all_input_nodes if a is not ids):
        return rw.fallback(n, "embedding with a sharded table")
    rw.emit_local(n)
    return s


@rule(*torch_ops("matmul", "mm", "bmm"), accepts=("blocks",))
def matmul(rw, n):
    a, b = n.args[0], n.args[1]
    sa, sb = rw.state(a), rw.state(b)
    na, nb = ndim(a), ndim(b)
    if na < 2 or nb < 2:
        return rw.fallback(n, "matmul with a vector")
    if any(is_shard(s) and s.block != 1 and s.dim >= k - 2 for s, k in ((sa, na), (sb, nb))):
        return rw.fallback(n, "matmul over a sequence cut into blocks (only a batch dim of "
                              "blocks stays local)")
    out = matmul_region(rw, n)  # q @ k^T: a hand-written attention region
    if out is not None:
        return out
    if is_shard(sa) and sa.dim == na - 1:
        if is_shard(sb) and sb.dim == nb - 2 and sb.same_sequence(sa) and not sa.padded:
            return contract_sequence(rw, n, rw.value(a), rw.value(b))
        return rw.fallback(n, "matmul contracting the sequence")
    new_b = rw.value(b)
    if is_shard(sb):
        if sb.dim == nb - 1:
            return rw.fallback(n, "matmul producing a sequence-sharded column dimension")
        if sb.dim == nb - 2:  # contraction over the sequence: gather the right operand
            new_b = rw.gather(b)
            rw.note_fallback(n, "contracts the sequence of its right operand -> all_gather "
                                "of that operand", new_b)
            sb = REP
    if not is_shard(sa):
        return rw.fallback(n, "only the right operand is sharded")
    out_nd = len(rw.info.shape(n))
    od = sa.dim + out_nd - na
    if is_shard(sb):  # both sharded along batch dims: must agree
        if sb.with_dim(sb.dim + out_nd - nb) != sa.with_dim(od):
            return rw.fallback(n, "operands sharded differently")
    elif rw.is_full(b):
        shp = rw.info.shape(b)
        bd = od - (out_nd - nb)
        if 0 <= bd < nb - 2 and rw.info.has_seq(shp[bd]):
            new_b = rw.localize(b, sa.with_dim(bd))
    rw.bind(n, rw.emit(n, (rw.value(a), new_b) + tuple(rw.map(list(n.args[2:]))),
                       rw.map(n.kwargs)))
    return sa.with_dim(od)


LINALG = ("solve_triangular", "cholesky", "cholesky_solve", "inv", "solve")


@rule(*torch_ops(*LINALG), accepts=("blocks",))
def batched_linalg(rw, n):
    """Solves and factorizations of the last two dims, batched over the leading ones (a delta
    rule's triangular solve per chunk): local when every sharded operand has the same layout on
    a batch dim."""
    ops = [a for a in n.all_input_nodes if is_tensor_node(a)]
    nd = len(rw.info.shape(n))
    shards = {rw.state(a).with_dim(rw.state(a).dim + nd - ndim(a)) for a in ops
              if is_shard(rw.state(a))}
    if len(shards) != 1 or any(ndim(a) < 2 or rw.is_full(a) for a in ops) or \
            any(is_shard(rw.state(a)) and rw.state(a).dim >= ndim(a) - 2 for a in ops):
        return rw.fallback(n, f"{op_name(n)} over the sequence")
    rw.emit_local(n)
    return shards.pop()


@rule(*torch_ops("addmm"))
def addmm(rw, n):
    """``addmm(bias, x2d, W)`` (GPT-2's Conv1D): rows of ``x2d`` sharded, ``W`` replicated."""
    bias, a, b = n.args[0], n.args[1], n.args[2]
    sa = rw.state(a)
    if (not is_shard(sa) or sa.dim != 0 or is_shard(rw.state(b)) or rw.is_full(b)
            or is_shard(rw.state(bias)) or rw.is_full(bias)):
        return rw.fallback(n, "addmm over the sequence")
    rw.emit_local(n)
    return sa


@rule(*torch_ops("layer_norm", "rms_norm"))
def norm(rw, n):
    x = n.args[0]
    s = rw.state(x)
    shape = dim_arg(n, 1, key="normalized_shape")
    k = 1 if isinstance(shape, int) else len(shape)
    if not is_shard(s) or s.dim >= ndim(x) - k or any(
            is_shard(rw.state(a)) or rw.is_full(a) for a in n.all_input_nodes if a is not x):
        return rw.fallback(n, "normalization over the sequence")
    rw.emit_local(n)
    return s


_DIM_POS = {"topk": 2, "kthvalue": 2, "normalize": 2}
_LAST_DIM_DEFAULT = ("sort", "argsort", "topk", "normalize", "glu", "kthvalue")


@rule(*torch_ops("softmax", "log_softmax", "topk", "normalize", "glu", "kthvalue"),
      accepts=("blocks",))
def along_dim(rw, n):
    x = n.args[0]
    s = rw.state(x)
    name = op_name(n)
    default = -1 if name in _LAST_DIM_DEFAULT else None
    dim = dim_arg(n, _DIM_POS.get(name, 1), default)
    if name == "normalize" and len(n.args) <= 2 and "dim" not in n.kwargs:
        dim = 1
    if not is_shard(s) or dim is None or norm_dim(dim, ndim(x)) == s.dim:
        return rw.fallback(n, f"{name} along the sequence")
    rw.emit_local(n)
    ev = example(n)
    return tuple(s for _ in ev) if isinstance(ev, (tuple, list)) else s
