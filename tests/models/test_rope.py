"""RoPE scaling: our frequencies, attention factors and cos/sin tables against transformers'.

transformers computes the frequencies in float32, we in float64 rounded once, so the two differ by
a few float32 ulps; the tables are compared with the bound that difference allows (and a negative
check proves the bound still catches a wrong parameter).
"""
from __future__ import annotations

import math

import pytest
import torch

from autosp_lm.models import ModelConfig, build_model
from autosp_lm.models.rope import (RopeScalingError, normalize_rope_scaling, rope_attention_factor,
                                   rope_inv_freq)

HEAD_DIM, BASE, ORIG = 16, 10000.0, 64
EPS32 = torch.finfo(torch.float32).eps

# (our scaling, transformers' rope_parameters, positions to tabulate)
CASES = {
    "none": (None, {"rope_type": "default"}, 256),
    "linear": ({"rope_type": "linear", "factor": 4.0}, {"rope_type": "linear", "factor": 4.0}, 256),
    # dynamic NTK grows the base only beyond the original length: tabulate past it
    "dynamic-ntk": ({"rope_type": "dynamic-ntk", "factor": 2.0, "original_max_position_embeddings": ORIG},
                    {"rope_type": "dynamic", "factor": 2.0}, 200),
    "dynamic-ntk-short": ({"rope_type": "dynamic-ntk", "factor": 2.0, "original_max_position_embeddings": ORIG},
                          {"rope_type": "dynamic", "factor": 2.0}, 48),
    "llama3": ({"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": ORIG},
               {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": ORIG}, 512),
    "yarn": ({"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": ORIG},
             {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": ORIG}, 256),
    "yarn-betas-attention-factor": (
        {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": ORIG, "beta_fast": 8.0,
         "beta_slow": 2.0, "attention_factor": 1.25},
        {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": ORIG, "beta_fast": 8.0,
         "beta_slow": 2.0, "attention_factor": 1.25}, 256),
    "yarn-mscale-untruncated": (
        {"rope_type": "yarn", "factor": 16.0, "original_max_position_embeddings": ORIG, "mscale": 1.0,
         "mscale_all_dim": 0.5, "truncate": False},
        {"rope_type": "yarn", "factor": 16.0, "original_max_position_embeddings": ORIG, "mscale": 1.0,
         "mscale_all_dim": 0.5, "truncate": False}, 1024),
}


def hf_rotary(hf_params: dict, max_pos: int):
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(hidden_size=4 * HEAD_DIM, num_attention_heads=4, head_dim=HEAD_DIM,
                                   num_hidden_layers=1, max_position_embeddings=max_pos,
                                   rope_theta=BASE,
                                   rope_scaling=None if hf_params["rope_type"] == "default" else hf_params)
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding
    return LlamaRotaryEmbedding(cfg)


def our_model(scaling, max_pos):
    cfg = ModelConfig(arch="llama", num_layers=1, hidden_size=4 * HEAD_DIM, num_attention_heads=4,
                      vocab_size=32, max_position_embeddings=max_pos, rotary_base=BASE, rope_scaling=scaling)
    return build_model(cfg)


# transformers' float32 frequency arithmetic (pow, divide, YaRN's ramp blend) rounds up to ~5
# times; ours rounds once
FREQ_RTOL = 8 * EPS32


def tables_bound(pos_max: int, inv: torch.Tensor, factor: float) -> torch.Tensor:
    """Per-frequency bound of |cos_ours - cos_theirs| (and sin): the angle differs by at most
    pos * FREQ_RTOL * inv_freq, plus one float32 rounding of each angle product and of each
    cos/sin; all times the attention factor."""
    inv = inv.double()
    return factor * (pos_max * FREQ_RTOL * inv + 2 * EPS32 * pos_max * inv + 2 * EPS32)


@pytest.mark.parametrize("name", list(CASES))
def test_tables_equal_transformers(name):
    ours, theirs, n = CASES[name]
    # transformers' dynamic NTK takes the original length from max_position_embeddings
    max_pos = ORIG if theirs["rope_type"] in ("dynamic", "default") else ORIG * 16
    rot = hf_rotary(theirs, max_pos)
    model = our_model(ours, max_pos=4096)
    pos = torch.arange(n).unsqueeze(0)
    x = torch.zeros(1, 1, n, HEAD_DIM)
    cos_hf, sin_hf = rot(x, pos)  # [1, n, d] (two copies of d/2)
    # the model's own tables: dynamic NTK depends on the sequence length seen
    cos, sin = model.rope(pos)
    assert cos.shape == (1, 1, n, HEAD_DIM // 2)
    half = HEAD_DIM // 2
    torch.testing.assert_close(cos_hf[..., :half], cos_hf[..., half:], rtol=0, atol=0)
    ours_inv = rope_inv_freq(HEAD_DIM, BASE, ours, seq_len=n)
    theirs_inv = rot.inv_freq
    torch.testing.assert_close(ours_inv, theirs_inv, rtol=FREQ_RTOL, atol=0)
    assert rope_attention_factor(ours) == pytest.approx(rot.attention_scaling, rel=1e-12)
    bound = tables_bound(n - 1, ours_inv, rot.attention_scaling)
    assert ((cos[0, 0] - cos_hf[0, :, :half]).abs() <= bound).all()
    assert ((sin[0, 0] - sin_hf[0, :, :half]).abs() <= bound).all()


@pytest.mark.parametrize("wrong", [{"beta_slow": 1.0}, {"factor": 4.5}, {"attention_factor": 1.2},
                                   {"original_max_position_embeddings": 1024}])
def test_tables_bound_catches_a_wrong_parameter(wrong):
    ours, theirs, n = CASES["yarn-betas-attention-factor"]
    rot = hf_rotary(dict(theirs, **wrong), ORIG * 16)
    cos, sin = our_model(ours, 4096).rope(torch.arange(n).unsqueeze(0))
    cos_hf, sin_hf = rot(torch.zeros(1, 1, n, HEAD_DIM), torch.arange(n).unsqueeze(0))
    bound = tables_bound(n - 1, rope_inv_freq(HEAD_DIM, BASE, ours), rot.attention_scaling)
    excess = torch.maximum((cos[0, 0] - cos_hf[0, :, :HEAD_DIM // 2]).abs() / bound,
                           (sin[0, 0] - sin_hf[0, :, :HEAD_DIM // 2]).abs() / bound)
    assert excess.max().item() > 10


def test_llama3_presets_keep_their_legacy_form():
    from autosp_lm.models import PRESETS
    legacy = PRESETS["llama-3.1-8b"]["rope_scaling"]
    assert "rope_type" not in legacy
    assert normalize_rope_scaling(legacy)["rope_type"] == "llama3"
    torch.testing.assert_close(rope_inv_freq(128, 500000.0, legacy),
                               rope_inv_freq(128, 500000.0, dict(legacy, rope_type="llama3")))


@pytest.mark.parametrize("scaling, words", [
    ({"rope_type": "yarn", "original_max_position_embeddings": 64}, ["'factor'", "--rope-scaling-factor"]),
    ({"rope_type": "yarn", "factor": 4.0}, ["original_max_position_embeddings",
                                           "--rope-original-max-position-embeddings"]),
    ({"rope_type": "llama3", "factor": 8.0, "original_max_position_embeddings": 64},
     ["low_freq_factor", "high_freq_factor"]),
    ({"rope_type": "linear", "factor": 2.0, "beta_fast": 3.0}, ["does not take", "beta_fast"]),
    ({"rope_type": "ntk", "factor": 2.0}, ["unknown RoPE scaling type", "'ntk'"]),
    ({"rope_type": "linear", "factor": 0.5}, ["must be >= 1", "0.5"]),
    ({"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64, "beta_fast": 1.0,
      "beta_slow": 2.0}, ["beta_fast", "larger than", "beta_slow"]),
    ({"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 4.0, "high_freq_factor": 1.0,
      "original_max_position_embeddings": 64}, ["high_freq_factor", "low_freq_factor"]),
    ({"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64.5}, ["positive integer"]),
    ({"rope_type": "none", "factor": 4.0}, ["takes no parameters", "factor"]),
    ({"factor": 4.0}, ["no 'rope_type'"]),
])
def test_wrong_or_missing_parameter_is_a_clear_error(scaling, words):
    with pytest.raises(RopeScalingError) as e:
        normalize_rope_scaling(scaling)
    for w in words:
        assert w in str(e.value)
    # the model config refuses it too (before any weights exist)
    with pytest.raises(ValueError):
        ModelConfig(arch="llama", rope_scaling=scaling).validate()


def test_yarn_default_attention_factor():
    sc = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}
    assert rope_attention_factor(sc) == pytest.approx(0.1 * math.log(4.0) + 1.0)
    assert rope_attention_factor({"rope_type": "linear", "factor": 4.0}) == 1.0
