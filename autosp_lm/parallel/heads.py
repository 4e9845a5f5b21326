"""How attention heads are split over a sequence-parallel group (one policy for every strategy).

Ulysses-style attention gives each of the ``P`` ranks ``H/P`` query heads over the whole
sequence, so ``P`` must divide ``H``. With grouped-query attention (``Hkv`` key/value heads,
query head ``h`` using kv head ``h // (H/Hkv)``) each kv head is repeated ``r`` times
(``repeat_interleave``, which keeps that grouping) so that every rank receives exactly the kv
heads its query heads use: the smallest ``r`` with ``P | Hkv*r`` and ``Hkv*r | H``
(``r = 1``: the kv heads are split like the query heads). Both the hand-written Ulysses baseline
and the AutoSP compiler use :func:`kv_replication`.

Head chunks (UPipe's "untied" Ulysses, ``--ulysses --attention-head-chunks K``): each rank's
``H/P`` query heads are attended in ``K`` chunks, one after the other. A chunk holds ``H/(P K)``
query heads of every rank and must use whole kv heads of that rank (``K`` divides the rank's
``Hkv r / P`` kv heads: each chunk exchanges its own) or a share of one kv head (the rank's kv
heads divide ``K``: consecutive chunks share one kv head, exchanged once for them):
:func:`head_chunks`.
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


def _chunk_fits(per_rank_q: int, per_rank_kv: int, k: int) -> bool:
    return k >= 1 and per_rank_q % k == 0 and (per_rank_kv % k == 0 or k % per_rank_kv == 0)


def chunk_counts(num_heads: int, num_kv_heads: int, sp_size: int) -> list[int]:
    """The head-chunk counts that split each rank's heads exactly over ``sp_size`` ranks (empty
    where the heads do not split over ``sp_size`` at all)."""
    r = replication_or_none(num_heads, num_kv_heads, sp_size)
    if r is None:
        return []
    hq, hk = num_heads // sp_size, num_kv_heads * r // sp_size
    return [k for k in range(1, hq + 1) if _chunk_fits(hq, hk, k)]


def head_chunks(num_heads: int, num_kv_heads: int, sp_size: int, chunks: int) -> int:
    """The number of head chunks each rank attends one after the other: ``chunks``, or for 0
    the most the heads allow (one query head of each rank a chunk: UPipe's choice); raises
    ValueError naming the numbers and the counts that work when ``chunks`` does not split each
    rank's heads into equal chunks of whole kv heads (or of one kv head's share)."""
    h, hkv, p = num_heads, num_kv_heads, sp_size
    r = kv_replication(h, hkv, p)  # (raises for heads that do not split over p at all)
    ok = chunk_counts(h, hkv, p)
    if chunks == 0:
        return ok[-1]
    if chunks not in ok:
        hq, hk = h // p, hkv * r // p
        raise ValueError(
            f"--attention-head-chunks {chunks} does not split each rank's {hq} query heads "
            f"({h} heads over {p} ranks) and the {hk} key/value head(s) they use into equal "
            f"chunks of whole kv heads or of one kv head's share; use one of "
            f"{', '.join(map(str, ok))} (0: {ok[-1]}, one query head of each rank a chunk)")
    return chunks
