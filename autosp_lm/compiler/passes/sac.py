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
    at ``ac_graph_id`` when both ends of an edge carry one), and, with offload on,
    ``node.meta["autosp_offload"] = True`` on the saved tensors to keep in host memory.

Holds afterwards
    * Outputs of attention kernels (``aten._scaled_dot_product_*attention*``, the flash /
      efficient forward ops, and every ``getitem`` of them: output, logsumexp, RNG seed/offset)
      are MUST_SAVE: attention is O(S^2) and is never recomputed.
    * Collectives (any ``autosp_lm`` collective, ``_c10d_functional``, ``c10d``) are recomputed
      only when the cost model finds re-communicating them cheaper per byte freed than the
      alternatives (the q/k/v all-to-alls at long context); with ``recommunicate=False`` they are
      MUST_SAVE and bound stages: we never communicate twice. The stats list every forward
      collective run again in the backward (``recommunicated``).
    * Outputs of random ops (``nondeterministic_seeded``: dropout, rand*, bernoulli) are
      MUST_SAVE, so a recomputed consumer sees exactly the forward's random values.
    * A set R of forward nodes (matmuls, norms, pointwise, copies, collectives) chosen by the cost
      model below is PREFER_RECOMPUTE; every other forward compute node is MUST_SAVE, so the
      partition is exactly the one the cost model predicted (the min-cut only places views and
      symbolic sizes).

Cost model
    Every node is priced in seconds on a device (:mod:`..cost_model`: matmul and attention FLOPs
    at their rates, memory-bound ops by the bytes they move, collectives by latency plus bytes on
    the wire over the link bandwidth) at hinted sizes (the real sequence length even under dynamic
    shapes). The budget is ``budget * step time`` (every node of the joint graph: forward and
    backward); with a memory target the target replaces it. Candidates are taken greedily by
    (bytes no longer saved) / (seconds added to the backward): recomputing a node also recomputes
    the not-otherwise-saved inputs it needs from its own *stage*, and saves those from earlier
    stages. A stage is the part of the graph between two anchors (attention kernels; collectives
    too under ``recommunicate=False``), so recomputation never reaches back across an attention: at
    long context the result is that per layer only the residual-stream value entering the layer,
    the attention output (in the sequence layout) and its logsumexp stay saved, while at short
    context, where attention is cheap and the linear layers dominate the step, the same budget
    buys little recomputation.
"""
from __future__ import annotations

import heapq
import logging
import operator
import time
from typing import Any, Callable, Optional

import torch.fx as fx
from torch.utils.checkpoint import CheckpointPolicy

from ..cost_model import device_params
from ..graph import example, is_alias_op, is_tensor_node, op_name
from .sac_cost import estimate_node_flops, hint, tensor_bytes
from .sac_graph import JointGraphFacts, flat_outputs

log = logging.getLogger(__name__)

__all__ = ["apply_sac", "sac_partition_fn", "SACPartitionFn", "estimate_node_flops",
           "DEFAULT_BUDGET", "DEFAULT_OFFLOAD_THRESHOLD"]

#: Default recompute budget (fraction of the step's time); ``--sac-recompute-budget``'s default.
DEFAULT_BUDGET = 0.1
#: Saved tensors smaller than this stay on the device under ``--offload-activations``.
DEFAULT_OFFLOAD_THRESHOLD = 1 << 20



# --------------------------------------------------------------------------------------------
# the greedy policy
# --------------------------------------------------------------------------------------------
class _Policy:
    def __init__(self, g: JointGraphFacts, budget_seconds: float,
                 target_bytes: Optional[float] = None):
        self.g = g
        self.budget_seconds = budget_seconds
        self.target_bytes = target_bytes
        self.used = 0.0
        self.R: set = set()
        self.r_users = {m: 0 for m in g.unit_of}
        self.saved_now = sum(g.bytes[m] for m in g.unit_of if self.saved(m))

    def saved(self, m) -> bool:
        return self.g.unit_of[m] not in self.R and (m in self.g.needed_bw or self.r_users[m] > 0)

    def recomputable(self, u) -> bool:
        g = self.g
        return u in g.may_recompute and u not in g.pinned \
            and (u not in g.crosses_stage or u in g.free_cross)

    def edge_ok(self, c, w) -> bool:
        """May recomputing ``c`` pull in the recomputation of its producer ``w``? Within a stage,
        or across stages into a value whose whole chain is input-rooted and private."""
        g = self.g
        return g.stage[w] == g.stage[c] or w in g.free_cross

    def move(self, u):
        """Recompute ``u``: returns (bytes freed, seconds added, units recomputed, members newly
        saved)."""
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
        cost = sum(g.seconds[c] for c in closure)
        # A latency-bound collective is never worth running again: the move must free at least
        # what the link moves in its latency, per collective it re-runs.
        floor = g.device.link_latency * g.device.link_bw * sum(
            1 for c in closure if g.kind[c] == "collective")
        gain = freed - added
        return (gain if gain >= floor else 0), cost, closure, stops

    def allowed(self, cost: float) -> bool:
        if self.target_bytes is not None:
            return self.saved_now > self.target_bytes
        return self.used + cost <= self.budget_seconds

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
                heapq.heappush(heap, (-gain / max(cost, 1e-12), g.order[u], u))

        for u in g.units:
            push(u)
        while heap:
            neg_score, _, u = heapq.heappop(heap)
            if u in self.R:
                continue
            gain, cost, closure, stops = self.move(u)
            if gain <= 0:
                continue
            score = gain / max(cost, 1e-12)
            if score < -neg_score * (1 - 1e-9):  # stale: re-queue at its current score
                heapq.heappush(heap, (-score, g.order[u], u))
                continue
            if not self.allowed(cost):
                if self.target_bytes is not None:
                    break
                continue
            self.used += cost
            self.saved_now -= gain
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


def _plan_offload(g: JointGraphFacts, saved: list, *, threshold: int, target: Optional[float],
                  saved_bytes: float) -> list:
    """Saved tensors to keep in host memory between their forward and backward uses: at least
    ``threshold`` bytes, largest first, while their copies to the host fit in the forward's time
    (so that they overlap its compute) and, with a memory target, until the target is met."""
    fwd_seconds = sum(g.seconds[u] for u in g.units)
    window = fwd_seconds * g.device.host_bw
    chosen, moved = [], 0.0
    for m in sorted(saved, key=lambda m: (-g.bytes[m], g.order[m])):
        if target is not None and saved_bytes <= target:
            break
        if g.bytes[m] < threshold or moved + g.bytes[m] > window:
            continue
        chosen.append(m)
        moved += g.bytes[m]
        saved_bytes -= g.bytes[m]
    return chosen


def _describe_saved(g: JointGraphFacts, m) -> dict:
    v = example(m)
    return dict(node=m.name, op=op_name(g.unit_of[m]), kind=g.kind[g.unit_of[m]],
                shape=[hint(x) for x in v.shape], dtype=str(v.dtype).replace("torch.", ""),
                bytes=g.bytes[m])


# --------------------------------------------------------------------------------------------
# public API
# --------------------------------------------------------------------------------------------
def apply_sac(joint_gm: fx.GraphModule, *, budget: float = 0.1,
              num_fwd_outputs: Optional[int] = None, num_tokens: Optional[int] = None,
              recommunicate: bool = True, device: Any = None, world: int = 1,
              memory_target: Optional[float] = None, offload: bool = False,
              offload_threshold: int = DEFAULT_OFFLOAD_THRESHOLD,
              stages: str = "attention") -> dict:
    """Tag the forward nodes of an AOTAutograd joint graph with checkpoint policies.

    ``budget`` bounds the recomputation: added backward time <= ``budget`` x (forward + backward
    time of the step), both priced on ``device`` (:mod:`~autosp_lm.compiler.cost_model`: a
    preset name, ``"name,field=value"`` or a ``DeviceParams``; default ``cpu``).
    ``recommunicate=False`` is the never-communicate-twice policy: collectives bound stages and
    are never recomputed. ``memory_target`` (bytes) replaces the budget: moves are taken,
    cheapest per byte first, until the predicted saved bytes on the device are at most the target.
    ``offload`` marks saved tensors of at least ``offload_threshold`` bytes for host memory
    (``node.meta["autosp_offload"]``; :mod:`.offload` inserts the copies). ``num_fwd_outputs``
    is what AOTAutograd passes to the partitioner (inferred from the tangents when None);
    ``num_tokens`` overrides the tokens-per-rank used for the per-token figure (default: the
    largest integer input, i.e. ``batch x local sequence``); ``world`` sizes collectives that
    carry no world argument.

    ``stages="layers"`` (the max-context mode): stages are whole layers, bounded at one
    residual-stream value before each attention (:func:`.sac_stages.layer_boundaries`), and
    attention may be recomputed; the memory target (0 when None: everything a stage can
    recompute) is met by recomputation first, and offload then moves what stays saved (the
    layer inputs) to host memory.

    Returns stats: ``nodes_recomputed``/``nodes_saved``, ``saved_bytes`` (on the device, after
    offload) and ``saved_bytes_no_recompute``, ``saved_bytes_per_token``, ``offloaded_bytes``,
    ``recompute_seconds``/``step_seconds``/``recompute_fraction`` (their ratio),
    ``recompute_flops``/``step_flops``/``attention_flops``, ``recommunicated`` (the forward
    collectives run again in the backward: node, op, bytes on the wire) and
    ``recommunicate_bytes``, ``saved`` (every saved tensor: node, op, kind, shape, dtype, bytes,
    offload), anchor counts, ``policy``, ``device``, ``memory_target``, ``target_met``,
    ``num_tokens``, ``budget`` and ``seconds`` (time spent here).
    """
    if budget < 0:
        raise ValueError(f"SAC budget must be >= 0, got {budget}")
    if memory_target is not None and memory_target < 0:
        raise ValueError(f"SAC memory target must be >= 0 bytes, got {memory_target}")
    t0 = time.perf_counter()
    g = JointGraphFacts(joint_gm, num_fwd_outputs, recommunicate=recommunicate,
                        device=device_params(device), world=world, stages=stages)
    layers = stages == "layers"
    if layers and memory_target is None:
        memory_target = 0.0
    policy = _Policy(g, budget * g.step_seconds,
                     None if (memory_target is not None and offload and not layers)
                     else memory_target)
    saved_before = policy.saved_now
    policy.run()
    saved = [m for m in g.unit_of if policy.saved(m)]
    offloaded: list = []
    if offload and layers:  # recomputed to the target already: what stays saved goes to host
        offloaded = _plan_offload(g, saved, threshold=offload_threshold, target=None,
                                  saved_bytes=policy.saved_now)
    elif offload:
        offloaded = _plan_offload(g, saved, threshold=offload_threshold, target=memory_target,
                                  saved_bytes=policy.saved_now)
        rest = policy.saved_now - sum(g.bytes[m] for m in offloaded)
        if memory_target is not None and rest > memory_target:  # recompute beyond the budget
            policy.target_bytes = memory_target + sum(g.bytes[m] for m in offloaded)
            policy.run()
            saved = [m for m in g.unit_of if policy.saved(m)]
            offloaded = [m for m in offloaded if m in saved]

    # Tags.
    for u in g.units:
        if u in policy.R:
            tag = CheckpointPolicy.PREFER_RECOMPUTE
        else:
            tag = CheckpointPolicy.MUST_SAVE
        u.meta["recompute"] = tag
        u.meta.pop("autosp_offload", None)
        if u not in g.members or g.members[u] != [u]:
            for gi in u.users:
                if gi.target is operator.getitem:
                    gi.meta["recompute"] = tag
    for m in offloaded:
        m.meta["autosp_offload"] = True

    # Views/aliases of recomputed values are recomputed with them (the partitioner would
    # otherwise ban some of them, e.g. transpose or _unsafe_view, and save the view instead).
    for n in joint_gm.graph.nodes:
        if n in g.fwd and n.op == "call_function" and n not in g.members:
            r = g.root.get(n)
            if r is not n and r in g.unit_of and g.unit_of[r] in policy.R:
                n.meta["recompute"] = CheckpointPolicy.PREFER_RECOMPUTE

    off = set(offloaded)
    offloaded_bytes = sum(g.bytes[m] for m in offloaded)
    saved_bytes = sum(g.bytes[m] for m in saved) - offloaded_bytes
    tokens = num_tokens or g.num_tokens
    anchors: dict = {}
    for u in g.units:
        if g.kind[u] in ("attention", "collective", "random"):
            anchors[g.kind[u]] = anchors.get(g.kind[u], 0) + 1
    recomm = [dict(node=u.name, op=op_name(u), bytes=g.wire_bytes.get(u, 0.0))
              for u in g.units if u in policy.R and g.kind[u] == "collective"]
    stats = dict(
        budget=budget,
        policy="recommunicate" if recommunicate else "never-recommunicate",
        device=g.device.name,
        num_tokens=tokens,
        nodes_forward=len(g.units),
        nodes_recomputed=len(policy.R),
        nodes_saved=len(saved),
        saved_bytes=saved_bytes,
        saved_bytes_no_recompute=saved_before,
        saved_bytes_per_token=(saved_bytes / tokens) if tokens else None,
        offloaded_bytes=offloaded_bytes,
        memory_target=memory_target,
        target_met=None if memory_target is None else saved_bytes <= memory_target,
        recompute_seconds=policy.used,
        step_seconds=g.step_seconds,
        recompute_fraction=(policy.used / g.step_seconds) if g.step_seconds else 0.0,
        recompute_flops=sum(g.flops[u] for u in policy.R),
        step_flops=g.step_flops,
        attention_flops=g.attention_flops,
        recommunicated=recomm,
        recommunicate_bytes=sum(r["bytes"] for r in recomm),
        saved=[dict(_describe_saved(g, m), offload=m in off) for m in saved],
        anchors=anchors,
        stages=(max(g.stage.values()) + 1) if g.stage else 0,
        stage_layout=stages,
        attention_recomputed=sum(1 for u in policy.R if g.kind[u] == "attention"),
        layer_boundaries=[b.name for b in g.boundaries],
        seconds=time.perf_counter() - t0,
    )
    log.info("SAC: %s", {k: v for k, v in stats.items() if k != "saved"})
    return stats


def partition_saved_bytes(fw_module: fx.GraphModule, num_fwd_outputs: int,
                          host: bool = False) -> tuple[int, int]:
    """Bytes and count of the tensors the partitioned forward hands to the backward on the device
    (deduplicated by storage root within the forward graph); ``host=True``: of the host copies
    made by activation offload instead."""
    import torch
    offload_op = getattr(getattr(torch.ops, "autosp_lm", None), "offload", None)
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
        is_host = offload_op is not None and r.target is offload_op.default
        if is_host == host:
            roots[r] = tensor_bytes(example(r))
    return sum(roots.values()), len(roots)


class SACPartitionFn:
    """An AOTAutograd ``partition_fn``: apply :func:`apply_sac`, then the min-cut partitioner.

    ``last_stats`` holds the stats of the latest call (plus ``partition_saved_bytes`` /
    ``partition_saved_tensors`` measured on the partitioned forward), ``history`` all of them;
    ``on_stats`` (optional) is called with each stats dict; ``options`` go to :func:`apply_sac`
    (``recommunicate``, ``device``, ``memory_target`` ...).
    """

    def __init__(self, budget: float = 0.1, on_stats: Optional[Callable[[dict], None]] = None,
                 num_tokens: Optional[int] = None, **options: Any):
        if budget < 0:
            raise ValueError(f"SAC budget must be >= 0, got {budget}")
        self.budget = budget
        self.on_stats = on_stats
        self.num_tokens = num_tokens
        self.options = options
        self.last_stats: Optional[dict] = None
        self.history: list = []

    def __call__(self, joint_module: fx.GraphModule, joint_inputs: Any, *, num_fwd_outputs: int,
                 **kwargs: Any):
        from torch._functorch.partitioners import min_cut_rematerialization_partition

        stats = apply_sac(joint_module, budget=self.budget, num_fwd_outputs=num_fwd_outputs,
                          num_tokens=self.num_tokens, **self.options)
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
                     num_tokens: Optional[int] = None, **options: Any) -> SACPartitionFn:
    """Return a partition function ``partition_fn(joint_module, joint_inputs, *, num_fwd_outputs,
    **kwargs)`` for ``aot_autograd(partition_fn=...)`` that tags with :func:`apply_sac` (given
    ``options``) and then calls ``min_cut_rematerialization_partition``. Stats:
    ``partition_fn.last_stats``."""
    return SACPartitionFn(budget, on_stats=on_stats, num_tokens=num_tokens, **options)
