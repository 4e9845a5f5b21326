"""A decoder with a token-routed mixture-of-experts block, written as dropless MoE code is:
router, softmax, top-k, the (token, expert) pairs sorted by expert (``argsort``), tokens gathered
in that order, expert weights gathered per row and batched matmuls, the rows put back, and a
Switch-style load-balancing loss from global counts (``histc`` or a ``scatter_add`` into expert
bins) and mean router probabilities, plus a router z-loss.

``back`` picks the way back to token order: ``index_add`` (scatter-add of weighted rows), ``inverse``
(``inv[perm] = arange(n)``, then ``y[inv]`` and a sum over the k choices, as transformers'
grouped experts do) or ``argsort`` (``y[argsort(perm)]``). ``counts``: ``histc``, ``scatter`` or
``bincount`` (``bincount(ids, minlength=E)``). ``experts_impl="grouped"``: the pairs sorted with
``torch.sort``, group offsets from a ``histc`` of the sorted ids and its ``cumsum``, and a grouped
matmul custom op (tests/helpers/kernels_standin.py, registered token-local with offsets), as
transformers' default ``grouped_mm`` experts do.
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F


class MoE(nn.Module):
    def __init__(self, dim, hidden, experts, k, back, counts, grouped=False):
        super().__init__()
        if grouped:
            from autosp_lm.compiler import register_kernel
            from tests.helpers.kernels_standin import define_all
            define_all()
            register_kernel("standin::grouped_mm", "token_local", rows=("input",), offsets="offs")
        self.grouped = grouped
        self.router = nn.Linear(dim, experts, bias=False)
        self.w_in = nn.Parameter(torch.randn(experts, dim, 2 * hidden) * dim ** -0.5)
        self.w_out = nn.Parameter(torch.randn(experts, hidden, dim) * hidden ** -0.5)
        self.e, self.k, self.back, self.counts = experts, k, back, counts

    def forward(self, x):
        b, s, d = x.shape
        xf = x.reshape(-1, d)  # [T, D] flattened tokens
        logits = self.router(xf)
        probs = logits.softmax(dim=-1)
        weights, ids = torch.topk(probs, self.k, dim=-1)
        weights = weights / weights.sum(dim=-1, keepdim=True)
        flat_ids = ids.reshape(-1)  # [T*k]
        if self.grouped:
            ids_sorted, perm = torch.sort(flat_ids)
            rows = xf[perm // self.k]
            sizes = torch.histc(ids_sorted.float(), bins=self.e, min=0, max=self.e - 1)
            offs = torch.cumsum(sizes, dim=0).to(torch.int32)
            gate, up = torch.ops.standin.grouped_mm(rows, self.w_in, offs).chunk(2, dim=-1)
            y = torch.ops.standin.grouped_mm(F.silu(gate) * up, self.w_out, offs)
        else:
            perm = torch.argsort(flat_ids, stable=True)
            rows = xf.index_select(0, perm // self.k)  # tokens grouped by expert
            ids_sorted = flat_ids[perm]
            h = torch.bmm(rows.unsqueeze(1), self.w_in[ids_sorted]).squeeze(1)
            gate, up = h.chunk(2, dim=-1)
            y = torch.bmm((F.silu(gate) * up).unsqueeze(1), self.w_out[ids_sorted]).squeeze(1)
        w_sorted = weights.reshape(-1)[perm]
        if self.back == "index_add":
            out = torch.zeros_like(xf).index_add(0, perm // self.k,
                                                 (y * w_sorted[:, None]).to(xf.dtype))
        else:
            if self.back == "inverse":
                inv = torch.empty_like(perm)
                inv[perm] = torch.arange(perm.size(0), device=x.device)
            else:
                inv = torch.argsort(perm)
            out = (y[inv] * weights.reshape(-1, 1)).view(-1, self.k, d).sum(dim=1)
        # load balancing: fraction of assignments per expert x mean router probability
        if self.counts == "histc":
            count = torch.histc(flat_ids.float(), bins=self.e, min=0, max=self.e - 1)
        elif self.counts == "bincount":
            count = torch.bincount(flat_ids, minlength=self.e).float()
        else:
            count = torch.zeros(self.e, device=x.device).scatter_add(
                0, flat_ids, torch.ones_like(flat_ids, dtype=torch.float))
        frac = count / flat_ids.numel()
        aux = self.e * (frac * probs.mean(dim=0)).sum()
        z = torch.logsumexp(logits, dim=-1).pow(2).mean()
        return out.view(b, s, d), aux + 1e-2 * z


class MoELM(nn.Module):
    def __init__(self, vocab=256, dim=32, heads=4, layers=1, experts=4, k=2, hidden=32,
                 back="index_add", counts="histc", aux_coef=0.01, experts_impl="bmm"):
        super().__init__()
        self.emb = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList(
            nn.ModuleList([nn.LayerNorm(dim), nn.Linear(dim, 3 * dim), nn.Linear(dim, dim),
                           nn.LayerNorm(dim), MoE(dim, hidden, experts, k, back, counts,
                                                       experts_impl == "grouped")])
            for _ in range(layers))
        self.head = nn.Linear(dim, vocab)
        self.heads, self.aux_coef = heads, aux_coef

    def forward(self, input_ids, labels):
        x = self.emb(input_ids)
        b, s, d = x.shape
        aux_total = 0.0
        for n1, qkv, proj, n2, moe in self.blocks:
            q, k, v = qkv(n1(x)).view(b, s, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            x = x + proj(y.transpose(1, 2).reshape(b, s, d))
            m, aux = moe(n2(x))
            x = x + m
            aux_total = aux_total + aux
        logits = self.head(x)
        ce = F.cross_entropy(logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten())
        return ce + self.aux_coef * aux_total
