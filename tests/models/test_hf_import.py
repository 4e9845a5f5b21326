"""Import Hugging Face checkpoints: every family gives transformers' logits (1e-5, fp32); sharded
checkpoints; loading a subset of tensors through a callback; unsupported configs refused before
any tensor is read, naming the config.json field.
"""
from __future__ import annotations

import json
import os

import pytest
import torch

from autosp_lm.config.arguments import ArgumentError, parse_args
from autosp_lm.config.build import build_run_config
from autosp_lm.models.hf import (HFCheckpointError, config_from_hf, load_hf_checkpoint,
                                 load_hf_weights, parameter_names)
from tests.helpers.hf_cases import FAMILIES, hf_logits, make_hf_model, sample_ids, save_hf_model

TOL = dict(rtol=1e-5, atol=1e-5)


def _our_logits(model, ids):
    model.eval()
    with torch.no_grad():
        return model(ids)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_import_family_gives_transformers_logits(family, tmp_path):
    pytest.importorskip("transformers")
    hf = make_hf_model(family)
    path = save_hf_model(hf, tmp_path / family)
    model, cfg = load_hf_checkpoint(path)
    assert cfg.hf_model_type == hf.config.model_type
    ids = sample_ids(seq=24)  # longer than llama-dynamic's 16 positions: the base grows
    ref = hf_logits(hf, ids)
    ours = _our_logits(model, ids)
    torch.testing.assert_close(ours, ref, **TOL)
    assert ref.abs().max() > 1.0  # logits of a size where 1e-5 is a real test
    if cfg.tie_embeddings:
        emb = model.wte if cfg.arch == "gpt" else model.embed_tokens
        assert model.lm_head.weight is emb.weight


def test_comparison_sees_every_family_extension(tmp_path):
    """Perturbing a q/k norm gain (Qwen3) or a q/k/v bias (Qwen2) moves the logits far beyond the
    tolerance: the import tests would catch such a tensor mapped wrongly or skipped."""
    pytest.importorskip("transformers")
    ids = sample_ids()
    for family, name in (("qwen3", "layers.0.attn.k_norm.weight"), ("qwen2", "layers.1.attn.v_proj.bias")):
        hf = make_hf_model(family)
        model, _ = load_hf_checkpoint(save_hf_model(hf, tmp_path / family))
        ref = hf_logits(hf, ids)
        with torch.no_grad():
            model.state_dict()[name].add_(0.05)
        assert (_our_logits(model, ids) - ref).abs().max() > 100 * TOL["atol"]


def test_sharded_checkpoint_through_its_index(tmp_path):
    pytest.importorskip("transformers")
    hf = make_hf_model("llama-3")
    path = save_hf_model(hf, tmp_path / "sharded", max_shard_size="40KB")
    shards = [f for f in os.listdir(path) if f.endswith(".safetensors")]
    assert len(shards) > 2 and os.path.isfile(os.path.join(path, "model.safetensors.index.json"))
    model, _ = load_hf_checkpoint(path)
    torch.testing.assert_close(_our_logits(model, sample_ids()), hf_logits(hf, sample_ids()), **TOL)


@pytest.mark.parametrize("family", ["llama-3.2", "gpt2"])
def test_subset_of_tensors_through_a_callback(family, tmp_path):
    """The building block of per-rank loading: only the chosen tensors are read, each handed over
    in our layout (GPT-2's Conv1D weights transposed); a tied output layer is never read."""
    pytest.importorskip("transformers")
    hf = make_hf_model(family)
    path = save_hf_model(hf, tmp_path / family)
    model, cfg = load_hf_checkpoint(path)
    names = [n for n in parameter_names(cfg) if n.startswith("layers.1.")]
    seen = {}
    loaded = load_hf_weights(None, path, cfg, names=names, on_tensor=lambda n, t: seen.__setitem__(n, t.clone()))
    assert sorted(loaded) == sorted(names) == sorted(seen)
    state = model.state_dict()
    for n, t in seen.items():
        torch.testing.assert_close(t, state[n], rtol=0, atol=0)
    # all names: the tied output layer comes with the embedding and is not read again
    seen.clear()
    load_hf_weights(None, path, cfg, on_tensor=lambda n, t: seen.__setitem__(n, None))
    assert "lm_head.weight" not in seen and len(seen) == len(parameter_names(cfg)) - 1
    # into a plain state dict of our names
    target = {n: torch.zeros_like(state[n]) for n in names}
    load_hf_weights(target, path, cfg, names=names)
    for n in names:
        torch.testing.assert_close(target[n], state[n], rtol=0, atol=0)


# --- refusals: config.json only, with a corrupt weights file that must never be opened --------
LLAMA = {"model_type": "llama", "vocab_size": 96, "hidden_size": 64, "intermediate_size": 96,
         "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
         "max_position_embeddings": 128, "rms_norm_eps": 1e-5, "rope_theta": 10000.0}
GPT2 = {"model_type": "gpt2", "vocab_size": 96, "n_embd": 64, "n_layer": 2, "n_head": 4, "n_positions": 64}

REFUSED = [
    (dict(LLAMA, model_type="mistral", sliding_window=4096), "sliding_window"),
    (dict(LLAMA, model_type="qwen2", use_sliding_window=True, sliding_window=32), "use_sliding_window"),
    (dict(LLAMA, model_type="qwen3", layer_types=["full_attention", "sliding_attention"]), "layer_types"),
    (dict(LLAMA, model_type="phi3"), "model_type"),
    (dict(LLAMA, hidden_act="gelu"), "hidden_act"),
    (dict(LLAMA, attention_bias=True), "attention_bias"),
    (dict(LLAMA, mlp_bias=True), "mlp_bias"),
    (dict(LLAMA, partial_rotary_factor=0.5), "partial_rotary_factor"),
    (dict(LLAMA, rope_scaling={"rope_type": "longrope", "short_factor": [1.0], "long_factor": [2.0]}),
     "longrope"),
    (dict(LLAMA, rope_scaling={"rope_type": "linear"}), "factor"),
    (dict(LLAMA, rope_scaling={"rope_type": "llama3", "factor": 8.0, "original_max_position_embeddings": 32}),
     "low_freq_factor"),
    ({k: v for k, v in LLAMA.items() if k != "intermediate_size"}, "intermediate_size"),
    (dict(GPT2, activation_function="relu"), "activation_function"),
    (dict(GPT2, scale_attn_by_inverse_layer_idx=True), "scale_attn_by_inverse_layer_idx"),
    (dict(GPT2, add_cross_attention=True), "add_cross_attention"),
]


def _write_ckpt(path, config: dict, weights: bytes = b"not a safetensors file") -> str:
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f)
    with open(os.path.join(path, "model.safetensors"), "wb") as f:
        f.write(weights)
    return str(path)


@pytest.mark.parametrize("config, field", REFUSED, ids=[f for _, f in REFUSED])
def test_unsupported_config_refused_before_any_work(config, field, tmp_path):
    path = _write_ckpt(tmp_path / "ckpt", config)
    with pytest.raises(HFCheckpointError, match=field):
        load_hf_checkpoint(path)  # the corrupt weights file would fail differently if it were read
    # the same through pretrain.py's flag validation, which runs before any process group or data
    with pytest.raises(ArgumentError, match=field):
        build_run_config(parse_args(["--hf-checkpoint", path, "--mock-data"]), world_size=1)


def test_sliding_window_message_names_value_and_field():
    with pytest.raises(HFCheckpointError) as e:
        config_from_hf(dict(LLAMA, model_type="mistral", sliding_window=4096))
    assert "sliding_window = 4096" in str(e.value) and "not supported" in str(e.value)


@pytest.mark.parametrize("flags, words", [
    (["--hidden-size", "32"], ["--hidden-size 32", "hidden_size = 64"]),
    (["--num-layers", "3"], ["--num-layers 3", "num_hidden_layers = 2"]),
    (["--group-query-attention", "--num-query-groups", "4"], ["--num-query-groups 4", "num_key_value_heads = 2"]),
    (["--vocab-size", "128"], ["--vocab-size 128", "vocab_size = 96"]),
    (["--norm-epsilon", "1e-6"], ["--norm-epsilon 1e-06", "rms_norm_eps = 1e-05"]),
    (["--ffn-hidden-size", "64"], ["--ffn-hidden-size 64", "intermediate_size = 96"]),
])
def test_shape_flags_that_disagree_name_both_values(flags, words, tmp_path):
    path = _write_ckpt(tmp_path / "ckpt", LLAMA)
    with pytest.raises(ArgumentError) as e:
        build_run_config(parse_args(["--hf-checkpoint", path, "--mock-data"] + flags), world_size=1)
    for w in words:
        assert w in str(e.value)


def test_gpt2_positions_are_a_shape(tmp_path):
    path = _write_ckpt(tmp_path / "ckpt", GPT2)
    with pytest.raises(ArgumentError, match="n_positions = 64"):
        build_run_config(parse_args(["--hf-checkpoint", path, "--mock-data", "--max-position-embeddings", "128",
                                  "--seq-length", "32"]), world_size=1)


def test_context_flags_change_the_imported_config(tmp_path):
    from safetensors.torch import save

    path = _write_ckpt(tmp_path / "ckpt", LLAMA, weights=save({"x": torch.zeros(1)}))
    run = build_run_config(parse_args(["--hf-checkpoint", path, "--mock-data", "--seq-length", "512",
                                       "--rope-scaling", "yarn", "--rope-scaling-factor", "4",
                                       "--yarn-beta-fast", "16"]), world_size=1)
    cfg = run.model.config
    assert cfg.rope_scaling == {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128,
                                "beta_fast": 16.0, "beta_slow": 1.0, "attention_factor": None,
                                "mscale": None, "mscale_all_dim": None, "truncate": True}
    assert cfg.max_position_embeddings == 512 and cfg.hidden_size == 64 and cfg.num_query_groups == 2
    # without the extension the sequence is too long for the checkpoint's context
    with pytest.raises(ArgumentError, match="--seq-length 512 exceeds --max-position-embeddings 128"):
        build_run_config(parse_args(["--hf-checkpoint", path, "--mock-data", "--seq-length", "512"]), world_size=1)
    with pytest.raises(ArgumentError, match="--yarn-beta-fast need"):
        build_run_config(parse_args(["--hf-checkpoint", path, "--mock-data", "--yarn-beta-fast", "16"]), world_size=1)
    with pytest.raises(ArgumentError, match="does not take 'beta_fast'"):
        build_run_config(parse_args(["--hf-checkpoint", path, "--mock-data", "--rope-scaling", "linear",
                                  "--rope-scaling-factor", "2", "--yarn-beta-fast", "16"]), world_size=1)


def test_missing_or_misshapen_tensor_is_named(tmp_path):
    from safetensors.torch import load_file, save_file
    pytest.importorskip("transformers")
    path = save_hf_model(make_hf_model("llama-3"), tmp_path / "ok")
    file = os.path.join(path, "model.safetensors")
    tensors = load_file(file)
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, file)
    with pytest.raises(HFCheckpointError, match=r"model\.layers\.1\.mlp\.up_proj\.weight"):
        load_hf_checkpoint(path)
    tensors["model.layers.1.mlp.up_proj.weight"] = torch.zeros(96, 32)
    save_file(tensors, file)
    with pytest.raises(HFCheckpointError, match=r"up_proj\.weight.*\(96, 32\).*\(96, 64\)"):
        load_hf_checkpoint(path)
    tensors["model.layers.1.mlp.up_proj.weight"] = torch.zeros(96, 64)
    tensors["model.layers.1.extra.weight"] = torch.zeros(3)
    save_file(tensors, file)
    with pytest.raises(HFCheckpointError, match=r"no place for: model\.layers\.1\.extra\.weight"):
        load_hf_checkpoint(path)
