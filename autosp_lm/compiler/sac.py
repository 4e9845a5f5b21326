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

import torch
import torch.fx as fx
from torch.utils.checkpoint import CheckpointPolicy

log = logging.getLogger(__name__)

__all__ = ["apply_sac", "sac_partition_fn", "SACPartitionFn", "estimate_node_flops",
           "DEFAULT_BUDGET"]

#: Default recompute budget (fraction of the step's FLOPs); ``--sac-recompute-budget``'s default.
DEFAULT_BUDGET = 0.1

COLLECTIVE_NAMESPACES = frozenset({"autosp_lm", "_c10d_functional", "c10d", "c10d_functional",
                                   "_dtensor"})
_ATTENTION_NAMES = ("_scaled_dot_product", "_flash_attention_forward",
                    "_efficient_attention_forward", "_cudnn_attention_forward")
_ATTENTION_BWD_NAMES = ("_scaled_dot_product", "_flash_attention_backward",
                        "_efficient_attention_backward", "_cudnn_attention_backward")
_DEFAULT_SEQ_HINT = 8192


# --------------------------------------------------------------------------------------------
# small helpers: hints, sizes, op classification
# --------------------------------------------------------------------------------------------
def _hint(v: Any, fallback: int = _DEFAULT_SEQ_HINT) -> int:
    """A concrete integer for a (possibly symbolic) size, from the shape environment's hint."""
    if isinstance(v, int):
        return v
    if isinstance(v, torch.SymInt):
        node = v.node
        for attr in ("hint", "_hint"):
            h = getattr(node, attr, None)
            if isinstance(h, int):
                return h
        try:
            from torch.fx.experimental import symbolic_shapes as ss
            fn = getattr(ss, "optimization_hint", None) or getattr(ss, "size_hint", None)
            if fn is not None:
                return int(fn(v, fallback=fallback))
        except Exception:  # pragma: no cover - version differences
            pass
        return fallback
    try:
        return int(v)
    except Exception:
        return fallback


def _numel(t: Any) -> int:
    n = 1
    for s in t.shape:
        n *= _hint(s)
    return n


def _tensor_bytes(t: Any) -> int:
    if not isinstance(t, torch.Tensor):
        return 0
    return _numel(t) * t.element_size()


def _val(node: Any) -> Any:
    return node.meta.get("val", None) if isinstance(node, fx.Node) else None


def _is_tensor_node(node: fx.Node) -> bool:
    return isinstance(_val(node), torch.Tensor)


def _is_tuple_of_tensors(node: fx.Node) -> bool:
    v = _val(node)
    return isinstance(v, (tuple, list)) and len(v) > 0 and any(isinstance(x, torch.Tensor) for x in v)


def _op_name(target: Any) -> str:
    if isinstance(target, torch._ops.OpOverload):
        return target._schema.name.split("::", 1)[-1]
    return getattr(target, "__name__", str(target))


def _namespace(target: Any) -> str:
    return getattr(target, "namespace", "") if isinstance(target, torch._ops.OpOverload) else ""


def _is_alias_op(node: fx.Node) -> bool:
    """True when the op returns a view of (or the same storage as) its first tensor input."""
    t = node.target
    if node.op != "call_function" or not isinstance(t, torch._ops.OpOverload):
        return False
    if t in (torch.ops.aten._unsafe_view.default, torch.ops.aten.detach.default,
             torch.ops.aten.alias.default):
        return True
    schema = t._schema
    if schema.is_mutable:
        return False
    rets = schema.returns
    return len(rets) > 0 and all(r.alias_info is not None and not r.alias_info.is_write for r in rets)


def is_attention_op(target: Any) -> bool:
    name = _op_name(target)
    if "backward" in name:
        return False
    return isinstance(target, torch._ops.OpOverload) and any(k in name for k in _ATTENTION_NAMES) \
        and "attention" in name


def is_attention_backward_op(target: Any) -> bool:
    name = _op_name(target)
    return isinstance(target, torch._ops.OpOverload) and "backward" in name and "attention" in name \
        and any(k in name for k in _ATTENTION_BWD_NAMES)


def is_collective_op(target: Any) -> bool:
    return _namespace(target) in COLLECTIVE_NAMESPACES


def is_random_op(target: Any) -> bool:
    if not isinstance(target, torch._ops.OpOverload):
        return False
    if torch.Tag.nondeterministic_seeded in target.tags:
        return True
    name = _op_name(target)
    return _namespace(target) == "prims" and ("random" in name or "seed" in name)


def _schema_arg(node: fx.Node, name: str, default: Any = None) -> Any:
    if name in node.kwargs:
        return node.kwargs[name]
    t = node.target
    if isinstance(t, torch._ops.OpOverload):
        for i, a in enumerate(t._schema.arguments):
            if a.name == name:
                return node.args[i] if i < len(node.args) else default
    return default


def _attention_flops(node: fx.Node, factor: float) -> float:
    q, k, v = (_val(_schema_arg(node, n)) for n in ("query", "key", "value"))
    if not all(isinstance(x, torch.Tensor) for x in (q, k, v)) or q.dim() < 2:
        return 0.0
    batch_heads = _numel(q) // (_hint(q.shape[-2]) * _hint(q.shape[-1]))
    sq, dqk = _hint(q.shape[-2]), _hint(q.shape[-1])
    sk, dv = _hint(k.shape[-2]), _hint(v.shape[-1])
    flops = 2.0 * batch_heads * sq * sk * (dqk + dv)
    if bool(_schema_arg(node, "is_causal", False)):
        flops *= 0.5
    return flops * factor


def estimate_node_flops(node: fx.Node) -> float:
    """Estimated FLOPs of one joint-graph node at its hinted sizes (0 for views and getitems)."""
    if node.op != "call_function" or node.target is operator.getitem or _is_alias_op(node):
        return 0.0
    t = node.target
    aten = torch.ops.aten
    packet = getattr(t, "overloadpacket", None)
    args = [_val(a) for a in node.args]
    if packet in (aten.mm, aten.addmm):
        a, b = args[-2], args[-1]
        if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
            m, kk = _hint(a.shape[0]), _hint(a.shape[1])
            n = _hint(b.shape[1])
            return 2.0 * m * n * kk + (m * n if packet is aten.addmm else 0)
    if packet in (aten.bmm, aten.baddbmm):
        a, b = args[-2], args[-1]
        if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
            bb, m, kk = (_hint(s) for s in a.shape)
            n = _hint(b.shape[2])
            return 2.0 * bb * m * n * kk
    if is_attention_op(t):
        return _attention_flops(node, 1.0)
    if is_attention_backward_op(t):
        return _attention_flops(node, 2.5)
    # Everything else: one operation per element of the largest tensor touched.
    sizes = [_numel(x) for x in [_val(node), *args] if isinstance(x, torch.Tensor)]
    out = _val(node)
    if isinstance(out, (tuple, list)):
        sizes += [_numel(x) for x in out if isinstance(x, torch.Tensor)]
    for a in node.args:
        if isinstance(a, (tuple, list)):
            sizes += [_numel(_val(x)) for x in a if isinstance(_val(x), torch.Tensor)]
    return float(max(sizes, default=0))


# --------------------------------------------------------------------------------------------
# graph analysis
# --------------------------------------------------------------------------------------------
def _flat_outputs(graph: fx.Graph) -> list:
    out = next(n for n in reversed(graph.nodes) if n.op == "output")
    return list(torch.utils._pytree.tree_leaves(out.args))


def _infer_num_fwd_outputs(graph: fx.Graph) -> int:
    """Forward outputs come first; gradients depend on tangents. Count the leading outputs that
    do not (a gradient that does not depend on any tangent is rare and only widens the forward
    set)."""
    tangent_closure: set = set()
    for n in graph.nodes:
        if (n.op == "placeholder" and "tangents" in str(n.target)) or \
                any(a in tangent_closure for a in n.all_input_nodes):
            tangent_closure.add(n)
    outs = _flat_outputs(graph)
    for i, o in enumerate(outs):
        if isinstance(o, fx.Node) and o in tangent_closure:
            return i
    return len(outs)


class _Graph:
    """The facts the cost model needs about one joint graph."""

    def __init__(self, gm: fx.GraphModule, num_fwd_outputs: Optional[int]):
        graph = gm.graph
        if num_fwd_outputs is None:
            num_fwd_outputs = _infer_num_fwd_outputs(graph)
        self.num_fwd_outputs = num_fwd_outputs
        outs = _flat_outputs(graph)
        # Forward nodes: ancestors of the forward outputs.
        fwd: set = set()
        stack = [o for o in outs[:num_fwd_outputs] if isinstance(o, fx.Node)]
        while stack:
            n = stack.pop()
            if n in fwd:
                continue
            fwd.add(n)
            stack.extend(n.all_input_nodes)
        self.fwd = fwd
        self.order = {n: i for i, n in enumerate(graph.nodes)}

        # Storage roots: views/aliases map to the tensor that owns the storage.
        self.root: dict = {}
        for n in graph.nodes:
            self.root[n] = self._find_root(n)

        # Units: forward compute ops (non-alias, non-getitem) and their tensor members.
        self.units: list = []
        self.members: dict = {}
        self.unit_of: dict = {}
        for n in graph.nodes:
            if n not in fwd or n.op != "call_function" or n.target is operator.getitem \
                    or _is_alias_op(n):
                continue
            if _is_tensor_node(n):
                mem = [n]
            elif _is_tuple_of_tensors(n):
                mem = [u for u in n.users if u.target is operator.getitem and _is_tensor_node(u)]
            else:
                continue
            self.units.append(n)
            self.members[n] = mem
            for m in mem:
                self.unit_of[m] = n
        self.bytes = {m: _tensor_bytes(_val(m)) for m in self.unit_of}

        # Classification of units.
        self.kind: dict = {}
        for u in self.units:
            t = u.target
            if is_attention_op(t):
                self.kind[u] = "attention"
            elif is_collective_op(t):
                self.kind[u] = "collective"
            elif is_random_op(t):
                self.kind[u] = "random"
            elif not isinstance(t, torch._ops.OpOverload) or t._schema.is_mutable \
                    or _namespace(t) not in ("aten", "prims"):
                self.kind[u] = "fixed"
            else:
                self.kind[u] = "compute"

        # Inputs (as members) of each unit, and which units read each member.
        self.inputs: dict = {}
        self.readers: dict = {m: [] for m in self.unit_of}
        for u in self.units:
            ins = []
            for a in u.all_input_nodes:
                r = self.root.get(a)
                if r in self.unit_of and r not in ins:
                    ins.append(r)
            self.inputs[u] = ins
            for m in ins:
                self.readers[m].append(u)

        # Members the backward reads directly (through aliases): saved unless recomputed.
        self.needed_bw: set = set()
        for n in graph.nodes:
            if n in fwd or n.op in ("placeholder", "output"):
                continue
            if n.target is operator.getitem and n in self.unit_of:
                if n.users:
                    self.needed_bw.add(n)
                continue
            for a in n.all_input_nodes:
                r = self.root.get(a)
                if r in self.unit_of:
                    self.needed_bw.add(r)

        # Stages: number of attention/collective anchors on the longest path from the inputs.
        self.stage: dict = {}
        for u in self.units:
            s = 0
            for m in self.inputs[u]:
                w = self.unit_of[m]
                s = max(s, self.stage[w] + (1 if self.kind[w] in ("attention", "collective") else 0))
            self.stage[u] = s

        # Values read in a later stage (the residual stream entering a layer, rotary tables) are
        # never recomputed: that would chain recomputation across attentions.
        self.crosses_stage = {u for u in self.units
                              if any(self.stage[r] != self.stage[u]
                                     for m in self.members[u] for r in self.readers[m])}

        # Values read in a later stage that may still be recomputed: those whose whole recompute
        # chain is rooted in the graph's inputs and parameters (stage 0: no attention/collective
        # behind them, e.g. the embedding output entering layer 0, the rotary tables) and whose
        # chain is private: no node of it is read by the backward or by anything outside stage 0.
        # Held from its first use in the backward on, such a value never costs more than saving
        # it. A residual value x_l (l > 0) is excluded: its chain runs through layer l-1's o_proj
        # and MLP, whose outputs layer l-1's backward needs; the partitioner recomputes a node
        # once, so those would be rebuilt at the start of layer l's backward and held through it
        # (measured on gpt-tiny at 8K: saved bytes 3152 -> 2640 B/token, but the backward's peak
        # of live tensors 11952 -> 14224 B/token).
        # A node of such a chain that the backward reads itself (e.g. the position indices the
        # embedding backward needs) is pinned: saved, a root of the chain, never held early.
        self.free_cross: set = set()
        self.pinned: set = set()
        for u in self.crosses_stage:
            if self.kind[u] != "compute" or self.stage[u] != 0:
                continue
            ok, seen, stack, pins = True, {u}, [u], set()
            while stack and ok:
                c = stack.pop()
                for m in self.inputs[c]:
                    w = self.unit_of[m]
                    if w in seen or self.kind[w] != "compute":
                        continue
                    seen.add(w)
                    if any(self.stage[r] != 0 for x in self.members[w] for r in self.readers[x]):
                        ok = False
                        break
                    if any(x in self.needed_bw for x in self.members[w]):
                        pins.add(w)
                    else:
                        stack.append(w)
            if ok:
                self.free_cross.add(u)
                self.pinned |= pins

        # FLOPs.
        self.flops = {}
        self.step_flops = 0.0
        self.attention_flops = 0.0
        for n in graph.nodes:
            f = estimate_node_flops(n) if n.op == "call_function" else 0.0
            if n in self.members:
                self.flops[n] = f
            self.step_flops += f
            if is_attention_op(n.target) or is_attention_backward_op(n.target):
                self.attention_flops += f

        # Tokens on this rank: the largest integer (token id / label) input.
        toks = 0
        for n in graph.nodes:
            v = _val(n)
            if n.op == "placeholder" and isinstance(v, torch.Tensor) and v.dim() in (1, 2) \
                    and not v.is_floating_point() and not v.is_complex() and v.dtype != torch.bool:
                toks = max(toks, _numel(v))
        self.num_tokens = toks or None

    def _find_root(self, n: fx.Node) -> fx.Node:
        seen = 0
        while seen < 1000:
            seen += 1
            if n.op != "call_function":
                return n
            if n.target is operator.getitem:
                parent = n.args[0]
                if isinstance(parent, fx.Node) and _is_alias_op(parent) and parent.args \
                        and isinstance(parent.args[0], fx.Node):
                    n = parent.args[0]
                    continue
                return n
            if _is_alias_op(n) and n.args and isinstance(n.args[0], fx.Node):
                n = n.args[0]
                continue
            return n
        return n


# --------------------------------------------------------------------------------------------
# the greedy policy
# --------------------------------------------------------------------------------------------
class _Policy:
    def __init__(self, g: _Graph, budget_flops: float):
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
    g = _Graph(joint_gm, num_fwd_outputs)
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


def _partition_saved_bytes(fw_module: fx.GraphModule, num_fwd_outputs: int) -> tuple[int, int]:
    """Bytes and count of the tensors the partitioned forward hands to the backward (deduplicated
    by storage root within the forward graph)."""
    outs = _flat_outputs(fw_module.graph)[num_fwd_outputs:]
    roots: dict = {}
    for o in outs:
        if not isinstance(o, fx.Node) or not _is_tensor_node(o):
            continue
        r = o
        while r.op == "call_function" and _is_alias_op(r) and r.args and isinstance(r.args[0], fx.Node):
            r = r.args[0]
        if r.op == "placeholder":  # parameters / inputs are not activations
            continue
        roots[r] = _tensor_bytes(_val(r))
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
        pbytes, pcount = _partition_saved_bytes(fw, num_fwd_outputs)
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
