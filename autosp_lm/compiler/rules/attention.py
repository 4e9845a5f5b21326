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

import math
import operator

import torch
import torch.fx as fx

from autosp_lm.parallel.heads import kv_replication, replication_or_none

from ..graph import REP, AutoSPError, describe, example, is_shard, op_name, static_int, torch_ops
from .common import a2a
from .registry import rule

SDPA_PARAMS = ["query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale",
               "enable_gqa"]
SDPA_OPS = tuple(torch_ops("scaled_dot_product_attention"))


def bind_sdpa(n: fx.Node) -> dict:
    bound = dict(zip(SDPA_PARAMS, n.args))
    bound.update(n.kwargs)
    return bound



def _ulysses_degree(rw) -> int:
    plan = rw.plan
    return rw.info.world if plan is None else plan.ulysses_degree


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


def _sequence_layout(rw, n, tensors):
    """The common layout of the sharded q/k/v (sequence at dim -2, not merged)."""
    nd = example(tensors[0]).dim()
    seq = None
    for t in tensors:
        s = rw.state(t)
        if is_shard(s):
            if s.dim != nd - 2 or s.merged:
                raise AutoSPError(f"AutoSP: {describe(n)}: attention input {t.name} is sharded "
                                  f"along dimension {s.dim}, expected the sequence at dim -2")
            if seq is not None and s != seq:
                raise AutoSPError(f"AutoSP: {describe(n)}: q/k/v are sharded differently "
                                  f"({seq} vs {s})")
            seq = s
    return seq


def exchange_qkv(rw, n, q, k, v, seq, gqa: bool, q_groups: int = 1):
    """q/k/v of this rank's sequence chunk -> this rank's heads over the whole sequence (the
    Ulysses all-to-all, with the kv-head policy of :mod:`autosp_lm.parallel.heads` and the
    all-to-all moved before an in-graph kv repeat). Returns ``(qg, kg, vg, info)`` where
    ``info`` holds the head counts and the kv plan for the report. ``q_groups > 1``: ``qg`` is
    a list, one all-to-all per group of the rank's query heads (:func:`_query_groups`)."""
    nd = example(q).dim()
    P = _ulysses_degree(rw)  # the all-to-all spans the Ulysses group
    head = nd - 3

    def local(t):
        return rw.value(t) if is_shard(rw.state(t)) else rw.localize(t, seq)

    H = static_int(example(q).shape[-3], "number of query heads")
    _replication(rw, n, H, H, P)  # the query heads alone must split
    rg_q = example(q).requires_grad
    if q_groups == 1:
        qg = a2a(rw, local(q), head, nd - 2, rg_q)
    else:
        qg = [a2a(rw, part, head, nd - 2, rg_q)
              for part in _query_groups(rw, local(q), head, P, q_groups)]

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
            x = a2a(rw, x, head, nd - 2, rg)
            if pre // r > 1:
                x = rw.call(torch.repeat_interleave, x, pre // r, dim=head)
            return x, H, f"kv all-to-all before the x{pre} repeat ({hsrc} kv heads)", hsrc, r
        r = _replication(rw, n, H, hk, P)
        x = local(t)
        if r > 1:
            x = rw.call(torch.repeat_interleave, x, r, dim=head)
        plan = f"kv heads replicated x{r} ({hk} -> {hk * r})" if r > 1 else f"{hk} kv heads split"
        return a2a(rw, x, head, nd - 2, rg), hk * r, plan, hk, r

    kg, hk_eff, plan, hkv, rep = kv(k)
    vg = kv(v)[0]
    return qg, kg, vg, dict(heads=H, heads_per_rank=H // P, kv_heads=hkv, kv_replication=rep,
                            kv_plan=plan, kv_heads_after=hk_eff, head_dim=head)


def _query_groups(rw, x, head: int, P: int, G: int) -> list:
    """This rank's ``[.., H, S/P, D]`` queries as ``G`` tensors ``[.., P*h, S/P, D]`` (``h =
    H/(P*G)``), group ``g`` holding heads ``r*H/P + g*h + j`` of every rank ``r``: after its
    all-to-all, rank ``r`` holds ``h`` consecutive heads of its own share, the ``g``-th."""
    parts = rw.call(torch.unbind, rw.method("unflatten", x, head, (P, G, -1)), head + 1)
    return [rw.method("flatten", rw.call(operator.getitem, parts, g), head, head + 1)
            for g in range(G)]


def _merge_query_groups(rw, outs: list, head: int, P: int):
    """The inverse of :func:`_query_groups` on the attention outputs (after their all-to-all
    back): ``G x [.., P*h, S/P, D] -> [.., H, S/P, D]`` in the original head order."""
    parts = [rw.method("unflatten", o, head, (P, -1)) for o in outs]
    return rw.method("flatten", rw.call(torch.stack, parts, head + 1), head, head + 2)


def head_groups(rw, n, H: int, P: int, kv_after: int) -> int:
    """How many groups of its ``H/P`` query heads each rank attends one after the other (the
    heads of one group and their all-to-all buffers are what is live at a time: UPipe's head
    chunking). The option ``attention_head_groups`` of the pass: 1 (default) one group; 0 the
    most the heads allow (one query head a group, or one kv head's share under GQA when that
    is less); ``k``: ``k`` groups, refused by name when ``k`` does not split the heads."""
    want = rw.head_groups
    per_rank = H // P
    rep = H // kv_after  # query heads a kv head serves after the all-to-all

    def fits(g):
        h = per_rank // g
        return per_rank % g == 0 and (h % rep == 0 or rep % h == 0)

    if want == 1:
        return 1
    if want == 0:
        return max(g for g in range(1, per_rank + 1) if fits(g))
    if not fits(want):
        ok = [g for g in range(1, per_rank + 1) if fits(g)]
        raise AutoSPError(f"AutoSP: {describe(n)}: attention_head_groups={want} does not split "
                          f"the {per_rank} query heads of a rank ({H} heads over {P} ranks, "
                          f"{rep} per kv head) into equal groups that each use whole kv heads "
                          f"or one kv head's share; use one of {ok} (0: the most)")
    return want


def _kv_of_group(rw, t, head: int, g: int, h: int, rep: int):
    """The kv heads (after the all-to-all) that query group ``g`` of ``h`` heads uses, when a kv
    head serves ``rep`` query heads: a narrow of the head dim (SDPA's GQA pairs the group's
    query head ``j`` with kv head ``j // (h / count)`` of it, as before the split)."""
    start, count = (g * h // rep, h // rep) if h % rep == 0 else (g * h // rep, 1)
    return rw.call(torch.narrow, t, head, start, count), count


def _mask_description(example_mask) -> str:
    shape = "x".join(str(d) for d in example_mask.shape)
    kind = "boolean" if example_mask.dtype == torch.bool else "additive"
    return f"mask ({kind} [{shape}], whole sequence: used as it is after the all-to-all)"


@rule(*SDPA_OPS)
def sdpa(rw, n: fx.Node):
    b = bind_sdpa(n)
    q, k, v = b["query"], b["key"], b["value"]
    nd = example(q).dim()
    P = _ulysses_degree(rw)
    seq = _sequence_layout(rw, n, (q, k, v))
    causal = bool(b.get("is_causal", False))
    mask = b.get("attn_mask")
    if seq.pad_left or (seq.pad_right and (not causal or mask is not None)):
        raise AutoSPError(f"AutoSP: {describe(n)}: attention over a shifted sequence "
                          f"({seq.pad_left} positions dropped in front, {seq.pad_right} at the "
                          f"end) is only supported with is_causal=True, no mask, nothing dropped "
                          f"in front")
    gqa = bool(b.get("enable_gqa", False))
    H = static_int(example(q).shape[-3], "number of query heads")
    G = 1
    if rw.head_groups != 1:
        hk = static_int(example(k).shape[-3], "number of key/value heads")
        r = replication_or_none(H, hk, P)
        if r is not None:  # (otherwise exchange_qkv refuses the heads by name)
            G = head_groups(rw, n, H, P, hk * r)
    qg, kg, vg, info = exchange_qkv(rw, n, q, k, v, seq, gqa, q_groups=G)
    H, head = info["heads"], info["head_dim"]
    plan = rw.plan
    ring = plan is not None and plan.ring_degree > 1
    u_rank = rw.info.rank % P if ring else rw.info.rank
    kwargs = {key: rw.map(val) for key, val in b.items()
              if key not in ("query", "key", "value", "attn_mask")}
    masking = "causal" if causal else "full"
    m, mask_head = None, None
    if mask is not None:
        m = rw.gather(mask) if is_shard(rw.state(mask)) else rw.value(mask)
        mshape = example(mask).shape
        if len(mshape) >= 3 and static_int(mshape[-3], "mask head dim") == H and H > 1:
            mask_head = len(mshape) - 3
            m = rw.call(torch.narrow, m, mask_head, u_rank * (H // P), H // P)
        kwargs["attn_mask"] = m
        masking = _mask_description(example(mask))
    rg = example(n).requires_grad

    def attend(qx, kx, vx, mx, kv_heads):
        if ring:
            return _ring(rw, n, b, qx, kx, vx, mx, causal)
        kw = dict(kwargs, enable_gqa=kv_heads != H // P // G)
        if mask is not None:
            kw["attn_mask"] = mx
        y = rw.graph.create_node("call_function", n.target, (qx, kx, vx), kw,
                                 name=n.name if G == 1 else f"{n.name}_g")
        y.meta.update({k2: v2 for k2, v2 in n.meta.items() if k2 == "stack_trace"})
        return y

    if G == 1:
        out = a2a(rw, attend(qg, kg, vg, m, info["kv_heads_after"] // P), nd - 2, head, rg)
    else:  # the rank's heads in G groups, one after the other (UPipe's head chunking)
        h, rep = H // P // G, H // info["kv_heads_after"]
        outs = []
        for g, qx in enumerate(qg):
            kx, count = _kv_of_group(rw, kg, head, g, h, rep)
            vx = _kv_of_group(rw, vg, head, g, h, rep)[0]
            mx = rw.call(torch.narrow, m, mask_head, g * h, h) if mask_head is not None else m
            outs.append(a2a(rw, attend(qx, kx, vx, mx, count), nd - 2, head, rg))
        out = _merge_query_groups(rw, outs, head, P)
    if ring:
        masking += f"; ring over {plan.ring_degree} ranks (zigzag)"
    rw.bind(n, out)
    rw.report.attention_rewrite(n, heads=H, heads_per_rank=info["heads_per_rank"],
                                kv_heads=info["kv_heads"], kv_replication=info["kv_replication"],
                                kv_plan=info["kv_plan"], masking=masking, head_groups=G)
    return seq


def _ring(rw, n, b, qg, kg, vg, mask, causal):
    """Ring attention over the plan's ring group on this rank's ring shard (the zigzag layout),
    the block kernels of the device, log-sum-exp merged in fp32: ``autosp_lm::ring_attention``,
    one opaque op (forward and backward) for AOTAutograd, Inductor and SAC (saved, never
    recomputed)."""
    import autosp_lm.parallel.ring  # noqa: F401 - registers autosp_lm::ring_attention
    plan = rw.plan
    if b.get("dropout_p"):
        raise AutoSPError(f"AutoSP: {describe(n)}: attention dropout cannot be made exact under a "
                          f"ring plan (ring degree {plan.ring_degree}); use --hidden-dropout 0 "
                          f"or --ulysses-degree {rw.info.world}")
    if mask is not None and b["attn_mask"] is not None and \
            example(b["attn_mask"]).dtype != torch.bool:
        raise AutoSPError(f"AutoSP: {describe(n)}: an additive (float) attn_mask under a ring plan "
                          f"is not supported (ring degree {plan.ring_degree}); pass a boolean "
                          f"mask or use --ulysses-degree {rw.info.world}")
    D = static_int(example(b["query"]).shape[-1], "head dimension")
    scale = b.get("scale")
    scale = float(scale) if scale is not None else 1.0 / math.sqrt(D)
    res = rw.call(torch.ops.autosp_lm.ring_attention.default, qg, kg, vg, None, mask,
                  bool(causal), True, scale, plan.ring_group, "auto")
    rw.report.collective("ring_attention", bool(example(n).requires_grad))
    return rw.call(operator.getitem, res, 0)


def _flex_hop():
    try:
        return torch.ops.higher_order.flex_attention
    except AttributeError:  # pragma: no cover - torch without FlexAttention
        return None


FLEX_OPS = tuple(op for op in (_flex_hop(),) if op is not None)


@rule(*FLEX_OPS)
def flex_attention(rw, n: fx.Node):
    """FlexAttention's higher-order op ``(q, k, v, score_mod, block_mask, scale, kernel_options,
    score_mod_buffers, mask_mod_buffers)``: q/k/v through the Ulysses all-to-all; the block mask
    and the mask function's buffers (document ids, built on the whole sequence) apply unchanged,
    because after the all-to-all every rank holds the whole sequence for its heads. The output
    goes back; the logsumexp (head layout) may not be used."""
    q, k, v = n.args[:3]
    nd = example(q).dim()
    seq = _sequence_layout(rw, n, (q, k, v))
    if seq.padded:
        raise AutoSPError(f"AutoSP: {describe(n)}: FlexAttention over a shifted sequence is not "
                          f"supported")
    for a in n.all_input_nodes:
        if a not in (q, k, v) and is_shard(rw.state(a)):
            raise AutoSPError(f"AutoSP: {describe(n)}: a score_mod/mask_mod buffer "
                              f"({a.name}) carries this rank's chunk of the sequence; build "
                              f"masks from whole-sequence values (e.g. document_ids)")
    for u in n.users:
        if u.args[1:2] != (0,) and u.users:
            raise AutoSPError(f"AutoSP: {describe(n)}: the logsumexp output of FlexAttention is "
                              f"used; under sequence parallelism only its attention output is "
                              f"supported")
    qg, kg, vg, info = exchange_qkv(rw, n, q, k, v, seq, gqa=True)
    rest = rw.map(tuple(n.args[3:]))
    hop = rw.graph.create_node("call_function", n.target, (qg, kg, vg) + tuple(rest),
                               rw.map(n.kwargs), name=n.name)
    out = rw.call(operator.getitem, hop, 0)
    lse = rw.call(operator.getitem, hop, 1)
    out_seq = a2a(rw, out, nd - 2, info["head_dim"], bool(example(q).requires_grad))
    rw.bind(n, (out_seq, lse) + tuple(rw.call(operator.getitem, hop, i)
                                      for i in range(2, len(example(n)))))
    rw.report.attention_rewrite(n, heads=info["heads"], heads_per_rank=info["heads_per_rank"],
                                kv_heads=info["kv_heads"], kv_replication=info["kv_replication"],
                                kv_plan=info["kv_plan"],
                                masking="FlexAttention block mask (whole sequence)")
    return tuple([seq] + [REP] * (len(example(n)) - 1))
