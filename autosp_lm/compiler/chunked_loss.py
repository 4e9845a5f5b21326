"""The loss head, recomputed in sequence chunks: output projection + cross entropy as one op.

A language model's last step, ``logits = h @ W.T (+ b)`` then ``cross_entropy(logits.float(),
labels)``, materializes ``[tokens, vocab]`` fp32 logits, their log-softmax and, in the backward,
their gradient: 0.5 MB per token each at a 128K vocabulary, more than all the activations SAC
keeps for a whole 8B model. With SAC those logits are recomputed in the backward anyway, so
nothing is lost by recomputing them chunk by chunk instead:

* forward, per chunk of tokens: the logits, their log-sum-exp and the loss of the chunk; only the
  per-token log-sum-exp (4 bytes per token) is kept;
* backward, per chunk: the logits again, ``softmax - one_hot`` scaled by the incoming gradient,
  then ``dh = dlogits @ W`` and ``dW += dlogits.T @ h`` (accumulated in fp32).

At most one chunk's ``[chunk, vocab]`` fp32 logits exist at a time, worked on in place (plus
their copy in the compute dtype for the gradient matmuls under bf16). The chunk count is
``ceil(vocab / hidden)`` (at least 1024 tokens per chunk), so a chunk's fp32 logits are about
the size of one fp32 ``[tokens, hidden]`` activation: 8 chunks for the tiny presets, 32 for
Llama 3 8B (2048 tokens each at 64K tokens per rank).

:func:`fuse_loss_heads` is the Dynamo-graph pass that finds ``linear -> [float / contiguous /
slicing / reshape] -> F.cross_entropy`` (integer targets, ``reduction`` mean or sum, no class
weights, no label smoothing, the logits used by nothing else) and replaces it with
:func:`linear_cross_entropy` on the hidden states, applying the same slicing and reshapes to
them. AutoSP's loss pass then treats it like ``cross_entropy`` (sharded input, local sum, one
``all_reduce_loss``). It runs as part of SAC (``--autosp`` and ``--compile --sac``; not with
``--no-sac``). Numerics: the loss and gradients equal the unfused ops to fp32 rounding (the sums
run in a different order); under autocast the projection runs in the autocast dtype as
``F.linear`` would.
"""
from __future__ import annotations

import math
import operator
from typing import Any, Optional

import torch
import torch.fx as fx
import torch.nn.functional as F
from torch.library import custom_op

MIN_CHUNK_TOKENS = 1024


def chunk_tokens_for(tokens: int, hidden: int, vocab: int) -> int:
    """Tokens per chunk: ``ceil(vocab / hidden)`` chunks, at least 1024 tokens each."""
    chunks = max(1, math.ceil(vocab / hidden))
    return max(MIN_CHUNK_TOKENS, math.ceil(tokens / chunks)) if tokens else MIN_CHUNK_TOKENS


def _chunks(n: int, chunk: int):
    chunk = max(1, chunk)
    for s in range(0, n, chunk):
        yield s, min(n, s + chunk)


def forward_chunks(h, w, b, target, ignore_index: int, chunk: int):
    """``(loss sum, per-token log-sum-exp)``, one ``[chunk, vocab]`` block of logits at a time
    (worked on in place: one fp32 block is the whole transient)."""
    n = h.shape[0]
    lse = torch.empty(n, dtype=torch.float32, device=h.device)
    total = torch.zeros((), dtype=torch.float32, device=h.device)
    for s, e in _chunks(n, chunk):
        logits = F.linear(h[s:e], w, b).float()
        t = target[s:e]
        valid = t != ignore_index
        picked = logits.gather(1, torch.where(valid, t, 0).unsqueeze(1)).squeeze(1)
        top = logits.amax(dim=1, keepdim=True)
        lse_c = logits.sub_(top).exp_().sum(dim=1).log_().add_(top.squeeze(1))
        total += torch.where(valid, lse_c - picked, 0.0).sum()
        lse[s:e] = lse_c
    return total, lse


def backward_chunks(grad, h, w, b, target, lse, ignore_index: int, chunk: int):
    """``(dh, dW, db)`` for the loss sum scaled by ``grad``, recomputing the logits per chunk
    (``db`` is empty without a bias)."""
    n = h.shape[0]
    gh = torch.empty_like(h)
    gw = torch.zeros(w.shape, dtype=torch.float32, device=w.device)
    gb = torch.zeros(w.shape[0] if b is not None else 0, dtype=torch.float32, device=w.device)
    g = grad.float()
    for s, e in _chunks(n, chunk):
        logits = F.linear(h[s:e], w, b).float()
        t = target[s:e]
        valid = t != ignore_index
        p = logits.sub_(lse[s:e].unsqueeze(1)).exp_()  # softmax, in place
        p.scatter_add_(1, torch.where(valid, t, 0).unsqueeze(1),
                       -valid.to(p.dtype).unsqueeze(1))  # - one_hot(target)
        p.mul_((valid.to(p.dtype) * g).unsqueeze(1))
        if b is not None:
            gb += p.sum(0)
        dlogits = p.to(h.dtype)
        gh[s:e] = dlogits @ w
        gw.add_((dlogits.t() @ h[s:e]).float())
    return gh, gw.to(w.dtype), gb.to(b.dtype) if b is not None else gb


@custom_op("autosp_lm::linear_cross_entropy", mutates_args=())
def _lce(h: torch.Tensor, w: torch.Tensor, b: Optional[torch.Tensor], target: torch.Tensor,
         ignore_index: int, chunk: int) -> tuple[torch.Tensor, torch.Tensor]:
    return forward_chunks(h, w, b, target, ignore_index, chunk)


@_lce.register_fake
def _(h, w, b, target, ignore_index, chunk):
    return h.new_empty((), dtype=torch.float32), h.new_empty(h.shape[0], dtype=torch.float32)


@custom_op("autosp_lm::linear_cross_entropy_backward", mutates_args=())
def _lce_backward(grad: torch.Tensor, h: torch.Tensor, w: torch.Tensor, b: Optional[torch.Tensor],
                  target: torch.Tensor, lse: torch.Tensor, ignore_index: int,
                  chunk: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return backward_chunks(grad, h, w, b, target, lse, ignore_index, chunk)


@_lce_backward.register_fake
def _(grad, h, w, b, target, lse, ignore_index, chunk):
    nb = w.shape[0] if b is not None else 0
    return (torch.empty_like(h), torch.empty_like(w),
            w.new_empty(nb, dtype=b.dtype if b is not None else torch.float32))


def _setup(ctx, inputs, output):
    h, w, b, target, ignore_index, chunk = inputs
    ctx.save_for_backward(h, w, b, target, output[1])
    ctx.ignore_index, ctx.chunk, ctx.has_bias = ignore_index, chunk, b is not None


def _backward(ctx, grad_total, grad_lse):
    h, w, b, target, lse = ctx.saved_tensors
    gh, gw, gb = _lce_backward(grad_total, h, w, b, target, lse, ctx.ignore_index, ctx.chunk)
    return gh, gw, (gb if ctx.has_bias else None), None, None, None


_lce.register_autograd(_backward, setup_context=_setup)


def linear_cross_entropy(input: torch.Tensor, target: torch.Tensor, lm_weight: torch.Tensor,
                         lm_bias: Optional[torch.Tensor] = None, ignore_index: int = -100,
                         reduction: str = "mean", chunk_tokens: Optional[int] = None
                         ) -> torch.Tensor:
    """``F.cross_entropy(F.linear(input, lm_weight, lm_bias).float(), target, ...)`` without the
    ``[tokens, vocab]`` logits: ``input`` is ``[tokens, hidden]``, ``target`` ``[tokens]``.

    ``reduction`` is ``"mean"`` (over targets other than ``ignore_index``; NaN when there are
    none, as ``F.cross_entropy``) or ``"sum"``. Under autocast the projection runs in the
    autocast dtype, as ``F.linear`` would.
    """
    if reduction not in ("mean", "sum"):
        raise ValueError(f"linear_cross_entropy: reduction must be 'mean' or 'sum', got {reduction!r}")
    h, w, b = input, lm_weight, lm_bias
    dev = h.device.type
    if torch.is_autocast_enabled(dev):
        dt = torch.get_autocast_dtype(dev)
        h, w = h.to(dt), w.to(dt)
        b = b.to(dt) if b is not None else None
    elif w.dtype != h.dtype:
        w = w.to(h.dtype)
        b = b.to(h.dtype) if b is not None else None
    chunk = chunk_tokens or chunk_tokens_for(h.shape[0], h.shape[1], w.shape[0])
    total, _ = _lce(h, w, b, target, ignore_index, int(chunk))
    if reduction == "sum":
        return total
    return total / (target != ignore_index).sum().to(torch.float32)


# --------------------------------------------------------------------------------------------
# the Dynamo-graph pass
# --------------------------------------------------------------------------------------------
_LINEAR = (torch._C._nn.linear, F.linear)
# F.cross_entropy's parameters in positional order (AutoSP's loss pass binds them the same way)
CROSS_ENTROPY_PARAMS = ["input", "target", "weight", "size_average", "ignore_index", "reduce",
                        "reduction", "label_smoothing"]


def _val(n: Any):
    if isinstance(n, fx.Node):
        return n.meta.get("example_value", n.meta.get("val"))
    return n


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
