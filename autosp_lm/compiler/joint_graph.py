"""Facts about graph nodes shared by every pass: a node's example value, and the predicates and
helpers of the joint graph (ATen level, after AOTAutograd): collectives, attention and random
ops, aliases, schema arguments, :func:`check_post_decomposition` (which every op inserted into a
joint graph must pass), and graph FSDP's parameter gathers. :mod:`.graph` re-exports all of it
(one vocabulary for the passes); this module needs nothing from it.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.fx as fx


def example(node: Any):
    """The example (fake) value of a Dynamo-graph or joint-graph node (or of a stand-in for one:
    an object with a ``meta`` dict); the value itself for a constant."""
    if isinstance(node, fx.Node) or isinstance(getattr(node, "meta", None), dict):
        return node.meta.get("example_value", node.meta.get("val"))
    return node


def is_tensor_node(node: Any) -> bool:
    return isinstance(node, fx.Node) and isinstance(example(node), torch.Tensor)


# ============================================================================ joint graph (ATen)
COLLECTIVE_NAMESPACES = frozenset({"autosp_lm", "_c10d_functional", "c10d", "c10d_functional",
                                   "_dtensor"})
#: ``autosp_lm::`` ops that are collectives (the others are local custom ops)
AUTOSP_COLLECTIVES = frozenset({"all_to_all", "all_gather", "reduce_scatter", "all_reduce_sum",
                                "all_reduce_loss", "seq_window", "seq_window_backward",
                                "exclusive_scan", "exclusive_scan_backward"})
_ATTENTION_NAMES = ("_scaled_dot_product", "_flash_attention_forward",
                    "_efficient_attention_forward", "_cudnn_attention_forward")
_ATTENTION_BWD_NAMES = ("_scaled_dot_product", "_flash_attention_backward",
                        "_efficient_attention_backward", "_cudnn_attention_backward")


def schema_name(target: Any) -> str:
    """The op name of an overload without its namespace (``_scaled_dot_product_flash_attention``),
    or the callable's ``__name__``."""
    if isinstance(target, torch._ops.OpOverload):
        return target._schema.name.split("::", 1)[-1]
    return getattr(target, "__name__", str(target))


def namespace(target: Any) -> str:
    return getattr(target, "namespace", "") if isinstance(target, torch._ops.OpOverload) else ""


def is_collective_op(target: Any) -> bool:
    """A communication op: our ``autosp_lm::`` collectives and PyTorch's functional collectives."""
    ns = namespace(target)
    if ns == "autosp_lm":
        return schema_name(target) in AUTOSP_COLLECTIVES
    return ns in COLLECTIVE_NAMESPACES


def is_all_to_all(node: Any) -> bool:
    return (isinstance(node, fx.Node) and node.op == "call_function"
            and isinstance(node.target, torch._ops.OpOverload)
            and namespace(node.target) == "autosp_lm" and schema_name(node.target) == "all_to_all")


#: our attention ops (``autosp_lm::``): ring attention's forward and backward, O(S^2) like SDPA
RING_ATTENTION_OPS = frozenset({"ring_attention"})
RING_ATTENTION_BACKWARD_OPS = frozenset({"ring_attention_backward"})


def is_ring_attention_op(target: Any) -> bool:
    return namespace(target) == "autosp_lm" and schema_name(target) in RING_ATTENTION_OPS


def is_ring_attention_backward_op(target: Any) -> bool:
    return namespace(target) == "autosp_lm" and schema_name(target) in RING_ATTENTION_BACKWARD_OPS


def is_attention_op(target: Any) -> bool:
    """A forward attention kernel of the joint graph: the SDPA ATen variants and our ring
    attention (``autosp_lm::ring_attention``)."""
    if is_ring_attention_op(target):
        return True
    name = schema_name(target)
    if "backward" in name:
        return False
    return isinstance(target, torch._ops.OpOverload) and any(k in name for k in _ATTENTION_NAMES) \
        and "attention" in name


def is_attention_backward_op(target: Any) -> bool:
    if is_ring_attention_backward_op(target):
        return True
    name = schema_name(target)
    return isinstance(target, torch._ops.OpOverload) and "backward" in name and "attention" in name \
        and any(k in name for k in _ATTENTION_BWD_NAMES)


def is_random_op(target: Any) -> bool:
    if not isinstance(target, torch._ops.OpOverload):
        return False
    if torch.Tag.nondeterministic_seeded in target.tags:
        return True
    name = schema_name(target)
    return namespace(target) == "prims" and ("random" in name or "seed" in name)


def is_alias_op(node: fx.Node) -> bool:
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
    return len(rets) > 0 and all(r.alias_info is not None and not r.alias_info.is_write
                                 for r in rets)


def schema_arg(node: fx.Node, name: str, default: Any = None) -> Any:
    """Argument ``name`` of an op-overload node, positional or keyword."""
    if name in node.kwargs:
        return node.kwargs[name]
    t = node.target
    if isinstance(t, torch._ops.OpOverload):
        for i, a in enumerate(t._schema.arguments):
            if a.name == name:
                return node.args[i] if i < len(node.args) else default
    return default


def check_post_decomposition(target) -> None:
    """Raise when ``target`` may not be inserted into a joint graph that Inductor will lower.

    The joint graph has already been decomposed with Inductor's table; an op with an entry in
    that table and no lowering of its own makes Inductor fail ("both a fallback and a decomp for
    same op"): ``aten._to_copy`` for instance, whose decomposition is
    ``prims.convert_element_type``. Custom ops (no decomposition) and ops Inductor lowers
    directly are fine."""
    if not isinstance(target, torch._ops.OpOverload) or namespace(target) not in ("aten", "prims"):
        return
    from torch._inductor.decomposition import select_decomp_table
    from torch._inductor.lowering import lowerings
    if target not in lowerings and target in select_decomp_table():
        raise AssertionError(f"AutoSP internal error: a joint-graph pass inserted {target}, which "
                             f"Inductor decomposes but does not lower; insert its decomposition")


# ============================================================================ parameter gathers
def _is_functional(node: Any, name: str) -> bool:
    return (isinstance(node, fx.Node) and node.op == "call_function"
            and isinstance(node.target, torch._ops.OpOverload)
            and namespace(node.target) == "_c10d_functional" and schema_name(node.target) == name)


def param_gathers(graph: fx.Graph) -> dict:
    """The parameter all-gathers of a joint graph (graph FSDP) and the nodes that make each one.

    A parameter gather is a ``_c10d_functional.all_gather_into_tensor`` whose inputs derive from
    exactly one placeholder, a floating-point one (a parameter's local shard; the criterion of
    Inductor's own FSDP passes). Returns ``{gather: chain}`` where ``chain`` holds every node
    from that placeholder (excluded) to the gathered value: the cast and padding before the
    collective, the collective, its ``wait_tensor`` and the views after it."""
    out: dict = {}
    for n in graph.nodes:
        if not _is_functional(n, "all_gather_into_tensor"):
            continue
        seen, stack, places = set(), list(n.all_input_nodes), []
        while stack:
            a = stack.pop()
            if a in seen:
                continue
            seen.add(a)
            if a.op == "placeholder":
                places.append(a)
            else:
                stack.extend(a.all_input_nodes)
        ev = example(places[0]) if len(places) == 1 else None
        if not (isinstance(ev, torch.Tensor) and ev.is_floating_point()):
            continue
        chain = {a for a in seen if a.op != "placeholder"} | {n}
        frontier = [n]
        while frontier:  # the wait and the views of the gathered value
            m = frontier.pop()
            for u in m.users:
                if u not in chain and (_is_functional(u, "wait_tensor") or is_alias_op(u)):
                    chain.add(u)
                    frontier.append(u)
        out[n] = chain
    return out


def is_param_reduce_scatter(node: Any) -> bool:
    """A ``_c10d_functional.reduce_scatter_tensor`` (graph FSDP's gradient reduction; AutoSP's
    own collectives are ``autosp_lm::`` ops)."""
    return _is_functional(node, "reduce_scatter_tensor")
