"""A gated-delta-rule decoder (the linear attention of Gated DeltaNet / Qwen3-Next), written as
a plain PyTorch reference: the sequence cut into chunks of ``chunk`` positions laid out
``[batch, chunk, position, head, dim]``, the intra-chunk UT transform as a unit-triangular solve,
then a Python loop over the chunks that carries a ``[head, dim, dim]`` state from one chunk to the
next and writes each chunk's output in place into a preallocated buffer. ``attention``: a causal
SDPA block follows the delta block (a hybrid)."""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F


class GatedDelta(nn.Module):
    def __init__(self, dim, heads, chunk):
        super().__init__()
        self.h, self.d, self.chunk = heads, dim // heads, chunk
        self.qkv = nn.Linear(dim, 3 * dim, bias=False)
        self.gates = nn.Linear(dim, 2 * heads)  # write strength beta, decay rate
        self.A_log = nn.Parameter(torch.linspace(-1.0, 0.5, heads))
        self.proj = nn.Linear(dim, dim, bias=False)

    def forward(self, x):
        b, s, _ = x.shape
        L = self.chunk
        q, k, v = self.qkv(x).unflatten(-1, (3, self.h, self.d)).unbind(2)
        q, k = F.normalize(q, dim=-1), F.normalize(k, dim=-1)
        strength, rate = self.gates(x).chunk(2, -1)
        beta = strength.sigmoid()
        g = -self.A_log.exp() * F.softplus(rate)  # log decay per position and head
        q, k, v = (t.unflatten(1, (s // L, L)) for t in (q, k, v))  # [b, c, L, h, d]
        beta, g = (t.unflatten(1, (s // L, L)) for t in (beta, g))  # [b, c, L, h]
        G = g.cumsum(2)
        gap = (G.unsqueeze(3) - G.unsqueeze(2)).permute(0, 1, 4, 2, 3)  # [b, c, h, L, L]
        lower = torch.ones(L, L, dtype=torch.bool, device=x.device).tril()
        gap = gap.masked_fill(~lower, float("-inf")).exp()
        kb = k * beta[..., None]
        kk = torch.einsum("bcihd,bcjhd->bchij", kb, k) * gap
        system = kk.tril(-1) + torch.eye(L, dtype=x.dtype, device=x.device)
        u = torch.linalg.solve_triangular(system, (v * beta[..., None]).transpose(2, 3),
                                          upper=False, unitriangular=True)
        w = torch.linalg.solve_triangular(system, (kb * G.exp()[..., None]).transpose(2, 3),
                                          upper=False, unitriangular=True)
        qh, kh, Gh = q.transpose(2, 3), k.transpose(2, 3), G.transpose(2, 3)
        scores = (qh @ kh.transpose(-1, -2)) * gap
        out = torch.zeros_like(u)  # [b, c, h, L, d]
        state = x.new_zeros(b, self.h, self.d, self.d)
        for i in range(s // L):
            fresh = u[:, i] - w[:, i] @ state
            out[:, i] = (qh[:, i] * Gh[:, i, :, :, None].exp()) @ state + scores[:, i] @ fresh
            last = Gh[:, i, :, -1:]
            carry = kh[:, i] * (last - Gh[:, i]).exp()[..., None]
            state = state * last[..., None].exp() + carry.transpose(-1, -2) @ fresh
        return self.proj(out.transpose(2, 3).reshape(b, s, self.h * self.d))


class DeltaNet(nn.Module):
    """Embedding, ``layers`` pairs of a :class:`GatedDelta` block and a causal SDPA block
    (pre-norm, residual; ``attention=False``: delta blocks only), and a head."""

    def __init__(self, vocab=64, dim=32, heads=4, chunk=4, attention=True, layers=1):
        super().__init__()
        torch.manual_seed(0)
        self.emb, self.head = nn.Embedding(vocab, dim), nn.Linear(dim, vocab)
        self.norms = nn.ModuleList(nn.LayerNorm(dim) for _ in range((2 if attention else 1) * layers))
        self.deltas = nn.ModuleList(GatedDelta(dim, heads, chunk) for _ in range(layers))
        self.qkvs = nn.ModuleList(nn.Linear(dim, 3 * dim) for _ in range(layers if attention else 0))
        self.heads = heads

    def forward(self, input_ids, labels):
        x = self.emb(input_ids)
        for i, delta in enumerate(self.deltas):
            x = x + delta(self.norms[(2 if self.qkvs else 1) * i](x))
            if i < len(self.qkvs):
                b, s, _ = x.shape
                qkv = self.qkvs[i](self.norms[2 * i + 1](x))
                q, k, v = qkv.view(b, s, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
                y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
                x = x + y.transpose(1, 2).reshape(b, s, -1)
        return F.cross_entropy(self.head(x).flatten(0, 1), labels.flatten())
