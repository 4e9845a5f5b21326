"""A decoder for packed documents written the way varlen-style research code writes it.

* ``forward(input_ids, labels, document_ids)``; positions restart per document, computed inside
  from the document ids with a cumulative sum (no ``position_ids`` argument);
* the model builds its own additive float mask ``[B, 1, S, S]`` (``0`` / ``-inf``) from the
  document ids with ``masked_fill`` and passes it to SDPA (``attn="sdpa"``), or calls
  FlexAttention with a block mask from ``create_block_mask`` (``attn="flex"``);
* learned absolute position embeddings, fused qkv with ``chunk``, GELU MLP, untied head, the
  labels given already aligned.
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F


def positions_from_documents(doc: torch.Tensor) -> torch.Tensor:
    """0, 1, 2, ... restarting where the document id changes."""
    b, s = doc.shape
    idx = torch.arange(s, device=doc.device).expand(b, s)
    starts = torch.ones_like(doc, dtype=torch.bool)
    starts[:, 1:] = doc[:, 1:] != doc[:, :-1]
    start_pos = torch.where(starts, idx, torch.zeros_like(idx))
    return idx - torch.cummax(start_pos, dim=1).values


class Block(nn.Module):
    def __init__(self, dim, heads, attn):
        super().__init__()
        self.heads, self.attn = heads, attn
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.out = nn.Linear(dim, dim)
        self.fc1, self.fc2 = nn.Linear(dim, 4 * dim), nn.Linear(4 * dim, dim)

    def forward(self, x, mask):
        b, s, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).chunk(3, dim=-1)
        q, k, v = (t.view(b, s, self.heads, d // self.heads).transpose(1, 2) for t in (q, k, v))
        if self.attn == "flex":
            from torch.nn.attention.flex_attention import flex_attention
            y = flex_attention(q, k, v, block_mask=mask)
        else:
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        x = x + self.out(y.transpose(1, 2).reshape(b, s, d))
        return x + self.fc2(F.gelu(self.fc1(self.norm2(x))))


class PackedLM(nn.Module):
    def __init__(self, vocab=256, dim=32, heads=4, layers=2, max_len=512, attn="sdpa"):
        super().__init__()
        self.attn = attn
        self.tok = nn.Embedding(vocab, dim)
        self.pos = nn.Embedding(max_len, dim)
        self.blocks = nn.ModuleList(Block(dim, heads, attn) for _ in range(layers))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)

    def mask(self, doc):
        s = doc.size(1)
        if self.attn == "flex":
            from torch.nn.attention.flex_attention import create_block_mask

            def mask_mod(b, h, q, k):
                return (doc[b, q] == doc[b, k]) & (k <= q)
            return create_block_mask(mask_mod, doc.size(0), 1, s, s, device=str(doc.device),
                                     BLOCK_SIZE=16)
        causal = torch.ones(s, s, dtype=torch.bool, device=doc.device).tril()
        allowed = (doc.unsqueeze(-1) == doc.unsqueeze(-2)) & causal
        bias = torch.zeros(allowed.shape, device=doc.device)
        return bias.masked_fill(~allowed, float("-inf")).unsqueeze(1)

    def forward(self, input_ids, labels, document_ids):
        x = self.tok(input_ids) + self.pos(positions_from_documents(document_ids))
        mask = self.mask(document_ids)
        for blk in self.blocks:
            x = blk(x, mask)
        logits = self.head(self.norm(x))
        loss = F.cross_entropy(logits.float().flatten(0, 1), labels.flatten())
        return {"loss": loss, "logits": logits}
