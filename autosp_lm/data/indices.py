"""Megatron's sample index arrays: the documents of each epoch (``doc_idx``), where each sample
starts (``sample_idx``), the order samples are served in (``shuffle_idx``) and the interleaving of
blended datasets. Pure functions of their inputs (numpy); :mod:`.gpt_dataset` caches them."""
from __future__ import annotations

from typing import Sequence

import numpy as np

BLEND_WINDOW = 1 << 16  # interleaving keys are merged this many samples at a time


def num_epochs_for(tokens_per_epoch: int, seq_length: int, num_samples: int) -> int:
    """Fewest epochs whose stream holds ``num_samples`` samples of ``seq_length + 1`` tokens."""
    if tokens_per_epoch <= 0:
        raise ValueError("cannot make samples from a split with no tokens")
    return max(1, -(-(num_samples * seq_length + 1) // tokens_per_epoch))


def samples_in(tokens: int, seq_length: int) -> int:
    """Samples a stream of ``tokens`` tokens holds (consecutive samples share one token)."""
    return max(0, (tokens - 1) // seq_length)


def build_document_index(documents: np.ndarray, num_epochs: int, seed: int) -> np.ndarray:
    """The split's documents, permuted anew for each epoch, epochs back to back."""
    dt = np.int32 if documents.size == 0 or documents.max() < 2**31 - 1 else np.int64
    out = np.empty(documents.size * num_epochs, dtype=dt)
    for e in range(num_epochs):
        out[e * documents.size:(e + 1) * documents.size] = \
            np.random.default_rng([seed, e]).permutation(documents)
    return out


def build_sample_index(stream_lengths: np.ndarray, seq_length: int, num_samples: int) -> np.ndarray:
    """``[num_samples + 1, 2]``: (doc_idx position, token offset) where each sample starts."""
    ends = np.cumsum(stream_lengths, dtype=np.int64)
    starts_pos = np.arange(num_samples + 1, dtype=np.int64) * seq_length
    doc = np.searchsorted(ends, starts_pos, side="right")
    if num_samples and doc[-1] >= stream_lengths.size:
        raise AssertionError("sample index ran past the document stream")
    offset = starts_pos - (ends[doc] - stream_lengths[doc])
    big = (doc.max(initial=0) >= 2**31 - 1) or (offset.max(initial=0) >= 2**31 - 1)
    return np.stack([doc, offset], axis=1).astype(np.int64 if big else np.int32)


def build_shuffle_index(block_ends: Sequence[int], seed: int) -> np.ndarray:
    """A permutation of ``range(block_ends[-1])`` that shuffles within each block."""
    total = int(block_ends[-1]) if len(block_ends) else 0
    dt = np.uint32 if total < 2**32 - 1 else np.int64
    out = np.empty(total, dtype=dt)
    start = 0
    for b, end in enumerate(block_ends):
        out[start:end] = start + np.random.default_rng([seed, b, 1]).permutation(end - start)
        start = end
    return out


def build_blend_indices(weights: Sequence[float], size: int) -> tuple[np.ndarray, np.ndarray]:
    """(dataset_index, dataset_sample_index) for ``size`` samples: dataset ``j``'s ``k``-th sample
    has key ``(k + 0.5) / w_j``; samples are served in key order (ties: lower ``j`` first)."""
    w = np.asarray(weights, dtype=np.float64)
    if w.ndim != 1 or w.size == 0 or np.any(w <= 0):
        raise ValueError(f"blend weights must be positive, got {list(weights)}")
    w = w / w.sum()
    dataset_index = np.empty(size, dtype=np.int16 if w.size < 2**15 else np.int32)
    sample_index = np.empty(size, dtype=np.int64)
    taken = np.zeros(w.size, dtype=np.int64)
    filled, horizon = 0, 0.0
    while filled < size:
        horizon += BLEND_WINDOW
        upto = np.maximum(np.ceil(horizon * w - 0.5).astype(np.int64), taken)
        ks = [np.arange(taken[j], upto[j], dtype=np.int64) for j in range(w.size)]
        keys = np.concatenate([(k + 0.5) / w[j] for j, k in enumerate(ks)])
        ids = np.concatenate([np.full(k.size, j, dtype=dataset_index.dtype) for j, k in enumerate(ks)])
        samples = np.concatenate(ks)
        order = np.lexsort((ids, keys))[:size - filled]
        dataset_index[filled:filled + order.size] = ids[order]
        sample_index[filled:filled + order.size] = samples[order]
        filled += order.size
        taken = upto
    return dataset_index, sample_index
