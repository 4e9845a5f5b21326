"""The head-parallel fallback: an op no rule shards runs on the whole sequence for ``1/P`` of a
dimension it treats independently, instead of on the gathered sequence for all of it.

Expects an op on its way to the gather fallback (:mod:`.fallback`) whose distributed operands are
sequence-sharded (plain, or in whole blocks of a chunked scan) or already inside such a region,
and which treats another static dimension, divisible by ``P``, independently: the heads of a
state-space model's recurrence across chunks (Mamba-2's segment sum over the chunk states), of a
delta rule's chunk loop, of a scan over features, or the batch.

Rewrites: each sharded operand takes the Ulysses all-to-all (scatter that dimension, gather the
sequence), as at an attention region's entry; the op and every later op that treats the same
dimension independently (the attention-region rules: elementwise, reductions and views keeping
it, products batched over it, scans, pads, flips along other dims) run inside the region with
the whole sequence (:class:`~autosp_lm.compiler.graph.Heads`). Values leave at the first op
without such a rule: by the inverse all-to-all to a dimension of the sequence's length (or its
number of blocks), else by an all_gather of the split dimension. The op is verified by those
rules before anything is committed; an op they do not know (a custom op, a Python function)
stays a gather fallback, since its independence along any dimension cannot be proven.

Choice of the dimension: the first the op accepts, in this order: not the last dim (features), not
dim 0 (the batch: long-context runs have one sequence), then nearest the sequence dim. Any
accepted dimension is exact; the order only decides how far the region reaches before its values
leave.

Afterwards: one all-to-all in per sharded operand and one out per value leaving, each moving
``(P-1)/P`` of this rank's bytes, where the fallback's all_gather moves ``(P-1)`` times them (and
a reduce-scatter of the same size backward); compute and memory inside are ``1/P`` of the
fallback's. The report lists each region with the reason its entry had no sharding rule.
"""
from __future__ import annotations

import torch.fx as fx

from ..graph import Heads, integer, is_distributed, is_heads, is_shard, op_name
from .attention_region import to_heads
from .registry import STATE_RULES


def _candidates(rw, shards):
    """``{operand: dim}`` assignments to try, best first: a dim of the first sharded operand
    (static, divisible by P) and, in the others, the dim of the same size aligned from the right
    or else the only dim of that size."""
    P = rw.info.world
    a0 = shards[0]
    s0, shape0 = rw.state(a0), rw.info.shape(a0)
    nd0 = len(shape0)
    scored = []
    for j, e in enumerate(shape0):
        z = integer(e)
        if j == s0.dim or z is None or z < P or z % P:
            continue
        scored.append(((j != nd0 - 1, j != 0, -abs(j - s0.dim)), j, z))
    for _, j, z in sorted(scored, key=lambda t: t[0], reverse=True):
        pick = {a0: j}
        for a in shards[1:]:
            shape = rw.info.shape(a)
            k = j - nd0 + len(shape)
            if not (0 <= k < len(shape) and integer(shape[k]) == z):
                same = [i for i, e in enumerate(shape) if integer(e) == z]
                k = same[0] if len(same) == 1 else None
            if k is None or k == rw.state(a).dim:
                break
            pick[a] = k
        else:
            yield pick, z


def head_parallel(rw, n: fx.Node, reason: str):
    """The state of ``n`` run in a head-parallel region (see the module docstring), or None:
    no dimension to split that ``n`` treats independently (then the caller gathers)."""
    if not rw.heads_split_only() or not rw.allowed("heads", n) or ("heads_trial", n) in rw.tags:
        return None
    ins = [a for a in n.all_input_nodes if is_distributed(rw.state(a))]
    shards = [a for a in ins if is_shard(rw.state(a))]
    if not shards or len(shards) + sum(is_heads(rw.state(a)) for a in ins) != len(ins):
        return None  # rank-local rows keep their own plan
    if any(s.padded or s.outer != 1 or s.inner != 1 for s in map(rw.state, shards)):
        return None
    for pick, size in _candidates(rw, shards):
        moved = []
        for a, d in pick.items():
            v = to_heads(rw, a, d)
            if v is None:
                break
            rw.assume(a, v, Heads(d, rw.state(a).dim, n.name))
            moved.append(a)
        else:
            rec = rw.report.region(n, split=size, per_rank=size // rw.info.world,
                                   ops=[], entry=reason)
            rw.tags[("region", n.name)] = rec
            rw.tags[("heads_trial", n)] = True  # a nested fallback gives up the trial
            try:
                out = STATE_RULES["heads"](rw, n)
            finally:
                del rw.tags[("heads_trial", n)]
            if out is not NotImplemented:
                if not rec.ops:
                    rec.ops.append(op_name(n))
                return out
            rw.report.regions[:] = [r for r in rw.report.regions if r is not rec]
            del rw.tags[("region", n.name)]
        for a in moved:
            rw.forget(a)
    return None

