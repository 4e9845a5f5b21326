"""GPT-2 style decoder: learned absolute positions, pre-LayerNorm, GELU MLP, biases, tied embeddings.

Plain single-device PyTorch: no distributed code, attention through ``models.attention``.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from .attention import attention
from .config import ModelConfig, megatron_init_
from .loss import lm_cross_entropy


class GPTAttention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.num_heads = cfg.num_attention_heads
        self.head_dim = cfg.head_dim
        self.qkv = nn.Linear(cfg.hidden_size, 3 * cfg.hidden_size)
        self.proj = nn.Linear(cfg.hidden_size, cfg.hidden_size)
        self.dropout = cfg.dropout

    def forward(self, x: torch.Tensor, document_ids: Optional[torch.Tensor] = None) -> torch.Tensor:
        b, s, _ = x.shape
        qkv = self.qkv(x).view(b, s, 3, self.num_heads, self.head_dim)
        q, k, v = qkv.permute(2, 0, 3, 1, 4).unbind(0)  # each [b, h, s, d]
        y = attention(q, k, v, causal=True, dropout_p=self.dropout if self.training else 0.0,
                      document_ids=document_ids)
        y = y.transpose(1, 2).reshape(b, s, self.num_heads * self.head_dim)
        return self.proj(y)


class GPTMLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.fc = nn.Linear(cfg.hidden_size, cfg.ffn_hidden_size)
        self.proj = nn.Linear(cfg.ffn_hidden_size, cfg.hidden_size)

    def forward(self, x):
        return self.proj(F.gelu(self.fc(x), approximate="tanh"))


class GPTBlock(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.hidden_size, eps=cfg.norm_eps)
        self.attn = GPTAttention(cfg)
        self.ln2 = nn.LayerNorm(cfg.hidden_size, eps=cfg.norm_eps)
        self.mlp = GPTMLP(cfg)
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x, document_ids=None):
        x = x + self.drop(self.attn(self.ln1(x), document_ids))
        x = x + self.drop(self.mlp(self.ln2(x)))
        return x


class GPTModel(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.config = cfg
        self.wte = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.wpe = nn.Embedding(cfg.max_position_embeddings, cfg.hidden_size)
        self.drop = nn.Dropout(cfg.dropout)
        self.layers = nn.ModuleList(GPTBlock(cfg) for _ in range(cfg.num_layers))
        self.ln_f = nn.LayerNorm(cfg.hidden_size, eps=cfg.norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.wte.weight
        self.reset_parameters()

    def reset_parameters(self):
        megatron_init_(self, self.config, output_suffixes=("proj.weight",))

    def forward(self, input_ids: torch.Tensor, position_ids: Optional[torch.Tensor] = None,
                labels: Optional[torch.Tensor] = None,
                document_ids: Optional[torch.Tensor] = None):
        """``document_ids [B, S]``: attention within each document of a packed sample."""
        b, s = input_ids.shape
        if position_ids is None:
            position_ids = torch.arange(s, device=input_ids.device).unsqueeze(0)
        x = self.drop(self.wte(input_ids) + self.wpe(position_ids))
        for layer in self.layers:
            x = layer(x, document_ids)
        logits = self.lm_head(self.ln_f(x))
        if labels is None:
            return logits
        return lm_cross_entropy(logits, labels)
