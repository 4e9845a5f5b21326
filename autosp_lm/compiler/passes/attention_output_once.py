"""Joint-graph pass — keep each attention output once, in the sequence layout.

After the Ulysses rewrite (:mod:`attention`) the attention output exists twice per layer: in the
head layout where SDPA produced it (``o``, ``[B, H/P, S, D]``) and in the sequence layout after
the all-to-all back (``o_seq``, ``[B, H, S/P, D]``). The backward needs both: the output
projection's weight gradient reads ``o_seq``, and the SDPA backward kernel reads ``o``. Neither can
be recomputed from the other without communicating it a second time, so a plain partition saves
both, ``2·H·D`` elements per local token per layer.

The SDPA backward reads ``o`` for one thing only: the softmax-backward term
``delta = rowsum(dO * o)`` per query row and head (``dS = P * (dP - delta)``; the gradients
depend on ``o`` through ``delta`` alone). That sum can be taken in the sequence layout, where
``dO_seq`` (the gradient arriving at ``o_seq``) and ``o_seq`` already are, and moved to the head
layout with an all-to-all of ``H/D`` the size of the attention output (``[B, H, S/P, 1]``, fp32).
The kernel still wants a tensor ``out``; we hand it a stand-in with the same row dot products:
``out' = dO * delta / |dO|²`` per row (computed with ``dO`` scaled by its row maximum, so it never
overflows or underflows). The kernel computes ``rowsum(dO * out') = delta`` and, from it, the
exact gradients (fp32: equal to the stock backward to rounding, ~1e-7 relative; bf16: one more
rounding of ``out'``, measured within 2% of the stock kernel's own bf16 error).

So the forward hands the backward ``o_seq`` only (``o`` dies right after its all-to-all), and
the backward gains one small collective per attention. Nothing is recomputed and nothing already
communicated is communicated again. The pass only touches the SDPA backward ops whose schema
has an ``out`` argument (CPU flash, CUDA flash, memory-efficient, cuDNN) and the backward of our
ring attention (``autosp_lm::ring_attention_backward``, a 2-D plan's Ulysses x ring attention:
its block kernels read ``out`` only through the same ``delta``, every block's query rows from
the same ``out`` rows), and only when ``out`` and the incoming gradient come straight from the
inverse pair of ``autosp_lm::all_to_all`` (a ring-only plan, U = 1, has no such pair and is
left as it is).

Expects
    An AOTAutograd joint graph (ATen level, after Inductor's decompositions when Inductor
    compiles) in which an SDPA forward's output ``o`` goes through ``autosp_lm::all_to_all`` to
    the sequence layout and the matching SDPA backward's ``grad_out`` comes from the inverse
    all-to-all.

Rewrites
    For each such pair: inserts ``delta = rowsum(dO_seq * o_seq)`` in fp32, one
    ``[B, H, S/P, 1]`` all-to-all of it, and the stand-in for ``out`` (only ops Inductor lowers
    as they are: :func:`~autosp_lm.compiler.graph.check_post_decomposition`); the backward's
    ``out`` argument becomes the stand-in.

Holds afterwards
    No backward op reads the head-layout attention output; gradients are those of the stock
    backward (to rounding). Returns the number of attentions rewritten.
"""
from __future__ import annotations

import operator
from typing import Any, Optional

import torch
import torch.fx as fx

from ..graph import check_post_decomposition, is_all_to_all as _is_a2a

_BACKWARD_OPS = ("_scaled_dot_product_flash_attention_for_cpu_backward",
                 "_scaled_dot_product_flash_attention_backward",
                 "_scaled_dot_product_efficient_attention_backward",
                 "_scaled_dot_product_cudnn_attention_backward",
                 # ours: a 2-D plan's ring attention (Ulysses all-to-all around a ring), whose
                 # block kernels read ``out`` only through the same row sums
                 "ring_attention_backward")
_PASS_THROUGH = ("detach", "alias", "clone", "contiguous")

aten = torch.ops.aten
prims = torch.ops.prims


def _opname(n: Any) -> str:
    t = getattr(n, "target", None)
    return t._opname if isinstance(t, torch._ops.OpOverload) else ""


def _strip(n: Any) -> Any:
    """The value ``n`` copies or aliases (detach/alias/clone/contiguous chains)."""
    while isinstance(n, fx.Node) and n.op == "call_function" and _opname(n) in _PASS_THROUGH:
        n = n.args[0]
    return n


def _arg_index(node: fx.Node, name: str) -> Optional[int]:
    for i, a in enumerate(node.target._schema.arguments):
        if a.name == name:
            return i if i < len(node.args) else None
    return None


def _a2a_dims(n: fx.Node, ndim: int) -> tuple:
    _, scatter, gather, group, world = n.args[:5]
    return scatter % ndim, gather % ndim, group, world


def _match(bw: fx.Node) -> Optional[dict]:
    """The nodes of one head-layout SDPA backward fed by the Ulysses all-to-all pair, or None."""
    i_out, i_grad = _arg_index(bw, "out"), _arg_index(bw, "grad_out")
    for name in ("grad_out_", "dout"):
        if i_grad is None:
            i_grad = _arg_index(bw, name)
    if i_out is None or i_grad is None:
        return None
    out, g_head = bw.args[i_out], bw.args[i_grad]
    o = _strip(out)
    if not (isinstance(o, fx.Node) and o.target is operator.getitem and o.args[1] == 0):
        return None
    if not _is_a2a(g_head):
        return None
    val = o.meta.get("val")
    if not isinstance(val, torch.Tensor) or val.dim() < 3:
        return None
    nd = val.dim()
    g_scatter, g_gather, group, world = _a2a_dims(g_head, nd)
    # The forward all-to-all that moved o to the sequence layout: the inverse of the gradient's.
    o_seq = None
    for u in list(o.users) + [w for u in o.users if _opname(u) in _PASS_THROUGH for w in u.users]:
        if _is_a2a(u) and _strip(u.args[0]) is o and \
                _a2a_dims(u, nd) == (g_gather, g_scatter, group, world):
            o_seq = u
            break
    if o_seq is None:
        return None
    g_seq = g_head.args[0]
    gv, sv = g_seq.meta.get("val"), o_seq.meta.get("val")
    if not isinstance(gv, torch.Tensor) or not isinstance(sv, torch.Tensor) or \
            gv.shape != sv.shape:
        return None
    return dict(i_out=i_out, out=out, o=o, o_seq=o_seq, g_seq=g_seq, g_head=g_head,
                scatter=g_scatter, gather=g_gather, group=group, world=world, dtype=val.dtype)


class _Builder:
    """Inserts aten calls before ``anchor`` with fake values (``meta["val"]``) for the partitioner.

    The joint graph has already been decomposed (Inductor's decomposition table), so every op
    inserted here must be one that Inductor lowers as it is: :func:`check_post_decomposition`
    refuses any other (``aten._to_copy`` for instance has a decomposition but no lowering; the
    post-decomposition dtype cast is ``prims.convert_element_type``)."""

    def __init__(self, graph: fx.Graph, anchor: fx.Node, mode):
        self.graph, self.anchor, self.mode = graph, anchor, mode

    def __call__(self, target, *args, **kwargs) -> fx.Node:
        check_post_decomposition(target)
        def fake(a):
            return a.meta["val"] if isinstance(a, fx.Node) else a

        with self.graph.inserting_before(self.anchor):
            node = self.graph.call_function(target, args, kwargs)
        with self.mode:
            node.meta["val"] = target(*[fake(a) for a in args],
                                      **{k: fake(v) for k, v in kwargs.items()})
        for key in ("stack_trace", "seq_nr"):
            if key in self.anchor.meta:
                node.meta[key] = self.anchor.meta[key]
        return node

    def cast(self, n: fx.Node, dtype: torch.dtype) -> fx.Node:
        if n.meta["val"].dtype == dtype:
            return n
        return self(prims.convert_element_type.default, n, dtype)

    def fp32(self, n: fx.Node) -> fx.Node:
        return self.cast(n, torch.float32)


def keep_attention_output_once(joint_gm: fx.GraphModule) -> int:
    """Rewrite every matching SDPA backward of the joint graph (see the module docstring) so the
    head-layout attention output is no longer read by the backward. Returns how many were
    rewritten; the graph is linted and (for a GraphModule) recompiled."""
    from torch._guards import detect_fake_mode

    graph = joint_gm.graph
    found = [(bw, m) for bw in graph.nodes
             if bw.op == "call_function" and _opname(bw) in _BACKWARD_OPS
             for m in [_match(bw)] if m is not None]
    if not found:
        return 0
    mode = detect_fake_mode([m["o"].meta["val"] for _, m in found])
    if mode is None:
        return 0
    for bw, m in found:
        b = _Builder(graph, bw, mode)
        last = m["o_seq"].meta["val"].dim() - 1
        # delta in the sequence layout, then to the head layout: [B, H/P, S, 1] fp32.
        d_seq = b(aten.sum.dim_IntList, b(aten.mul.Tensor, b.fp32(m["g_seq"]), b.fp32(m["o_seq"])),
                  [last], True)
        d_head = b(m["g_head"].target, d_seq, m["scatter"], m["gather"], m["group"], m["world"])
        # out' = dO * delta / |dO|^2, with dO scaled by its row maximum first.
        g = b.fp32(m["g_head"])
        row_max = b(aten.clamp_min.default,
                    b(aten.amax.default, b(aten.abs.default, g), [last], True),
                    torch.finfo(torch.float32).tiny)
        g_unit = b(aten.div.Tensor, g, row_max)
        # |g_unit|^2 >= 1 unless the row is zero, where delta = 0 as well.
        norm2 = b(aten.clamp_min.default,
                  b(aten.sum.dim_IntList, b(aten.mul.Tensor, g_unit, g_unit), [last], True), 1.0)
        scale = b(aten.div.Tensor, b(aten.div.Tensor, d_head, row_max), norm2)
        stand_in = b(aten.mul.Tensor, g_unit, scale)
        stand_in = b.cast(stand_in, m["dtype"])
        args = list(bw.args)
        args[m["i_out"]] = stand_in
        bw.args = tuple(args)
        # The detach/clone chain that fed the old out is dead now.
        n = m["out"]
        while n is not m["o"] and isinstance(n, fx.Node) and not n.users:
            prev = n.args[0]
            graph.erase_node(n)
            n = prev
    graph.lint()
    if isinstance(joint_gm, fx.GraphModule):
        joint_gm.recompile()
    return len(found)
