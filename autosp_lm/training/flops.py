"""Model FLOPs per step (Megatron's convention) and peak FLOP/s tables for MFU.

Convention: dense matmul FLOPs only, 2 FLOPs per multiply-add, training = 3x forward (backward
is 2x forward), activation recomputation *not* counted (model FLOPs, not hardware FLOPs), and
attention scores/values counted over the full S x S square even with a causal mask, as Megatron
does. Per token and layer the forward counts: QKV 2*h*(q_dim + 2*kv_dim), attention 4*S*q_dim,
output projection 2*q_dim*h, MLP 4*h*f (GPT) or 6*h*f (SwiGLU); plus 2*h*V for the logits
(q_dim = heads x head size, which is h unless the head size is set apart, as in Qwen3).

Document masking (``--reset-attention-mask``): the attention term counts only the attention the
mask leaves, with the same convention per document: each document of length ``L_d`` counts its
full ``L_d x L_d`` square, so a sequence counts ``sum_d L_d^2`` query-key pairs instead of
``S^2`` (:func:`document_attention_pairs`).
"""
from __future__ import annotations

import torch


def flops_per_step(cfg, tokens: int, seq_length: int, attention_pairs=None) -> float:
    """Training FLOPs (fwd + bwd) for ``tokens`` tokens of sequences of ``seq_length``.
    ``attention_pairs``: the query-key pairs the attention computes over all sequences of the
    step (default ``tokens * seq_length``: every sequence's full square)."""
    h, f, V = cfg.hidden_size, cfg.ffn_hidden_size, cfg.vocab_size
    q_dim = cfg.num_attention_heads * cfg.head_dim
    kv_dim = cfg.num_query_groups * cfg.head_dim
    mlp = (6 if cfg.arch == "llama" else 4) * h * f
    per_token_layer = 2 * h * (q_dim + 2 * kv_dim) + 2 * q_dim * h + mlp
    pairs = tokens * seq_length if attention_pairs is None else attention_pairs
    forward = tokens * (cfg.num_layers * per_token_layer + 2 * h * V) \
        + cfg.num_layers * 4 * q_dim * pairs
    return 3.0 * forward


def document_attention_pairs(document_ids: torch.Tensor) -> int:
    """``sum_d L_d^2`` over the documents of every sequence of ``document_ids [B, S]`` (ids
    non-decreasing along each sequence)."""
    total = 0
    for row in document_ids.reshape(-1, document_ids.size(-1)):
        counts = torch.unique_consecutive(row, return_counts=True)[1]
        total += int((counts.long() ** 2).sum())
    return total


# Dense peak TFLOP/s per GPU: (bf16, tf32). Unknown devices give no MFU.
_PEAKS = [
    ("H200", 989.0, 494.5), ("H100", 989.0, 494.5), ("H800", 989.0, 494.5), ("GH200", 989.0, 494.5),
    ("B200", 2250.0, 1100.0), ("A100", 312.0, 156.0), ("A800", 312.0, 156.0), ("L40S", 362.0, 183.0),
    ("A10G", 70.0, 35.0), ("A6000", 155.0, 77.0), ("V100", 125.0, 15.7),
]


def peak_tflops(device: torch.device, bf16: bool):
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    for key, bf, tf32 in _PEAKS:
        if key in name:
            return bf if bf16 else tf32
    return None
