"""The 2-D sequence-parallel mesh: an SP group of ``P = U x R`` ranks split into Ulysses groups
(``U`` consecutive ranks: all-to-all over heads, inside a node) and ring groups (the ranks with
the same Ulysses rank: point-to-point rotation of key/value blocks, across nodes).

SP rank ``i`` is Ulysses rank ``i % U`` of ring rank ``i // U`` (the layout of
:func:`autosp_lm.parallel.slicing.shard_fractions`). Creating process groups is collective over
the whole world, so :func:`ulysses_ring_groups` learns every SP group of the world with one
``all_gather_object`` and creates every group in the same order on every rank; the result is
cached per (SP group, U).
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist

from .rendezvous import new_group


@dataclass(frozen=True)
class SPMesh:
    ulysses_degree: int
    ring_degree: int
    ulysses_group: Optional[dist.ProcessGroup]  # None when U == 1
    ring_group: Optional[dist.ProcessGroup]  # None when R == 1
    ulysses_rank: int
    ring_rank: int


_CACHE: dict = {}


def forget_groups() -> None:
    """Forget the Ulysses / ring sub-groups made so far: they belong to one world (the memory
    planner's simulated worlds make them again in each)."""
    _CACHE.clear()


def node_size() -> int:
    """Ranks per node as the launcher says (``LOCAL_WORLD_SIZE``), else the visible GPUs, else 0
    (unknown)."""
    local = os.environ.get("LOCAL_WORLD_SIZE")
    if local:
        return int(local)
    if torch.cuda.is_available():
        return torch.cuda.device_count()
    return 0


def ulysses_ring_groups(sp_group: Optional[dist.ProcessGroup], ulysses_degree: int) -> SPMesh:
    """The Ulysses and ring groups of this rank for an SP group of ``P`` ranks and Ulysses degree
    ``U`` (``U`` must divide ``P``). Collective over the world the first time for a given
    ``(sp_group, U)``; every rank must call it with the same ``U``."""
    group = sp_group if sp_group is not None else dist.group.WORLD
    P = dist.get_world_size(group)
    U = int(ulysses_degree)
    problem = ulysses_degree_problem(P, U, U, U)
    if problem:
        raise ValueError(problem)
    R = P // U
    me = dist.get_rank(group)
    key = (tuple(dist.get_process_group_ranks(group)), U)
    if key not in _CACHE:
        if U == P or U == 1:
            u_group, r_group = (group, None) if U == P else (None, group)
        else:
            mine = list(key[0])
            everyone: list = [None] * dist.get_world_size()
            dist.all_gather_object(everyone, mine)
            u_group = r_group = None
            for ranks in sorted({tuple(g) for g in everyone}):
                for j in range(R):  # Ulysses groups: U consecutive SP ranks
                    members = list(ranks[j * U:(j + 1) * U])
                    g = new_group(members, "Ulysses group")
                    if ranks == key[0] and me // U == j:
                        u_group = g
                for u in range(U):  # ring groups: the same Ulysses rank of every ring rank
                    members = list(ranks[u::U])
                    g = new_group(members, "ring group")
                    if ranks == key[0] and me % U == u:
                        r_group = g
        _CACHE[key] = (u_group, r_group)
    u_group, r_group = _CACHE[key]
    return SPMesh(U, R, u_group, r_group, me % U, me // U)


def ulysses_degrees(sp_size: int, heads: int, kv_heads: int) -> list[int]:
    """The Ulysses degrees that split ``heads`` query / ``kv_heads`` kv heads and divide
    ``sp_size``, smallest first, then 1 (ring only, always possible)."""
    from .heads import splittable, working_sizes
    return [u for u in working_sizes(heads, kv_heads) if u > 1 and sp_size % u == 0
            and splittable(heads, kv_heads, u)] + [1]


def ulysses_degree_problem(sp_size: int, degree: int, heads: int, kv_heads: int) -> str:
    """Why a requested Ulysses ``degree`` cannot be used with ``sp_size`` ranks and an attention
    of ``heads`` query / ``kv_heads`` kv heads, with the degrees that can ("" when it can). The
    compiler's plan and the ``--autosp`` flag check share this text."""
    from .heads import splittable
    if degree < 1 or sp_size % degree:
        return (f"--ulysses-degree {degree} does not divide the sequence-parallel size "
                f"{sp_size}; use a divisor of {sp_size}")
    if degree > 1 and not splittable(heads, kv_heads, degree):
        ok = ", ".join(map(str, ulysses_degrees(sp_size, heads, kv_heads)))
        return (f"{heads} query heads and {kv_heads} key/value heads cannot be split over "
                f"--ulysses-degree {degree}; Ulysses degrees that work with P={sp_size}: {ok} "
                f"(the rest of P is a ring)")
    return ""


def choose_ulysses_degree(sp_size: int, heads: list[tuple[int, int]],
                          nodes: Optional[int] = None) -> tuple[int, str]:
    """The Ulysses degree of the 2-D plan and why: the largest ``U`` dividing ``sp_size`` that
    fits one node (``nodes``: ranks per node, 0/None unknown) and splits every attention's query
    heads, replicating kv heads where ``U`` exceeds their count (as Ulysses alone does): a larger
    ``U`` means a shorter ring and, at ``U = sp_size``, no ring and no constraint on the layout.
    ``heads`` is ``[(query heads, kv heads), ...]``."""
    from .heads import splittable
    cap = nodes or sp_size
    divisors = [u for u in range(sp_size, 0, -1) if sp_size % u == 0 and u <= cap]
    fits = [u for u in divisors if all(h % u == 0 and splittable(h, hk, u) for h, hk in heads)]
    heads_txt = ", ".join(sorted({f"{h}/{hk}" for h, hk in heads})) or "none"
    node_txt = f"{nodes} ranks per node" if nodes else "node size unknown"
    if fits:
        U = fits[0]
        replicated = any(hk % U for _, hk in heads)
        why = (f"largest U dividing P={sp_size} within one node ({node_txt}) that splits the "
               f"query/kv heads ({heads_txt})" + ("; kv heads replicated" if replicated else ""))
    else:
        U = 1
        why = f"no U > 1 splits the heads ({heads_txt}) of P={sp_size}: ring only"
    return U, why
