"""Sharding rules, one module per op family, registered by op object in :mod:`.registry`.

* :mod:`.pointwise` — elementwise and broadcasting ops, casts, ``*_like`` factories
* :mod:`.views` — view/reshape/transpose/expand/repeat/cat/stack/split/flip/roll/pad
* :mod:`.indexing` — slicing (shifts become padded layouts, constant-length slices a small
  replicated value), narrow/select
* :mod:`.halo` — short-range mixing along the sequence (conv1d, pad, roll, cat) by a halo
  exchange with the neighbouring ranks
* :mod:`.features` — linear, matmul, addmm, embedding, norms, ops along a feature dim
* :mod:`.reductions` — reductions over features or over the sequence (-> ``all_reduce_loss``)
* :mod:`.meta` — size queries of sharded tensors, ``new_*`` factories
* :mod:`.attention` — Ulysses all-to-all around SDPA
* :mod:`.loss` — cross entropy / nll_loss -> token-weighted global mean
* :mod:`.fallback` — gather, full-sequence compute, re-shard (not registered: the default)
"""
from . import (attention, features, halo, indexing, loss, meta, pointwise,  # noqa: F401
               reductions, views)
from .loss import LOSS_OPS
from .registry import ACCEPTS, RULES, STATE_RULES, Replan, accepts, lookup, rule, state_rule

__all__ = ["RULES", "ACCEPTS", "STATE_RULES", "Replan", "accepts", "lookup", "rule", "state_rule",
           "LOSS_OPS"]
