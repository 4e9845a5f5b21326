"""Llama decoder: RoPE (optionally scaled, see ``models.rope``), RMSNorm, SwiGLU, grouped-query
attention; optional q/k/v biases (Qwen2), per-head q/k RMSNorm (Qwen3) and a head size other than
hidden/heads.

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
from .rope import normalize_rope_scaling, rope_attention_factor, rope_cos_sin, rope_inv_freq

__all__ = ["LlamaModel", "RMSNorm", "apply_rope", "rope_inv_freq"]


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return xf.type_as(x) * self.weight


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x [b, h, s, d]`` by angles given as ``cos``/``sin`` of shape ``[b, 1, s, d/2]``."""
    x1, x2 = x.float().chunk(2, dim=-1)
    out = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
    return out.type_as(x)


class LlamaAttention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.num_heads = cfg.num_attention_heads
        self.num_kv = cfg.num_query_groups
        self.head_dim = cfg.head_dim
        bias = cfg.qkv_bias
        self.q_proj = nn.Linear(cfg.hidden_size, self.num_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(cfg.hidden_size, self.num_kv * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(cfg.hidden_size, self.num_kv * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, cfg.hidden_size, bias=False)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, cfg.norm_eps)
            self.k_norm = RMSNorm(self.head_dim, cfg.norm_eps)
        else:
            self.q_norm = self.k_norm = None
        self.dropout = cfg.dropout

    def forward(self, x, cos, sin, document_ids=None):
        b, s, _ = x.shape
        q = self.q_proj(x).view(b, s, self.num_heads, self.head_dim)
        k = self.k_proj(x).view(b, s, self.num_kv, self.head_dim)
        if self.q_norm is not None:  # per head, over the head dimension
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = q.transpose(1, 2), k.transpose(1, 2)
        v = self.v_proj(x).view(b, s, self.num_kv, self.head_dim).transpose(1, 2)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        y = attention(q, k, v, causal=True, dropout_p=self.dropout if self.training else 0.0,
                      document_ids=document_ids)
        return self.o_proj(y.transpose(1, 2).reshape(b, s, self.num_heads * self.head_dim))


class LlamaMLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.ffn_hidden_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.ffn_hidden_size, bias=False)
        self.down_proj = nn.Linear(cfg.ffn_hidden_size, cfg.hidden_size, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class LlamaBlock(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.input_norm = RMSNorm(cfg.hidden_size, cfg.norm_eps)
        self.attn = LlamaAttention(cfg)
        self.post_attn_norm = RMSNorm(cfg.hidden_size, cfg.norm_eps)
        self.mlp = LlamaMLP(cfg)

    def forward(self, x, cos, sin, document_ids=None):
        x = x + self.attn(self.input_norm(x), cos, sin, document_ids)
        x = x + self.mlp(self.post_attn_norm(x))
        return x


class LlamaModel(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.config = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(LlamaBlock(cfg) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        scaling = normalize_rope_scaling(cfg.rope_scaling)
        self.rope_attention_factor = rope_attention_factor(scaling)
        # dynamic NTK: frequencies depend on the sequence length beyond this one
        self._dynamic_from = (scaling["original_max_position_embeddings"]
                              if scaling and scaling["rope_type"] == "dynamic-ntk" else None)
        self.register_buffer("inv_freq", torch.empty(cfg.head_dim // 2, dtype=torch.float32),
                             persistent=False)
        self.init_buffers()
        self.reset_parameters()

    def init_buffers(self):
        """(Re)compute the non-persistent buffers (RoPE frequencies), e.g. after ``to_empty``."""
        cfg = self.config
        with torch.no_grad():
            self.inv_freq.copy_(rope_inv_freq(cfg.head_dim, cfg.rotary_base, cfg.rope_scaling))

    def reset_parameters(self):
        megatron_init_(self, self.config, output_suffixes=("o_proj.weight", "down_proj.weight"))

    def rope(self, position_ids: torch.Tensor):
        inv_freq = self.inv_freq
        s = position_ids.shape[-1]
        if self._dynamic_from is not None and s > self._dynamic_from:
            cfg = self.config
            inv_freq = rope_inv_freq(cfg.head_dim, cfg.rotary_base, cfg.rope_scaling,
                                     seq_len=s).to(inv_freq.device)
        return rope_cos_sin(position_ids, inv_freq, self.rope_attention_factor)

    def forward(self, input_ids: torch.Tensor, position_ids: Optional[torch.Tensor] = None,
                labels: Optional[torch.Tensor] = None,
                document_ids: Optional[torch.Tensor] = None):
        """``document_ids [B, S]``: attention within each document of a packed sample."""
        b, s = input_ids.shape
        if position_ids is None:
            position_ids = torch.arange(s, device=input_ids.device).unsqueeze(0)
        cos, sin = self.rope(position_ids)
        x = self.embed_tokens(input_ids)
        for layer in self.layers:
            x = layer(x, cos, sin, document_ids)
        logits = self.lm_head(self.norm(x))
        if labels is None:
            return logits
        return lm_cross_entropy(logits, labels)
