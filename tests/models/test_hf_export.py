"""Export to Hugging Face: transformers.AutoModelForCausalLM.from_pretrained loads what
save_hf_checkpoint writes and gives our logits (1e-5, fp32): imported families, models built
here with every RoPE scaling and family option, sharded output."""
from __future__ import annotations

import json
import os

import pytest
import torch

from autosp_lm.models import ModelConfig, build_model
from autosp_lm.models.hf import HFCheckpointError, load_hf_checkpoint, save_hf_checkpoint
from autosp_lm.models.rope import normalize_rope_scaling
from tests.helpers.hf_cases import make_hf_model, sample_ids, save_hf_model

transformers = pytest.importorskip("transformers")
TOL = dict(rtol=1e-5, atol=1e-5)


def hf_load(path):
    return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32,
                                                             attn_implementation="eager").eval()


def logits(model, ids):
    model.eval()
    with torch.no_grad():
        out = model(input_ids=ids)
    return out.logits if hasattr(out, "logits") else out


def randomize_(model, seed=0):
    """Weights large enough that every tensor moves the logits (our init's biases are 0)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1:
                base = 0.0 if name.endswith("bias") else 1.0
                p.copy_(base + 0.2 * torch.randn(p.shape, generator=g))
            elif name.startswith(("embed_tokens", "wte", "wpe")):
                p.copy_(0.2 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(torch.randn(p.shape, generator=g) / p.shape[-1] ** 0.5)
    return model


@pytest.mark.parametrize("family", ["llama-3.1", "llama-3.2", "mistral", "qwen2", "qwen2.5-yarn", "qwen3",
                                    "gpt2", "llama-dynamic"])
def test_import_then_export_loads_in_transformers(family, tmp_path):
    src = save_hf_model(make_hf_model(family), tmp_path / "src")
    model, cfg = load_hf_checkpoint(src)
    out = tmp_path / "out"
    written = save_hf_checkpoint(model, cfg, out)
    assert "config.json" in written and "model.safetensors" in written
    exported = hf_load(out)
    assert exported.config.model_type == cfg.hf_model_type
    ids = sample_ids(seq=24)
    torch.testing.assert_close(logits(exported, ids), logits(model, ids), **TOL)


LLAMA = dict(arch="llama", num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=2,
             ffn_hidden_size=96, vocab_size=96, max_position_embeddings=256)
NATIVE = {
    "llama": dict(LLAMA),
    "llama-tied-yarn": dict(LLAMA, tie_embeddings=True, rope_scaling={
        "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 8, "beta_fast": 16.0,
        "beta_slow": 2.0}),
    "llama-yarn-attention-factor": dict(LLAMA, rope_scaling={
        "rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 12, "attention_factor": 1.3,
        "truncate": False}),
    "llama-linear": dict(LLAMA, rope_scaling={"rope_type": "linear", "factor": 3.0}),
    "llama-dynamic-ntk": dict(LLAMA, rope_scaling={"rope_type": "dynamic-ntk", "factor": 2.0,
                                                  "original_max_position_embeddings": 16}),
    "llama3-scaling": dict(LLAMA, rotary_base=500000.0, rope_scaling={
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 16}),
    "qkv-bias": dict(LLAMA, qkv_bias=True),
    "qk-norm-head-size": dict(LLAMA, qk_norm=True, kv_channels=24, norm_eps=1e-6),
    "gpt": dict(arch="gpt", num_layers=2, hidden_size=64, num_attention_heads=4, ffn_hidden_size=128,
                vocab_size=96, max_position_embeddings=64),
    "gpt-untied": dict(arch="gpt", num_layers=1, hidden_size=32, num_attention_heads=2, vocab_size=96,
                       max_position_embeddings=64, tie_embeddings=False),
}


@pytest.mark.parametrize("name", list(NATIVE))
def test_models_built_here_export_with_equal_logits(name, tmp_path):
    cfg = ModelConfig(**NATIVE[name])
    model = randomize_(build_model(cfg))
    save_hf_checkpoint(model, cfg, tmp_path)
    exported = hf_load(tmp_path)
    ids = sample_ids(seq=24)  # past the dynamic/yarn original lengths
    torch.testing.assert_close(logits(exported, ids), logits(model, ids), **TOL)
    # and back: importing the export gives the same model
    again, cfg2 = load_hf_checkpoint(tmp_path)
    torch.testing.assert_close(logits(again, ids), logits(model, ids), rtol=0, atol=0)
    assert cfg2.rope_scaling == normalize_rope_scaling(cfg.rope_scaling)
    for k in ("rotary_base", "qkv_bias", "qk_norm", "head_dim", "tie_embeddings", "norm_eps", "num_query_groups"):
        assert getattr(cfg2, k) == getattr(cfg, k), k


def test_sharded_bf16_export(tmp_path):
    from safetensors import safe_open
    cfg = ModelConfig(**NATIVE["qkv-bias"])
    model = randomize_(build_model(cfg))
    written = save_hf_checkpoint(model, cfg, tmp_path, dtype=torch.bfloat16, max_shard_bytes="20KB")
    shards = [f for f in written if f.endswith(".safetensors")]
    assert len(shards) > 2 and "model.safetensors.index.json" in written
    index = json.load(open(os.path.join(tmp_path, "model.safetensors.index.json")))
    assert set(index["weight_map"].values()) == set(shards)
    with safe_open(os.path.join(tmp_path, shards[0]), framework="pt") as f:
        assert all(f.get_tensor(k).dtype == torch.bfloat16 for k in f.keys())
    assert json.load(open(os.path.join(tmp_path, "config.json")))["torch_dtype"] == "bfloat16"
    exported = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    ref = build_model(cfg)
    ref.load_state_dict({k: v.to(torch.bfloat16).float() for k, v in model.state_dict().items()})
    ids = sample_ids()
    torch.testing.assert_close(logits(exported, ids), logits(ref, ids), **TOL)


def test_export_refuses_a_model_without_an_equivalent(tmp_path):
    cfg = ModelConfig(**dict(LLAMA, qkv_bias=True, qk_norm=True))
    with pytest.raises(HFCheckpointError, match="no Hugging Face equivalent"):
        save_hf_checkpoint(build_model(cfg), cfg, tmp_path / "out")
    assert not os.path.exists(tmp_path / "out")  # refused before writing anything
