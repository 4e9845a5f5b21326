"""Synthetic token data for ``--mock-data``: deterministic, learnable, infinite.

Each sample is a walk through a fixed random permutation of the vocabulary (the "next" token of
``t`` is ``perm[t]``) with 10% of tokens replaced at random, so a model can learn it and the loss
visibly falls, while every sample is a pure function of (seed, index).
"""
from __future__ import annotations

import numpy as np
import torch


class MockGPTDataset(torch.utils.data.Dataset):
    def __init__(self, vocab_size: int, seq_length: int, num_samples: int, seed: int = 1234,
                 noise: float = 0.1, split: int = 0):
        self.vocab_size = vocab_size
        self.seq_length = seq_length
        self.num_samples = num_samples
        self.seed = seed
        self.noise = noise
        self.split = split  # train/valid/test draw different samples of the same "language"
        self.perm = np.random.default_rng(seed).permutation(vocab_size)

    def __len__(self):
        return self.num_samples

    def tokens(self, idx: int) -> np.ndarray:
        rng = np.random.default_rng([self.seed, self.split, idx])
        n = self.seq_length + 1
        toks = np.empty(n, dtype=np.int64)
        noise = rng.random(n) < self.noise
        rand = rng.integers(0, self.vocab_size, n)
        toks[0] = rand[0]
        for i in range(1, n):
            toks[i] = rand[i] if noise[i] else self.perm[toks[i - 1]]
        return toks

    def __getitem__(self, idx: int) -> dict:
        if not 0 <= idx < self.num_samples:
            raise IndexError(f"sample {idx} out of range [0, {self.num_samples})")
        toks = torch.from_numpy(self.tokens(idx))
        return {"input_ids": toks[:-1].clone(), "labels": toks[1:].clone(),
                "position_ids": torch.arange(self.seq_length)}
