"""Rules: ``torch.einsum`` — per-token einsums, contractions over the sequence, and einsums that
start or continue a hand-written attention region (:mod:`.attention_region`).

Expects ``torch.einsum(eq, *operands)`` with a string equation (``...`` allowed) and node operands.

Rewrites: an einsum whose sequence letter passes through to the output (a per-token einsum) runs
locally on the shards; one that sums over the sequence of sharded operands is a local einsum plus
``all_reduce_sum``; one whose two operands carry different sequence letters (``bqhd,bkhd->bhqk``
scores) enters an attention region, split along a letter present in both operands and the
output (the heads) by the Ulysses all-to-all; inside a region, einsums split along the region's
letter (``bhqk,bkhd->bqhd``) stay in it.

Afterwards: no gather; einsums of shifted sequences, summing over the heads, or without a
divisible letter to split fall back (the report names the op).
"""
from __future__ import annotations

import string

import torch
import torch.fx as fx

from ..graph import Heads, integer, is_heads, is_shard, torch_ops
from .attention_region import (choose_split, numel_at, region_allowed, ring_refusal,
                               sequence_layout, start_region, sum_partial, to_heads)
from .common import ndim
from .heads_ops import record_op
from .registry import rule


# ============================================================================ einsum
def _parse(eq: str, nds):
    eq = eq.replace(" ", "")
    lhs, rhs = eq.split("->") if "->" in eq else (eq, None)
    terms = lhs.split(",")
    if len(terms) != len(nds):
        return None
    used = set(c for c in eq if c.isalpha())
    spare = [c for c in string.ascii_letters if c not in used]
    ell = None
    out = []
    for t, nd in zip(terms, nds):
        if "..." in t:
            k = nd - (len(t) - 3)
            if ell is None:
                ell = "".join(spare[:k])
            elif len(ell) < k:
                ell = "".join(spare[:k])
            t = t.replace("...", ell[len(ell) - k:] if k else "")
        if len(t) != nd:
            return None
        out.append(t)
    if rhs is None:
        counts = {}
        for t in out:
            for c in t:
                counts[c] = counts.get(c, 0) + 1
        rhs = (ell or "") + "".join(sorted(c for c, k in counts.items() if k == 1
                                           and c not in (ell or "")))
    else:
        rhs = rhs.replace("...", ell or "")
    return out, rhs


def _einsum_operands(n):
    eq = n.args[0]
    ops = list(n.args[1:])
    if len(ops) == 1 and isinstance(ops[0], (list, tuple)):
        ops = list(ops[0])
    return eq, ops


@rule(*torch_ops("einsum"), accepts=("blocks",))
def einsum(rw, n):
    eq, ops = _einsum_operands(n)
    if not isinstance(eq, str) or not all(isinstance(o, fx.Node) for o in ops):
        return rw.fallback(n, "einsum with unusual arguments")
    parsed = _parse(eq, [ndim(o) for o in ops])
    if parsed is None:
        return rw.fallback(n, "einsum equation")
    terms, rhs = parsed
    states = [rw.state(o) for o in ops]
    seq_letters = {terms[i][s.dim] for i, s in enumerate(states) if is_shard(s)}
    heads = [(i, s) for i, s in enumerate(states) if is_heads(s)]
    if any(is_shard(s) and (s.outer != 1 or s.inner != 1 or s.padded) for s in states) and (
            heads or len(seq_letters) > 1):
        return rw.fallback(n, "einsum of shifted sequences")
    if heads and seq_letters and _cheaper_to_leave(rw, ops, states):
        return NotImplemented
    if not heads and len(seq_letters) == 1:
        (c,) = seq_letters
        if c in rhs:
            return _einsum_local(rw, n, ops, terms, rhs, c)
        if all(is_shard(s) or not rw.is_full(o) for o, t, s in zip(ops, terms, states)
               if c in t) and len({s for s in states if is_shard(s)}) == 1 and not any(
                is_shard(s) and s.padded for s in states):
            return contract_sequence_einsum(rw, n, eq, [rw.value(o) for o in ops])
        return rw.fallback(n, "einsum over the sequence")
    # a region: split along a letter present in every distributed operand and the output
    if heads:
        i0, h0 = heads[0]
        split = terms[i0][h0.dim]
        if any(terms[i][s.dim] != split for i, s in heads):
            return NotImplemented  # operands split along different letters
        region, rec = h0.region, rw.tags.get(("region", h0.region))
        qletters = {terms[i][s.qdim] for i, s in heads if s.qdim is not None}
        qletter = qletters.pop() if len(qletters) == 1 else None
    else:
        shard_ops = [i for i, s in enumerate(states) if is_shard(s)]
        cands = []
        for pos, c in enumerate(rhs):
            if c in seq_letters:
                continue
            sizes = {integer(rw.info.shape(ops[i])[terms[i].index(c)]) for i in shard_ops
                     if c in terms[i]}
            both = all(c in terms[i] for i in shard_ops)
            size = sizes.pop() if len(sizes) == 1 else None
            cands.append((size, both, pos, c))
        pick = choose_split(rw, [(c[0], c[1], c[2]) for c in cands])
        refused = ring_refusal(rw, n, "the scores einsum") if pick is not None else None
        if refused is not None:
            return refused
        if pick is None or not region_allowed(rw, n):
            return rw.fallback(n, "einsum mixing the sequence without a dimension to split")
        split = rhs[pick[2]]
        region, rec = n.name, None
        qletter = terms[shard_ops[0]][states[shard_ops[0]].dim]
    if split not in rhs:
        return NotImplemented if heads else rw.fallback(n, "einsum summing over the heads")
    locs = []
    for o, t in zip(ops, terms):
        v = to_heads(rw, o, t.index(split) if split in t else None)
        if v is None:
            return NotImplemented if heads else rw.fallback(
                n, "einsum operand cannot join the attention region")
        locs.append(v)
    if rec is None and region == n.name:
        start_region(rw, n, pick[0])
    record_op(rw, region, n)
    rw.bind(n, rw.call(torch.einsum, eq, *locs))
    return Heads(rhs.index(split), rhs.index(qletter) if qletter and qletter in rhs else None,
                 region)


def _cheaper_to_leave(rw, ops, states) -> bool:
    """Whether the region operands of an einsum that also has sequence-sharded ones are smaller
    than those (then they leave the region, one all-to-all each, and the einsum runs on the
    shards) and can leave by an all-to-all (they have a dimension of the sequence's length).
    Compared at a long length, per rank."""
    def elems(o):
        return numel_at(rw, o)
    inside = [o for o, s in zip(ops, states) if is_heads(s)]
    if any(sequence_layout(rw, o, rw.state(o)) is None for o in inside):
        return False
    return sum(map(elems, inside)) < sum(elems(o) for o, s in zip(ops, states) if is_shard(s))


def _einsum_local(rw, n, ops, terms, rhs, c):
    out_d = rhs.index(c)
    shard = next(rw.state(o) for o in ops if is_shard(rw.state(o)))
    target = shard.with_dim(out_d)
    args = []
    for o, t in zip(ops, terms):
        s = rw.state(o)
        if is_shard(s):
            if s.with_dim(out_d) != target:
                return rw.fallback(n, "einsum operands sharded differently")
            args.append(rw.value(o))
        elif rw.is_full(o) and c in t:
            args.append(rw.localize(o, target.with_dim(t.index(c))))
        else:
            args.append(rw.value(o))
    rw.bind(n, rw.call(torch.einsum, n.args[0], *args))
    return target


def contract_sequence_einsum(rw, n, eq, args):
    return sum_partial(rw, n, rw.call(torch.einsum, eq, *args),
                       "einsum contracting the sequence: local einsum")
