"""Model configuration and the named presets (``--model NAME``).

Presets follow the published shapes of the models they are named after; any individual
shape flag given on the command line overrides the preset's value.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Optional


@dataclass
class ModelConfig:
    arch: str = "gpt"  # "gpt" or "llama"
    num_layers: int = 2
    hidden_size: int = 64
    num_attention_heads: int = 4
    num_query_groups: Optional[int] = None  # None: same as num_attention_heads (no GQA)
    ffn_hidden_size: Optional[int] = None  # None: 4*hidden (gpt) or the Llama rule
    vocab_size: int = 512
    max_position_embeddings: int = 2048
    rotary_base: float = 10000.0
    # RoPE scaling for context extension (llama): a dict with "rope_type" (linear, dynamic-ntk,
    # llama3, yarn) and its parameters (see models/rope.py), or None. A dict without "rope_type"
    # holding Llama-3's four parameters is Llama-3 scaling.
    rope_scaling: Optional[dict] = None
    norm_eps: float = 1e-5
    tie_embeddings: Optional[bool] = None  # None: True for gpt, False for llama
    init_std: float = 0.02
    dropout: float = 0.0
    # Family extensions (llama arch), off by default: biases on the q/k/v projections (Qwen2),
    # RMSNorm of each query/key head before RoPE (Qwen3), a head size other than
    # hidden/heads (Megatron's --kv-channels; Qwen3, Mistral-Nemo).
    qkv_bias: bool = False
    qk_norm: bool = False
    kv_channels: Optional[int] = None
    # The Hugging Face model_type this config was imported from (llama, qwen2, qwen3, mistral,
    # gpt2): export writes the same one. None: inferred from the architecture.
    hf_model_type: Optional[str] = None

    def __post_init__(self):
        self.finalize()

    def finalize(self) -> "ModelConfig":
        if self.arch not in ("gpt", "llama"):
            raise ValueError(f"unknown model architecture {self.arch!r}: use 'gpt' or 'llama'")
        if self.num_query_groups is None:
            self.num_query_groups = self.num_attention_heads
        if self.ffn_hidden_size is None:
            if self.arch == "gpt":
                self.ffn_hidden_size = 4 * self.hidden_size
            else:  # Llama: 2/3 of 4h rounded up to a multiple of 64
                h = int(2 * 4 * self.hidden_size / 3)
                self.ffn_hidden_size = 64 * ((h + 63) // 64)
        if self.tie_embeddings is None:
            self.tie_embeddings = self.arch == "gpt"
        return self

    def validate(self) -> None:
        """Raise ValueError naming the flag when the shape is inconsistent."""
        for name in ("num_layers", "hidden_size", "num_attention_heads", "num_query_groups",
                     "ffn_hidden_size", "vocab_size", "max_position_embeddings"):
            if getattr(self, name) <= 0:
                raise ValueError(f"--{name.replace('_', '-')} must be positive, got {getattr(self, name)}")
        if self.kv_channels is not None and self.kv_channels <= 0:
            raise ValueError(f"kv_channels (head size) must be positive, got {self.kv_channels}")
        if self.arch == "gpt":
            for name in ("qkv_bias", "qk_norm", "kv_channels", "rope_scaling"):
                if getattr(self, name):
                    raise ValueError(f"{name} is a llama-architecture option (GPT has learned "
                                     f"positions, biases everywhere and head size hidden/heads)")
        if self.kv_channels is None and self.hidden_size % self.num_attention_heads:
            raise ValueError(
                f"--hidden-size {self.hidden_size} is not divisible by --num-attention-heads "
                f"{self.num_attention_heads}; choose a hidden size that is a multiple of the head count")
        if self.num_attention_heads % self.num_query_groups:
            raise ValueError(
                f"--num-attention-heads {self.num_attention_heads} is not divisible by "
                f"--num-query-groups {self.num_query_groups}; each key/value group must serve the "
                f"same number of query heads")
        if self.arch == "gpt" and self.num_query_groups != self.num_attention_heads:
            raise ValueError("grouped-query attention (--num-query-groups) is only supported for "
                             "llama models; drop --group-query-attention for gpt")
        if self.arch == "llama" and self.head_dim % 2:
            raise ValueError(f"rotary embeddings need an even head dimension, got {self.head_dim}")
        if self.arch == "llama":
            from .rope import normalize_rope_scaling
            normalize_rope_scaling(self.rope_scaling)  # RopeScalingError (a ValueError) naming the field

    @property
    def head_dim(self) -> int:
        if self.kv_channels is not None:
            return self.kv_channels
        return self.hidden_size // self.num_attention_heads

    def num_parameters(self, include_embeddings: bool = True) -> int:
        h, f, L, V = self.hidden_size, self.ffn_hidden_size, self.num_layers, self.vocab_size
        kv = self.num_query_groups * self.head_dim
        if self.arch == "gpt":
            attn = h * (h + 2 * kv) + (h + 2 * kv) + h * h + h
            mlp = 2 * h * f + f + h
            norms = 4 * h
            per_layer = attn + mlp + norms
            emb = V * h + self.max_position_embeddings * h
            out = 0 if self.tie_embeddings else V * h
            final = 2 * h
        else:
            q = self.num_attention_heads * self.head_dim
            attn = h * (q + 2 * kv) + q * h
            if self.qkv_bias:
                attn += q + 2 * kv
            if self.qk_norm:
                attn += 2 * self.head_dim
            mlp = 3 * h * f
            per_layer = attn + mlp + 2 * h
            emb = V * h
            out = 0 if self.tie_embeddings else V * h
            final = h
        total = L * per_layer + final + (emb + out if include_embeddings else 0)
        return total

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


_LLAMA3_SCALING_32 = dict(factor=32.0, low_freq_factor=1.0, high_freq_factor=4.0,
                          original_max_position_embeddings=8192)
_LLAMA3_SCALING_8 = dict(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                         original_max_position_embeddings=8192)

PRESETS: dict[str, dict] = {
    # Small enough for CPU tests; max positions allow long-context tests.
    "gpt-tiny": dict(arch="gpt", num_layers=2, hidden_size=64, num_attention_heads=4,
                     ffn_hidden_size=256, vocab_size=512, max_position_embeddings=16384),
    "llama-tiny": dict(arch="llama", num_layers=2, hidden_size=64, num_attention_heads=4,
                       num_query_groups=2, ffn_hidden_size=192, vocab_size=512,
                       max_position_embeddings=16384, rotary_base=10000.0),
    # Published shapes.
    "gpt2-124m": dict(arch="gpt", num_layers=12, hidden_size=768, num_attention_heads=12,
                      ffn_hidden_size=3072, vocab_size=50257, max_position_embeddings=1024),
    "llama-3.2-1b": dict(arch="llama", num_layers=16, hidden_size=2048, num_attention_heads=32,
                         num_query_groups=8, ffn_hidden_size=8192, vocab_size=128256,
                         max_position_embeddings=131072, rotary_base=500000.0,
                         rope_scaling=_LLAMA3_SCALING_32, tie_embeddings=True),
    "llama-3.2-3b": dict(arch="llama", num_layers=28, hidden_size=3072, num_attention_heads=24,
                         num_query_groups=8, ffn_hidden_size=8192, vocab_size=128256,
                         max_position_embeddings=131072, rotary_base=500000.0,
                         rope_scaling=_LLAMA3_SCALING_32, tie_embeddings=True),
    "llama-3.1-8b": dict(arch="llama", num_layers=32, hidden_size=4096, num_attention_heads=32,
                         num_query_groups=8, ffn_hidden_size=14336, vocab_size=128256,
                         max_position_embeddings=131072, rotary_base=500000.0,
                         rope_scaling=_LLAMA3_SCALING_8, tie_embeddings=False),
    "llama-2-13b": dict(arch="llama", num_layers=40, hidden_size=5120, num_attention_heads=40,
                        num_query_groups=40, ffn_hidden_size=13824, vocab_size=32000,
                        max_position_embeddings=4096, rotary_base=10000.0, tie_embeddings=False),
}


def megatron_init_(model, cfg: ModelConfig, output_suffixes: tuple) -> None:
    """Megatron's init in place: weights normal(0, init_std), output projections (names ending in
    ``output_suffixes``) normal(0, init_std / sqrt(2 * layers)), biases 0, norm gains 1."""
    import math

    import torch.nn as nn
    out_std = cfg.init_std / math.sqrt(2.0 * cfg.num_layers)
    for name, p in model.named_parameters():
        if p.dim() == 1:
            (nn.init.zeros_ if name.endswith("bias") else nn.init.ones_)(p)
        else:
            nn.init.normal_(p, 0.0, out_std if name.endswith(output_suffixes) else cfg.init_std)


def pad_vocab(size: int, multiple: int) -> int:
    """``size`` rounded up to a multiple of ``multiple`` (Megatron's
    ``--make-vocab-size-divisible-by``)."""
    return ((size + multiple - 1) // multiple) * multiple


def preset_config(name: str, **overrides) -> ModelConfig:
    if name not in PRESETS:
        raise ValueError(f"unknown --model {name!r}; choose one of: {', '.join(PRESETS)}")
    values = dict(PRESETS[name])
    values.update({k: v for k, v in overrides.items() if v is not None})
    cfg = ModelConfig(**values)
    cfg.validate()
    return cfg
