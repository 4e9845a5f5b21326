"""Rules: a token-local region run in sequence chunks (:func:`~autosp_lm.compiler.tiling.run_tiled`,
put into the graph by :mod:`~autosp_lm.compiler.passes.tile_sequence`). Every token is computed
independently, so the region runs on this rank's chunk: its sequence inputs in one sharded
layout (replicated full ones are chunked in it), its outputs sharded the same way."""
from __future__ import annotations

from ..graph import REP, is_shard
from ..tiling import REGIONS, run_tiled
from .registry import rule


@rule(run_tiled)
def tiled_region(rw, n):
    key, chunks, *inputs = n.args
    region = REGIONS[key]
    target = None
    for a, d in zip(inputs, region.in_dims):
        s = rw.state(a)
        if not is_shard(s):
            continue
        if d is None or s.dim != d or (target is not None and not s.same_sequence(target)):
            return rw.fallback(n, "region inputs sharded in different layouts")
        target = target or s
    if target is None:
        rw.emit_local(n)
        return tuple(REP for _ in region.out_dims)
    args = [key, chunks]
    for a, d in zip(inputs, region.in_dims):
        if d is not None and not is_shard(rw.state(a)):
            args.append(rw.localize(a, target.with_dim(d)))
        else:
            args.append(rw.value(a))
    rw.bind(n, rw.emit(n, args, {}))
    return tuple(target.with_dim(d) for d in region.out_dims)
