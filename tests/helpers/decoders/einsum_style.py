"""Decoders with attention written out by hand, as models that cannot use SDPA do.

``style``:

* ``einsum`` — ``[B, S, H, D]`` projections, ``einsum("bqhd,bkhd->bhqk")`` scores, a T5-style
  learned relative-position bias (buckets of ``j - i`` through an embedding), tanh soft-capping
  (Gemma 2), a causal mask from ``torch.tril`` with ``masked_fill``, softmax in fp32, dropout on
  the probabilities, ``einsum("bhqk,bkhd->bqhd")``;
* ``matmul`` — ``[B, H, S, D]``, grouped-query kv heads repeated with ``repeat_interleave``,
  ``q @ k.transpose(-1, -2) * scale``, ALiBi slopes times the distance, a sliding-window causal
  mask from ``arange`` comparisons (``where`` with ``-inf``), ``probs @ v``; with ``sinks``, a
  learned logit per head appended to the scores as one more key that every query sees, dropped
  again after the softmax (GPT-OSS's attention sinks);
* ``bmm`` — heads merged into the batch (``[B*H, S, D]``), ``torch.bmm`` scores, ``triu``
  mask, ``torch.bmm(probs, v)``.
"""
from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F


class HandAttention(nn.Module):
    def __init__(self, dim, heads, kv_heads, style, window, softcap, buckets=8, sinks=False):
        super().__init__()
        self.h, self.kv, self.d = heads, kv_heads, dim // heads
        self.q = nn.Linear(dim, dim, bias=False)
        self.kvp = nn.Linear(dim, 2 * kv_heads * self.d, bias=False)
        self.o = nn.Linear(dim, dim, bias=False)
        self.style, self.window, self.softcap = style, window, softcap
        self.rel = nn.Embedding(buckets, heads)
        self.buckets = buckets
        slopes = torch.tensor([2.0 ** (-8.0 * (i + 1) / heads) for i in range(heads)])
        self.register_buffer("slopes", slopes, persistent=False)
        self.sinks = nn.Parameter(torch.linspace(-1.0, 1.0, heads)) if sinks else None

    def forward(self, x):
        b, s, _ = x.shape
        q = self.q(x).view(b, s, self.h, self.d)
        k, v = self.kvp(x).view(b, s, 2, self.kv, self.d).unbind(2)
        if self.kv != self.h:
            k = k.repeat_interleave(self.h // self.kv, dim=2)
            v = v.repeat_interleave(self.h // self.kv, dim=2)
        pos = torch.arange(s, device=x.device)
        if self.style == "einsum":
            scores = torch.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(self.d)
            rel = (pos[None, :] - pos[:, None]).clamp(-(self.buckets - 1), 0).neg()
            scores = scores + self.rel(rel).permute(2, 0, 1)  # [H, S, S], per-token bias
            scores = torch.tanh(scores / self.softcap) * self.softcap
            causal = torch.tril(torch.ones(s, s, dtype=torch.bool, device=x.device))
            scores = scores.masked_fill(~causal, float("-inf"))
            probs = F.softmax(scores.float(), dim=-1).to(q.dtype)
            probs = F.dropout(probs, p=0.0, training=self.training)
            out = torch.einsum("bhqk,bkhd->bqhd", probs, v)
            return self.o(out.reshape(b, s, -1))
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        if self.style == "matmul":
            scores = q @ k.transpose(-1, -2) * self.d ** -0.5
            dist = (pos[None, :] - pos[:, None]).to(x.dtype)  # j - i <= 0 below the diagonal
            scores = scores + self.slopes[:, None, None] * dist
            keep = (pos[None, :] <= pos[:, None]) & (pos[:, None] - pos[None, :] < self.window)
            scores = torch.where(keep, scores, float("-inf"))
            if self.sinks is not None:
                sink = self.sinks.view(1, -1, 1, 1).expand(b, -1, s, 1)
                probs = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]
                return self.o((probs @ v).transpose(1, 2).reshape(b, s, -1))
            out = torch.softmax(scores, dim=-1) @ v
            return self.o(out.transpose(1, 2).reshape(b, s, -1))
        # bmm: heads merged with the batch
        qb, kb, vb = (t.reshape(b * self.h, s, self.d) for t in (q, k, v))
        scores = torch.bmm(qb, kb.transpose(1, 2)) / math.sqrt(self.d)
        future = torch.triu(torch.ones(s, s, device=x.device), diagonal=1).bool()
        scores = scores.masked_fill(future, -1e9)
        out = torch.bmm(scores.softmax(-1), vb).view(b, self.h, s, self.d)
        return self.o(out.transpose(1, 2).reshape(b, s, -1))


class EinsumLM(nn.Module):
    def __init__(self, vocab=256, dim=32, heads=4, kv_heads=None, layers=1, style="einsum",
                 window=6, softcap=20.0, sinks=False):
        super().__init__()
        self.emb = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList(
            nn.ModuleList([nn.RMSNorm(dim), HandAttention(dim, heads, kv_heads or heads, style,
                                                          window, softcap, sinks=sinks),
                           nn.RMSNorm(dim), nn.Linear(dim, 2 * dim), nn.Linear(dim, dim)])
            for _ in range(layers))
        self.head = nn.Linear(dim, vocab, bias=False)

    def forward(self, input_ids, labels):
        x = self.emb(input_ids)
        for n1, attn, n2, up, down in self.blocks:
            x = x + attn(n1(x))
            g, u = up(n2(x)).chunk(2, dim=-1)
            x = x + down(F.silu(g) * u)
        logits = self.head(x)
        return F.cross_entropy(logits[:, :-1].reshape(-1, logits.size(-1)),
                               labels[:, 1:].reshape(-1))
