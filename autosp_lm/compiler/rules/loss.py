"""Rule: the loss — token-weighted global mean over the SP group.

Expects ``F.cross_entropy`` / ``F.nll_loss`` (or the fused loss head
:func:`~autosp_lm.compiler.ops.linear_cross_entropy`, or a kernel registered as a ``loss``:
:mod:`.kernels`) whose input (logits / log-probabilities, any
reshape: ``[B*S, V]``, ``[B, V, S]`` ...) is sharded along the sequence; the target is usually a
replicated full value (``labels``, ``labels[:, 1:]``, ``labels.reshape(-1)``).

Rewrites: the target is chunked in the input's layout with ``ignore_index`` as padding, so
shifted targets line up with their logits and padded positions are ignored. Then

* ``reduction="mean"`` becomes ``local_sum / global_count``: the op runs with
  ``reduction="sum"``, the local count of non-ignored targets (weighted by ``weight[target]``
  when a class weight is given) is stacked with the local sum and one
  ``autosp_lm::all_reduce_loss`` sums both over the group; the loss is ``sum / count``.
  Ranks whose shard holds no valid target contribute 0 (no NaN); the backward of
  ``all_reduce_loss`` is the identity, so each rank back-propagates ``local_sum / N``.
* ``reduction="sum"``: local sum + ``all_reduce_loss``.
* ``reduction="none"``: per-token losses stay sharded.

Afterwards: the loss is a REDUCED value — identical on every rank, equal to the single-device
loss of the full batch; summing parameter gradients over the group gives the single-device
gradient. One tiny collective per loss (two fp32 scalars), none in the backward.
"""
from __future__ import annotations

import torch
import torch.fx as fx

from ..graph import REDUCED, AutoSPError, describe, example, is_shard, target_key, torch_ops
from ..ops import CROSS_ENTROPY_PARAMS, linear_cross_entropy
from .registry import rule

_CROSS_ENTROPY = frozenset(torch_ops("cross_entropy")) | {linear_cross_entropy}
_NLL = frozenset(torch_ops("nll_loss"))
LOSS_OPS = _CROSS_ENTROPY | _NLL
_PARAMS = {
    "cross_entropy": CROSS_ENTROPY_PARAMS,
    "nll_loss": ["input", "target", "weight", "size_average", "ignore_index", "reduce",
                 "reduction"],
}


@rule(*LOSS_OPS)
def cross_entropy(rw, n: fx.Node):
    # the fused loss head takes the hidden states as its input and its projection as keyword
    # arguments; it shards and reduces like cross_entropy
    name = "cross_entropy" if target_key(n) in _CROSS_ENTROPY else "nll_loss"
    b = dict(zip(_PARAMS[name], n.args))
    b.update(n.kwargs)
    if b.get("size_average") is not None or b.get("reduce") is not None:
        raise AutoSPError(f"AutoSP: {describe(n)} uses the deprecated size_average/reduce "
                          f"arguments; use reduction=")
    return token_mean(rw, n, b, lambda x, t, **kw: rw.call(n.target, x, t, **kw))


def token_mean(rw, n: fx.Node, b: dict, call):
    """The loss ``n`` over the SP group: ``b`` holds its arguments under cross_entropy's names
    (``input``, ``target``, ``weight`` (class weights), ``ignore_index``, ``reduction``, the
    rest as they are); ``call(input, target, **kwargs)`` emits the op on this rank's rows."""
    x, tgt = b["input"], b["target"]
    s = rw.state(x)
    weight = b.get("weight")
    if not is_shard(s) or (weight is not None and is_shard(rw.state(weight))):
        return rw.fallback(n, "loss input is not the sharded operand")
    nd = example(x).dim()
    if nd >= 2 and s.dim == 1:
        return rw.fallback(n, "the class dimension is the sequence")
    ignore = b.get("ignore_index", -100)
    reduction = b.get("reduction", "mean")
    prob_target = example(tgt).is_floating_point()
    tshard = s if prob_target else s.with_dim(s.dim - 1 if (nd >= 2 and s.dim > 1) else s.dim)
    ts = rw.state(tgt)
    if is_shard(ts):
        if ts != tshard or ts.padded:
            return rw.fallback(n, "target sharded differently from the input")
        t_local = rw.value(tgt)
    else:
        t_local = rw.localize(tgt, tshard, fill=0.0 if prob_target else ignore)
    kwargs = {k: rw.map(v) for k, v in b.items() if k not in ("input", "target", "size_average",
                                                              "reduce")}
    if reduction == "none":
        kwargs["reduction"] = "none"
        rw.bind(n, call(rw.value(x), t_local, **kwargs))
        return tshard if not prob_target else s.with_dim(s.dim - 1 if s.dim > 1 else s.dim)
    kwargs["reduction"] = "sum"
    local_sum = call(rw.value(x), t_local, **kwargs)
    rg = bool(example(n).requires_grad)
    if reduction == "sum":
        rw.bind(n, rw.collective("all_reduce_loss", local_sum, requires_grad=rg))
        rw.report.loss_rewrite(n, "sum -> local sum + all_reduce_loss")
        return REDUCED
    if reduction != "mean":
        raise AutoSPError(f"AutoSP: {describe(n)}: unknown reduction {reduction!r}")
    # the count of the global mean
    if prob_target:
        if s.padded:
            return rw.fallback(n, "probability targets over a shifted sequence")
        cls_dim = 1 if nd >= 2 else 0
        rows = rw.call(torch.select, rw.method("detach", t_local), cls_dim, 0)
        count = rw.call(torch.sum, rw.call(torch.ones_like, rows, dtype=torch.float32))
    else:
        valid = rw.call(torch.ne, t_local, ignore)
        if weight is not None:
            safe = rw.call(torch.where, valid, t_local, 0)
            w = rw.call(torch.index_select, rw.value(weight), 0, rw.method("reshape", safe, [-1]))
            w = rw.method("reshape", w, rw.method("size", safe))
            count = rw.call(torch.sum, rw.call(torch.where, valid, w, 0.0), dtype=torch.float32)
            count = rw.method("detach", count)
        else:
            count = rw.call(torch.sum, valid, dtype=torch.float32)
    pair = rw.call(torch.stack, [rw.method("float", local_sum), count])
    total = rw.collective("all_reduce_loss", pair, requires_grad=rg)
    loss = rw.call(torch.div, rw.call(torch.select, total, 0, 0),
                   rw.call(torch.select, total, 0, 1))
    rw.bind(n, rw.method("to", loss, example(n).dtype))
    rw.report.loss_rewrite(n, "mean -> local sum / global count (one all_reduce_loss of "
                              "[sum, count])"
                           + (", shifted targets padded with ignore_index" if s.padded else ""))
    return REDUCED
