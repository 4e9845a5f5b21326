"""How attention heads are split over a sequence-parallel group (one policy for every strategy).

Ulysses-style attention gives each of the ``P`` ranks ``H/P`` query heads over the whole
sequence, so ``P`` must divide ``H``. With grouped-query attention (``Hkv`` key/value heads,
query head ``h`` using kv head ``h // (H/Hkv)``) each kv head is repeated ``r`` times
(``repeat_interleave``, which keeps that grouping) so that every rank receives exactly the kv
heads its query heads use: the smallest ``r`` with ``P | Hkv*r`` and ``Hkv*r | H``
(``r = 1``: the kv heads are split like the query heads). Both the hand-written Ulysses baseline
and the AutoSP compiler use :func:`kv_replication`.
"""
from __future__ import annotations

from typing import Optional


def replication_or_none(h: int, hkv: int, p: int) -> Optional[int]:
    """:func:`kv_replication` or None where the heads cannot be split."""
    if hkv <= 0 or h % hkv or h % p:
        return None
    for r in range(1, h // hkv + 1):
        if (h // hkv) % r == 0 and (hkv * r) % p == 0:
            return r
    return None


def splittable(num_heads: int, num_kv_heads: int, sp_size: int) -> bool:
    """Whether the heads can be split exactly over ``sp_size`` ranks."""
    return replication_or_none(num_heads, num_kv_heads, sp_size) is not None


def working_sizes(num_heads: int, num_kv_heads: int) -> list[int]:
    """The sequence-parallel sizes > 1 over which the heads split exactly."""
    return [p for p in range(2, num_heads + 1) if splittable(num_heads, num_kv_heads, p)]


def kv_replication(num_heads: int, num_kv_heads: int, sp_size: int) -> int:
    """The kv-head replication factor ``r`` for ``sp_size`` ranks; raises ValueError naming the
    numbers (and the sizes that would work) when the heads cannot be split exactly."""
    h, hkv, p = num_heads, num_kv_heads, sp_size
    if hkv <= 0 or h % hkv:
        raise ValueError(f"{h} query heads are not a multiple of {hkv} key/value heads")
    r = replication_or_none(h, hkv, p)
    if r is None:
        ok = working_sizes(h, hkv)
        raise ValueError(
            f"{h} query heads and {hkv} key/value heads cannot be split over sequence-parallel "
            f"size {p} (every rank needs the same number of query heads and the kv heads they "
            f"use); sequence-parallel sizes that work: {', '.join(map(str, ok)) or 'none'}")
    return r
