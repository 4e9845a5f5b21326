"""Graph pass — plan the sequence parallelism: the Ulysses x Ring factorisation and the layout.

Expects
    The Dynamo graph and the :class:`~autosp_lm.compiler.graph.SequenceInfo` of
    :mod:`.find_sequence` (SP size ``P``, this rank). Options: ``ulysses_degree`` (None: chosen
    here).

Rewrites
    Nothing in the graph. It reads the head counts of every attention op
    (``scaled_dot_product_attention``, FlexAttention), chooses ``U`` (given, or the largest
    divisor of ``P`` that fits one node and splits the heads, preferring no kv replication:
    :func:`autosp_lm.parallel.mesh.choose_ulysses_degree`), ``R = P / U``, creates the Ulysses and
    ring process groups (collective over the world, once per factorisation) and sets
    ``info.plan``: this rank's positions (contiguous when ``R == 1``; the zigzag split with
    Ulysses degree ``U`` when ``R > 1``, so that causal attention over the ring is balanced).

Holds afterwards
    Every later pass reads the layout from ``info.plan``: the sharding pass takes chunks and
    gathers in it, the attention rule exchanges over the Ulysses group and rotates over the ring
    group. ``R > 1`` requires the sequence length to be a multiple of ``2P`` and attention
    through SDPA (FlexAttention runs under ``R == 1`` only); both are checked here, with the
    numbers and the fix in the error.
"""
from __future__ import annotations

import torch.fx as fx

from autosp_lm.parallel.mesh import (choose_ulysses_degree, node_size, ulysses_degree_problem,
                                     ulysses_degrees, ulysses_ring_groups)
from autosp_lm.parallel.slicing import CONTIGUOUS, ZIGZAG, shard_fractions

from ..graph import AutoSPError, SPPlan, describe, example, static_int, target_key
from ..rules.attention import FLEX_OPS, SDPA_OPS, bind_sdpa
from .sac_cost import hint


def attention_heads(gm: fx.GraphModule) -> list:
    """``[(node, query heads, kv heads, kind)]`` of the attention ops of the graph."""
    out = []
    for n in gm.graph.nodes:
        key = target_key(n)
        if key in SDPA_OPS:
            b = bind_sdpa(n)
            q, k = b["query"], b["key"]
            kind = "sdpa"
        elif key in FLEX_OPS:
            q, k = n.args[0], n.args[1]
            kind = "flex"
        else:
            continue
        if example(q) is None or example(q).dim() < 3:
            continue
        out.append((n, static_int(example(q).shape[-3], "number of query heads"),
                    static_int(example(k).shape[-3], "number of key/value heads"), kind))
    return out


def _group_name(group) -> str:
    if group is None:
        return ""
    from autosp_lm.parallel.collectives import group_name
    return group_name(group)


def plan_sequence_parallel(gm: fx.GraphModule, info, sp_group, ulysses_degree=None) -> SPPlan:
    P = info.world
    atts = attention_heads(gm)
    heads = [(h, hk) for _, h, hk, _ in atts]
    if ulysses_degree is None:
        U, why = choose_ulysses_degree(P, heads, node_size())
        if P == 1:
            U, why = 1, "one rank"
    else:
        U = int(ulysses_degree)
        for n, h, hk, _ in atts or [(None, U, U, None)]:
            problem = ulysses_degree_problem(P, U, h, hk)
            if problem:
                raise AutoSPError("AutoSP: " + (f"{describe(n)}: " if n is not None else "")
                                  + problem)
        why = f"ulysses_degree={U} requested"
    R = P // U
    if R > 1:
        for n, _, _, kind in atts:
            if kind != "sdpa":
                raise AutoSPError(f"AutoSP: {describe(n)}: FlexAttention is supported with the "
                                  f"Ulysses plan only (ring degree 1), but the plan has ring "
                                  f"degree {R}; use ulysses_degree={P} (--ulysses-degree {P}) "
                                  f"or SDPA with a mask")
        length = seq_hint(info)
        if length is not None and length > 0 and length % (2 * P):
            pure = all(P in ulysses_degrees(P, h, hk) for _, h, hk, _ in atts)
            raise AutoSPError(f"AutoSP: sequence length {length} is not a multiple of 2 x "
                              f"sequence-parallel size = {2 * P}, which the load-balanced ring "
                              f"layout of the {U} x {R} plan needs; use a multiple of {2 * P}"
                              + (f" or --ulysses-degree {P} (no ring)" if pure else ""))
    mesh = ulysses_ring_groups(sp_group, U) if P > 1 else None
    layout = CONTIGUOUS if R == 1 else ZIGZAG
    ranges = tuple(shard_fractions(P, info.rank, layout, U))
    everyone = tuple(tuple(shard_fractions(P, r, layout, U)) for r in range(P))
    return SPPlan(ulysses_degree=U, ring_degree=R,
                  ulysses_group=_group_name(mesh.ulysses_group) if mesh and U > 1 else "",
                  ring_group=_group_name(mesh.ring_group) if mesh and R > 1 else "",
                  ranges=ranges, all_ranges=everyone, reason=why)


def seq_hint(info):
    """The traced sequence length (the symbol's hint), or None."""
    ev = example(info.seq_placeholder)
    if ev is None:
        return None
    return hint(ev.shape[info.seq_dim], fallback=-1)


def attention_pairs(plan: SPPlan, seq_len: int, causal: bool = True) -> list[int]:
    """The query-key pairs each SP rank's attention computes under ``plan`` for a sequence of
    ``seq_len`` (causal): after the Ulysses all-to-all a rank computes its ring shard's rows for
    ``H/U`` heads, so the figure is ``sum over the ring shard's positions q of (q + 1)`` (for one
    head group). Equal across ranks for the zigzag layout."""
    out = []
    P = len(plan.all_ranges)
    U = plan.ulysses_degree
    for r in range(P):
        j = r // U
        shard = [x for rr in range(j * U, (j + 1) * U) for x in plan.all_ranges[rr]]
        total = 0
        for start, length in shard:
            a, b = int(start * seq_len), int((start + length) * seq_len)
            total += (b * (b + 1) - a * (a + 1)) // 2 if causal else (b - a) * seq_len
        out.append(total)
    return out
