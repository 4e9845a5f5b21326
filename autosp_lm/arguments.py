"""Command-line flags (Megatron-LM names where one exists) and their validation.

``parse_args`` returns an ``argparse.Namespace``; ``validate_args`` checks every combination
before any work starts and raises ``ArgumentError`` with a message naming the flag and the fix.
"""
from __future__ import annotations

import argparse
import os
from typing import Optional, Sequence

from .compiler.passes.sac import DEFAULT_BUDGET
from .models.config import PRESETS, ModelConfig, preset_config
from .strategies import SP_STRATEGIES, check_strategy


class ArgumentError(ValueError):
    """An invalid flag or flag combination; the message names the flag and the fix."""


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}")
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {value}")
    return value


def _nonneg_int(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return value


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="pretrain.py",
        description="Pretrain a GPT or Llama model, optionally sequence-parallel. Launch with "
                    "torchrun, e.g. `torchrun --nproc-per-node 2 pretrain.py --autosp`.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)

    g = p.add_argument_group("model")
    g.add_argument("--model", default="llama-tiny", choices=sorted(PRESETS),
                   help="named model shape; individual shape flags below override it")
    g.add_argument("--num-layers", type=_positive_int, help="number of transformer layers")
    g.add_argument("--hidden-size", type=_positive_int, help="transformer hidden size")
    g.add_argument("--num-attention-heads", type=_positive_int, help="number of query heads")
    g.add_argument("--group-query-attention", action="store_true",
                   help="use grouped-query attention (llama); set the group count with --num-query-groups")
    g.add_argument("--num-query-groups", type=_positive_int,
                   help="number of key/value heads with --group-query-attention")
    g.add_argument("--ffn-hidden-size", type=_positive_int, help="MLP hidden size")
    g.add_argument("--max-position-embeddings", type=_positive_int,
                   help="maximum sequence length the model supports (size of GPT's position table)")
    g.add_argument("--rotary-base", type=float, help="RoPE theta (llama)")
    g.add_argument("--vocab-size", type=_positive_int,
                   help="model vocabulary size (default: the tokenizer's, padded; the preset's with --mock-data)")
    g.add_argument("--make-vocab-size-divisible-by", type=_positive_int, default=128,
                   help="pad the tokenizer's vocabulary to a multiple of this for efficient matmuls")
    g.add_argument("--norm-epsilon", type=float, help="epsilon of LayerNorm/RMSNorm")
    g.add_argument("--init-method-std", type=float, help="std of the normal weight init (default 0.02)")
    g.add_argument("--hidden-dropout", type=float, default=0.0, help="dropout probability (0 for exact parity)")
    g.add_argument("--untie-embeddings-and-output-weights", action="store_true",
                   help="use a separate output layer even where the preset ties it")

    g = p.add_argument_group("training")
    g.add_argument("--seq-length", type=_positive_int, default=1024, help="tokens per sample")
    g.add_argument("--micro-batch-size", type=_positive_int, default=1, help="samples per micro batch per data-parallel rank")
    g.add_argument("--global-batch-size", type=_positive_int, default=8,
                   help="samples per optimizer step = micro batch x data-parallel size x accumulation steps")
    g.add_argument("--train-iters", type=_positive_int, default=100, help="optimizer steps to train")
    g.add_argument("--exit-interval", type=_positive_int,
                   help="stop cleanly after this iteration (saving a checkpoint when --save is set)")
    g.add_argument("--lr", type=float, default=1e-3, help="peak learning rate")
    g.add_argument("--min-lr", type=float, default=1e-4, help="learning rate at the end of decay")
    g.add_argument("--lr-decay-style", choices=["constant", "linear", "cosine"], default="cosine",
                   help="learning-rate decay after warm-up")
    g.add_argument("--lr-warmup-iters", type=_nonneg_int,
                   help="linear warm-up steps from 0 to --lr (default: 10%% of --lr-decay-iters, at most 100)")
    g.add_argument("--lr-decay-iters", type=_positive_int, help="steps over which to decay (default --train-iters)")
    g.add_argument("--weight-decay", type=float, default=0.1, help="AdamW weight decay (not applied to norms and biases)")
    g.add_argument("--clip-grad", type=float, default=1.0, help="clip the global gradient norm to this (0 disables)")
    g.add_argument("--adam-beta1", type=float, default=0.9, help="AdamW beta1")
    g.add_argument("--adam-beta2", type=float, default=0.95, help="AdamW beta2")
    g.add_argument("--adam-eps", type=float, default=1e-8, help="AdamW epsilon")
    g.add_argument("--seed", type=int, default=1234, help="random seed (model init, data order)")
    g.add_argument("--bf16", action="store_true", help="bf16 mixed precision (fp32 master weights)")
    g.add_argument("--compile", action="store_true", help="torch.compile the model (implied by --autosp)")
    g.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto",
                   help="device to train on (auto: cuda when available)")

    g = p.add_argument_group("sequence parallelism")
    helps = {"autosp": "compile the unchanged model into sequence-parallel training (AutoSP pass stack)",
             "ulysses": "hand-written Ulysses (all-to-all) attention baseline",
             "ring": "hand-written ring attention baseline (load-balanced zigzag)"}
    for name in SP_STRATEGIES:
        g.add_argument(f"--{name}", action="store_true", help=helps[name])
    g.add_argument("--sequence-parallel-size", "--context-parallel-size", dest="sequence_parallel_size",
                   type=_positive_int,
                   help="ranks that split one sequence (default: the world size with a strategy flag, else 1)")
    g.add_argument("--sac", dest="sac", action="store_true", default=None,
                   help="sequence-aware activation checkpointing (default on with --autosp; with --compile applies it without SP)")
    g.add_argument("--no-sac", dest="sac", action="store_false",
                   help="turn sequence-aware activation checkpointing off")
    g.add_argument("--sac-recompute-budget", type=float, default=DEFAULT_BUDGET,
                   help="SAC: largest added recompute FLOPs as a fraction of the step's FLOPs")
    g.add_argument("--sac-memory-target-gb", type=float,
                   help="SAC (--autosp): recompute (and offload) until the bytes saved for the "
                        "backward per rank are at most this many GB, instead of the recompute budget")
    g.add_argument("--sac-never-recommunicate", action="store_true",
                   help="SAC (--autosp): never run a collective again in the backward (the policy "
                        "before the communication-aware cost model)")
    g.add_argument("--sac-device",
                   help="SAC cost-model device: cpu, h100-nvlink, h200-nvlink, h100-cross-node, "
                        "optionally with overrides, e.g. h100-nvlink,link_bw=2e11 (default: detected)")
    g.add_argument("--offload-activations", action="store_true",
                   help="SAC (--autosp): keep saved activations above --offload-threshold-mb in "
                        "host memory between forward and backward (async copies, prefetched)")
    g.add_argument("--offload-threshold-mb", type=float, default=1.0,
                   help="--offload-activations: smallest saved tensor moved to host memory (MiB)")
    g.add_argument("--no-sequence-tiling", dest="sequence_tiling", action="store_false",
                   help="SAC (--autosp): do not run token-local regions (MLP, norms) in sequence chunks")
    g.add_argument("--compile-backend", "--autosp-backend", dest="compile_backend",
                   choices=["inductor", "aot_eager"], default="inductor",
                   help="code generation of every compiled strategy (--autosp, --compile, "
                        "--ulysses/--ring --compile); aot_eager skips Inductor")

    g = p.add_argument_group("data")
    g.add_argument("--data-path", nargs="+",
                   help="indexed dataset prefix, or a blend `W1 PREFIX1 W2 PREFIX2 ...` "
                        "(default: the built-in corpus of Python standard library sources)")
    g.add_argument("--split", default="969,30,1", help="train,valid,test proportions of the documents")
    g.add_argument("--tokenizer-model", help="tokenizer the data was made with (required with --data-path): a "
                                             "sentencepiece .model, or a Hugging Face tokenizer.json / directory")
    g.add_argument("--data-cache-path", help="where sample indices and the built-in corpus are cached (default: "
                                              "$AUTOSP_LM_CACHE, else a cache/ folder beside the data for "
                                              "--data-path, else ~/.cache/autosp_lm)")
    g.add_argument("--mock-data", action="store_true", help="train on synthetic tokens (no data needed)")
    g.add_argument("--eod-mask-loss", action="store_true", help="ignore the loss of the token after an end-of-document")
    g.add_argument("--reset-position-ids", action="store_true", help="restart position ids after each end-of-document")
    g.add_argument("--num-workers", type=_nonneg_int, default=0, help="background data loader workers")

    g = p.add_argument_group("checkpointing")
    g.add_argument("--save", help="directory to write checkpoints to (DIR/iter_NNNNNNN plus a `latest` tracker)")
    g.add_argument("--load", help="directory to resume from (the iteration in its `latest` tracker)")
    g.add_argument("--save-interval", type=_positive_int, help="save every N iterations (and at the end)")

    g = p.add_argument_group("evaluation and logging")
    g.add_argument("--eval-interval", type=_positive_int, default=1000, help="evaluate on the validation split every N iterations")
    g.add_argument("--eval-iters", type=_nonneg_int, default=10, help="global batches per evaluation (0 disables)")
    g.add_argument("--log-interval", type=_positive_int, default=10, help="log every N iterations")
    g.add_argument("--metrics-file", help="append one JSON object per logged iteration to this file")
    g.add_argument("--wandb-project", help="log to Weights & Biases under this project (offline unless an account is configured)")
    g.add_argument("--wandb-exp-name", help="W&B run name")
    g.add_argument("--wandb-save-dir", help="directory for W&B files (default: ./wandb)")
    g.add_argument("--distributed-backend", choices=["nccl", "gloo"],
                   help="torch.distributed backend (default: nccl on CUDA, gloo on CPU)")
    g.add_argument("--distributed-timeout-minutes", type=float, default=30, help="collective timeout")
    add_checkpoint_import_args(p)
    return p


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    return build_parser().parse_args(argv)


def strategy_name(args) -> str:
    chosen = [n for n in SP_STRATEGIES if getattr(args, n, False)]
    return chosen[0] if chosen else "none"


def strategy_options(args):
    """The options dataclass of the chosen strategy, from the flags (after validate_args)."""
    from .strategies import strategy_class
    name = args.strategy
    fields = {"none": dict(compile=args.compile, sac=bool(args.sac), backend=args.compile_backend,
                           sac_budget=args.sac_recompute_budget),
              "ulysses": dict(compile=args.compile, backend=args.compile_backend),
              "ring": dict(compile=args.compile, backend=args.compile_backend),
              "autosp": dict(sac=bool(args.sac), backend=args.compile_backend,
                             sac_budget=args.sac_recompute_budget, verbose=False,
                             **_autosp_memory_options(args))}[name]
    return strategy_class(name).Options(**fields)


def _autosp_memory_options(args) -> dict:
    """The SAC memory flags as :class:`~autosp_lm.compiler.AutoSPOptions` fields."""
    target = getattr(args, "sac_memory_target_gb", None)
    return dict(sac_memory_target=None if target is None else target * 2**30,
                sac_recommunicate=not getattr(args, "sac_never_recommunicate", False),
                sac_device=getattr(args, "sac_device", None),
                offload_activations=bool(getattr(args, "offload_activations", False)),
                offload_threshold=int(getattr(args, "offload_threshold_mb", 1.0) * 2**20),
                sequence_tiling=getattr(args, "sequence_tiling", True))


def model_config(args, vocab_size: Optional[int] = None) -> ModelConfig:
    """The model shape: the preset, overridden by the shape flags (and the data's vocabulary); or,
    with --hf-checkpoint, the checkpoint's config.json."""
    if getattr(args, "hf_checkpoint", None):
        return checkpoint_model_config(args)
    overrides = dict(num_layers=args.num_layers, hidden_size=args.hidden_size,
                     num_attention_heads=args.num_attention_heads,
                     ffn_hidden_size=args.ffn_hidden_size,
                     max_position_embeddings=args.max_position_embeddings,
                     rotary_base=args.rotary_base, norm_eps=args.norm_epsilon,
                     init_std=args.init_method_std, dropout=args.hidden_dropout,
                     vocab_size=args.vocab_size or vocab_size)
    if args.group_query_attention:
        overrides["num_query_groups"] = args.num_query_groups
    elif args.num_attention_heads is not None:
        overrides["num_query_groups"] = args.num_attention_heads
    if args.untie_embeddings_and_output_weights:
        overrides["tie_embeddings"] = False
    try:
        return apply_rope_scaling_args(preset_config(args.model, **overrides), args)
    except ValueError as e:
        raise ArgumentError(str(e)) from None


def pad_vocab(size: int, multiple: int) -> int:
    return ((size + multiple - 1) // multiple) * multiple


def validate_args(args, world_size: int) -> argparse.Namespace:
    """Check flag combinations against the world size; fill derived values. Raises ArgumentError."""
    validate_checkpoint_import_args(args)
    strategies = [n for n in SP_STRATEGIES if getattr(args, n)]
    if len(strategies) > 1:
        raise ArgumentError(f"--{' and --'.join(strategies)} are mutually exclusive; choose one strategy")
    strategy = strategy_name(args)
    sp = args.sequence_parallel_size
    if sp is None:
        sp = world_size if strategy != "none" else 1
    if sp > 1 and strategy == "none":
        raise ArgumentError(f"--sequence-parallel-size {sp} needs a strategy: add --autosp, --ulysses or --ring")
    if world_size % sp:
        raise ArgumentError(f"world size {world_size} is not divisible by --sequence-parallel-size {sp}; "
                            f"launch a multiple of {sp} processes")
    args.sequence_parallel_size = sp
    args.data_parallel_size = world_size // sp
    args.strategy = strategy

    per_step = args.micro_batch_size * args.data_parallel_size
    if args.global_batch_size % per_step:
        raise ArgumentError(
            f"--global-batch-size {args.global_batch_size} is not divisible by --micro-batch-size "
            f"{args.micro_batch_size} x data-parallel size {args.data_parallel_size} (= {per_step}); "
            f"use a global batch that is a multiple of {per_step}")
    args.grad_accum_steps = args.global_batch_size // per_step

    if args.group_query_attention and args.num_query_groups is None:
        raise ArgumentError("--group-query-attention needs --num-query-groups N (the number of key/value heads)")
    if args.num_query_groups is not None and not args.group_query_attention:
        raise ArgumentError("--num-query-groups only takes effect with --group-query-attention; add that flag")
    if args.lr <= 0:
        raise ArgumentError(f"--lr must be positive, got {args.lr}")
    if args.min_lr < 0 or args.min_lr > args.lr:
        raise ArgumentError(f"--min-lr {args.min_lr} must be between 0 and --lr {args.lr}")
    if args.lr_decay_iters is None:
        args.lr_decay_iters = args.train_iters
    if args.lr_warmup_iters is None:
        args.lr_warmup_iters = min(100, args.lr_decay_iters // 10)
    if args.lr_warmup_iters > args.lr_decay_iters:
        raise ArgumentError(f"--lr-warmup-iters {args.lr_warmup_iters} exceeds --lr-decay-iters "
                            f"{args.lr_decay_iters}; shorten the warm-up")
    if not 0.0 <= args.hidden_dropout < 1.0:
        raise ArgumentError(f"--hidden-dropout must be in [0, 1), got {args.hidden_dropout}")
    if args.clip_grad < 0:
        raise ArgumentError(f"--clip-grad must be >= 0, got {args.clip_grad}")
    if not (0 <= args.adam_beta1 < 1 and 0 <= args.adam_beta2 < 1):
        raise ArgumentError("--adam-beta1 and --adam-beta2 must be in [0, 1)")
    if args.mock_data and args.data_path:
        raise ArgumentError("--mock-data and --data-path are mutually exclusive; drop one")
    if args.data_path and not args.tokenizer_model:
        raise ArgumentError("--data-path needs --tokenizer-model (the tokenizer the data was "
                            "tokenized with)")
    if args.data_path and len(args.data_path) > 1:
        if len(args.data_path) % 2:
            raise ArgumentError("--data-path blend must be pairs `WEIGHT PREFIX WEIGHT PREFIX ...`; "
                                f"got {len(args.data_path)} values")
        for w in args.data_path[::2]:
            try:
                if float(w) < 0:
                    raise ValueError
            except ValueError:
                raise ArgumentError(f"--data-path blend weight {w!r} is not a non-negative number; "
                                    "use `WEIGHT PREFIX WEIGHT PREFIX ...`") from None
    try:
        parts = [float(x) for x in args.split.replace("/", ",").split(",")]
        if len(parts) > 3 or any(x < 0 for x in parts) or sum(parts) <= 0:
            raise ValueError
    except ValueError:
        raise ArgumentError(f"--split {args.split!r} is not valid: give up to three non-negative "
                            "proportions like 969,30,1") from None
    if args.load and not os.path.isdir(args.load) and args.load != args.save:
        raise ArgumentError(f"--load {args.load}: no such directory; check the path "
                            "(or use the same path for --save and --load to resume when present)")
    if args.save_interval and not args.save:
        raise ArgumentError("--save-interval needs --save DIR to write checkpoints to")
    if args.sac is None:
        args.sac = strategy == "autosp"
    if args.sac and strategy in ("ulysses", "ring"):
        raise ArgumentError("--sac is a compiler pass: use it with --autosp or --compile, "
                            "not with the hand-written --ulysses/--ring baselines")
    if args.sac and strategy == "none" and not args.compile:
        raise ArgumentError("--sac without sequence parallelism needs --compile (it is a compiler pass)")
    memory_flags = [f for f, on in (("--sac-memory-target-gb", args.sac_memory_target_gb is not None),
                                    ("--offload-activations", args.offload_activations),
                                    ("--sac-never-recommunicate", args.sac_never_recommunicate),
                                    ("--sac-device", args.sac_device is not None),
                                    ("--no-sequence-tiling", not args.sequence_tiling)) if on]
    if memory_flags and not (args.sac and strategy == "autosp"):
        raise ArgumentError(f"{', '.join(memory_flags)}: options of the AutoSP checkpointing pass; "
                            "use them with --autosp (and SAC on, the default)")
    if args.sac_memory_target_gb is not None and args.sac_memory_target_gb < 0:
        raise ArgumentError(f"--sac-memory-target-gb must be >= 0, got {args.sac_memory_target_gb}")
    if args.offload_threshold_mb < 0:
        raise ArgumentError(f"--offload-threshold-mb must be >= 0, got {args.offload_threshold_mb}")
    if args.sac_device is not None:
        from .compiler.cost_model import device_params
        try:
            device_params(args.sac_device)
        except ValueError as e:
            raise ArgumentError(f"--sac-device: {e}") from None
    if not 0 <= args.sac_recompute_budget <= 10:
        raise ArgumentError(f"--sac-recompute-budget must be in [0, 10], got {args.sac_recompute_budget}")

    cfg = model_config(args, vocab_size=None)  # shape validation only (vocab may change with data)
    if args.seq_length > cfg.max_position_embeddings:
        raise ArgumentError(f"--seq-length {args.seq_length} exceeds --max-position-embeddings "
                            f"{cfg.max_position_embeddings} of model {args.hf_checkpoint or args.model}; raise "
                            "--max-position-embeddings or shorten the sequence")
    try:
        check_strategy(strategy, cfg, sp, args.seq_length)
    except ValueError as e:
        raise ArgumentError(str(e)) from None
    return args


# --- pretrained checkpoints, Hugging Face tokenizers, RoPE scaling ------------------------------
def add_checkpoint_import_args(parser: argparse.ArgumentParser) -> None:
    """Flags to start from a Hugging Face checkpoint, use its tokenizer and rescale RoPE."""
    from .data.tokenizer import TOKENIZER_TYPES
    from .models.rope import ROPE_TYPES

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
    from .models.rope import RopeScalingError, normalize_rope_scaling, rope_context_length

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
    from .models.hf import CONFIG_FILE, HFCheckpointError, config_from_hf, read_hf_config

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


def validate_checkpoint_import_args(args) -> None:
    """Check the --hf-checkpoint, --tokenizer-type and --rope-scaling flags before any work; fill
    the tokenizer from the checkpoint when none is given."""
    from .data.tokenizer import infer_tokenizer_type

    if getattr(args, "rope_scaling", None) is None:
        given = [f"--{flag.replace('_', '-')}" for flag, _ in _ROPE_FLAGS if getattr(args, flag, None) is not None]
        if given:
            raise ArgumentError(f"{', '.join(given)} need(s) --rope-scaling TYPE (linear, dynamic-ntk, "
                                f"llama3 or yarn)")
    ckpt = getattr(args, "hf_checkpoint", None)
    if ckpt:
        from .models.hf import HFCheckpointError, SafetensorsCheckpoint
        if not os.path.isdir(ckpt):
            raise ArgumentError(f"--hf-checkpoint {ckpt}: no such directory")
        model_config(args)  # refuses an unsupported config.json, naming the field
        try:
            SafetensorsCheckpoint(ckpt)  # the weight files exist (reads their headers only)
        except HFCheckpointError as e:
            raise ArgumentError(f"--hf-checkpoint: {e}") from None
        own = os.path.join(ckpt, "tokenizer.json")
        if not args.tokenizer_model and not args.mock_data and os.path.isfile(own) and \
                args.tokenizer_type in (None, "HuggingFaceTokenizer"):
            args.tokenizer_model = own  # the vocabulary the embeddings were trained with
    if args.tokenizer_model:
        path = args.tokenizer_model
        if args.tokenizer_type is None:
            args.tokenizer_type = infer_tokenizer_type(path)
        if args.tokenizer_type == "HuggingFaceTokenizer" and os.path.isdir(path):
            if not os.path.isfile(os.path.join(path, "tokenizer.json")):
                raise ArgumentError(f"--tokenizer-model {path}: the directory holds no tokenizer.json")
            args.tokenizer_model = os.path.join(path, "tokenizer.json")
    elif args.tokenizer_type == "HuggingFaceTokenizer":
        raise ArgumentError("--tokenizer-type HuggingFaceTokenizer needs --tokenizer-model (a tokenizer.json "
                            "or a directory holding one), or an --hf-checkpoint that has one")
