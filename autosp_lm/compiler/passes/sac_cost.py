"""What one joint-graph node costs: its FLOPs, bytes and seconds on a device, at hinted sizes.

:func:`estimate_node_flops` counts an ATen node's FLOPs (matmuls exactly, attention by its
``q k^T`` and ``p v`` products, the fused loss head as the output projection it runs, tiled
regions by their per-token FLOPs, everything else one operation per element of the largest
tensor it touches); :func:`node_seconds_of` turns them into seconds on a
:class:`..cost_model.DeviceParams` (matmul and attention FLOPs at their rates, collectives by
latency plus bytes on the wire, the rest by the bytes it moves). Sizes may be symbolic:
:func:`hint` reads the shape environment's hint (the real sequence length under dynamic shapes).
The SAC policy (:mod:`.sac_graph`, :mod:`.sac`) and the planner's clock
(:mod:`autosp_lm.planner.timing`) price the same graph with these functions, so the plan the
compiler takes and the step time the planner predicts agree.
"""
from __future__ import annotations

import operator
from typing import Any, Optional

import torch
import torch.fx as fx

from ..cost_model import collective_wire_bytes, node_seconds
from ..graph import (example, is_alias_op, is_attention_backward_op, is_attention_op,
                     is_collective_op, is_ring_attention_backward_op, is_ring_attention_op,
                     schema_arg, schema_name)
from ..tiling import region_of

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


_MATMULS = (torch.ops.aten.mm, torch.ops.aten.addmm, torch.ops.aten.bmm, torch.ops.aten.baddbmm)


def _out_bytes(n: fx.Node) -> int:
    v = example(n)
    if isinstance(v, (tuple, list)):
        return sum(tensor_bytes(x) for x in v)
    return tensor_bytes(v)


#: Ops that read only a tensor's metadata (its sizes, strides, offset), never its data. The
#: backward asks them for symbolic sizes, and whether it does depends on how this rank's shard
#: bounds simplified (rank 0 starts at 0, the last rank ends at S): they must not make the tensor
#: "needed by the backward", nor cost anything, or the policy differs between ranks.
METADATA_OPS = frozenset({torch.ops.aten.sym_size.int, torch.ops.aten.sym_stride.int,
                          torch.ops.aten.sym_numel.default,
                          torch.ops.aten.sym_storage_offset.default})


def is_size_arithmetic(node: fx.Node) -> bool:
    """A node that computes a (symbolic) size or scalar rather than a tensor: its value is no
    tensor (nor a tuple of tensors). Priced at zero seconds: whether it exists in a rank's graph
    depends on how that rank's bounds simplified."""
    v = example(node)
    if isinstance(v, torch.Tensor):
        return False
    if isinstance(v, (tuple, list)) and any(isinstance(x, torch.Tensor) for x in v):
        return False
    return v is not None or node.target in METADATA_OPS


def _ring_world(node: fx.Node) -> int:
    """Ranks of a ring attention's group (by its registered name, as the op itself resolves it);
    1 where this process does not know the name."""
    from ...parallel.collectives import resolve_group
    name = schema_arg(node, "group", "")
    if not name:
        return 1
    try:
        return int(resolve_group(name).size())
    except Exception:  # noqa: BLE001 - an unknown name: price one block
        return 1


def _attention_flops(node: fx.Node, factor: float) -> float:
    ring = is_ring_attention_op(node.target) or is_ring_attention_backward_op(node.target)
    names = ("q", "k", "v") if ring else ("query", "key", "value")
    q, k, v = (example(schema_arg(node, n)) for n in names)
    if not all(isinstance(x, torch.Tensor) for x in (q, k, v)) or q.dim() < 2:
        return 0.0
    batch_heads = numel(q) // (hint(q.shape[-2]) * hint(q.shape[-1]))
    sq, dqk = hint(q.shape[-2]), hint(q.shape[-1])
    sk, dv = hint(k.shape[-2]), hint(v.shape[-1])
    if ring:  # this rank's queries against the keys of every rank of the ring
        sk *= _ring_world(node)
    flops = 2.0 * batch_heads * sq * sk * (dqk + dv)
    if bool(schema_arg(node, "causal" if ring else "is_causal", False)):
        flops *= 0.5
    return flops * factor


def _loss_head_flops(node: fx.Node) -> Optional[float]:
    """The fused loss head (``autosp_lm::linear_cross_entropy``, :mod:`..ops`): the output
    projection's ``2 tokens hidden vocab`` FLOPs in the forward, three times that in its
    backward (the logits again, then ``dh`` and ``dW``); None for other nodes."""
    name = getattr(getattr(node.target, "_schema", None), "name", "")
    if name not in ("autosp_lm::linear_cross_entropy", "autosp_lm::linear_cross_entropy_backward"):
        return None
    h, w = (example(schema_arg(node, n)) for n in ("h", "w"))
    if not (isinstance(h, torch.Tensor) and isinstance(w, torch.Tensor)):
        return 0.0
    flops = 2.0 * hint(h.shape[0]) * hint(w.shape[1]) * hint(w.shape[0])
    return flops * (3.0 if name.endswith("backward") else 1.0)


def estimate_node_flops(node: fx.Node) -> float:
    """Estimated FLOPs of one joint-graph node at its hinted sizes (0 for views and getitems)."""
    if node.op != "call_function" or node.target is operator.getitem or is_alias_op(node) \
            or is_size_arithmetic(node):
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
    lce = _loss_head_flops(node)
    if lce is not None:
        return lce
    if is_attention_op(t):
        return _attention_flops(node, 1.0)
    if is_attention_backward_op(t):
        return _attention_flops(node, 2.5)
    region = region_of(node)
    if region is not None:  # forward once; its backward runs it again and differentiates it
        ins = node.args[0] if t is torch.ops.autosp_lm.tiled_region.default else node.args[1]
        i = next(i for i, d in enumerate(region.in_dims) if d is not None)
        tokens = numel(example(ins[i])) // max(1, hint(example(ins[i]).shape[-1])) \
            if region.in_dims[i] != example(ins[i]).dim() - 1 else numel(example(ins[i]))
        factor = 1.0 if t is torch.ops.autosp_lm.tiled_region.default else 3.0
        return factor * region.flops_per_token * tokens
    # Everything else: one operation per element of the largest tensor touched.
    sizes = [numel(x) for x in [example(node), *args] if isinstance(x, torch.Tensor)]
    out = example(node)
    if isinstance(out, (tuple, list)):
        sizes += [numel(x) for x in out if isinstance(x, torch.Tensor)]
    for a in node.args:
        if isinstance(a, (tuple, list)):
            sizes += [numel(example(x)) for x in a if isinstance(example(x), torch.Tensor)]
    return float(max(sizes, default=0))


def node_seconds_of(n: fx.Node, flops: float, device, world: int) -> tuple[float, float]:
    """(seconds, bytes on the wire) of one graph node on ``device`` (cost_model.DeviceParams);
    ``world``: the collectives' group size when the node does not name it."""
    if n.target is operator.getitem or is_alias_op(n) or is_size_arithmetic(n):
        return 0.0, 0.0
    t = n.target
    if is_collective_op(t):
        w = schema_arg(n, "world", None)
        w = w if isinstance(w, int) else world
        ins = sum(tensor_bytes(example(a)) for a in n.all_input_nodes)
        wire = collective_wire_bytes(schema_name(t), ins, _out_bytes(n), w)
        return node_seconds(device, kind="collective", flops=0.0, bytes_moved=0.0,
                            wire_bytes=wire), wire
    if is_attention_op(t) or is_attention_backward_op(t):
        return node_seconds(device, kind="attention", flops=flops, bytes_moved=0.0), 0.0
    if getattr(t, "overloadpacket", None) in _MATMULS or region_of(n) is not None \
            or _loss_head_flops(n) is not None:
        return node_seconds(device, kind="matmul", flops=flops, bytes_moved=0.0), 0.0
    moved = _out_bytes(n) + sum(tensor_bytes(example(a)) for a in n.all_input_nodes)
    return node_seconds(device, kind="memory", flops=flops, bytes_moved=moved), 0.0

