"""A decoder whose blocks scan the sequence: a running mean (``cumsum`` divided by the position),
a decaying memory (``cumprod`` of gates, as in gated linear recurrences written naively), a
log-space running normaliser (``logcumsumexp``) and a running maximum (``cummax`` values and
indices), beside causal SDPA attention."""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F


class ScanMix(nn.Module):
    def __init__(self, dim, cummax=True):
        super().__init__()
        self.gate = nn.Linear(dim, dim)
        self.val = nn.Linear(dim, dim)
        self.out = nn.Linear(3 * dim + (1 if cummax else 0), dim)
        self.cummax = cummax

    def forward(self, x):
        s = x.size(1)
        pos = torch.arange(1, s + 1, device=x.device, dtype=x.dtype)[None, :, None]
        mean = x.cumsum(dim=1) / pos
        decay = torch.cumprod(torch.sigmoid(self.gate(x)) * 0.5 + 0.5, dim=1)
        norm = torch.logcumsumexp(self.val(x), dim=1) - torch.log(pos)
        parts = [mean, decay * x, norm]
        if self.cummax:
            peak, where = torch.cummax(x[..., 0], dim=1)
            age = (torch.arange(s, device=x.device)[None, :] - where).to(x.dtype)
            parts.append((peak * torch.exp(-0.1 * age)).unsqueeze(-1))
        return self.out(torch.cat(parts, dim=-1))


class ScanLM(nn.Module):
    def __init__(self, vocab=256, dim=32, heads=4, layers=1, cummax=True):
        super().__init__()
        self.emb = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList(
            nn.ModuleList([nn.LayerNorm(dim), ScanMix(dim, cummax), nn.LayerNorm(dim),
                           nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)]) for _ in range(layers))
        self.head = nn.Linear(dim, vocab)
        self.heads = heads

    def forward(self, input_ids, labels):
        x = self.emb(input_ids)
        b, s, d = x.shape
        for n1, mix, n2, qkv, proj in self.layers:
            x = x + mix(n1(x))
            q, k, v = qkv(n2(x)).view(b, s, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            x = x + proj(y.transpose(1, 2).reshape(b, s, d))
        logits = self.head(x)
        return F.cross_entropy(logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten())
