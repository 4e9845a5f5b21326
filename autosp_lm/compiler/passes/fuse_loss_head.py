"""Graph pass — fuse the loss head: ``linear -> cross_entropy`` becomes one chunked op.

Expects
    A Dynamo graph (torch-function level) whose loss is ``F.cross_entropy`` of the output of
    ``F.linear`` through ``float()`` / ``to(float32)`` / ``contiguous()`` / slicing that keeps the
    last dim / ``reshape``/``view`` ending in the vocabulary: the shape of every decoder's loss head,
    including ``logits.float()`` under bf16 autocast.

Rewrites
    Only heads with integer targets, ``reduction`` mean or sum, no class weights, no label
    smoothing, a loss computed in fp32 and logits used by nothing else become
    :func:`~autosp_lm.compiler.ops.linear_cross_entropy` on the hidden states, with the same
    slicing and reshapes applied to the hidden states (the vocabulary dim replaced by hidden).

Holds afterwards
    No ``[tokens, vocab]`` logits exist in the forward or backward of a fused head; the loss rule
    shards the fused op like ``cross_entropy``. Returns a description per fused head (empty: the
    graph is unchanged). Runs with SAC (``--autosp`` and ``--compile --sac``; not ``--no-sac``).
"""
from __future__ import annotations

import operator
from typing import Any, Optional

import torch
import torch.fx as fx
import torch.nn.functional as F

from ..graph import example as _val
from ..ops import CROSS_ENTROPY_PARAMS, linear_cross_entropy

_LINEAR = (torch._C._nn.linear, F.linear)


def _slices_keep_last(idx: Any, ndim: int) -> bool:
    if not isinstance(idx, tuple):
        idx = (idx,)
    if not all(isinstance(i, slice) or i is Ellipsis for i in idx):
        return False
    if any(isinstance(v, fx.Node) and not isinstance(_val(v), (int, torch.SymInt))
           for i in idx if isinstance(i, slice) for v in (i.start, i.stop, i.step)):
        return False
    explicit = [i for i in idx if i is not Ellipsis]
    if Ellipsis in idx:
        last = idx[-1]
        return last is Ellipsis or last == slice(None)
    return len(explicit) < ndim or explicit[-1] == slice(None)


def _shape_args(n: fx.Node) -> Optional[list]:
    args = list(n.args[1:])
    if len(args) == 1 and isinstance(args[0], (tuple, list)):
        args = list(args[0])
    if "shape" in n.kwargs or "size" in n.kwargs:
        return None
    return args


def _chain(x: fx.Node) -> Optional[tuple]:
    """``(linear node, ops from the linear's output to x)`` or None."""
    ops = []
    cur = x
    while True:
        if not isinstance(cur, fx.Node) or len(cur.users) != 1:
            return None
        if cur.op == "call_function" and cur.target in _LINEAR:
            return cur, list(reversed(ops))
        if cur.op == "call_method" and cur.target in ("float", "contiguous"):
            pass
        elif cur.op == "call_method" and cur.target == "to":
            if cur.args[1:] != (torch.float32,) or cur.kwargs:
                return None
        elif cur.op == "call_method" and cur.target in ("reshape", "view"):
            if _shape_args(cur) is None:
                return None
        elif cur.op == "call_function" and cur.target is operator.getitem:
            v = _val(cur.args[0])
            if not isinstance(v, torch.Tensor) or not _slices_keep_last(cur.args[1], v.dim()):
                return None
        else:
            return None
        ops.append(cur)
        cur = cur.args[0]


def fuse_loss_heads(gm: fx.GraphModule, chunk_tokens: Optional[int] = None) -> list:
    """Replace each ``linear -> ... -> F.cross_entropy`` loss head of a Dynamo graph with
    :func:`linear_cross_entropy`; returns a description per fused head (empty: graph unchanged)."""
    graph = gm.graph
    done = []
    for ce in list(graph.nodes):
        if ce.op != "call_function" or ce.target is not F.cross_entropy:
            continue
        b = dict(zip(CROSS_ENTROPY_PARAMS, ce.args))
        b.update(ce.kwargs)
        if b.get("weight") is not None or b.get("size_average") is not None or \
                b.get("reduce") is not None or b.get("label_smoothing", 0.0) not in (0, 0.0):
            continue
        reduction = b.get("reduction", "mean")
        x, t = b["input"], b["target"]
        xv, tv = _val(x), _val(t)
        if reduction not in ("mean", "sum") or not isinstance(xv, torch.Tensor) or \
                not isinstance(tv, torch.Tensor) or xv.dim() != 2 or tv.dim() != 1 or \
                tv.is_floating_point() or not isinstance(b.get("ignore_index", -100), int):
            continue
        out = _val(ce)
        if not isinstance(out, torch.Tensor) or out.dtype != torch.float32:
            continue  # a loss computed in bf16/fp16 stays as it is (the fused op sums in fp32)
        found = _chain(x)
        if found is None:
            continue
        lin, ops = found
        h = lin.args[0] if lin.args else lin.kwargs.get("input")
        w = lin.args[1] if len(lin.args) > 1 else lin.kwargs.get("weight")
        bias = lin.args[2] if len(lin.args) > 2 else lin.kwargs.get("bias")
        wv = _val(w)
        if not isinstance(wv, torch.Tensor) or wv.dim() != 2:
            continue
        vocab, hidden = int(wv.shape[0]), int(wv.shape[1])
        if any(isinstance(a, fx.Node) for op in ops if op.target in ("reshape", "view")
               for a in _shape_args(op)[-1:]) or \
                any(_shape_args(op)[-1] != vocab for op in ops if op.target in ("reshape", "view")):
            continue
        mode = getattr(_val(h), "fake_mode", None)
        if mode is None:
            continue

        def add(fn, args, kwargs, op="call_function"):
            with graph.inserting_before(ce):
                node = graph.create_node(op, fn, tuple(args), kwargs)
            def fake(a):
                return _val(a) if isinstance(a, fx.Node) else a
            fa = fx.node.map_aggregate(args, fake)
            fk = fx.node.map_aggregate(kwargs, fake)
            with mode:
                node.meta["example_value"] = (getattr(fa[0], fn)(*fa[1:], **fk) if op == "call_method"
                                              else fn(*fa, **fk))
            for key in ("stack_trace", "nn_module_stack", "source_fn_stack"):
                if key in ce.meta:
                    node.meta[key] = ce.meta[key]
            return node

        cur = h
        for op in ops:
            if op.target in ("float", "contiguous", "to"):
                continue
            if op.target is operator.getitem:
                cur = add(operator.getitem, (cur, op.args[1]), {})
            else:
                shape = _shape_args(op)[:-1] + [hidden]
                # reshape, not view: the chain's contiguous() calls are dropped on this side
                cur = add("reshape", (cur, *shape), {}, op="call_method")
        fused = add(linear_cross_entropy, (cur, t),
                    dict(lm_weight=w, lm_bias=bias, ignore_index=b.get("ignore_index", -100),
                         reduction=reduction, chunk_tokens=chunk_tokens))
        ce.replace_all_uses_with(fused)
        graph.erase_node(ce)
        for op in reversed([lin] + ops):
            if not op.users:
                graph.erase_node(op)
        done.append(f"{lin.name} -> {ce.name}: linear + cross_entropy fused, logits recomputed in "
                    f"the backward in chunks (vocab {vocab}, hidden {hidden})")
    if done:
        graph.lint()
        gm.recompile()
    return done
