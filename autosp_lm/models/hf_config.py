"""Hugging Face ``config.json`` <-> :class:`~autosp_lm.models.config.ModelConfig`: the families we
compute exactly, their fields and defaults, and the refusals (a field we cannot honour is named
before any tensor is read). The weights are :mod:`.hf`."""
from __future__ import annotations

import json
import os
from typing import Optional, Union

import torch

from .config import ModelConfig
from .rope import RopeScalingError, normalize_rope_scaling, rope_context_length

CONFIG_FILE = "config.json"
INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")
SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "gpt2")
_ARCHITECTURES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM",
                  "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM", "gpt2": "GPT2LMHeadModel"}
# transformers' defaults for fields a config.json may leave out
_DEFAULT_KV_HEADS = {"mistral": 8, "qwen2": 32, "qwen3": 32}
_DEFAULT_HEAD_DIM = {"qwen3": 128}
_DEFAULT_MAX_POS = {"llama": 2048, "mistral": 4096 * 32, "qwen2": 32768, "qwen3": 32768}
_HF_ROPE_TYPES = {"default": "none", "linear": "linear", "dynamic": "dynamic-ntk", "llama3": "llama3",
                  "yarn": "yarn"}
_OUR_ROPE_TYPES = {v: k for k, v in _HF_ROPE_TYPES.items()}


class HFCheckpointError(ValueError):
    """An unsupported config, a missing file or tensor, or a tensor of the wrong shape; the
    message names the field, file or tensor."""


# ---------------------------------------------------------------------------------------------
# config.json <-> ModelConfig
# ---------------------------------------------------------------------------------------------
def read_hf_config(path: Union[str, os.PathLike]) -> dict:
    """The parsed ``config.json`` of a checkpoint directory (or the file itself)."""
    path = os.fspath(path)
    file = os.path.join(path, CONFIG_FILE) if os.path.isdir(path) else path
    if not os.path.isfile(file):
        raise HFCheckpointError(f"{file} not found: a Hugging Face checkpoint directory holds "
                                f"config.json and *.safetensors")
    try:
        with open(file) as f:
            return json.load(f)
    except json.JSONDecodeError as e:
        raise HFCheckpointError(f"{file} is not valid JSON ({e})") from None


def _hf_rope(hf: dict, where: str) -> tuple[float, Optional[dict]]:
    """(rope base, our scaling dict) from either config layout: transformers 4's ``rope_theta`` +
    ``rope_scaling``, or transformers 5's ``rope_parameters`` (which holds ``rope_theta``)."""
    params = hf.get("rope_parameters")
    if params is not None and not isinstance(params, dict):
        raise HFCheckpointError(f"{where}: rope_parameters must be an object, got {params!r}")
    if params and any(isinstance(v, dict) for v in params.values()):
        raise HFCheckpointError(f"{where}: rope_parameters per layer type ({', '.join(params)}) are "
                                f"not supported: every layer must share one RoPE")
    scaling = dict(hf.get("rope_scaling") or params or {})
    base = scaling.pop("rope_theta", None)
    if base is None:
        base = hf.get("rope_theta", 10000.0)
    partial = scaling.pop("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0))
    if partial not in (None, 1, 1.0):
        raise HFCheckpointError(f"{where}: partial_rotary_factor = {partial} is not supported (our "
                                f"models rotate the whole head)")
    kind = scaling.pop("rope_type", None) or scaling.pop("type", None) or "default"
    scaling.pop("type", None)
    if kind not in _HF_ROPE_TYPES:
        raise HFCheckpointError(f"{where}: rope_scaling type {kind!r} is not supported; supported: "
                                f"{', '.join(_HF_ROPE_TYPES)}")
    ours = _HF_ROPE_TYPES[kind]
    if ours == "none":
        return float(base), None
    max_pos = hf.get("max_position_embeddings")
    if ours == "dynamic-ntk":
        # transformers grows the base relative to max_position_embeddings
        scaling.pop("original_max_position_embeddings", None)
        scaling["original_max_position_embeddings"] = max_pos
    elif ours in ("llama3", "yarn") and scaling.get("original_max_position_embeddings") is None:
        scaling["original_max_position_embeddings"] = hf.get("original_max_position_embeddings", max_pos)
    if ours == "yarn" and scaling.get("factor") is None and max_pos:
        scaling["factor"] = max_pos / scaling["original_max_position_embeddings"]
    try:
        return float(base), normalize_rope_scaling(dict(scaling, rope_type=ours))
    except RopeScalingError as e:
        raise HFCheckpointError(f"{where}: rope_scaling: {e}") from None


def _refuse(where: str, field: str, value, why: str):
    raise HFCheckpointError(f"{where}: {field} = {json.dumps(value)} is not supported: {why}")


def _require(hf: dict, where: str, *fields):
    out = []
    for f in fields:
        if hf.get(f) is None:
            raise HFCheckpointError(f"{where}: the required field {f!r} is missing")
        out.append(hf[f])
    return out


def _check_no_sliding_window(hf: dict, where: str, kind: str) -> None:
    if kind == "mistral" and hf.get("sliding_window") is not None:
        _refuse(where, "sliding_window", hf["sliding_window"],
                "sliding-window attention is not implemented yet (every layer attends to the whole "
                "causal context); set it to null only if your sequences never exceed the window")
    if kind in ("qwen2", "qwen3") and hf.get("use_sliding_window"):
        _refuse(where, "use_sliding_window", hf["use_sliding_window"],
                "sliding-window attention is not implemented yet")
    layer_types = hf.get("layer_types")
    if layer_types and any(t != "full_attention" for t in layer_types):
        bad = sorted({t for t in layer_types if t != "full_attention"})
        _refuse(where, "layer_types", bad, "only full_attention layers are implemented")


def config_from_hf(hf: dict, where: str = CONFIG_FILE) -> ModelConfig:
    """Our :class:`ModelConfig` for a Hugging Face ``config.json`` (as a dict).

    Refuses, naming the field, anything we would not compute exactly. Dropout is a training
    choice and is not imported (``ModelConfig.dropout`` stays 0).
    """
    kind = hf.get("model_type")
    if kind not in SUPPORTED_MODEL_TYPES:
        raise HFCheckpointError(f"{where}: model_type = {json.dumps(kind)} is not supported; supported: "
                                f"{', '.join(SUPPORTED_MODEL_TYPES)}")
    if hf.get("is_encoder_decoder") or hf.get("add_cross_attention"):
        _refuse(where, "add_cross_attention" if hf.get("add_cross_attention") else "is_encoder_decoder",
                True, "only decoder-only causal language models are supported")
    init_std = hf.get("initializer_range", 0.02)
    if kind == "gpt2":
        vocab, h, layers, heads = _require(hf, where, "vocab_size", "n_embd", "n_layer", "n_head")
        act = hf.get("activation_function", "gelu_new")
        if act not in ("gelu_new", "gelu_pytorch_tanh"):
            _refuse(where, "activation_function", act, "our GPT uses the tanh-approximated GELU "
                                                       "(gelu_new)")
        if hf.get("scale_attn_weights", True) is not True:
            _refuse(where, "scale_attn_weights", hf["scale_attn_weights"],
                    "attention is always scaled by 1/sqrt(head size)")
        if hf.get("scale_attn_by_inverse_layer_idx"):
            _refuse(where, "scale_attn_by_inverse_layer_idx", True, "not implemented")
        cfg = ModelConfig(arch="gpt", num_layers=layers, hidden_size=h, num_attention_heads=heads,
                          ffn_hidden_size=hf.get("n_inner") or 4 * h, vocab_size=vocab,
                          max_position_embeddings=hf.get("n_positions", 1024),
                          norm_eps=hf.get("layer_norm_epsilon", 1e-5),
                          tie_embeddings=hf.get("tie_word_embeddings", True), init_std=init_std,
                          hf_model_type=kind)
    else:
        vocab, h, ffn, layers, heads = _require(hf, where, "vocab_size", "hidden_size",
                                                "intermediate_size", "num_hidden_layers",
                                                "num_attention_heads")
        act = hf.get("hidden_act", "silu")
        if act != "silu":
            _refuse(where, "hidden_act", act, "our Llama MLP is SwiGLU (silu)")
        if kind in ("llama", "qwen3") and hf.get("attention_bias"):
            _refuse(where, "attention_bias", True, "biases on all four attention projections are "
                                                   "not implemented (Qwen2-style q/k/v biases are)")
        if kind == "llama" and hf.get("mlp_bias"):
            _refuse(where, "mlp_bias", True, "MLP biases are not implemented")
        _check_no_sliding_window(hf, where, kind)
        kv = hf.get("num_key_value_heads") or _DEFAULT_KV_HEADS.get(kind, heads)
        head_dim = hf.get("head_dim") or _DEFAULT_HEAD_DIM.get(kind) or h // heads
        base, scaling = _hf_rope(hf, where)
        max_pos = hf.get("max_position_embeddings") or _DEFAULT_MAX_POS[kind]
        if scaling:  # the context the scaling is for (Qwen2.5 keeps the original length here)
            max_pos = max(max_pos, rope_context_length(scaling) or 0)
        cfg = ModelConfig(arch="llama", num_layers=layers, hidden_size=h, num_attention_heads=heads,
                          num_query_groups=kv, ffn_hidden_size=ffn, vocab_size=vocab,
                          max_position_embeddings=max_pos, rotary_base=base, rope_scaling=scaling,
                          norm_eps=hf.get("rms_norm_eps", 1e-6),
                          tie_embeddings=bool(hf.get("tie_word_embeddings", False)), init_std=init_std,
                          qkv_bias=kind == "qwen2", qk_norm=kind == "qwen3",
                          kv_channels=head_dim if head_dim * heads != h else None,
                          hf_model_type=kind)
    try:
        cfg.validate()
    except ValueError as e:
        raise HFCheckpointError(f"{where}: {e}") from None
    return cfg


def hf_model_type(cfg: ModelConfig) -> str:
    """The ``model_type`` to export ``cfg`` as (its own, else the one its options need)."""
    if cfg.arch == "gpt":
        kind = cfg.hf_model_type or "gpt2"
    elif cfg.hf_model_type:
        kind = cfg.hf_model_type
    else:
        kind = "qwen3" if cfg.qk_norm else "qwen2" if cfg.qkv_bias else "llama"
    needs = {"qwen2": (True, False), "qwen3": (False, True)}.get(kind, (False, False))
    if kind not in SUPPORTED_MODEL_TYPES or (cfg.arch == "gpt") != (kind == "gpt2") or \
            (cfg.arch == "llama" and (cfg.qkv_bias, cfg.qk_norm) != needs):
        raise HFCheckpointError(
            f"this model (arch {cfg.arch}, qkv_bias {cfg.qkv_bias}, qk_norm {cfg.qk_norm}) has no "
            f"Hugging Face equivalent as model_type {kind!r}: qwen2 has q/k/v biases and no q/k "
            f"norms, qwen3 q/k norms and no biases, llama/mistral neither")
    return kind


def config_to_hf(cfg: ModelConfig, *, dtype: torch.dtype = torch.float32,
                 bos_token_id: Optional[int] = None, eos_token_id: Optional[int] = None) -> dict:
    """The ``config.json`` dict transformers builds the same model from."""
    kind = hf_model_type(cfg)
    out: dict = {"architectures": [_ARCHITECTURES[kind]], "model_type": kind,
                 "vocab_size": cfg.vocab_size, "initializer_range": cfg.init_std,
                 "tie_word_embeddings": bool(cfg.tie_embeddings),
                 "torch_dtype": str(dtype).replace("torch.", ""),  # transformers 4's name
                 "dtype": str(dtype).replace("torch.", ""), "use_cache": True}
    if bos_token_id is not None:
        out["bos_token_id"] = bos_token_id
    if eos_token_id is not None:
        out["eos_token_id"] = eos_token_id
    if kind == "gpt2":
        out.update(n_embd=cfg.hidden_size, n_layer=cfg.num_layers, n_head=cfg.num_attention_heads,
                   n_inner=cfg.ffn_hidden_size, n_positions=cfg.max_position_embeddings,
                   activation_function="gelu_new", layer_norm_epsilon=cfg.norm_eps,
                   resid_pdrop=cfg.dropout, embd_pdrop=cfg.dropout, attn_pdrop=cfg.dropout,
                   scale_attn_weights=True, scale_attn_by_inverse_layer_idx=False,
                   reorder_and_upcast_attn=False)
        return out
    scaling = normalize_rope_scaling(cfg.rope_scaling)
    max_pos = cfg.max_position_embeddings
    rope_scaling = None
    if scaling:
        rope_scaling = {k: v for k, v in scaling.items() if v is not None}
        rope_scaling["rope_type"] = _OUR_ROPE_TYPES[scaling["rope_type"]]
        if scaling["rope_type"] == "dynamic-ntk":
            # transformers grows the base relative to max_position_embeddings
            max_pos = rope_scaling.pop("original_max_position_embeddings")
        if scaling["rope_type"] == "yarn" and scaling["truncate"]:
            del rope_scaling["truncate"]  # the default; older transformers do not know the key
    out.update(hidden_size=cfg.hidden_size, intermediate_size=cfg.ffn_hidden_size,
               num_hidden_layers=cfg.num_layers, num_attention_heads=cfg.num_attention_heads,
               num_key_value_heads=cfg.num_query_groups, head_dim=cfg.head_dim, hidden_act="silu",
               max_position_embeddings=max_pos, rms_norm_eps=cfg.norm_eps,
               rope_theta=cfg.rotary_base, rope_scaling=rope_scaling, attention_dropout=cfg.dropout)
    if kind in ("llama", "qwen3"):
        out["attention_bias"] = False
    if kind == "llama":
        out["mlp_bias"] = False
    if kind == "mistral":
        out["sliding_window"] = None
    if kind in ("qwen2", "qwen3"):
        out.update(use_sliding_window=False, sliding_window=None, max_window_layers=cfg.num_layers)
    return out
