"""The facts the SAC policy needs about a joint graph: FLOPs, seconds, bytes, stages, who reads what.

:mod:`.sac_cost` prices one ATen node at its hinted sizes; :class:`JointGraphFacts`
collects, for one AOTAutograd joint graph, the forward units (compute nodes with their tensor
members), their byte sizes, inputs and readers, their time on the device
(:mod:`..cost_model`), what the backward reads, the *stages* (the parts between anchors) and the
values whose recomputation may cross a stage boundary. See :mod:`.sac` for how the policy uses
them.

**Kinds.** Every forward unit gets a kind from :data:`KIND_RULES` (first match wins, keyed by op
object predicates) and the kind's properties from :func:`kind_properties`: whether it bounds a
stage (``anchor``) and whether it may be recomputed (``recompute``: ``never``, ``compute`` or
``communicate``). To give a new op family its own behaviour (an FSDP parameter gather, a ring
attention op), insert a :class:`KindRule` before the row it would otherwise match and, for a new
kind name, add its properties to :data:`KIND_PROPERTIES`.
"""
from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch
import torch.fx as fx

from ..cost_model import DeviceParams, device_params
from ..graph import (COLLECTIVE_NAMESPACES, example, is_alias_op, is_attention_backward_op,
                     is_attention_op, is_collective_op, is_random_op, is_tensor_node, namespace, param_gathers,
                     schema_name)
from .sac_cost import METADATA_OPS, estimate_node_flops, node_seconds_of, numel, tensor_bytes
from .sac_stages import STAGES, layer_boundaries

def reads_data(node: fx.Node) -> bool:
    """Whether ``node`` may use the data of its tensor inputs (not a size query:
    :data:`METADATA_OPS`)."""
    return not (node.op == "call_function" and node.target in METADATA_OPS)


def _is_tuple_of_tensors(node: fx.Node) -> bool:
    v = example(node)
    return isinstance(v, (tuple, list)) and len(v) > 0 and any(isinstance(x, torch.Tensor) for x in v)


def is_anchor_op(target: Any) -> bool:
    """Ops that bound SAC stages under the never-communicate-twice policy and are never
    recomputed: attention kernels and every op in a communication namespace, which includes all
    of our ``autosp_lm::`` custom ops (collectives, the fused loss head, grad_scale)."""
    return namespace(target) in COLLECTIVE_NAMESPACES


# --------------------------------------------------------------------------------------------
# kinds
# --------------------------------------------------------------------------------------------
#: ``autosp_lm::`` custom ops that are neither collectives nor stage anchors: token-local
#: regions run in sequence chunks (recomputable like any compute op: a recomputation runs the
#: region's forward again, chunk by chunk).
TOKEN_LOCAL_OPS = frozenset({"tiled_region"})


def _is_functional_aten(t: Any) -> bool:
    return isinstance(t, torch._ops.OpOverload) and not t._schema.is_mutable \
        and namespace(t) in ("aten", "prims")


@dataclass(frozen=True)
class KindRule:
    kind: str
    matches: Callable[[Any], bool]  # op object (node.target) -> bool


#: The kind of a forward unit: the first rule that matches its op.
KIND_RULES: list = [
    KindRule("attention", is_attention_op),
    KindRule("collective", is_collective_op),
    KindRule("random", is_random_op),
    KindRule("tiled", lambda t: namespace(t) == "autosp_lm" and schema_name(t) in TOKEN_LOCAL_OPS),
    KindRule("opaque", lambda t: namespace(t) in COLLECTIVE_NAMESPACES),  # fused loss head ...
    KindRule("compute", _is_functional_aten),
    KindRule("fixed", lambda t: True),  # mutating ops, other custom ops, HOPs
]

#: ``anchor``: bounds a stage; ``recompute``: never | compute | communicate. A collective is an
#: anchor that is never recomputed under the never-communicate-twice policy
#: (``recommunicate=False``); otherwise it is priced like any other move (its re-communication).
KIND_PROPERTIES = {
    "attention": dict(anchor=True, recompute="never"),
    "collective": dict(anchor=False, recompute="communicate"),
    "random": dict(anchor=False, recompute="never"),
    "tiled": dict(anchor=False, recompute="compute"),
    "opaque": dict(anchor=True, recompute="never"),
    "compute": dict(anchor=False, recompute="compute"),
    "fixed": dict(anchor=False, recompute="never"),
}


def kind_of(target: Any) -> str:
    return next(r.kind for r in KIND_RULES if r.matches(target))


def kind_properties(kind: str, recommunicate: bool = True, stages: str = "attention") -> dict:
    props = dict(KIND_PROPERTIES[kind])
    if props["recompute"] == "communicate" and not recommunicate:
        props.update(anchor=True, recompute="never")
    if kind == "attention" and stages == "layers":
        props.update(anchor=False, recompute="compute")
    return props


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

    def __init__(self, gm: fx.GraphModule, num_fwd_outputs: Optional[int], *,
                 recommunicate: bool = True, device: Optional[DeviceParams] = None,
                 world: int = 1, stages: str = "attention"):
        if stages not in STAGES:
            raise ValueError(f"SAC stages must be one of {STAGES}, got {stages!r}")
        graph = gm.graph
        self.recommunicate = recommunicate
        self.stages = stages
        self.device = device_params(device)
        self.world = world
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

        # Classification of units (KIND_RULES) and what each kind may do.
        self.kind: dict = {u: kind_of(u.target) for u in self.units}
        self.anchor: set = set()
        self.may_recompute: set = set()
        for u in self.units:
            props = kind_properties(self.kind[u], recommunicate, stages)
            if props["anchor"]:
                self.anchor.add(u)
            if props["recompute"] != "never":
                self.may_recompute.add(u)

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
            if not reads_data(n):  # a size query: the partitioner saves the size, not the tensor
                continue
            for a in n.all_input_nodes:
                r = self.root.get(a)
                if r in self.unit_of:
                    self.needed_bw.add(r)

        # Stages: number of anchors (attention; collectives too when they may not be
        # re-communicated) on the longest path from the inputs; under ``layers``, the number of
        # layer boundaries before the unit in program order.
        self.stage: dict = {}
        self.boundaries: list = []
        if stages == "layers":
            self.boundaries = layer_boundaries(self, graph, outs, num_fwd_outputs)
            k, bset = 0, set(self.boundaries)
            for u in self.units:
                self.stage[u] = k
                if u in bset:
                    k += 1
        else:
            for u in self.units:
                s = 0
                for m in self.inputs[u]:
                    w = self.unit_of[m]
                    s = max(s, self.stage[w] + (1 if w in self.anchor else 0))
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
            if u not in self.may_recompute or self.stage[u] != 0:
                continue
            ok, seen, stack, pins = True, {u}, [u], set()
            while stack and ok:
                c = stack.pop()
                for m in self.inputs[c]:
                    w = self.unit_of[m]
                    if w in seen or w not in self.may_recompute:
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

        # FLOPs and seconds (cost_model): per unit, and for the whole step.
        self.flops, self.seconds, self.wire_bytes = {}, {}, {}
        self.step_flops = self.attention_flops = self.step_seconds = 0.0
        for n in graph.nodes:
            if n.op != "call_function":
                continue
            f = estimate_node_flops(n)
            sec, wire = node_seconds_of(n, f, self.device, self.world)
            if n in self.members:
                self.flops[n], self.seconds[n], self.wire_bytes[n] = f, sec, wire
            self.step_flops += f
            self.step_seconds += sec
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
