"""Sharding rules, one module per op family, registered by op object in :mod:`.registry`.

The families share their helpers through :mod:`.common` (argument helpers, the Ulysses
all-to-all, sequence layouts and slices), which imports no rule module.

* :mod:`.pointwise` — elementwise and broadcasting ops, casts, ``*_like`` factories
* :mod:`.views` — view/reshape/transpose/expand/repeat/cat/stack/split/flip/roll/pad
* :mod:`.indexing` — slicing (shifts become padded layouts, constant-length slices a small
  replicated value), narrow/select
* :mod:`.halo` — short-range mixing along the sequence (conv1d, pad, roll, cat) by a halo
  exchange with the neighbouring ranks
* :mod:`.features` — linear, matmul, addmm, embedding, norms, ops along a feature dim
* :mod:`.scans` — cumsum/cumprod/logcumsumexp/cummax/cummin over the sequence: local scan plus an
  exclusive scan of the per-rank totals
* :mod:`.reductions` — reductions over features or over the sequence (-> ``all_reduce_loss``)
* :mod:`.meta` — size queries of sharded tensors, ``new_*`` factories
* :mod:`.attention` — Ulysses all-to-all around SDPA
* :mod:`.attention_region` — hand-written attention (matmul/einsum/bmm scores, masks, soft-capping,
  softmax, ``probs @ v``) as a region on the whole sequence for the local heads
* :mod:`.einsum` — einsum: region entries, per-token einsums, contractions over the sequence
* :mod:`.tokens` — token routing (MoE): sorts, gathers and scatters of this rank's own tokens
* :mod:`.counts` — counts over tokens: global (local + all_reduce_sum), or the group sizes of a
  rank's own sorted rows (a grouped kernel's offsets)
* :mod:`.loss` — cross entropy / nll_loss -> token-weighted global mean
* :mod:`.kernels` — kernels registered with ``autosp_lm.compiler.register_kernel``: token-local
  (grouped expert matmuls) on this rank's rows, per-head and attention kernels head-parallel
* :mod:`.tiled` — token-local regions run in sequence chunks (the tiling pass's calls)
* :mod:`.fallback` — gather, full-sequence compute, re-shard (not registered: the default)
"""
from . import (attention, attention_region, counts, einsum, features, halo,  # noqa: F401
               indexing, kernels, loss, meta, pointwise, reductions, scans, tiled, tokens, views)
from .loss import LOSS_OPS
from .registry import ACCEPTS, RULES, STATE_RULES, Replan, accepts, lookup, rule, state_rule

__all__ = ["RULES", "ACCEPTS", "STATE_RULES", "Replan", "accepts", "lookup", "rule", "state_rule",
           "LOSS_OPS"]
