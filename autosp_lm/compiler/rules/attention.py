"""Rule: Ulysses all-to-all around every ``scaled_dot_product_attention``.

Expects ``F.scaled_dot_product_attention(q, k, v, ...)`` whose ``q``/``k``/``v`` are sharded
along the sequence dimension ``-2`` (``[B, H, S/P, D]``; full operands are chunked first).

Rewrites: ``q``, ``k`` and ``v`` go through ``autosp_lm::all_to_all`` (scatter heads, gather the
sequence: ``[B, H, S/P, D] -> [B, H/P, S, D]``, rank ``r`` keeps heads ``[r*H/P, (r+1)*H/P)``),
SDPA runs on the whole sequence for the local heads (``is_causal`` stays exact since the gathered
sequence is in rank order), and the output goes back (``[B, H/P, S, D] -> [B, H, S/P, D]``).

* Grouped-query attention (``enable_gqa=True``) with ``Hkv`` key/value heads: kv heads are
  replicated ``r`` times with ``repeat_interleave`` where the head-split policy
  (:func:`autosp_lm.parallel.heads.kv_replication`, shared with the Ulysses baseline) needs it.
* kv heads repeated *in the graph* before SDPA (``repeat_interleave(k, n, dim=1)`` or HF's
  ``k[:, :, None].expand(...).reshape(...)``): the all-to-all is moved before the repeat (``n/r``
  times less traffic) and the remaining repeat runs locally after it.
* An explicit full ``attn_mask`` is used as is (query and key axes are both whole after the
  all-to-all), sliced to the local heads when it has a head axis; a sharded mask is gathered.
* Impossible head counts raise :class:`AutoSPError` naming ``H``, ``Hkv``, ``P`` and the SP sizes
  that would work.

Afterwards: the attention output has the layout of ``q``; per layer the forward has 4
all-to-alls (the backward 4 more), no other collective.
"""
from __future__ import annotations

import torch
import torch.fx as fx

from autosp_lm.parallel.heads import kv_replication, replication_or_none

from ..graph import AutoSPError, describe, example, is_shard, op_name, static_int, torch_ops
from .registry import rule

SDPA_PARAMS = ["query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale",
               "enable_gqa"]
SDPA_OPS = tuple(torch_ops("scaled_dot_product_attention"))


def bind_sdpa(n: fx.Node) -> dict:
    bound = dict(zip(SDPA_PARAMS, n.args))
    bound.update(n.kwargs)
    return bound


def _a2a(rw, x, scatter, gather_dim, requires_grad=True):
    return rw.collective("all_to_all", rw.method("contiguous", x), scatter, gather_dim,
                         requires_grad=requires_grad)


def _replication(rw, n, h, hkv, P):
    try:
        return kv_replication(h, hkv, P)
    except ValueError as e:
        raise AutoSPError(f"AutoSP: {describe(n)}: {e}; or use --ring, which has no head "
                          f"constraint") from None


def _repeated_source(rw, t, head, nd):
    """``(src, n)`` when ``t`` repeats the heads of the sharded ``src`` ``n`` times in the graph:
    ``repeat_interleave(src, n, dim=head)`` or HF's ``src[:, :, None].expand(...).reshape(...)``."""
    if not isinstance(t, fx.Node):
        return None
    name = op_name(t)
    if name == "repeat_interleave":
        src, reps = t.args[0], t.args[1] if len(t.args) > 1 else t.kwargs.get("repeats")
        dim = t.args[2] if len(t.args) > 2 else t.kwargs.get("dim")
        if (isinstance(reps, int) and dim is not None and dim % nd == head
                and is_shard(rw.state(src))):
            return src, reps
        return None
    if name in ("reshape", "view") and isinstance(t.args[0], fx.Node) \
            and op_name(t.args[0]) == "expand":
        e = t.args[0]
        u = e.args[0]
        if not isinstance(u, fx.Node) or op_name(u) not in ("getitem", "unsqueeze"):
            return None
        src = u.args[0]
        if not isinstance(src, fx.Node) or not is_shard(rw.state(src)):
            return None
        s_src, s_u, s_e, s_t = (rw.info.shape(x) for x in (src, u, e, t))
        if None in (s_src, s_u, s_e, s_t) or len(s_src) != nd or len(s_u) != nd + 1:
            return None
        k = s_e[head + 1]
        if (s_u[:head + 1] + s_u[head + 2:] == s_src and s_u[head + 1] == 1
                and s_e[:head + 1] + s_e[head + 2:] == s_src and k.is_Integer
                and s_t[head] == s_src[head] * k):
            return src, int(k)
    return None


@rule(*SDPA_OPS)
def sdpa(rw, n: fx.Node):
    b = bind_sdpa(n)
    q, k, v = b["query"], b["key"], b["value"]
    nd = example(q).dim()
    P = rw.info.world
    seq = None
    for t in (q, k, v):
        s = rw.state(t)
        if is_shard(s):
            if s.dim != nd - 2 or s.merged:
                raise AutoSPError(f"AutoSP: {describe(n)}: attention input {t.name} is sharded "
                                  f"along dimension {s.dim}, expected the sequence at dim -2")
            if seq is not None and s != seq:
                raise AutoSPError(f"AutoSP: {describe(n)}: q/k/v are sharded differently "
                                  f"({seq} vs {s})")
            seq = s
    causal = bool(b.get("is_causal", False))
    mask = b.get("attn_mask")
    if seq.pad_left or (seq.pad_right and (not causal or mask is not None)):
        raise AutoSPError(f"AutoSP: {describe(n)}: attention over a shifted sequence "
                          f"({seq.pad_left} positions dropped in front, {seq.pad_right} at the "
                          f"end) is only supported with is_causal=True, no mask, nothing dropped "
                          f"in front")

    def local(t):
        return rw.value(t) if is_shard(rw.state(t)) else rw.localize(t, seq)

    H = static_int(example(q).shape[-3], "number of query heads")
    gqa = bool(b.get("enable_gqa", False))
    head = nd - 3
    _replication(rw, n, H, H, P)  # the query heads alone must split
    qg = _a2a(rw, local(q), head, nd - 2, example(q).requires_grad)

    def kv(t):
        hk = static_int(example(t).shape[-3], "number of key/value heads")
        rg = example(t).requires_grad
        if hk != H and not gqa:
            raise AutoSPError(f"AutoSP: {describe(n)}: {H} query heads but {hk} key/value heads "
                              f"without enable_gqa=True")
        found = _repeated_source(rw, t, head, nd)
        r = replication_or_none(hk, hk // found[1], P) if found is not None else None
        if r is not None:  # move the all-to-all before the in-graph repeat
            src, pre = found
            hsrc = hk // pre
            x = rw.value(src) if is_shard(rw.state(src)) else rw.localize(src, seq)
            if r > 1:
                x = rw.call(torch.repeat_interleave, x, r, dim=head)
            x = _a2a(rw, x, head, nd - 2, rg)
            if pre // r > 1:
                x = rw.call(torch.repeat_interleave, x, pre // r, dim=head)
            return x, H, f"kv all-to-all before the x{pre} repeat ({hsrc} kv heads)", hsrc, r
        r = _replication(rw, n, H, hk, P)
        x = local(t)
        if r > 1:
            x = rw.call(torch.repeat_interleave, x, r, dim=head)
        plan = f"kv heads replicated x{r} ({hk} -> {hk * r})" if r > 1 else f"{hk} kv heads split"
        return _a2a(rw, x, head, nd - 2, rg), hk * r, plan, hk, r

    kg, hk_eff, plan, hkv, rep = kv(k)
    vg = kv(v)[0]
    kwargs = {key: rw.map(val) for key, val in b.items()
              if key not in ("query", "key", "value", "attn_mask")}
    if mask is not None:
        m = rw.gather(mask) if is_shard(rw.state(mask)) else rw.value(mask)
        mshape = example(mask).shape
        if len(mshape) >= 3 and static_int(mshape[-3], "mask head dim") == H and H > 1:
            m = rw.call(torch.narrow, m, len(mshape) - 3, rw.info.rank * (H // P), H // P)
        kwargs["attn_mask"] = m
    kwargs["enable_gqa"] = hk_eff != H
    y = rw.graph.create_node("call_function", n.target, (qg, kg, vg), kwargs, name=n.name)
    y.meta.update({k2: v2 for k2, v2 in n.meta.items() if k2 == "stack_trace"})
    rw.bind(n, _a2a(rw, y, nd - 2, head, example(n).requires_grad))
    rw.report.attention_rewrite(n, heads=H, heads_per_rank=H // P, kv_heads=hkv,
                                kv_replication=rep, kv_plan=plan,
                                masking="causal" if causal else "mask" if mask is not None
                                else "full")
    return seq
