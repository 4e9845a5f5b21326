"""A Mamba-2-style decoder written as the state-space-duality reference is (einops + einsum):
the sequence cut into chunks, an intra-chunk quadratic form, chunk states passed on by a segment
sum over the chunks. ``attention_every``: every that-many-th block is causal SDPA attention
instead (a hybrid, as Bamba / Jamba / Falcon-H1 interleave them)."""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F
from einops import rearrange, repeat


def _segsum(x):
    """Sums of ``x`` over every segment ``(j, i]`` of its last dim, -inf above the diagonal."""
    t = x.size(-1)
    x = repeat(x, "... d -> ... d e", e=t)
    below = torch.tril(torch.ones(t, t, dtype=torch.bool, device=x.device), diagonal=-1)
    x = torch.cumsum(x.masked_fill(~below, 0), dim=-2)
    keep = torch.tril(torch.ones(t, t, dtype=torch.bool, device=x.device))
    return x.masked_fill(~keep, -torch.inf)


class SSDMixer(nn.Module):
    """The mixer: input projection to X, B, C and the step dt, then the chunked scan. ``pad``:
    the inputs are padded to a multiple of the chunk first and the output cut back, as
    transformers' Mamba-2 does (``(c - S % c) % c`` rows)."""

    def __init__(self, dim, heads, state, chunk, pad=False):
        super().__init__()
        self.h, self.n, self.chunk, self.pad = heads, state, chunk, pad
        self.inp = nn.Linear(dim, dim + 2 * heads * state + heads)
        self.A_log = nn.Parameter(torch.randn(heads) * 0.1)

    def ssd(self, X, A, B, C):
        X, A, B, C = (rearrange(t, "b (c l) ... -> b c l ...", l=self.chunk) for t in (X, A, B, C))
        A = rearrange(A, "b c l h -> b h c l")
        A_cum = torch.cumsum(A, dim=-1)
        Y_diag = torch.einsum("bclhn,bcshn,bhcls,bcshp->bclhp", C, B, torch.exp(_segsum(A)), X)
        decay = torch.exp(A_cum[:, :, :, -1:] - A_cum)
        states = torch.einsum("bclhn,bhcl,bclhp->bchpn", B, decay, X)
        states = torch.cat([torch.zeros_like(states[:, :1]), states], dim=1)
        chunk_decay = torch.exp(_segsum(F.pad(A_cum[:, :, :, -1], (1, 0))))
        states = torch.einsum("bhzc,bchpn->bzhpn", chunk_decay, states)[:, :-1]
        Y_off = torch.einsum("bclhn,bchpn,bhcl->bclhp", C, states, torch.exp(A_cum))
        return rearrange(Y_diag + Y_off, "b c l h p -> b (c l) h p")

    def forward(self, x):
        xs, B, C, dt = self.inp(x).split([x.shape[-1], self.h * self.n, self.h * self.n, self.h], -1)
        dt = F.softplus(dt)
        X = rearrange(xs, "b s (h p) -> b s h p", h=self.h) * dt[..., None]
        B, C = (rearrange(t, "b s (h n) -> b s h n", h=self.h) for t in (B, C))
        A = -torch.exp(self.A_log) * dt
        s = x.shape[1]
        if self.pad:
            extra = (self.chunk - s % self.chunk) % self.chunk
            X, B, C = (F.pad(t, (0, 0, 0, 0, 0, extra)) for t in (X, B, C))
            A = F.pad(A, (0, 0, 0, extra))
        return rearrange(self.ssd(X, A, B, C)[:, :s], "b s h p -> b s (h p)")


class ChunkedSSD(nn.Module):
    """One :class:`SSDMixer` block between an embedding and a head (``pad``: see the mixer)."""

    def __init__(self, vocab=64, dim=32, heads=4, state=8, chunk=4, pad=False):
        super().__init__()
        torch.manual_seed(0)
        self.emb, self.head = nn.Embedding(vocab, dim), nn.Linear(dim, vocab)
        self.mixer, self.out = SSDMixer(dim, heads, state, chunk, pad), nn.Linear(dim, dim)

    def forward(self, input_ids, labels):
        x = self.emb(input_ids)
        x = x + self.out(self.mixer(x))
        return F.cross_entropy(self.head(x).flatten(0, 1), labels.flatten())


class HybridSSD(nn.Module):
    """Blocks of RMSNorm + a chunked-scan mixer (:class:`SSDMixer`) or causal attention, each
    followed by RMSNorm + a SwiGLU MLP, residual around each."""

    def __init__(self, vocab=256, dim=64, layers=4, heads=4, state=16, chunk=64,
                 attention_every=2):
        super().__init__()
        torch.manual_seed(0)
        self.emb, self.head = nn.Embedding(vocab, dim), nn.Linear(dim, vocab, bias=False)
        self.heads, self.attention_every = heads, attention_every
        self.mixers = nn.ModuleList(
            nn.Linear(dim, 3 * dim) if (i + 1) % attention_every == 0
            else SSDMixer(dim, heads, state, chunk) for i in range(layers))
        self.outs = nn.ModuleList(nn.Linear(dim, dim) for _ in range(layers))
        self.mlps = nn.ModuleList(nn.Linear(dim, 4 * dim) for _ in range(layers))
        self.downs = nn.ModuleList(nn.Linear(2 * dim, dim) for _ in range(layers))
        self.norms = nn.ModuleList(nn.RMSNorm(dim) for _ in range(2 * layers))

    def forward(self, input_ids, labels):
        x = self.emb(input_ids)
        for i, (mix, out, up, down) in enumerate(zip(self.mixers, self.outs, self.mlps,
                                                     self.downs)):
            h = self.norms[2 * i](x)
            if isinstance(mix, SSDMixer):
                y = mix(h)
            else:
                q, k, v = (rearrange(t, "b s (h d) -> b h s d", h=self.heads)
                           for t in mix(h).chunk(3, -1))
                y = rearrange(F.scaled_dot_product_attention(q, k, v, is_causal=True),
                              "b h s d -> b s (h d)")
            x = x + out(y)
            a, g = up(self.norms[2 * i + 1](x)).chunk(2, -1)
            x = x + down(F.silu(a) * g)
        return F.cross_entropy(self.head(x).flatten(0, 1), labels.flatten())


class BlockScan(nn.Module):
    """Scans over whole blocks of positions: per block of 4 a sum and a max, a running sum
    (``cumsum``) and a running max (``cummax``) of them over the blocks, added back to every
    position of the block."""

    def __init__(self, vocab=64, dim=16):
        super().__init__()
        torch.manual_seed(0)
        self.emb, self.head = nn.Embedding(vocab, dim), nn.Linear(dim, vocab)

    def forward(self, input_ids, labels):
        x = self.emb(input_ids)
        b, s, d = x.shape
        blocks = x.reshape(b, s // 4, 4, d)
        total = blocks.sum(2).cumsum(1)
        best = blocks.amax(2).cummax(1).values
        y = (blocks + total[:, :, None] + best[:, :, None]).reshape(b, s, d)
        return F.cross_entropy(self.head(y).flatten(0, 1), labels.flatten())
