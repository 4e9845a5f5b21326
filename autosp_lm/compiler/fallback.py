"""Pass 6 — anything else: gather the sequence, compute, re-shard.

Expects: an op with sharded inputs that no sharding rule understands (``cumsum``/``sort``/``flip``
over the sequence, a slice that is not a shift, a matmul contracting the sequence, an op unknown
to AutoSP ...).

Rewrites: every sharded input is all-gathered along its sequence dimension
(``autosp_lm::all_gather``, whose backward is a reduce-scatter) and un-padded back to its logical
length; the op runs on the full sequence on every rank. Its output is a replicated full value;
the next consumer that does per-token work takes this rank's chunk again (pass 4), so the
gradient flowing back into the replicated region is non-zero only on this rank's chunk and the
reduce-scatter adds the ranks' contributions: gradients stay exact. The report names each
fallback with its source line.

Afterwards: results are exact, only slower. Cases that cannot be made exact this way (an unknown
op that reduces the whole sequence of a value that requires grad, a shifted layout meeting an
op that mixes positions) raise :class:`AutoSPError` instead.
"""
from __future__ import annotations

import torch
import torch.fx as fx

from .common import REDUCED, AutoSPError, Shard, describe, example, is_shard, static_int


def gather(rw, node):
    """The full value of the sharded original node ``node`` (cached per node)."""
    if node in rw.gather_cache:
        return rw.gather_cache[node]
    shard: Shard = rw.st(node)
    shape = rw.info.shape(node)
    d = shard.dim
    x = rw.arg(node)
    if shard.merged:
        pre = [static_int(s, f"dimension {i} of {node.name}") for i, s in enumerate(shape[:d])]
        post = [static_int(s, f"dimension {i} of {node.name}") for i, s in enumerate(shape[d + 1:])]
        x = rw.method("reshape", x, pre + [shard.outer, -1, shard.inner] + post)
        d += 1
    x = rw.method("contiguous", x)
    x = rw.call(torch.ops.autosp_lm.all_gather.default, x, d, rw.info.group, rw.info.world)
    rw.report.collective("all_gather", bool(getattr(example(node), "requires_grad", False)))
    if shard.padded:
        length = rw.sym(rw.info.symbol - shard.pad_left - shard.pad_right)
        x = rw.call(torch.narrow, x, d, shard.pad_left, length)
    if shard.merged:
        x = rw.method("reshape", x, pre + [-1] + post)
    rw.gather_cache[node] = x
    return x


def fallback(rw, n: fx.Node, reason: str = "no sharding rule") -> object:
    """Run ``n`` on the full sequence (see the module docstring); returns the replicated state."""
    gathered_grad = False

    def full(a):
        nonlocal gathered_grad
        if isinstance(a, fx.Node):
            s = rw.st(a)
            if s is REDUCED:
                raise AutoSPError(f"AutoSP: {describe(n)} mixes a sequence-reduced value (loss) "
                                  f"with per-token values; not supported")
            if is_shard(s):
                gathered_grad |= bool(getattr(example(a), "requires_grad", False))
                return gather(rw, a)
            return rw.arg(a)
        return a

    args = fx.node.map_aggregate(n.args, full)
    kwargs = fx.node.map_aggregate(n.kwargs, full)
    out = rw.emit(n, args, kwargs)
    ev = example(n)
    outs = ev if isinstance(ev, (tuple, list)) else [ev]
    for o in outs:
        if isinstance(o, torch.Tensor) and o.requires_grad and gathered_grad:
            if not any(rw.info.has_seq(s) for s in o.shape):
                raise AutoSPError(
                    f"AutoSP: {describe(n)} reduces the whole sequence of a value that requires "
                    f"grad in a way AutoSP cannot split exactly ({reason}); use sum/mean or "
                    f"F.cross_entropy, or compute it outside the model")
    rw.report.fallbacks.append(f"{describe(n)}: {reason} -> all_gather, full-sequence compute")
    rw.env[n] = out
    from .common import REP
    if isinstance(ev, (tuple, list)):
        return tuple(REP for _ in ev)
    return REP
