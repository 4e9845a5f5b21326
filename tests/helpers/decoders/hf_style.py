"""HF-style causal LM: ``enable_gqa=True`` SDPA, rotate-half RoPE from cos/sin caches built from
``position_ids`` (or an internal ``cache_position``), an output object with ``loss`` and
``logits``, loss shifted on the label side (``pad`` then ``[..., 1:]``)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass
class CausalLMOutput:
    loss: Optional[torch.Tensor] = None
    logits: Optional[torch.Tensor] = None


def repeat_kv(hidden_states, n_rep):
    """HF's kv-head repeat: [B, Hkv, S, D] -> [B, Hkv*n_rep, S, D] via expand + reshape."""
    batch, num_key_value_heads, slen, head_dim = hidden_states.shape
    if n_rep == 1:
        return hidden_states
    hidden_states = hidden_states[:, :, None, :, :].expand(batch, num_key_value_heads, n_rep, slen,
                                                           head_dim)
    return hidden_states.reshape(batch, num_key_value_heads * n_rep, slen, head_dim)


def rotate_half(x):
    x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2:]
    return torch.cat((-x2, x1), dim=-1)


class Rotary(nn.Module):
    def __init__(self, head_dim, base=10000.0):
        super().__init__()
        inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim))
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(self, x, position_ids):
        inv = self.inv_freq[None, :, None].float().expand(position_ids.shape[0], -1, 1)
        pos = position_ids[:, None, :].float()
        freqs = (inv @ pos).transpose(1, 2)
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(x.dtype), emb.sin().to(x.dtype)


class HFAttention(nn.Module):
    def __init__(self, hidden, heads, kv_heads, use_repeat_kv=False):
        super().__init__()
        self.use_repeat_kv = use_repeat_kv
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, hidden // heads
        self.q_proj = nn.Linear(hidden, heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(hidden, kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(hidden, kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(heads * self.head_dim, hidden, bias=False)

    def forward(self, hidden_states, cos, sin):
        input_shape = hidden_states.shape[:-1]
        hidden_shape = (*input_shape, -1, self.head_dim)
        q = self.q_proj(hidden_states).view(hidden_shape).transpose(1, 2)
        k = self.k_proj(hidden_states).view(hidden_shape).transpose(1, 2)
        v = self.v_proj(hidden_states).view(hidden_shape).transpose(1, 2)
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        if self.use_repeat_kv:
            k = repeat_kv(k, self.heads // self.kv_heads)
            v = repeat_kv(v, self.heads // self.kv_heads)
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                                 scale=self.head_dim ** -0.5)
        else:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True,
                                                 scale=self.head_dim ** -0.5)
        out = out.transpose(1, 2).reshape(*input_shape, -1).contiguous()
        return self.o_proj(out)


class HFLayer(nn.Module):
    def __init__(self, hidden, heads, kv_heads, inter, use_repeat_kv=False):
        super().__init__()
        self.input_layernorm = nn.RMSNorm(hidden, eps=1e-6)
        self.self_attn = HFAttention(hidden, heads, kv_heads, use_repeat_kv)
        self.post_attention_layernorm = nn.RMSNorm(hidden, eps=1e-6)
        self.gate_proj = nn.Linear(hidden, inter, bias=False)
        self.up_proj = nn.Linear(hidden, inter, bias=False)
        self.down_proj = nn.Linear(inter, hidden, bias=False)

    def forward(self, x, cos, sin):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin)
        h = self.post_attention_layernorm(x)
        return x + self.down_proj(F.silu(self.gate_proj(h)) * self.up_proj(h))


class HFStyleLM(nn.Module):
    def __init__(self, vocab=256, hidden=64, layers=2, heads=4, kv_heads=1, inter=128,
                 return_dict=False, use_repeat_kv=False):
        super().__init__()
        self.embed_tokens = nn.Embedding(vocab, hidden)
        self.rotary = Rotary(hidden // heads)
        self.layers = nn.ModuleList(HFLayer(hidden, heads, kv_heads, inter, use_repeat_kv) for _ in range(layers))
        self.norm = nn.RMSNorm(hidden, eps=1e-6)
        self.lm_head = nn.Linear(hidden, vocab, bias=False)
        self.vocab = vocab
        self.return_dict = return_dict

    def forward(self, input_ids, attention_mask=None, position_ids=None, labels=None):
        x = self.embed_tokens(input_ids)
        if position_ids is None:
            cache_position = torch.arange(0, x.shape[1], device=x.device)
            position_ids = cache_position.unsqueeze(0)
        cos, sin = self.rotary(x, position_ids)
        for layer in self.layers:
            x = layer(x, cos, sin)
        logits = self.lm_head(self.norm(x))
        loss = None
        if labels is not None:
            logits_f = logits.float()
            labels = F.pad(labels, (0, 1), value=-100)
            shift_labels = labels[..., 1:].contiguous()
            loss = F.cross_entropy(logits_f.view(-1, self.vocab), shift_labels.view(-1),
                                   ignore_index=-100, reduction="mean")
        if self.return_dict:
            return {"loss": loss, "logits": logits}
        return CausalLMOutput(loss=loss, logits=logits)
