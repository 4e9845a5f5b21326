"""The flags to start from a pretrained checkpoint: ``--hf-checkpoint``, ``--tokenizer-type`` and
the ``--rope-scaling`` family (context extension), with their checks. Part of the command line
(:mod:`.arguments` adds them to its parser, :mod:`.build` calls the checks)."""
from __future__ import annotations

import argparse
import os

from .cli import ArgumentError, positive_int as _positive_int
from ..models.config import ModelConfig


def add_checkpoint_import_args(parser: argparse.ArgumentParser) -> None:
    """Flags to start from a Hugging Face checkpoint, use its tokenizer and rescale RoPE."""
    from ..data.tokenizer import TOKENIZER_TYPES
    from ..models.rope import ROPE_TYPES

    g = parser.add_argument_group("pretrained checkpoints, tokenizers and RoPE scaling")
    g.add_argument("--hf-checkpoint", metavar="DIR",
                   help="initialise the model from a Hugging Face directory (config.json + *.safetensors, "
                        "sharded or not): llama, mistral, qwen2, qwen3 or gpt2. Shapes, RoPE, norm eps, "
                        "tied embeddings and vocabulary come from config.json (shape flags that disagree "
                        "are an error); its tokenizer.json is the default --tokenizer-model")
    g.add_argument("--tokenizer-type", choices=TOKENIZER_TYPES,
                   help="tokenizer kind of --tokenizer-model (default: HuggingFaceTokenizer for a .json "
                        "file or a directory, else SentencePieceTokenizer)")
    g.add_argument("--rope-scaling", choices=ROPE_TYPES,
                   help="RoPE scaling for context extension (default: config.json's with --hf-checkpoint, "
                        "else the preset's); `none` turns it off")
    g.add_argument("--rope-scaling-factor", type=float,
                   help="context extension factor (linear, dynamic-ntk, llama3, yarn)")
    g.add_argument("--rope-original-max-position-embeddings", type=_positive_int,
                   help="context length the model was trained at (dynamic-ntk, llama3, yarn; default: "
                        "the model's max position embeddings before scaling)")
    g.add_argument("--rope-low-freq-factor", type=float, help="llama3 scaling's low_freq_factor (default 1)")
    g.add_argument("--rope-high-freq-factor", type=float, help="llama3 scaling's high_freq_factor (default 4)")
    g.add_argument("--yarn-beta-fast", type=float, help="YaRN beta_fast (default 32)")
    g.add_argument("--yarn-beta-slow", type=float, help="YaRN beta_slow (default 1)")
    g.add_argument("--yarn-attention-factor", type=float,
                   help="YaRN attention factor cos/sin are multiplied by (default 0.1 ln(factor) + 1)")


_ROPE_FLAGS = (("rope_scaling_factor", "factor"),
               ("rope_original_max_position_embeddings", "original_max_position_embeddings"),
               ("rope_low_freq_factor", "low_freq_factor"), ("rope_high_freq_factor", "high_freq_factor"),
               ("yarn_beta_fast", "beta_fast"), ("yarn_beta_slow", "beta_slow"),
               ("yarn_attention_factor", "attention_factor"))


def apply_rope_scaling_args(cfg: ModelConfig, args) -> ModelConfig:
    """``cfg`` with the --rope-scaling flags applied (unchanged without --rope-scaling).

    The original context defaults to ``cfg.max_position_embeddings``; unless
    --max-position-embeddings is given, the limit grows to factor x original.
    """
    from ..models.rope import RopeScalingError, normalize_rope_scaling, rope_context_length

    kind = getattr(args, "rope_scaling", None)
    if kind is None:
        return cfg
    if cfg.arch != "llama":
        raise ArgumentError(f"--rope-scaling is for RoPE models; {cfg.arch} has learned positions")
    scaling: dict = {"rope_type": kind}
    for flag, key in _ROPE_FLAGS:
        if getattr(args, flag, None) is not None:
            scaling[key] = getattr(args, flag)
    if kind in ("dynamic-ntk", "llama3", "yarn"):
        scaling.setdefault("original_max_position_embeddings", cfg.max_position_embeddings)
    if kind == "llama3":
        scaling.setdefault("low_freq_factor", 1.0)
        scaling.setdefault("high_freq_factor", 4.0)
    try:
        scaling = normalize_rope_scaling(scaling)
    except RopeScalingError as e:
        raise ArgumentError(f"--rope-scaling {kind}: {e}") from None
    cfg.rope_scaling = scaling
    extended = rope_context_length(scaling) if kind != "linear" else \
        int(scaling["factor"] * cfg.max_position_embeddings)
    if getattr(args, "max_position_embeddings", None) is None and extended:
        cfg.max_position_embeddings = max(cfg.max_position_embeddings, extended)
    cfg.validate()
    return cfg


def checkpoint_model_config(args) -> ModelConfig:
    """The model config of --hf-checkpoint's config.json, with the training flags applied.

    Explicit shape flags must agree with it (an error names both values); --rotary-base,
    --max-position-embeddings (RoPE models) and the --rope-scaling flags may change it: they are
    what context extension changes.
    """
    from ..models.hf import CONFIG_FILE, HFCheckpointError, config_from_hf, read_hf_config

    where = os.path.join(args.hf_checkpoint, CONFIG_FILE)
    try:
        hf = read_hf_config(args.hf_checkpoint)
        cfg = config_from_hf(hf, where=where)
    except HFCheckpointError as e:
        raise ArgumentError(f"--hf-checkpoint: {e}") from None
    gpt = cfg.arch == "gpt"
    checks = [("--num-layers", args.num_layers, cfg.num_layers, "n_layer" if gpt else "num_hidden_layers"),
              ("--hidden-size", args.hidden_size, cfg.hidden_size, "n_embd" if gpt else "hidden_size"),
              ("--num-attention-heads", args.num_attention_heads, cfg.num_attention_heads,
               "n_head" if gpt else "num_attention_heads"),
              ("--ffn-hidden-size", args.ffn_hidden_size, cfg.ffn_hidden_size, "n_inner" if gpt else "intermediate_size"),
              ("--vocab-size", args.vocab_size, cfg.vocab_size, "vocab_size"),
              ("--norm-epsilon", args.norm_epsilon, cfg.norm_eps, "layer_norm_epsilon" if gpt else "rms_norm_eps")]
    if args.group_query_attention:
        checks.append(("--num-query-groups", args.num_query_groups, cfg.num_query_groups, "num_key_value_heads"))
    if gpt:
        checks.append(("--max-position-embeddings", args.max_position_embeddings, cfg.max_position_embeddings,
                       "n_positions"))
    for flag, given, have, field in checks:
        if given is not None and given != have:
            raise ArgumentError(f"{flag} {given} disagrees with {field} = {have} in {where}; the shape comes "
                                f"from the checkpoint: drop {flag}")
    if args.untie_embeddings_and_output_weights and cfg.tie_embeddings:
        raise ArgumentError(f"--untie-embeddings-and-output-weights: {where} ties them "
                            f"(tie_word_embeddings true); drop the flag")
    cfg.dropout = args.hidden_dropout
    if args.init_method_std is not None:
        cfg.init_std = args.init_method_std
    if not gpt:
        if args.rotary_base is not None:
            cfg.rotary_base = args.rotary_base
        if args.max_position_embeddings is not None:
            cfg.max_position_embeddings = args.max_position_embeddings
    try:
        return apply_rope_scaling_args(cfg, args)
    except ValueError as e:
        raise ArgumentError(str(e)) from None


def check_checkpoint_flags(args) -> None:
    """Before the model config is read: the --rope-scaling family is complete and
    --hf-checkpoint is a directory."""
    if getattr(args, "rope_scaling", None) is None:
        given = [f"--{flag.replace('_', '-')}" for flag, _ in _ROPE_FLAGS if getattr(args, flag, None) is not None]
        if given:
            raise ArgumentError(f"{', '.join(given)} need(s) --rope-scaling TYPE (linear, dynamic-ntk, "
                                f"llama3 or yarn)")
    ckpt = getattr(args, "hf_checkpoint", None)
    if ckpt and not os.path.isdir(ckpt):
        raise ArgumentError(f"--hf-checkpoint {ckpt}: no such directory")


def checkpoint_tokenizer(args) -> tuple:
    """After the model config (it refuses an unsupported config.json first): the checkpoint's
    weight files exist (their headers are read) and the tokenizer; returns ``(tokenizer_model,
    tokenizer_type)``: the flags', else the checkpoint's own tokenizer.json, with the type
    inferred from the file (a directory: its tokenizer.json)."""
    from ..data.tokenizer import infer_tokenizer_type

    path, kind = args.tokenizer_model, args.tokenizer_type
    ckpt = getattr(args, "hf_checkpoint", None)
    if ckpt:
        from ..models.hf import HFCheckpointError, SafetensorsCheckpoint
        try:
            SafetensorsCheckpoint(ckpt)  # the weight files exist (reads their headers only)
        except HFCheckpointError as e:
            raise ArgumentError(f"--hf-checkpoint: {e}") from None
        own = os.path.join(ckpt, "tokenizer.json")
        if not path and not args.mock_data and os.path.isfile(own) and \
                kind in (None, "HuggingFaceTokenizer"):
            path = own  # the vocabulary the embeddings were trained with
    if path:
        if kind is None:
            kind = infer_tokenizer_type(path)
        if kind == "HuggingFaceTokenizer" and os.path.isdir(path):
            if not os.path.isfile(os.path.join(path, "tokenizer.json")):
                raise ArgumentError(f"--tokenizer-model {path}: the directory holds no tokenizer.json")
            path = os.path.join(path, "tokenizer.json")
    elif kind == "HuggingFaceTokenizer":
        raise ArgumentError("--tokenizer-type HuggingFaceTokenizer needs --tokenizer-model (a tokenizer.json "
                            "or a directory holding one), or an --hf-checkpoint that has one")
    return path, kind
