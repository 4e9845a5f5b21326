"""Tiny random Hugging Face models of every supported family, made and saved by transformers.

Weights are redrawn at a larger scale than transformers' init (whose biases are 0 and norm gains
1) so that every tensor, biases and norm gains included, changes the logits: a wrongly mapped or
skipped tensor shows up in a logits comparison.
"""
from __future__ import annotations

import os

import torch

VOCAB = 96

# family -> (config class name, model class name, config kwargs)
FAMILIES = {
    # Llama 2: multi-head attention, untied, plain RoPE
    "llama-2": ("LlamaConfig", "LlamaForCausalLM",
                dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                     num_key_value_heads=4, max_position_embeddings=128, rms_norm_eps=1e-5,
                     tie_word_embeddings=False)),
    # Llama 3: GQA, theta 500000
    "llama-3": ("LlamaConfig", "LlamaForCausalLM",
                dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                     num_key_value_heads=2, max_position_embeddings=128, rope_theta=500000.0,
                     tie_word_embeddings=False)),
    # Llama 3.1: Llama-3 frequency scaling
    "llama-3.1": ("LlamaConfig", "LlamaForCausalLM",
                  dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                       num_key_value_heads=2, max_position_embeddings=256, rope_theta=500000.0,
                       rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                     "high_freq_factor": 4.0, "original_max_position_embeddings": 32},
                       tie_word_embeddings=False)),
    # Llama 3.2: tied embeddings
    "llama-3.2": ("LlamaConfig", "LlamaForCausalLM",
                  dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                       num_key_value_heads=2, max_position_embeddings=256, rope_theta=500000.0,
                       rope_scaling={"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                                     "high_freq_factor": 4.0, "original_max_position_embeddings": 8},
                       tie_word_embeddings=True)),
    # linear and dynamic NTK scaling (the input is longer than max_position_embeddings)
    "llama-linear": ("LlamaConfig", "LlamaForCausalLM",
                     dict(hidden_size=64, intermediate_size=96, num_hidden_layers=1, num_attention_heads=4,
                          num_key_value_heads=2, max_position_embeddings=64,
                          rope_scaling={"rope_type": "linear", "factor": 4.0})),
    "llama-dynamic": ("LlamaConfig", "LlamaForCausalLM",
                      dict(hidden_size=64, intermediate_size=96, num_hidden_layers=1, num_attention_heads=4,
                           num_key_value_heads=2, max_position_embeddings=16,
                           rope_scaling={"rope_type": "dynamic", "factor": 2.0})),
    "mistral": ("MistralConfig", "MistralForCausalLM",
                dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                     num_key_value_heads=2, max_position_embeddings=128, sliding_window=None,
                     tie_word_embeddings=False)),
    # Qwen2: q/k/v biases, tied (Qwen2.5-0.5B style)
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM",
              dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                   num_key_value_heads=1, max_position_embeddings=128, rope_theta=1000000.0,
                   tie_word_embeddings=True)),
    # Qwen2.5 with YaRN (the long-context configs)
    "qwen2.5-yarn": ("Qwen2Config", "Qwen2ForCausalLM",
                     dict(hidden_size=64, intermediate_size=96, num_hidden_layers=1, num_attention_heads=4,
                          num_key_value_heads=2, max_position_embeddings=64,
                          rope_scaling={"rope_type": "yarn", "factor": 4.0,
                                        "original_max_position_embeddings": 16},
                          tie_word_embeddings=False)),
    # Qwen3: per-head q/k RMSNorm, head size 32 != hidden / heads = 16
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM",
              dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                   num_key_value_heads=2, head_dim=32, max_position_embeddings=128,
                   tie_word_embeddings=True)),
    "gpt2": ("GPT2Config", "GPT2LMHeadModel",
             dict(n_embd=64, n_layer=2, n_head=4, n_positions=64, resid_pdrop=0.0, embd_pdrop=0.0,
                  attn_pdrop=0.0)),
}


def make_hf_model(family: str, seed: int = 0, **overrides):
    """A tiny random transformers model of ``family`` (eval mode, fp32, eager attention)."""
    import transformers

    cfg_cls, model_cls, kwargs = FAMILIES[family]
    cfg = getattr(transformers, cfg_cls)(**{**kwargs, "vocab_size": VOCAB, **overrides})
    cfg._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = getattr(transformers, model_cls)(cfg).eval()
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1 and "norm" in name or name.endswith(("ln_1.weight", "ln_2.weight", "ln_f.weight")):
                p.copy_(1 + 0.2 * torch.randn(p.shape, generator=g))
            elif p.dim() == 1:
                p.copy_(0.2 * torch.randn(p.shape, generator=g))
            elif any(k in name for k in ("embed", "wte", "wpe")):
                p.copy_(0.2 * torch.randn(p.shape, generator=g))
            else:  # unit-variance outputs
                p.copy_(torch.randn(p.shape, generator=g) / p.shape[-1] ** 0.5)
    return model


def save_hf_model(model, path, max_shard_size=None) -> str:
    os.makedirs(path, exist_ok=True)
    kw = {} if max_shard_size is None else {"max_shard_size": max_shard_size}
    model.save_pretrained(path, **kw)
    return str(path)


def hf_logits(model, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=ids).logits


def sample_ids(batch: int = 2, seq: int = 24, seed: int = 5) -> torch.Tensor:
    return torch.randint(0, VOCAB, (batch, seq), generator=torch.Generator().manual_seed(seed))


def pretrain_worker(rank, world, argv):
    """One rank of ``pretrain.main(argv)`` (for tests.dist_utils.run_distributed; importing this
    module does not import transformers)."""
    import pretrain
    res = pretrain.main(argv)
    return {"losses": res.losses, "grad_norms": res.grad_norms, "iteration": res.iteration}
