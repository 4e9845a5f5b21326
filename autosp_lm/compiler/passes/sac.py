"""Sequence-aware activation checkpointing (SAC) on the AOTAutograd joint graph.

Expects
    The joint forward/backward ``fx.GraphModule`` that AOTAutograd hands to a partition function:
    placeholders ``primals_*`` (parameters, buffers, inputs) and ``tangents_*``, ATen-level
    ``call_function`` nodes with ``node.meta["val"]`` fake values (sizes may be symbolic), and one
    output node whose flattened arguments are the ``num_fwd_outputs`` forward outputs followed by
    the gradients. Works on plain single-device graphs and on graphs carrying collectives (the
    ``autosp_lm::*`` custom ops, ``_c10d_functional`` ops).

Rewrites
    Nothing structural: it only sets ``node.meta["recompute"]`` to a
    ``torch.utils.checkpoint.CheckpointPolicy`` on forward nodes, which
    ``min_cut_rematerialization_partition`` honours (``must_recompute`` for PREFER/MUST_RECOMPUTE,
    a ban on recomputation for MUST_SAVE; no ``ac_graph_id`` is needed in torch 2.11-2.13 because
    the partitioner calls ``cleanup_recompute_tags(is_default_partition=False)``, which only looks
    at ``ac_graph_id`` when both ends of an edge carry one).

Holds afterwards
    * Outputs of attention kernels (``aten._scaled_dot_product_*attention*``, the flash /
      efficient forward ops, and every ``getitem`` of them: output, logsumexp, RNG seed/offset)
      are MUST_SAVE: attention is O(S^2) and is never recomputed.
    * Outputs of collectives (any op in the ``autosp_lm`` namespace, ``_c10d_functional``,
      ``c10d``) are MUST_SAVE: we never communicate twice.
    * Outputs of random ops (``nondeterministic_seeded``: dropout, rand*, bernoulli) are
      MUST_SAVE, so a recomputed consumer sees exactly the forward's random values.
    * A set R of forward nodes (matmuls, norms, pointwise, copies) chosen by the cost model below is
      PREFER_RECOMPUTE; every other forward compute node is MUST_SAVE, so the partition is exactly
      the one the cost model predicted (the min-cut only places views and symbolic sizes).

Cost model
    FLOPs are estimated per node from hinted sizes (the real sequence length even under dynamic
    shapes): ``2MNK`` for matmuls, ``2*B*H*Sq*Sk*(Dqk+Dv)`` for attention (half when causal;
    backward 2.5x), one per element for everything else. The budget is
    ``budget * step FLOPs`` (every node of the joint graph: forward and backward). Candidates are
    taken greedily by (bytes no longer saved) / (FLOPs added to backward): recomputing a node
    also recomputes the not-otherwise-saved inputs it needs from its own *stage*, and saves those
    from earlier stages. A stage is the part of the graph between two attention/collective
    anchors, so recomputation never reaches back across an attention: at long context the result
    is that per layer only the residual-stream value entering the layer, the attention output and
    its logsumexp (and collective outputs) stay saved, while at short context, where attention is
    cheap and the linear layers dominate the step, the same budget buys little recomputation.
"""
from __future__ import annotations

import heapq
import logging
import operator
import time
from typing import Any, Callable, Optional

import torch.fx as fx
from torch.utils.checkpoint import CheckpointPolicy

from ..graph import example, is_alias_op, is_tensor_node
from .sac_graph import JointGraphFacts, estimate_node_flops, flat_outputs, tensor_bytes

log = logging.getLogger(__name__)

__all__ = ["apply_sac", "sac_partition_fn", "SACPartitionFn", "estimate_node_flops",
           "DEFAULT_BUDGET"]

#: Default recompute budget (fraction of the step's FLOPs); ``--sac-recompute-budget``'s default.
DEFAULT_BUDGET = 0.1



# --------------------------------------------------------------------------------------------
# the greedy policy
# --------------------------------------------------------------------------------------------
class _Policy:
    def __init__(self, g: JointGraphFacts, budget_flops: float):
        self.g = g
        self.budget_flops = budget_flops
        self.used = 0.0
        self.R: set = set()
        self.r_users = {m: 0 for m in g.unit_of}

    def saved(self, m) -> bool:
        return self.g.unit_of[m] not in self.R and (m in self.g.needed_bw or self.r_users[m] > 0)

    def recomputable(self, u) -> bool:
        g = self.g
        return g.kind[u] == "compute" and u not in g.pinned \
            and (u not in g.crosses_stage or u in g.free_cross)

    def edge_ok(self, c, w) -> bool:
        """May recomputing ``c`` pull in the recomputation of its producer ``w``? Within a stage,
        or across stages into a value whose whole chain is input-rooted and private."""
        g = self.g
        return g.stage[w] == g.stage[c] or w in g.free_cross

    def move(self, u):
        """Recompute ``u``: returns (bytes freed, FLOPs added, units recomputed, members newly saved)."""
        g = self.g
        closure = [u]
        in_c = {u}
        stops: list = []
        i = 0
        while i < len(closure):
            c = closure[i]
            i += 1
            for m in g.inputs[c]:
                w = g.unit_of[m]
                if w in self.R or w in in_c or self.saved(m):
                    continue
                if self.recomputable(w) and self.edge_ok(c, w):
                    closure.append(w)
                    in_c.add(w)
                elif m not in stops:
                    stops.append(m)
        stops = [m for m in stops if g.unit_of[m] not in in_c]
        freed = sum(g.bytes[m] for c in closure for m in g.members[c] if self.saved(m))
        added = sum(g.bytes[m] for m in stops)
        cost = sum(g.flops[c] for c in closure)
        return freed - added, cost, closure, stops

    def run(self) -> None:
        g = self.g
        by_stage: dict = {}
        for u in g.units:
            if self.recomputable(u):
                by_stage.setdefault(g.stage[u], []).append(u)
        heap: list = []

        def push(u):
            if u in self.R or not self.recomputable(u):
                return
            gain, cost, _, _ = self.move(u)
            if gain > 0:
                heapq.heappush(heap, (-gain / max(cost, 1.0), g.order[u], u))

        for u in g.units:
            push(u)
        while heap:
            neg_score, _, u = heapq.heappop(heap)
            if u in self.R:
                continue
            gain, cost, closure, stops = self.move(u)
            if gain <= 0:
                continue
            score = gain / max(cost, 1.0)
            if score < -neg_score * (1 - 1e-9):  # stale: re-queue at its current score
                heapq.heappush(heap, (-score, g.order[u], u))
                continue
            if self.used + cost > self.budget_flops:
                continue
            self.used += cost
            touched_stages = set()
            for c in closure:
                self.R.add(c)
                touched_stages.add(g.stage[c])
                for m in g.inputs[c]:
                    self.r_users[m] += 1
            for m in stops:
                touched_stages.add(g.stage[g.unit_of[m]])
            for c in closure:  # later stages whose chains run through what just changed
                for m in g.members[c]:
                    for r in g.readers[m]:
                        touched_stages.add(g.stage[r])
            for s in touched_stages:
                for v in by_stage.get(s, ()):
                    push(v)


# --------------------------------------------------------------------------------------------
# public API
# --------------------------------------------------------------------------------------------
def apply_sac(joint_gm: fx.GraphModule, *, budget: float = 0.1,
              num_fwd_outputs: Optional[int] = None, num_tokens: Optional[int] = None) -> dict:
    """Tag the forward nodes of an AOTAutograd joint graph with checkpoint policies.

    ``budget`` bounds the recomputation: added backward FLOPs <= ``budget`` x (forward + backward
    FLOPs of the step). ``num_fwd_outputs`` is what AOTAutograd passes to the partitioner (inferred
    from the tangents when None). ``num_tokens`` overrides the tokens-per-rank used for the
    per-token figure (default: the largest integer input, i.e. ``batch x local sequence``).

    Returns stats: ``nodes_recomputed``/``nodes_saved`` (forward compute nodes tagged
    recompute / tensors the backward keeps), ``saved_bytes`` and ``saved_bytes_no_recompute``
    (estimated bytes saved for backward with this policy / with nothing recomputed),
    ``saved_bytes_per_token`` (per token on this rank), ``recompute_flops``, ``step_flops``,
    ``attention_flops``, ``recompute_fraction`` (recompute FLOPs / step FLOPs), anchor counts,
    ``num_tokens``, ``budget`` and ``seconds``.
    """
    if budget < 0:
        raise ValueError(f"SAC budget must be >= 0, got {budget}")
    t0 = time.perf_counter()
    g = JointGraphFacts(joint_gm, num_fwd_outputs)
    policy = _Policy(g, budget * g.step_flops)
    saved_before = sum(g.bytes[m] for m in g.unit_of if policy.saved(m))
    policy.run()

    # Tags.
    for u in g.units:
        if u in policy.R:
            tag = CheckpointPolicy.PREFER_RECOMPUTE
        else:
            tag = CheckpointPolicy.MUST_SAVE
        u.meta["recompute"] = tag
        if u not in g.members or g.members[u] != [u]:
            for gi in u.users:
                if gi.target is operator.getitem:
                    gi.meta["recompute"] = tag

    # Views/aliases of recomputed values are recomputed with them (the partitioner would
    # otherwise ban some of them, e.g. transpose or _unsafe_view, and save the view instead).
    for n in joint_gm.graph.nodes:
        if n in g.fwd and n.op == "call_function" and n not in g.members:
            r = g.root.get(n)
            if r is not n and r in g.unit_of and g.unit_of[r] in policy.R:
                n.meta["recompute"] = CheckpointPolicy.PREFER_RECOMPUTE

    saved = [m for m in g.unit_of if policy.saved(m)]
    saved_bytes = sum(g.bytes[m] for m in saved)
    tokens = num_tokens or g.num_tokens
    anchors: dict = {}
    for u in g.units:
        if g.kind[u] in ("attention", "collective", "random"):
            anchors[g.kind[u]] = anchors.get(g.kind[u], 0) + 1
    stats = dict(
        budget=budget,
        num_tokens=tokens,
        nodes_forward=len(g.units),
        nodes_recomputed=len(policy.R),
        nodes_saved=len(saved),
        saved_bytes=saved_bytes,
        saved_bytes_no_recompute=saved_before,
        saved_bytes_per_token=(saved_bytes / tokens) if tokens else None,
        recompute_flops=policy.used,
        step_flops=g.step_flops,
        attention_flops=g.attention_flops,
        recompute_fraction=(policy.used / g.step_flops) if g.step_flops else 0.0,
        anchors=anchors,
        stages=(max(g.stage.values()) + 1) if g.stage else 0,
        seconds=time.perf_counter() - t0,
    )
    log.info("SAC: %s", stats)
    return stats


def partition_saved_bytes(fw_module: fx.GraphModule, num_fwd_outputs: int) -> tuple[int, int]:
    """Bytes and count of the tensors the partitioned forward hands to the backward (deduplicated
    by storage root within the forward graph)."""
    outs = flat_outputs(fw_module.graph)[num_fwd_outputs:]
    roots: dict = {}
    for o in outs:
        if not isinstance(o, fx.Node) or not is_tensor_node(o):
            continue
        r = o
        while r.op == "call_function" and is_alias_op(r) and r.args and isinstance(r.args[0], fx.Node):
            r = r.args[0]
        if r.op == "placeholder":  # parameters / inputs are not activations
            continue
        roots[r] = tensor_bytes(example(r))
    return sum(roots.values()), len(roots)


class SACPartitionFn:
    """An AOTAutograd ``partition_fn``: apply :func:`apply_sac`, then the min-cut partitioner.

    ``last_stats`` holds the stats of the latest call (plus ``partition_saved_bytes`` /
    ``partition_saved_tensors`` measured on the partitioned forward), ``history`` all of them;
    ``on_stats`` (optional) is called with each stats dict.
    """

    def __init__(self, budget: float = 0.1, on_stats: Optional[Callable[[dict], None]] = None,
                 num_tokens: Optional[int] = None):
        if budget < 0:
            raise ValueError(f"SAC budget must be >= 0, got {budget}")
        self.budget = budget
        self.on_stats = on_stats
        self.num_tokens = num_tokens
        self.last_stats: Optional[dict] = None
        self.history: list = []

    def __call__(self, joint_module: fx.GraphModule, joint_inputs: Any, *, num_fwd_outputs: int,
                 **kwargs: Any):
        from torch._functorch.partitioners import min_cut_rematerialization_partition

        stats = apply_sac(joint_module, budget=self.budget, num_fwd_outputs=num_fwd_outputs,
                          num_tokens=self.num_tokens)
        fw, bw = min_cut_rematerialization_partition(joint_module, joint_inputs,
                                                     num_fwd_outputs=num_fwd_outputs, **kwargs)
        pbytes, pcount = partition_saved_bytes(fw, num_fwd_outputs)
        stats["partition_saved_bytes"] = pbytes
        stats["partition_saved_tensors"] = pcount
        self.last_stats = stats
        self.history.append(stats)
        if self.on_stats is not None:
            self.on_stats(stats)
        return fw, bw


def sac_partition_fn(budget: float = 0.1, *, on_stats: Optional[Callable[[dict], None]] = None,
                     num_tokens: Optional[int] = None) -> SACPartitionFn:
    """Return a partition function ``partition_fn(joint_module, joint_inputs, *, num_fwd_outputs,
    **kwargs)`` for ``aot_autograd(partition_fn=...)`` that tags with :func:`apply_sac` and then
    calls ``min_cut_rematerialization_partition``. Stats: ``partition_fn.last_stats``."""
    return SACPartitionFn(budget, on_stats=on_stats, num_tokens=num_tokens)
