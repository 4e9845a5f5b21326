"""Hugging Face checkpoints in and out: ``config.json`` + safetensors <-> our models.

    model, cfg = load_hf_checkpoint("Llama-3.2-1B")          # a directory transformers wrote
    save_hf_checkpoint(model, cfg, "out")                       # transformers.AutoModelForCausalLM
                                                                 # .from_pretrained("out") loads it

Families (``model_type``): ``llama`` (Llama 2, 3, 3.1, 3.2), ``mistral`` (without a sliding
window), ``qwen2`` (Qwen2, Qwen2.5: q/k/v biases), ``qwen3`` (per-head q/k RMSNorm, own head
size) and ``gpt2`` (Conv1D weights, stored ``[in, out]``: transposed on the way in and out).
Anything a family's config asks for that our models do not compute exactly (a sliding window,
another activation, biases elsewhere, partial rotary, another RoPE type) is refused by
:func:`config_from_hf` before any tensor is read, with an :class:`HFCheckpointError` naming the
``config.json`` field.

Memory: tensors are streamed one at a time from the safetensors files (``safe_open``, one file
open at a time; sharded checkpoints through ``model.safetensors.index.json``) and copied into a
model whose parameters were allocated uninitialised, so loading needs the model plus one tensor,
never two copies of the weights. :func:`load_hf_weights` is the building block a sharded
(per-rank) loader uses: it loads a chosen subset of our parameter names, into a module or a state
dict, or hands each converted tensor to a callback instead of copying it.

Export writes ``config.json`` in the classic layout (``rope_theta`` + ``rope_scaling``, which
transformers 4.x reads and 5.x converts) and safetensors shards of at most ``max_shard_bytes``.
"""
from __future__ import annotations

import json
import os
import re
import shutil
from collections import OrderedDict
from typing import Callable, Iterable, Iterator, Mapping, Optional, Union

import torch
import torch.nn as nn

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


# ---------------------------------------------------------------------------------------------
# tensor names
# ---------------------------------------------------------------------------------------------
_LLAMA_RULES = [(r"^embed_tokens\.", "model.embed_tokens."),
                (r"^layers\.(\d+)\.input_norm\.", r"model.layers.\1.input_layernorm."),
                (r"^layers\.(\d+)\.post_attn_norm\.", r"model.layers.\1.post_attention_layernorm."),
                (r"^layers\.(\d+)\.attn\.", r"model.layers.\1.self_attn."),
                (r"^layers\.(\d+)\.mlp\.", r"model.layers.\1.mlp."),
                (r"^norm\.", "model.norm."),
                (r"^lm_head\.", "lm_head.")]
_GPT2_RULES = [(r"^wte\.", "transformer.wte."), (r"^wpe\.", "transformer.wpe."),
               (r"^layers\.(\d+)\.ln1\.", r"transformer.h.\1.ln_1."),
               (r"^layers\.(\d+)\.ln2\.", r"transformer.h.\1.ln_2."),
               (r"^layers\.(\d+)\.attn\.qkv\.", r"transformer.h.\1.attn.c_attn."),
               (r"^layers\.(\d+)\.attn\.proj\.", r"transformer.h.\1.attn.c_proj."),
               (r"^layers\.(\d+)\.mlp\.fc\.", r"transformer.h.\1.mlp.c_fc."),
               (r"^layers\.(\d+)\.mlp\.proj\.", r"transformer.h.\1.mlp.c_proj."),
               (r"^ln_f\.", "transformer.ln_f."), (r"^lm_head\.", "lm_head.")]
_GPT2_CONV1D = re.compile(r"\.(attn\.c_attn|attn\.c_proj|mlp\.c_fc|mlp\.c_proj)\.weight$")
# tensors some checkpoints carry that are not parameters (GPT-2's causal-mask buffers, old RoPE
# frequency buffers)
_IGNORED = re.compile(r"(\.attn\.bias|\.attn\.masked_bias|rotary_emb\.inv_freq)$")


def hf_tensor_name(name: str, cfg: ModelConfig) -> tuple[str, bool]:
    """(Hugging Face tensor name, stored transposed?) of our parameter ``name``."""
    for pattern, repl in (_GPT2_RULES if cfg.arch == "gpt" else _LLAMA_RULES):
        if re.match(pattern, name):
            hf = re.sub(pattern, repl, name)
            return hf, bool(cfg.arch == "gpt" and _GPT2_CONV1D.search(hf))
    raise HFCheckpointError(f"no Hugging Face name for parameter {name!r}")


def parameter_names(cfg: ModelConfig) -> list[str]:
    """Our model's state-dict names, without building it (one meta-device instance)."""
    from . import build_model
    with torch.device("meta"):
        model = build_model(cfg)
    return list(model.state_dict())


def _stored_names(cfg: ModelConfig, names: Iterable[str]) -> list[str]:
    """Our names that a checkpoint stores (a tied output layer is the embedding)."""
    return [n for n in names if not (cfg.tie_embeddings and n == "lm_head.weight")]


# ---------------------------------------------------------------------------------------------
# reading safetensors, tensor by tensor
# ---------------------------------------------------------------------------------------------
class SafetensorsCheckpoint:
    """The tensors of a checkpoint directory: ``model.safetensors.index.json`` when present, else
    ``model.safetensors``, else every ``*.safetensors`` file in it. Reads one tensor at a time."""

    def __init__(self, path: Union[str, os.PathLike]):
        from safetensors import safe_open

        self.path = os.fspath(path)
        if not os.path.isdir(self.path):
            raise HFCheckpointError(f"{self.path} is not a directory")
        index = os.path.join(self.path, INDEX_FILE)
        self.weight_map: dict[str, str] = {}
        if os.path.isfile(index):
            try:
                with open(index) as f:
                    self.weight_map = dict(json.load(f)["weight_map"])
            except (json.JSONDecodeError, KeyError, TypeError) as e:
                raise HFCheckpointError(f"{index} is not a safetensors index ({e!r})") from None
            for file in sorted(set(self.weight_map.values())):
                if not os.path.isfile(os.path.join(self.path, file)):
                    raise HFCheckpointError(f"{index} names the shard {file}, which is missing from "
                                            f"{self.path}")
        else:
            files = [SINGLE_FILE] if os.path.isfile(os.path.join(self.path, SINGLE_FILE)) else \
                sorted(f for f in os.listdir(self.path) if f.endswith(".safetensors"))
            if not files:
                others = [f for f in os.listdir(self.path) if f.endswith((".bin", ".pt", ".pth"))]
                hint = (f" (it has {', '.join(others[:3])}: convert them to safetensors, e.g. load "
                        f"with transformers and save_pretrained(safe_serialization=True))") if others else ""
                raise HFCheckpointError(f"{self.path} has no *.safetensors files{hint}")
            for file in files:
                try:
                    with safe_open(os.path.join(self.path, file), framework="pt") as f:
                        for key in f.keys():
                            self.weight_map[key] = file
                except Exception as e:  # noqa: BLE001 - safetensors raises its own error type
                    raise HFCheckpointError(f"{os.path.join(self.path, file)} is not a readable "
                                            f"safetensors file ({e})") from None

    def names(self) -> list[str]:
        return list(self.weight_map)

    def iter_tensors(self, names: Optional[Iterable[str]] = None) -> Iterator[tuple[str, torch.Tensor]]:
        """(name, tensor) for ``names`` (default all), grouped by file, each read on its own."""
        from safetensors import safe_open

        wanted = list(self.weight_map) if names is None else list(names)
        by_file: dict[str, list[str]] = OrderedDict()
        for n in wanted:
            if n not in self.weight_map:
                raise HFCheckpointError(f"tensor {n!r} is not in the checkpoint {self.path}")
            by_file.setdefault(self.weight_map[n], []).append(n)
        for file, keys in by_file.items():
            with safe_open(os.path.join(self.path, file), framework="pt") as f:
                for n in keys:
                    yield n, f.get_tensor(n)


def _hf_lookup(ckpt: SafetensorsCheckpoint) -> Callable[[str], Optional[str]]:
    """Maps a canonical Hugging Face name (``model.`` / ``transformer.`` prefixed) to the name the
    checkpoint uses: some are saved from the base model, without the prefix."""
    have = set(ckpt.weight_map)

    def find(hf_name: str) -> Optional[str]:
        if hf_name in have:
            return hf_name
        for prefix in ("model.", "transformer."):
            if hf_name.startswith(prefix) and hf_name[len(prefix):] in have:
                return hf_name[len(prefix):]
        return None
    return find


def load_hf_weights(target: Union[nn.Module, Mapping[str, torch.Tensor], None],
                    checkpoint: Union[str, os.PathLike, SafetensorsCheckpoint], cfg: ModelConfig, *,
                    names: Optional[Iterable[str]] = None,
                    on_tensor: Optional[Callable[[str, torch.Tensor], None]] = None,
                    strict: bool = True) -> list[str]:
    """Stream checkpoint tensors into ``target``, one tensor in memory at a time; returns the names
    loaded.

    ``target``: a module (its state dict) or a mapping of our names to tensors; each checkpoint
    tensor, converted to our layout (GPT-2 Conv1D weights transposed), is copied in place into
    ``target[name]`` (cast to its dtype and device) after its shape is checked. ``names``: the
    subset of our parameter names to load (default: all of ``cfg``'s model; a tied output layer
    comes with the embedding). ``on_tensor(name, tensor)``: called instead of the copy (``target``
    may then be None), e.g. to keep only this rank's shard of each tensor. ``strict``: the
    checkpoint may hold no tensor we do not know (when loading all names).
    """
    ckpt = checkpoint if isinstance(checkpoint, SafetensorsCheckpoint) else SafetensorsCheckpoint(checkpoint)
    all_names = parameter_names(cfg)
    wanted = _stored_names(cfg, all_names if names is None else list(names))
    unknown = sorted(set(wanted) - set(all_names))
    if unknown:
        raise HFCheckpointError(f"not parameters of this model: {', '.join(unknown[:5])}")
    find = _hf_lookup(ckpt)
    plan: dict[str, tuple[str, bool]] = {}  # checkpoint name -> (our name, transposed)
    for n in wanted:
        hf, transposed = hf_tensor_name(n, cfg)
        found = find(hf)
        if found is None:
            why = (" (tie_word_embeddings is false in config.json, so the output layer is stored "
                   "separately)") if n == "lm_head.weight" else ""
            raise HFCheckpointError(f"tensor {hf!r} (for our {n!r}) is missing from the checkpoint "
                                    f"{ckpt.path}{why}")
        plan[found] = (n, transposed)
    if strict and names is None:
        known = set(plan)
        if cfg.tie_embeddings:
            out = find("lm_head.weight")
            if out:
                known.add(out)  # a tied copy of the embedding: not read
        extra = sorted(k for k in ckpt.weight_map if k not in known and not _IGNORED.search(k))
        if extra:
            raise HFCheckpointError(f"the checkpoint {ckpt.path} holds tensors this model has no place "
                                    f"for: {', '.join(extra[:5])}{' ...' if len(extra) > 5 else ''}")
    dest = None
    if on_tensor is None:
        if target is None:
            raise ValueError("load_hf_weights needs a target module/state dict or an on_tensor callback")
        dest = target.state_dict(keep_vars=True) if isinstance(target, nn.Module) else target
    loaded = []
    with torch.no_grad():
        for hf, tensor in ckpt.iter_tensors(plan):
            n, transposed = plan[hf]
            if transposed:
                tensor = tensor.t()
            if on_tensor is not None:
                on_tensor(n, tensor)
            else:
                if n not in dest:
                    raise HFCheckpointError(f"the target has no tensor {n!r}")
                d = dest[n]
                if tuple(d.shape) != tuple(tensor.shape):
                    raise HFCheckpointError(f"tensor {hf!r} has shape {tuple(tensor.shape)} in the "
                                            f"checkpoint but our {n!r} is {tuple(d.shape)}: config.json "
                                            f"does not describe these weights")
                d.copy_(tensor)
            loaded.append(n)
            del tensor
    return loaded


def load_hf_checkpoint(path: Union[str, os.PathLike], device: Union[str, torch.device] = "cpu", *,
                       config: Optional[ModelConfig] = None,
                       dtype: Optional[torch.dtype] = None) -> tuple[nn.Module, ModelConfig]:
    """Our model initialised from a Hugging Face checkpoint directory; returns ``(model, config)``.

    ``config``: use this config instead of the one read from ``config.json`` (e.g. with another
    RoPE scaling or context length for continued pretraining); its weight shapes must match the
    checkpoint's. ``dtype``: the parameters' dtype (default: the current default dtype, normally
    float32 master weights whatever the checkpoint stores).
    """
    from . import build_model

    path = os.fspath(path)
    cfg = config_from_hf(read_hf_config(path), where=os.path.join(path, CONFIG_FILE))
    if config is not None:
        _check_same_weights(cfg, config, path)
        cfg = config
    ckpt = SafetensorsCheckpoint(path)  # before allocating: a missing file fails fast
    with torch.device("meta"):
        model = build_model(cfg)
    model.to_empty(device=device)  # uninitialised storage, one copy
    _tie(model, cfg)  # to_empty replaced the meta parameters one by one: tie them again
    if dtype is not None:
        model.to(dtype)
    if hasattr(model, "init_buffers"):
        model.init_buffers()
    load_hf_weights(model, ckpt, cfg)
    return model, cfg


def _tie(model: nn.Module, cfg: ModelConfig) -> None:
    if cfg.tie_embeddings:
        model.lm_head.weight = (model.wte if cfg.arch == "gpt" else model.embed_tokens).weight


SHAPE_FIELDS = ("arch", "num_layers", "hidden_size", "num_attention_heads", "num_query_groups",
                "ffn_hidden_size", "vocab_size", "head_dim", "qkv_bias", "qk_norm", "tie_embeddings")


def _check_same_weights(ckpt_cfg: ModelConfig, cfg: ModelConfig, path: str) -> None:
    fields = list(SHAPE_FIELDS) + (["max_position_embeddings"] if ckpt_cfg.arch == "gpt" else [])
    diffs = [f"{f}: checkpoint {getattr(ckpt_cfg, f)} vs given {getattr(cfg, f)}"
             for f in fields if getattr(ckpt_cfg, f) != getattr(cfg, f)]
    if diffs:
        raise HFCheckpointError(f"the given config does not match the weights of {path}: "
                                f"{'; '.join(diffs)}")


# ---------------------------------------------------------------------------------------------
# export
# ---------------------------------------------------------------------------------------------
def _parse_size(size: Union[int, str]) -> int:
    if isinstance(size, int):
        return size
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?)I?B?\s*", size.upper())
    if not m:
        raise ValueError(f"not a size: {size!r} (e.g. 5GB, 500MB)")
    return int(float(m.group(1)) * {"": 1, "K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}[m.group(2)])


def save_hf_checkpoint(model: Union[nn.Module, Mapping[str, torch.Tensor]], config: ModelConfig,
                       path: Union[str, os.PathLike], *, dtype: Optional[torch.dtype] = None,
                       max_shard_bytes: Union[int, str] = "5GB", tokenizer=None) -> list[str]:
    """Write ``model`` (a module or our state dict) as a Hugging Face checkpoint into ``path``.

    ``config.json`` plus ``model.safetensors``, or shards ``model-0000i-of-0000n.safetensors``
    with ``model.safetensors.index.json`` when the weights exceed ``max_shard_bytes``. ``dtype``:
    the stored dtype (default: the parameters'). ``tokenizer``: a Hugging Face tokenizer (our
    ``HuggingFaceTokenizer`` or the path of its ``tokenizer.json`` / directory): its files are
    copied and its bos/eos ids written into ``config.json``. Returns the files written. Only one
    shard of converted tensors is in memory at a time.
    """
    from safetensors.torch import save_file

    path = os.fspath(path)
    state = model.state_dict() if isinstance(model, nn.Module) else model
    tok = None
    if tokenizer is not None:
        from ..data.tokenizer import HuggingFaceTokenizer
        tok = tokenizer if isinstance(tokenizer, HuggingFaceTokenizer) else HuggingFaceTokenizer(tokenizer)
    first = next(iter(state.values()))
    hf_cfg = config_to_hf(config, dtype=dtype or first.dtype,  # refuses before anything is written
                          bos_token_id=tok.bos_id if tok else None, eos_token_id=tok.eod_id if tok else None)
    names = _stored_names(config, parameter_names(config))
    missing = [n for n in names if n not in state]
    if missing:
        raise HFCheckpointError(f"the state dict lacks {', '.join(missing[:5])} for this config")
    os.makedirs(path, exist_ok=True)
    limit = _parse_size(max_shard_bytes)
    store_dtype = lambda t: dtype or t.dtype  # noqa: E731
    shards: list[list[str]] = [[]]
    size = total = 0
    for n in names:
        t = state[n]
        nbytes = t.numel() * torch.empty((), dtype=store_dtype(t)).element_size()
        if shards[-1] and size + nbytes > limit:
            shards.append([])
            size = 0
        shards[-1].append(n)
        size += nbytes
        total += nbytes
    # drop files of an earlier export in this directory that this one would not overwrite
    for f in os.listdir(path):
        if re.fullmatch(r"model(-\d{5}-of-\d{5})?\.safetensors|model\.safetensors\.index\.json", f):
            os.remove(os.path.join(path, f))
    written, weight_map = [], {}
    for i, shard in enumerate(shards):
        file = SINGLE_FILE if len(shards) == 1 else f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        tensors = {}
        for n in shard:
            hf, transposed = hf_tensor_name(n, config)
            t = state[n].detach()
            t = t.t() if transposed else t
            tensors[hf] = t.to(device="cpu", dtype=store_dtype(t)).contiguous()
            weight_map[hf] = file
        save_file(tensors, os.path.join(path, file), metadata={"format": "pt"})
        written.append(file)
        del tensors
    if len(shards) > 1:
        with open(os.path.join(path, INDEX_FILE), "w") as f:
            json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)
        written.append(INDEX_FILE)
    if tok is not None:
        for f in tok.files():
            shutil.copyfile(f, os.path.join(path, os.path.basename(f)))
            written.append(os.path.basename(f))
    with open(os.path.join(path, CONFIG_FILE), "w") as f:
        json.dump(hf_cfg, f, indent=2)
    written.append(CONFIG_FILE)
    return written


__all__ = ["HFCheckpointError", "SafetensorsCheckpoint", "SUPPORTED_MODEL_TYPES", "read_hf_config",
           "config_from_hf", "config_to_hf", "hf_model_type", "hf_tensor_name", "parameter_names",
           "load_hf_weights", "load_hf_checkpoint", "save_hf_checkpoint"]
