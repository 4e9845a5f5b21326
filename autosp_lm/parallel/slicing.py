"""Batch slicing, position ids and the sequence-parallel loss for the hand-written baselines.

Every rank of an SP group receives the same full-length micro batch ``[B, S]`` and keeps its
share of the sequence:

* **contiguous** (Ulysses): rank ``r`` of ``P`` keeps tokens ``[r*S/P, (r+1)*S/P)``. Ulysses'
  all-to-all gathers the sequence back in rank order, so the blocks must be in that order.
* **zigzag** (Ring, load balanced): the sequence is cut into ``2P`` chunks of ``S/(2P)`` tokens
  and rank ``r`` keeps chunks ``r`` and ``2P-1-r`` (in that order). With causal attention chunk
  ``c`` attends to ``c+1`` chunks, so every rank attends to ``(r+1) + (2P-r) = 2P+1`` chunks: the
  same work on every rank, where a contiguous split would leave the last rank ``2P-1`` times the
  work of the first.
* **zigzag with a Ulysses degree** ``U`` (the 2-D plan, ``P = U x R``): SP rank ``i`` is Ulysses
  rank ``u = i % U`` of ring rank ``j = i // U`` (Ulysses groups are ``U`` consecutive ranks, on
  one node). The sequence is cut into ``2R`` chunks; ring rank ``j`` owns chunks ``j`` and
  ``2R-1-j`` (its *ring shard*, ``S/R`` tokens) and its ``U`` ranks hold the shard's ``U``
  consecutive pieces of ``S/P`` tokens, so the Ulysses all-to-all over the ``U`` ranks rebuilds
  the ring shard in order, for ``H/U`` heads. ``U = 1`` is the plain zigzag, ``U = P`` the
  contiguous split.

Position ids follow the tokens (``arange(S)`` of the *global* positions when the batch has none),
so RoPE and learned position embeddings see the single-device positions.

The loss of a rank is ``sum of CE over its non-ignored tokens / number of non-ignored tokens of
the whole micro batch``. The denominator is computed from the full labels every rank already
holds (no collective), so summing the ranks' losses (and their gradients) gives the single-device
mean; a rank whose tokens are all ignored contributes exactly 0.
"""
from __future__ import annotations

from fractions import Fraction
from typing import Optional

import torch
import torch.distributed as dist

from ..models.loss import IGNORE_INDEX, lm_cross_entropy

CONTIGUOUS = "contiguous"
ZIGZAG = "zigzag"
LAYOUTS = (CONTIGUOUS, ZIGZAG)


def check_sequence_length(seq_len: int, sp_size: int, layout: str = CONTIGUOUS,
                          strategy: str = "sequence parallelism") -> None:
    """Raise a ValueError naming the numbers when ``seq_len`` cannot be split ``sp_size`` ways."""
    if layout not in LAYOUTS:
        raise ValueError(f"unknown sequence layout {layout!r}; choose one of {LAYOUTS}")
    div = 2 * sp_size if layout == ZIGZAG else sp_size
    if seq_len % div:
        what = (f"2 x sequence-parallel size = 2 x {sp_size} = {div} (the load-balanced ring splits "
                f"the sequence into chunks of which each rank holds two halves)" if layout == ZIGZAG
                else f"the sequence-parallel size {sp_size}")
        lower, upper = (seq_len // div) * div, (seq_len // div + 1) * div
        hint = f"{upper}" if lower == 0 else f"{lower} or {upper}"
        raise ValueError(f"{strategy}: sequence length {seq_len} is not divisible by {what}; "
                         f"use --seq-length {hint} (a multiple of {div}) or change "
                         f"--sequence-parallel-size")


def shard_fractions(sp_size: int, sp_rank: int, layout: str = CONTIGUOUS,
                    ulysses_degree: int = 1) -> list[tuple[Fraction, Fraction]]:
    """The ``(start, length)`` ranges, as fractions of the sequence length, of the positions
    ``sp_rank`` holds, in its local order (module docstring: the layouts). ``ulysses_degree``
    applies to the zigzag layout (``U``; ``R = sp_size / U`` ring ranks)."""
    if not 0 <= sp_rank < sp_size:
        raise ValueError(f"sp_rank {sp_rank} is outside [0, {sp_size})")
    if layout == CONTIGUOUS:
        return [(Fraction(sp_rank, sp_size), Fraction(1, sp_size))]
    if layout not in LAYOUTS:
        raise ValueError(f"unknown sequence layout {layout!r}; choose one of {LAYOUTS}")
    U = ulysses_degree
    if U < 1 or sp_size % U:
        raise ValueError(f"Ulysses degree {U} does not divide the sequence-parallel size {sp_size}")
    R = sp_size // U
    j, u = divmod(sp_rank, U)
    c = Fraction(1, 2 * R)  # a chunk; the ring shard is [chunk j | chunk 2R-1-j]
    parts = [(j * c, c), ((2 * R - 1 - j) * c, c)]
    lo, hi = Fraction(u, sp_size), Fraction(u + 1, sp_size)  # this piece of the shard (as S)
    out, offset = [], Fraction(0)
    for start, length in parts:  # intersect [lo, hi) with the shard's parts, in shard order
        a, b = max(lo, offset), min(hi, offset + length)
        if b > a:
            out.append((start + (a - offset), b - a))
        offset += length
    return out


def shard_ranges(seq_len: int, sp_size: int, sp_rank: int, layout: str = CONTIGUOUS,
                 ulysses_degree: int = 1) -> list[tuple[int, int]]:
    """The ``[start, end)`` ranges of global token positions that ``sp_rank`` holds, in order."""
    check_sequence_length(seq_len, sp_size, layout)
    return [(int(a * seq_len), int((a + n) * seq_len))
            for a, n in shard_fractions(sp_size, sp_rank, layout, ulysses_degree)]


def shard_positions(seq_len: int, sp_size: int, sp_rank: int, layout: str = CONTIGUOUS,
                    device=None, ulysses_degree: int = 1) -> torch.Tensor:
    """The global positions held by ``sp_rank`` as a LongTensor ``[S/P]``."""
    return torch.cat([torch.arange(a, b, device=device) for a, b in
                      shard_ranges(seq_len, sp_size, sp_rank, layout, ulysses_degree)])


def slice_sequence(x: torch.Tensor, sp_size: int, sp_rank: int, layout: str = CONTIGUOUS,
                   dim: int = 1, ulysses_degree: int = 1) -> torch.Tensor:
    """This rank's share of ``x`` along its sequence dimension ``dim``."""
    parts = [x.narrow(dim, a, b - a) for a, b in
             shard_ranges(x.size(dim), sp_size, sp_rank, layout, ulysses_degree)]
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=dim)


def attention_pairs_per_rank(document_ids: torch.Tensor, sp_size: int,
                             layout: str = CONTIGUOUS, ulysses_degree: int = 1) -> list[int]:
    """Causal query-key pairs within documents that each rank's queries attend to (the work of
    its attention), for ``document_ids [B, S]``: position ``p`` sees ``p - start(p) + 1`` keys,
    ``start(p)`` the first position of its document."""
    b, s = document_ids.shape
    idx = torch.arange(s, device=document_ids.device).expand(b, s)
    starts = torch.ones_like(document_ids, dtype=torch.bool)
    starts[:, 1:] = document_ids[:, 1:] != document_ids[:, :-1]
    first = torch.cummax(torch.where(starts, idx, torch.zeros_like(idx)), dim=1).values
    seen = (idx - first + 1).sum(0)  # [S], over the batch
    return [int(seen[shard_positions(s, sp_size, r, layout, device=seen.device,
                                     ulysses_degree=ulysses_degree)].sum())
            for r in range(sp_size)]


def gather_sequence(parts: list[torch.Tensor], layout: str = CONTIGUOUS, dim: int = 1,
                    ulysses_degree: int = 1) -> torch.Tensor:
    """Inverse of :func:`slice_sequence`: put every rank's share (rank order) back in sequence order."""
    if layout == CONTIGUOUS:
        return torch.cat(parts, dim=dim)
    seq_len = sum(t.size(dim) for t in parts)
    pos = torch.cat([shard_positions(seq_len, len(parts), r, layout, parts[0].device,
                                     ulysses_degree) for r in range(len(parts))])
    return torch.cat(parts, dim=dim).index_select(dim, torch.argsort(pos))


def slice_batch(batch: dict, sp_size: int, sp_rank: int, layout: str = CONTIGUOUS,
                strategy: str = "sequence parallelism", ulysses_degree: int = 1) -> dict:
    """This rank's ``input_ids``, ``labels``, ``position_ids`` (each ``[B, S/P]``; positions
    ``[1, S/P]`` when the batch has none) and ``document_ids`` (when the batch has them) from a
    full-length batch."""
    ids = batch["input_ids"]
    seq_len = ids.size(1)
    check_sequence_length(seq_len, sp_size, layout, strategy)
    kw = dict(sp_size=sp_size, sp_rank=sp_rank, layout=layout, ulysses_degree=ulysses_degree)
    pos = batch.get("position_ids")
    if pos is None:
        pos = shard_positions(seq_len, device=ids.device, **kw).unsqueeze(0)
    else:
        pos = slice_sequence(pos, **kw)
    out = {"input_ids": slice_sequence(ids, **kw), "position_ids": pos}
    if batch.get("document_ids") is not None:
        out["document_ids"] = slice_sequence(batch["document_ids"], **kw)
    labels = batch.get("labels")
    out["labels"] = None if labels is None else slice_sequence(labels, **kw)
    return out


# --------------------------------------------------------------------------------------------
# loss
# --------------------------------------------------------------------------------------------
class LocalLossSum(torch.nn.Module):
    """``model`` followed by the *sum* of cross entropy over the local non-ignored tokens.

    Wrapping both in one module lets ``torch.compile`` see the loss too (the fp32 logits are not
    kept for backward outside the graph).
    """

    def __init__(self, model: torch.nn.Module, loss_head=None):
        super().__init__()
        self.model = model
        # a fused loss head (strategies.memory.ChunkedLossHead): the model's output layer returns
        # the summed cross entropy of ``loss_head.labels`` itself, no logits
        self.loss_head = loss_head

    def forward(self, input_ids: torch.Tensor, position_ids: Optional[torch.Tensor],
                labels: torch.Tensor, document_ids: Optional[torch.Tensor] = None) -> torch.Tensor:
        kwargs = {"position_ids": position_ids}
        if document_ids is not None:
            kwargs["document_ids"] = document_ids
        if self.loss_head is None:
            return lm_cross_entropy(self.model(input_ids, **kwargs), labels, reduction="sum")
        self.loss_head.labels = labels
        out = self.model(input_ids, **kwargs)
        self.loss_head.labels = None
        return self.loss_head.result(out)


def global_token_count(labels: torch.Tensor) -> torch.Tensor:
    """Non-ignored target tokens of the full micro batch (every SP rank computes the same)."""
    return (labels != IGNORE_INDEX).sum()


def sp_loss(local_sum: torch.Tensor, full_labels: torch.Tensor,
            group: Optional[dist.ProcessGroup] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(loss_for_backward, reported)`` from this rank's CE sum and the batch's full labels.

    ``loss_for_backward = local_sum / global_count``; ``reported`` is its detached sum over the SP
    group (the single-device mean loss, identical on every rank; ``group=None``: a single rank,
    nothing to reduce). A micro batch without any
    target token reports 0 (the single-device mean would be 0/0) so training never sees a NaN.
    """
    count = global_token_count(full_labels).clamp(min=1).to(local_sum.dtype)
    loss = local_sum / count
    reported = loss.detach().clone()
    if group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(reported, group=group)
    return loss, reported
