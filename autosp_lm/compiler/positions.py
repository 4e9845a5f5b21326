"""Pass 4 — positions and other full-sequence values: shard them where they meet per-token work.

Expects: a replicated *full* value (computed on the whole sequence on every rank: ``labels``,
``labels[:, 1:]``, ``F.pad(labels, ...)``, ``torch.arange(S)``, RoPE cos/sin tables, a
``position_ids`` input) that the sharding pass is about to combine with sharded per-token compute
(an embedding, a linear, a multiply with sharded activations, a loss).

Rewrites: inserts, right before that use, the nodes that take this rank's chunk of the value in
the consumer's layout (:class:`~autosp_lm.compiler.common.Shard`): an optional reshape that
un-merges the sequence (``[B*L] -> [B, L]``), a constant pad of shifted values back to the input
length ``S`` (``fill`` = ``ignore_index`` for loss targets, 0 otherwise), ``narrow`` of the chunk
``[r*S/P, (r+1)*S/P)``, and the reshape back. One chunk is made per (value, layout) and reused.

Afterwards: every rank computes with its *global* positions (arange and cos/sin tables are
sharded like the tokens), shifted targets line up with the logits of the same positions, and
padded positions carry ``fill``.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .common import Shard, static_int


def localize(rw, node, shard: Shard, fill=0):
    """This rank's chunk of the full value ``node`` (an original graph node) in ``shard``."""
    key = (node, shard, fill)
    if key in rw.local_cache:
        return rw.local_cache[key]
    shape = rw.info.shape(node)
    d = shard.dim
    x = rw.env[node]
    if shard.merged:
        pre = [static_int(s, f"dimension {i} of {node.name}") for i, s in enumerate(shape[:d])]
        post = [static_int(s, f"dimension {i} of {node.name}") for i, s in enumerate(shape[d + 1:])]
        x = rw.method("reshape", x, pre + [shard.outer, -1, shard.inner] + post)
        d, nd = d + 1, len(shape) + 2
    else:
        nd = len(shape)
    if shard.padded:
        pad = [0, 0] * (nd - 1 - d) + [shard.pad_left, shard.pad_right]
        x = rw.call(F.pad, x, pad, value=fill)
    x = rw.call(torch.narrow, x, d, rw.chunk_start(), rw.chunk_len())
    if shard.merged:
        x = rw.method("reshape", x, pre + [-1] + post)
    else:
        x = rw.method("contiguous", x)
    rw.local_cache[key] = x
    return x


def fresh_shard(rw, node):
    """A layout for a full value that meets sharded compute for the first time: its first
    dimension of size ``c * (S - k)`` (``c > 1`` = the sequence merged with ``c`` outer rows)."""
    shape = rw.info.shape(node)
    if shape is None:
        return None
    for i, s in enumerate(shape):
        if rw.info.has_seq(s):
            lo = rw.info.length_offset(s)
            if lo is None:
                return None
            c, k = lo
            return Shard(i, c, 1, 0, k)
    return None
