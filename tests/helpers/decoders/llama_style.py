"""Llama/Qwen-style decoder written the way many research repos write it.

* positions built inside with ``torch.arange`` (or passed), complex RoPE via ``torch.polar`` /
  ``view_as_complex`` on ``[B, S, H, D]``;
* grouped-query attention by ``repeat_interleave`` of the kv heads before SDPA;
* labels shifted inside: ``logits[:, :-1]`` against ``labels[:, 1:]``.
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F


class RMSNorm(nn.Module):
    def __init__(self, dim, eps=1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def precompute_freqs_cis(dim, positions, theta=10000.0):
    freqs = 1.0 / (theta ** (torch.arange(0, dim, 2, device=positions.device).float() / dim))
    angles = torch.outer(positions.float(), freqs)  # [S, dim/2]
    return torch.polar(torch.ones_like(angles), angles)


def apply_rotary(x, freqs_cis):
    # x: [B, S, H, D]; freqs_cis: [S, D/2]
    xc = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))
    freqs_cis = freqs_cis.view(1, xc.size(1), 1, xc.size(-1))
    return torch.view_as_real(xc * freqs_cis).flatten(3).type_as(x)


class Attention(nn.Module):
    def __init__(self, dim, n_heads, n_kv_heads):
        super().__init__()
        self.n_heads, self.n_kv = n_heads, n_kv_heads
        self.head_dim = dim // n_heads
        self.wq = nn.Linear(dim, n_heads * self.head_dim, bias=True)  # Qwen-style qkv bias
        self.wk = nn.Linear(dim, n_kv_heads * self.head_dim, bias=True)
        self.wv = nn.Linear(dim, n_kv_heads * self.head_dim, bias=True)
        self.wo = nn.Linear(n_heads * self.head_dim, dim, bias=False)

    def forward(self, x, freqs_cis):
        bsz, seqlen, _ = x.shape
        xq = self.wq(x).view(bsz, seqlen, self.n_heads, self.head_dim)
        xk = self.wk(x).view(bsz, seqlen, self.n_kv, self.head_dim)
        xv = self.wv(x).view(bsz, seqlen, self.n_kv, self.head_dim)
        xq, xk = apply_rotary(xq, freqs_cis), apply_rotary(xk, freqs_cis)
        q, k, v = xq.transpose(1, 2), xk.transpose(1, 2), xv.transpose(1, 2)
        rep = self.n_heads // self.n_kv
        k = torch.repeat_interleave(k, rep, dim=1)
        v = torch.repeat_interleave(v, rep, dim=1)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(out.transpose(1, 2).contiguous().view(bsz, seqlen, -1))


class FeedForward(nn.Module):
    def __init__(self, dim, hidden):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    def __init__(self, dim, n_heads, n_kv_heads, hidden):
        super().__init__()
        self.attention_norm = RMSNorm(dim)
        self.attention = Attention(dim, n_heads, n_kv_heads)
        self.ffn_norm = RMSNorm(dim)
        self.feed_forward = FeedForward(dim, hidden)

    def forward(self, x, freqs_cis):
        h = x + self.attention(self.attention_norm(x), freqs_cis)
        return h + self.feed_forward(self.ffn_norm(h))


class LlamaStyleLM(nn.Module):
    def __init__(self, vocab=256, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, hidden=128):
        super().__init__()
        self.tok_embeddings = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList(Block(dim, n_heads, n_kv_heads, hidden) for _ in range(n_layers))
        self.norm = RMSNorm(dim)
        self.output = nn.Linear(dim, vocab, bias=False)
        self.head_dim = dim // n_heads

    def forward(self, input_ids, labels=None, position_ids=None):
        seqlen = input_ids.shape[1]
        if position_ids is None:
            positions = torch.arange(seqlen, device=input_ids.device)
        else:
            positions = position_ids[0]
        freqs_cis = precompute_freqs_cis(self.head_dim, positions)
        h = self.tok_embeddings(input_ids)
        for layer in self.layers:
            h = layer(h, freqs_cis)
        logits = self.output(self.norm(h)).float()
        if labels is None:
            return logits
        shift_logits = logits[:, :-1, :]
        shift_labels = labels[:, 1:]
        return F.cross_entropy(shift_logits.reshape(-1, shift_logits.size(-1)),
                               shift_labels.reshape(-1), ignore_index=-100)
