"""The fallback rule — anything without a rule: gather the sequence, compute, re-shard.

Expects an op with sharded inputs that no rule understands (``cumsum``/``sort``/``flip`` over the
sequence, a slice that is not a shift, a matmul contracting the sequence, an op unknown to
AutoSP, a user's custom op ...).

Rewrites: every sharded input is all-gathered along its sequence dimension
(``autosp_lm::all_gather``, whose backward is a reduce-scatter) and un-padded back to its logical
length; the op runs on the full sequence on every rank. Its output is a replicated full value;
the next consumer that does per-token work takes this rank's chunk again, so the gradient flowing
back into the replicated region is non-zero only on this rank's chunk and the reduce-scatter adds
the ranks' contributions: gradients stay exact. The report names each fallback with its source
line.

A result without the sequence dimension (an unknown reduction over the gathered sequence, rows
of a merged batch x sequence dim) is the same on every rank. Its gradient stays exact: where it
meets the loss or leaves the model the rewriter scales its gradient by ``1/P``
(``autosp_lm::grad_scale``), and a per-token consumer sends back only this rank's part.
"""
from __future__ import annotations

import torch
import torch.fx as fx

from ..graph import (REDUCED, REP, AutoSPError, describe, example, is_distributed, is_heads,
                     is_rows, is_shard, mutated_operand, static_int)
from .head_parallel import head_parallel


def gather(rw, node):
    """The full value of the sharded original node ``node`` (the rewriter caches it)."""
    shard = rw.state(node)
    shape = rw.info.shape(node)
    d = shard.dim
    x = rw.value(node)
    if is_heads(shard):  # inside an attention region: the heads are what is split
        return rw.collective("all_gather", rw.method("contiguous", x), d,
                             requires_grad=bool(getattr(example(node), "requires_grad", False)))
    if shard.merged:
        pre = [static_int(s, f"dimension {i} of {node.name}") for i, s in enumerate(shape[:d])]
        post = [static_int(s, f"dimension {i} of {node.name}")
                for i, s in enumerate(shape[d + 1:])]
        x = rw.method("reshape", x, pre + [shard.outer, -1, shard.inner] + post)
        d += 1
    x = rw.method("contiguous", x)
    x = rw.collective("all_gather", x, d,
                      requires_grad=bool(getattr(example(node), "requires_grad", False)))
    order = rw.sequence_order()
    if order is not None:  # the ring layout: ranks' pieces are not in sequence order
        x = rw.call(torch.index_select, x, d, order)
    if shard.padded:
        pl, pr = max(shard.pad_left, 0), max(shard.pad_right, 0)
        if pl or pr:
            x = rw.call(torch.narrow, x, d, pl, rw.sym(rw.info.symbol - pl - pr))
        if shard.overhang:  # rows outside the virtual sequence are zeros
            nd = len(shape) + (2 if shard.merged else 0)
            pad = [0, 0] * (nd - 1 - d) + [max(-shard.pad_left, 0), max(-shard.pad_right, 0)]
            x = rw.call(torch.nn.functional.pad, x, pad)
    if shard.merged:
        x = rw.method("reshape", x, pre + [-1] + post)
    return x


def fallback(rw, n: fx.Node, reason: str = "no sharding rule"):
    """Run ``n`` on the full sequence (see the module docstring); returns the replicated state.
    First tried: the head-parallel region (:mod:`.head_parallel`), when ``n`` treats a
    dimension of its operands independently; inside such a trial, NotImplemented."""
    if ("heads_trial", n) in rw.tags:
        return NotImplemented
    out = head_parallel(rw, n, reason)
    if out is not None:
        return out
    gathered_grad = False

    def full(a):
        nonlocal gathered_grad
        if isinstance(a, fx.Node):
            s = rw.state(a)
            if s is REDUCED:
                raise AutoSPError(f"AutoSP: {describe(n)} mixes a sequence-reduced value (loss) "
                                  f"with per-token values; not supported")
            if is_rows(s):  # rank-local rows have no global order to gather into
                rw.replan("rows", s.order, f"{describe(n)} has no rule for rank-local rows")
            if is_distributed(s):
                gathered_grad |= bool(getattr(example(a), "requires_grad", False))
                return rw.gather(a)
            return rw.value(a)
        return a

    args = fx.node.map_aggregate(n.args, full)
    kwargs = fx.node.map_aggregate(n.kwargs, full)
    out = rw.emit(n, args, kwargs)
    written = mutated_operand(n)
    if written is not None and is_distributed(rw.state(written)):
        rw.redefine(written, rw.gather(written), REP)  # the op wrote into the gathered copy
    ev = example(n)
    outs = ev if isinstance(ev, (tuple, list)) else [ev]
    if gathered_grad and any(isinstance(o, torch.Tensor) and o.requires_grad and not any(
            rw.info.has_seq(s) for s in o.shape) for o in outs):
        reason += ("; the result has no sequence dim: every rank computes it, and where it "
                   "meets the loss or is returned its gradient is scaled by 1/P")
    rw.note_fallback(n, f"{reason} -> all_gather, full-sequence compute", out)
    rw.bind(n, out)
    if isinstance(ev, (tuple, list)):
        return tuple(REP for _ in ev)
    return REP
