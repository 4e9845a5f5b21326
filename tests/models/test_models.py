import math

import pytest
import torch

from autosp_lm.models import (PRESETS, build_model, lm_cross_entropy, preset_config, sdpa_attention,
                              use_attention)
from autosp_lm.models.llama import rope_inv_freq


# Published parameter counts (embeddings included).
PUBLISHED = {"gpt2-124m": 124.44e6, "llama-3.2-1b": 1.236e9, "llama-3.2-3b": 3.213e9,
             "llama-3.1-8b": 8.030e9, "llama-2-13b": 13.016e9}


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_presets_match_published_sizes(name):
    cfg = preset_config(name)
    with torch.device("meta"):
        model = build_model(cfg)
    n = sum(p.numel() for p in model.parameters())
    assert n == cfg.num_parameters()
    assert abs(n - PUBLISHED[name]) / PUBLISHED[name] < 2e-3


def test_llama_tiny_uses_gqa_and_shapes():
    cfg = preset_config("llama-tiny")
    assert cfg.num_query_groups < cfg.num_attention_heads
    model = build_model(cfg)
    attn = model.layers[0].attn
    assert attn.k_proj.weight.shape == (cfg.num_query_groups * cfg.head_dim, cfg.hidden_size)
    ids = torch.randint(0, cfg.vocab_size, (2, 24))
    assert model(ids).shape == (2, 24, cfg.vocab_size)
    assert not cfg.tie_embeddings and model.lm_head.weight is not model.embed_tokens.weight


def test_gpt_ties_embeddings_and_positions_matter():
    cfg = preset_config("gpt-tiny")
    model = build_model(cfg)
    assert model.lm_head.weight is model.wte.weight
    ids = torch.randint(0, cfg.vocab_size, (1, 16))
    a = model(ids)
    b = model(ids, position_ids=torch.arange(5, 21).unsqueeze(0))
    assert not torch.allclose(a, b)


def test_flags_override_preset():
    cfg = preset_config("llama-tiny", num_layers=3, hidden_size=128, num_attention_heads=8, num_query_groups=4)
    assert (cfg.num_layers, cfg.hidden_size, cfg.num_attention_heads, cfg.num_query_groups) == (3, 128, 8, 4)
    with pytest.raises(ValueError, match="not divisible by --num-attention-heads"):
        preset_config("gpt-tiny", hidden_size=65)
    with pytest.raises(ValueError, match="unknown --model"):
        preset_config("gpt-huge")


@pytest.mark.parametrize("name", ["gpt-tiny", "llama-tiny"])
def test_loss_ignores_minus_100_and_matches_manual(name):
    torch.manual_seed(0)
    cfg = preset_config(name)
    model = build_model(cfg)
    ids = torch.randint(0, cfg.vocab_size, (2, 16))
    labels = torch.randint(0, cfg.vocab_size, (2, 16))
    labels[0, :10] = -100
    loss = model(ids, labels=labels)
    logits = model(ids)
    keep = labels != -100
    manual = torch.nn.functional.cross_entropy(logits[keep], labels[keep])
    torch.testing.assert_close(loss, manual)
    assert torch.isclose(lm_cross_entropy(logits, labels, "sum") / keep.sum(), loss)


@pytest.mark.parametrize("name", ["gpt-tiny", "llama-tiny"])
def test_causality(name):
    torch.manual_seed(0)
    model = build_model(preset_config(name))
    ids = torch.randint(0, 512, (1, 20))
    ids2 = ids.clone()
    ids2[0, 15:] = (ids2[0, 15:] + 7) % 512
    a, b = model(ids), model(ids2)
    torch.testing.assert_close(a[:, :15], b[:, :15])
    assert not torch.allclose(a[:, 15:], b[:, 15:])


def test_attention_entry_point_is_replaceable():
    calls = []

    def spy(q, k, v, *, causal=True, dropout_p=0.0):
        calls.append((q.shape, k.shape))
        return sdpa_attention(q, k, v, causal=causal, dropout_p=dropout_p)

    cfg = preset_config("llama-tiny")
    model = build_model(cfg)
    ids = torch.randint(0, 512, (1, 8))
    ref = model(ids)
    with use_attention(spy):
        out = model(ids)
    torch.testing.assert_close(out, ref)
    assert len(calls) == cfg.num_layers
    q_shape, k_shape = calls[0]
    assert q_shape == (1, cfg.num_attention_heads, 8, cfg.head_dim)
    assert k_shape == (1, cfg.num_query_groups, 8, cfg.head_dim)  # kv heads not repeated
    model(ids)
    assert len(calls) == cfg.num_layers  # restored


def test_megatron_init_scales_output_projections():
    torch.manual_seed(0)
    cfg = preset_config("llama-tiny", num_layers=8, hidden_size=256, num_attention_heads=4,
                        num_query_groups=2, ffn_hidden_size=512)
    model = build_model(cfg)
    assert abs(model.layers[0].attn.q_proj.weight.std().item() - 0.02) < 2e-3
    expect = 0.02 / math.sqrt(16)
    assert abs(model.layers[0].attn.o_proj.weight.std().item() - expect) < 1e-3


def test_llama3_rope_scaling():
    base = rope_inv_freq(128, 500000.0)
    scaled = rope_inv_freq(128, 500000.0, PRESETS["llama-3.1-8b"]["rope_scaling"])
    assert torch.equal(scaled[:10], base[:10])  # high frequencies (short wavelengths) untouched
    torch.testing.assert_close(scaled[-1], base[-1] / 8)  # lowest frequency divided by the factor
    assert (scaled <= base).all()
