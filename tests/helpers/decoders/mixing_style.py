"""A decoder with short-range mixing along the sequence, written the ways public code writes it
(RWKV-style token shift, Mamba/Hyena-style short causal convolutions), plus slices that are not
shifts: a BOS-embedding prefix, a cache of the last keys returned from the forward, a
``zeros_like`` of a one-position slice and the last position's hidden state.

``shift`` picks the token-shift spelling: ``cat`` (``torch.cat([x[:, :1], x[:, 1:] + ...])``),
``pad`` (``F.pad(x, (0, 0, 1, -1))``), ``roll`` (``torch.roll`` with the wrapped row masked) or
``slices`` (``torch.cat([zeros_like(x[:, :1]), x[:, :-1]], 1)``). ``conv`` picks the causal
depthwise convolution: ``cut`` (``conv1d(padding=k-1)[..., :S]``) or ``pad``
(``conv1d(F.pad(x, (k-1, 0)))``), with ``dilation``."""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F


class ShiftMix(nn.Module):
    def __init__(self, dim, shift):
        super().__init__()
        self.mix = nn.Parameter(torch.rand(dim))
        self.proj = nn.Linear(dim, dim)
        self.shift = shift

    def forward(self, x):
        if self.shift == "cat":  # x_t + g * x_{t-1}, position 0 kept
            y = torch.cat([x[:, :1], x[:, 1:] + self.mix * x[:, :-1]], dim=1)
        elif self.shift == "pad":
            prev = F.pad(x, (0, 0, 1, -1))
            y = x + self.mix * prev
        elif self.shift == "roll":
            prev = torch.roll(x, shifts=1, dims=1)
            first = torch.arange(x.size(1), device=x.device) == 0
            prev = prev.masked_fill(first[None, :, None], 0.0)
            y = x + self.mix * prev
        else:  # slices
            prev = torch.cat([torch.zeros_like(x[:, :1]), x[:, :-1]], dim=1)
            y = x + self.mix * prev
        return self.proj(y)


class ShortConv(nn.Module):
    def __init__(self, dim, kernel, conv, dilation=1):
        super().__init__()
        self.conv = nn.Conv1d(dim, dim, kernel, groups=dim, dilation=dilation,
                              padding=dilation * (kernel - 1) if conv == "cut" else 0)
        self.kind, self.span = conv, dilation * (kernel - 1)
        self.gate = nn.Linear(dim, dim)

    def forward(self, x):
        s = x.size(1)
        h = x.transpose(1, 2)  # [B, C, S]
        if self.kind == "cut":
            h = self.conv(h)[..., :s]
        else:
            h = self.conv(F.pad(h, (self.span, 0)))
        return F.silu(self.gate(x)) * h.transpose(1, 2)


class Attention(nn.Module):
    def __init__(self, dim, heads):
        super().__init__()
        self.qkv = nn.Linear(dim, 3 * dim)
        self.out = nn.Linear(dim, dim)
        self.heads = heads

    def forward(self, x):
        b, s, d = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.out(y.transpose(1, 2).reshape(b, s, d)), k


class MixingLM(nn.Module):
    def __init__(self, vocab=256, dim=32, heads=4, layers=1, shift="cat", conv="cut",
                 kernel=4, dilation=1, cache=4):
        super().__init__()
        self.emb = nn.Embedding(vocab, dim)
        self.bos = nn.Parameter(torch.randn(1, 1, dim) * 0.1)
        self.blocks = nn.ModuleList()
        for _ in range(layers):
            self.blocks.append(nn.ModuleList([nn.LayerNorm(dim), ShiftMix(dim, shift),
                                              nn.LayerNorm(dim),
                                              ShortConv(dim, kernel, conv, dilation),
                                              nn.LayerNorm(dim), Attention(dim, heads)]))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        self.cache = cache

    def forward(self, input_ids, labels):
        x = self.emb(input_ids)
        # a learned start vector replaces position 0 (a constant-length piece of a cat)
        x = torch.cat([self.bos.expand(x.size(0), 1, -1) + x[:, :1], x[:, 1:]], dim=1)
        keys = []
        for n1, mix, n2, conv, n3, attn in self.blocks:
            x = x + mix(n1(x))
            x = x + conv(n2(x))
            y, k = attn(n3(x))
            x = x + y
            keys.append(k[:, :, -self.cache:])  # a generation cache of the last keys
        h = self.norm(x)
        logits = self.head(h)
        loss = F.cross_entropy(logits[:, :-1].reshape(-1, logits.size(-1)),
                               labels[:, 1:].reshape(-1))
        last = h[:, -1]  # the last position's state (e.g. for a value head)
        return {"loss": loss + 1e-3 * last.pow(2).mean(), "cache": tuple(keys)}
