"""Sharding rules, one module per op family, registered by op object in :mod:`.registry`.

* :mod:`.pointwise` — elementwise and broadcasting ops, casts, ``*_like`` factories
* :mod:`.views` — view/reshape/transpose/expand/repeat/cat/stack/split/flip/roll/pad
* :mod:`.indexing` — slicing (shifts become padded layouts), narrow/select
* :mod:`.features` — linear, matmul, addmm, embedding, norms, ops along a feature dim
* :mod:`.reductions` — reductions over features or over the sequence (-> ``all_reduce_loss``)
* :mod:`.meta` — size queries of sharded tensors, ``new_*`` factories
* :mod:`.attention` — Ulysses all-to-all around SDPA
* :mod:`.loss` — cross entropy / nll_loss -> token-weighted global mean
* :mod:`.tiled` — token-local regions run in sequence chunks (the tiling pass's calls)
* :mod:`.fallback` — gather, full-sequence compute, re-shard (not registered: the default)
"""
from . import (attention, features, indexing, loss, meta, pointwise, reductions,  # noqa: F401
               tiled, views)
from .loss import LOSS_OPS
from .registry import RULES, lookup, rule

__all__ = ["RULES", "lookup", "rule", "LOSS_OPS"]
