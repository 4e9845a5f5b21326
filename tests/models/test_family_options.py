"""The model options the Hugging Face families need (q/k/v biases, per-head q/k norms, a head size
other than hidden/heads): off by default with unchanged parameter names, counted right."""
from __future__ import annotations

import pytest
import torch

from autosp_lm.models import ModelConfig, build_model, preset_config
from autosp_lm.training.flops import flops_per_step

BASE = dict(arch="llama", num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=2,
            ffn_hidden_size=96, vocab_size=96)


def test_defaults_keep_the_state_dict_names():
    names = list(build_model(preset_config("llama-tiny")).state_dict())
    assert not any("bias" in n or "q_norm" in n or "k_norm" in n for n in names)
    assert "layers.0.attn.q_proj.weight" in names and "layers.0.input_norm.weight" in names


@pytest.mark.parametrize("opts", [{}, {"qkv_bias": True}, {"qk_norm": True, "kv_channels": 24},
                                  {"kv_channels": 8, "tie_embeddings": True}])
def test_parameter_count_and_shapes(opts):
    cfg = ModelConfig(**BASE, **opts)
    model = build_model(cfg)
    assert cfg.num_parameters() == sum(p.numel() for p in model.parameters())
    hd = opts.get("kv_channels", 16)
    assert model.layers[0].attn.q_proj.weight.shape == (4 * hd, 64)
    assert model.layers[0].attn.o_proj.weight.shape == (64, 4 * hd)
    assert (model.layers[0].attn.k_proj.bias is not None) == bool(opts.get("qkv_bias"))
    assert (model.layers[0].attn.q_norm is not None) == bool(opts.get("qk_norm"))
    ids = torch.randint(0, 96, (1, 8))
    assert model(ids).shape == (1, 8, 96)


def test_flops_count_the_query_width():
    cfg = ModelConfig(**BASE, kv_channels=32)  # q width 128 != hidden 64
    h, q, kv, f, S, V = 64, 128, 64, 96, 16, 96
    per_layer = 2 * h * (q + 2 * kv) + 4 * S * q + 2 * q * h + 6 * h * f
    assert flops_per_step(cfg, S, S) == 3.0 * S * (2 * per_layer + 2 * h * V)
    plain = ModelConfig(**BASE)  # unchanged for configs whose heads fill the hidden size
    assert flops_per_step(plain, S, S) == 3.0 * S * (2 * (2 * h * (h + 2 * 32) + 4 * S * h + 2 * h * h
                                                          + 6 * h * f) + 2 * h * V)


def test_gpt_refuses_llama_options():
    for opt in ({"qkv_bias": True}, {"qk_norm": True}, {"kv_channels": 8},
                {"rope_scaling": {"rope_type": "linear", "factor": 2.0}}):
        with pytest.raises(ValueError, match="llama-architecture option"):
            ModelConfig(arch="gpt", **opt).validate()
