"""The facts the SAC policy needs about a joint graph: FLOPs, bytes, stages, who reads what.

:func:`estimate_node_flops` prices one ATen node at its hinted sizes; :class:`JointGraphFacts`
collects, for one AOTAutograd joint graph, the forward units (compute nodes with their tensor
members), their byte sizes, inputs and readers, what the backward reads, the *stages* (the parts
between attention/collective anchors) and the values whose recomputation may cross a stage
boundary. See :mod:`.sac` for how the policy uses them.
"""
from __future__ import annotations

import operator
from typing import Any, Optional

import torch
import torch.fx as fx

from ..graph import (COLLECTIVE_NAMESPACES, example, is_alias_op, is_attention_backward_op,
                     is_attention_op, is_random_op, is_tensor_node, namespace, param_gathers,
                     schema_arg)

_DEFAULT_SEQ_HINT = 8192


def hint(v: Any, fallback: int = _DEFAULT_SEQ_HINT) -> int:
    """A concrete integer for a (possibly symbolic) size, from the shape environment's hint."""
    if isinstance(v, int):
        return v
    if isinstance(v, torch.SymInt):
        node = v.node
        for attr in ("hint", "hint"):
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


def numel(t: Any) -> int:
    n = 1
    for s in t.shape:
        n *= hint(s)
    return n


def tensor_bytes(t: Any) -> int:
    if not isinstance(t, torch.Tensor):
        return 0
    return numel(t) * t.element_size()


def _is_tuple_of_tensors(node: fx.Node) -> bool:
    v = example(node)
    return isinstance(v, (tuple, list)) and len(v) > 0 and any(isinstance(x, torch.Tensor) for x in v)


def is_anchor_op(target: Any) -> bool:
    """Ops that bound SAC stages and are never recomputed: attention kernels and every op in a
    communication namespace, which includes all of our ``autosp_lm::`` custom ops (collectives,
    the fused loss head, grad_scale: opaque to the partitioner)."""
    return namespace(target) in COLLECTIVE_NAMESPACES


def _attention_flops(node: fx.Node, factor: float) -> float:
    q, k, v = (example(schema_arg(node, n)) for n in ("query", "key", "value"))
    if not all(isinstance(x, torch.Tensor) for x in (q, k, v)) or q.dim() < 2:
        return 0.0
    batch_heads = numel(q) // (hint(q.shape[-2]) * hint(q.shape[-1]))
    sq, dqk = hint(q.shape[-2]), hint(q.shape[-1])
    sk, dv = hint(k.shape[-2]), hint(v.shape[-1])
    flops = 2.0 * batch_heads * sq * sk * (dqk + dv)
    if bool(schema_arg(node, "is_causal", False)):
        flops *= 0.5
    return flops * factor


def estimate_node_flops(node: fx.Node) -> float:
    """Estimated FLOPs of one joint-graph node at its hinted sizes (0 for views and getitems)."""
    if node.op != "call_function" or node.target is operator.getitem or is_alias_op(node):
        return 0.0
    t = node.target
    aten = torch.ops.aten
    packet = getattr(t, "overloadpacket", None)
    args = [example(a) for a in node.args]
    if packet in (aten.mm, aten.addmm):
        a, b = args[-2], args[-1]
        if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
            m, kk = hint(a.shape[0]), hint(a.shape[1])
            n = hint(b.shape[1])
            return 2.0 * m * n * kk + (m * n if packet is aten.addmm else 0)
    if packet in (aten.bmm, aten.baddbmm):
        a, b = args[-2], args[-1]
        if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
            bb, m, kk = (hint(s) for s in a.shape)
            n = hint(b.shape[2])
            return 2.0 * bb * m * n * kk
    if is_attention_op(t):
        return _attention_flops(node, 1.0)
    if is_attention_backward_op(t):
        return _attention_flops(node, 2.5)
    # Everything else: one operation per element of the largest tensor touched.
    sizes = [numel(x) for x in [example(node), *args] if isinstance(x, torch.Tensor)]
    out = example(node)
    if isinstance(out, (tuple, list)):
        sizes += [numel(x) for x in out if isinstance(x, torch.Tensor)]
    for a in node.args:
        if isinstance(a, (tuple, list)):
            sizes += [numel(example(x)) for x in a if isinstance(example(x), torch.Tensor)]
    return float(max(sizes, default=0))


# --------------------------------------------------------------------------------------------
# graph analysis
# --------------------------------------------------------------------------------------------
def flat_outputs(graph: fx.Graph) -> list:
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
    outs = flat_outputs(graph)
    for i, o in enumerate(outs):
        if isinstance(o, fx.Node) and o in tangent_closure:
            return i
    return len(outs)


class JointGraphFacts:
    """The facts the cost model needs about one joint graph."""

    def __init__(self, gm: fx.GraphModule, num_fwd_outputs: Optional[int]):
        graph = gm.graph
        if num_fwd_outputs is None:
            num_fwd_outputs = _infer_num_fwd_outputs(graph)
        self.num_fwd_outputs = num_fwd_outputs
        outs = flat_outputs(graph)
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

        # Units: forward compute ops (non-alias, non-getitem) and their tensor members. Graph
        # FSDP's parameter gathers are none: not stage anchors, never candidates, their tags
        # (tag_param_gathers) kept, their bytes not counted as saved (they are re-gathered).
        self.param_gather_nodes = set().union(*param_gathers(graph).values())
        self.units: list = []
        self.members: dict = {}
        self.unit_of: dict = {}
        for n in graph.nodes:
            if n not in fwd or n.op != "call_function" or n.target is operator.getitem \
                    or is_alias_op(n) or n in self.param_gather_nodes:
                continue
            if is_tensor_node(n):
                mem = [n]
            elif _is_tuple_of_tensors(n):
                mem = [u for u in n.users if u.target is operator.getitem and is_tensor_node(u)]
            else:
                continue
            self.units.append(n)
            self.members[n] = mem
            for m in mem:
                self.unit_of[m] = n
        self.bytes = {m: tensor_bytes(example(m)) for m in self.unit_of}

        # Classification of units.
        self.kind: dict = {}
        for u in self.units:
            t = u.target
            if is_attention_op(t):
                self.kind[u] = "attention"
            elif is_anchor_op(t):
                self.kind[u] = "collective"
            elif is_random_op(t):
                self.kind[u] = "random"
            elif not isinstance(t, torch._ops.OpOverload) or t._schema.is_mutable \
                    or namespace(t) not in ("aten", "prims"):
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
            v = example(n)
            if n.op == "placeholder" and isinstance(v, torch.Tensor) and v.dim() in (1, 2) \
                    and not v.is_floating_point() and not v.is_complex() and v.dtype != torch.bool:
                toks = max(toks, numel(v))
        self.num_tokens = toks or None

    def _find_root(self, n: fx.Node) -> fx.Node:
        seen = 0
        while seen < 1000:
            seen += 1
            if n.op != "call_function":
                return n
            if n.target is operator.getitem:
                parent = n.args[0]
                if isinstance(parent, fx.Node) and is_alias_op(parent) and parent.args \
                        and isinstance(parent.args[0], fx.Node):
                    n = parent.args[0]
                    continue
                return n
            if is_alias_op(n) and n.args and isinstance(n.args[0], fx.Node):
                n = n.args[0]
                continue
            return n
        return n
