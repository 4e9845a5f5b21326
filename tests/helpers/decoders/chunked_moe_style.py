"""A decoder in the Llama-4 manner, written from the description, not from its code: layers that
attend within fixed chunks of the sequence (a boolean mask: same chunk and causal) with rotary
positions, every ``nope_every``-th layer a global causal attention without rotary positions
whose queries are scaled by a position-dependent temperature, and a mixture of experts that
dispatches densely: every token is copied once per expert (``repeat``), weighted by a sigmoid
score that is zero outside the token's top-k, run through all experts as one batched matmul and
summed back, beside a shared expert.

Used for the collective-schedule check (the rank-dependent SAC decision of issue 35 was found
on a model of this family at SP 4) and for parity.
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F


def rope(x, pos, base=10000.0):
    """Rotate pairs (even, odd) of the last dim by angles pos * base^(-2i/d)."""
    d = x.shape[-1]
    inv = base ** (-torch.arange(0, d, 2, dtype=torch.float32) / d)
    ang = pos.float()[:, None] * inv[None, :]  # [S, d/2]
    cos, sin = ang.cos(), ang.sin()
    even, odd = x[..., 0::2], x[..., 1::2]
    return torch.stack([even * cos - odd * sin, even * sin + odd * cos], dim=-1).flatten(-2)


class DenseDispatchMoE(nn.Module):
    def __init__(self, dim, hidden, experts, k):
        super().__init__()
        self.gate = nn.Linear(dim, experts, bias=False)
        self.up = nn.Parameter(torch.randn(experts, dim, 2 * hidden) * dim ** -0.5)
        self.down = nn.Parameter(torch.randn(experts, hidden, dim) * hidden ** -0.5)
        self.shared = nn.Sequential(nn.Linear(dim, hidden), nn.SiLU(), nn.Linear(hidden, dim))
        self.experts, self.k = experts, k

    def forward(self, x):
        b, s, d = x.shape
        tokens = x.reshape(-1, d)
        logits = self.gate(tokens)  # [T, E]
        top, idx = logits.topk(self.k, dim=-1)
        scores = torch.full_like(logits, float("-inf")).scatter(1, idx, top).sigmoid()
        copies = tokens.repeat(self.experts, 1) * scores.t().reshape(-1, 1)  # [E*T, D]
        h = torch.bmm(copies.view(self.experts, -1, d), self.up)
        a, g = h.chunk(2, dim=-1)
        y = torch.bmm(F.silu(g) * a, self.down)  # [E, T, D]
        return (self.shared(tokens) + y.sum(0)).view(b, s, d)


class Block(nn.Module):
    def __init__(self, dim, heads, hidden, experts, k, chunk, nope):
        super().__init__()
        self.n1, self.n2 = nn.RMSNorm(dim), nn.RMSNorm(dim)
        self.q, self.kv = nn.Linear(dim, dim, bias=False), nn.Linear(dim, 2 * dim, bias=False)
        self.o = nn.Linear(dim, dim, bias=False)
        self.moe = DenseDispatchMoE(dim, hidden, experts, k)
        self.heads, self.chunk, self.nope = heads, chunk, nope

    def forward(self, x, pos):
        b, s, d = x.shape
        h = self.n1(x)
        q = self.q(h).view(b, s, self.heads, -1).transpose(1, 2)
        k, v = self.kv(h).view(b, s, 2, self.heads, -1).permute(2, 0, 3, 1, 4)
        if self.nope:  # no rotary positions; queries sharpened with the distance from the start
            temp = 1 + 0.1 * torch.log1p(torch.floor((pos.float() + 1) / 4))
            q = q * temp[None, None, :, None]
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            q, k = rope(q, pos), rope(k, pos)
            same = (pos[:, None] // self.chunk) == (pos[None, :] // self.chunk)
            mask = same & (pos[:, None] >= pos[None, :])
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        x = x + self.o(y.transpose(1, 2).reshape(b, s, d))
        return x + self.moe(self.n2(x))


class ChunkedMoELM(nn.Module):
    def __init__(self, vocab=256, dim=32, heads=4, layers=2, hidden=32, experts=4, k=1,
                 chunk=8, nope_every=2):
        super().__init__()
        self.emb = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList(
            Block(dim, heads, hidden, experts, k, chunk, nope=(i + 1) % nope_every == 0)
            for i in range(layers))
        self.norm = nn.RMSNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)

    def forward(self, input_ids, labels):
        x = self.emb(input_ids)
        pos = torch.arange(input_ids.shape[1], device=input_ids.device)
        for blk in self.blocks:
            x = blk(x, pos)
        logits = self.head(self.norm(x)).float()
        return F.cross_entropy(logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten())

