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
from .hf_config import (CONFIG_FILE, INDEX_FILE, SINGLE_FILE, SUPPORTED_MODEL_TYPES,  # noqa: F401
                        TOKENIZER_FILES, HFCheckpointError, config_from_hf, config_to_hf,
                        hf_model_type, read_hf_config)


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
    the stored dtype (default: the parameters'). ``tokenizer``: a Hugging Face tokenizer
    (``autosp_lm.data.tokenizer.HuggingFaceTokenizer``, or any object with ``files()``,
    ``bos_id`` and ``eod_id``): its files are copied and its bos/eos ids written into
    ``config.json``. Returns the files written. Only one
    shard of converted tensors is in memory at a time.
    """
    from safetensors.torch import save_file

    path = os.fspath(path)
    state = model.state_dict() if isinstance(model, nn.Module) else model
    tok = tokenizer
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
