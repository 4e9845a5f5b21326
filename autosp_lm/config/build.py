"""The command line's flags (parsed by :mod:`.arguments`) checked once and turned into the
frozen :class:`~autosp_lm.config.run_config.RunConfig`: :func:`build_run_config`.

Every combination is checked before any work starts; a mistake raises :class:`ArgumentError`
with a message that names the flag and the fix. The checks return values, they never write into
the namespace; after this point nothing reads it. The model config is built here, once (with
``--hf-checkpoint`` its ``config.json`` is read once).
"""
from __future__ import annotations

import argparse
import os
from typing import Optional

from ..data.config import DataConfig
from ..models.config import ModelConfig, preset_config
from ..parallel.config import ParallelConfig
from ..strategies import SP_STRATEGIES, check_strategy
from ..training.config import CheckpointConfig, LoggingConfig, OptimizerConfig, TrainingConfig
from .checkpoint_flags import (apply_rope_scaling_args, check_checkpoint_flags,
                               checkpoint_model_config, checkpoint_tokenizer)
from .cli import ArgumentError
from .run_config import ModelSpec, RunConfig
from .strategy_flags import RECIPE_FLAGS, strategy_options, validate_memory_budget


def strategy_name(args) -> str:
    chosen = [n for n in SP_STRATEGIES if getattr(args, n, False)]
    return chosen[0] if chosen else "none"


def model_config(args) -> ModelConfig:
    """The model shape: the preset, overridden by the shape flags; or, with --hf-checkpoint, the
    checkpoint's config.json. (The vocabulary follows the data: :meth:`ModelSpec.with_vocab`.)"""
    if getattr(args, "hf_checkpoint", None):
        return checkpoint_model_config(args)
    overrides = dict(num_layers=args.num_layers, hidden_size=args.hidden_size,
                     num_attention_heads=args.num_attention_heads,
                     ffn_hidden_size=args.ffn_hidden_size,
                     max_position_embeddings=args.max_position_embeddings,
                     rotary_base=args.rotary_base, norm_eps=args.norm_epsilon,
                     init_std=args.init_method_std, dropout=args.hidden_dropout,
                     vocab_size=args.vocab_size)
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


def compile_description(strategy: str, options, sp: int) -> Optional[str]:
    """What the first iteration compiles, for the log (None for eager strategies)."""
    backend = getattr(options, "backend", "inductor")
    sac = bool(getattr(options, "sac", False))
    if strategy == "autosp":
        return (f"AutoSP for sequence-parallel size {sp}: Dynamo trace -> sequence-sharding "
                f"passes -> AOTAutograd{' -> SAC' if sac else ''} -> {backend}")
    if getattr(options, "compile", False):
        return f"torch.compile, {backend}" + (", SAC" if sac else "")
    return None


def _layout(args, world_size: int, strategy: str) -> ParallelConfig:
    sp = args.sequence_parallel_size
    if sp is None:
        sp = world_size if strategy != "none" else 1
    if sp > 1 and strategy == "none":
        raise ArgumentError(f"--sequence-parallel-size {sp} needs a strategy: add --autosp, --ulysses or --ring")
    if world_size % sp:
        raise ArgumentError(f"world size {world_size} is not divisible by --sequence-parallel-size {sp}; "
                            f"launch a multiple of {sp} processes")
    if not args.distributed_timeout_minutes > 0:
        raise ArgumentError(f"--distributed-timeout-minutes {args.distributed_timeout_minutes} must be "
                            "positive (fractions of a minute are allowed, e.g. 0.5)")
    if args.ulysses_degree is not None and strategy not in ("autosp", "ulysses"):
        raise ArgumentError(f"--ulysses-degree applies to --autosp and --ulysses, not "
                            f"{'--' + strategy if strategy != 'none' else 'training without SP'}")
    fsdp, zero = args.use_torch_fsdp2, args.use_distributed_optimizer
    if fsdp and zero:
        raise ArgumentError("--use-torch-fsdp2 and --use-distributed-optimizer are mutually exclusive: "
                            "FSDP2 already shards gradients and optimizer states; drop one")
    if fsdp and args.compile and args.cpu_offloading and strategy != "autosp":
        from ..strategies.memory import FSDP2_COMPILED_OFFLOAD
        raise ArgumentError(FSDP2_COMPILED_OFFLOAD)  # (MemoryRecipe's check, before any work)
    return ParallelConfig(world_size=world_size, sequence_parallel_size=sp,
                          data_parallel_size=world_size // sp, ulysses_degree=args.ulysses_degree,
                          use_torch_fsdp2=fsdp, use_distributed_optimizer=zero,
                          distributed_backend=args.distributed_backend, device=args.device,
                          distributed_timeout_minutes=args.distributed_timeout_minutes)


def _optimizer(args) -> OptimizerConfig:
    if args.lr <= 0:
        raise ArgumentError(f"--lr must be positive, got {args.lr}")
    if args.min_lr < 0 or args.min_lr > args.lr:
        raise ArgumentError(f"--min-lr {args.min_lr} must be between 0 and --lr {args.lr}")
    decay = args.train_iters if args.lr_decay_iters is None else args.lr_decay_iters
    warmup = min(100, decay // 10) if args.lr_warmup_iters is None else args.lr_warmup_iters
    if warmup > decay:
        raise ArgumentError(f"--lr-warmup-iters {warmup} exceeds --lr-decay-iters "
                            f"{decay}; shorten the warm-up")
    if args.clip_grad < 0:
        raise ArgumentError(f"--clip-grad must be >= 0, got {args.clip_grad}")
    if not (0 <= args.adam_beta1 < 1 and 0 <= args.adam_beta2 < 1):
        raise ArgumentError("--adam-beta1 and --adam-beta2 must be in [0, 1)")
    return OptimizerConfig(lr=args.lr, min_lr=args.min_lr, lr_decay_style=args.lr_decay_style,
                           lr_warmup_iters=warmup, lr_decay_iters=decay,
                           weight_decay=args.weight_decay, clip_grad=args.clip_grad,
                           adam_beta1=args.adam_beta1, adam_beta2=args.adam_beta2,
                           adam_eps=args.adam_eps)


def _data(args, tokenizer_model, tokenizer_type) -> DataConfig:
    if args.reset_attention_mask and args.mock_data:
        raise ArgumentError("--reset-attention-mask needs documents (end-of-document tokens), which "
                            "--mock-data has none of; train on the built-in corpus or --data-path")
    if args.mock_data and args.data_path:
        raise ArgumentError("--mock-data and --data-path are mutually exclusive; drop one")
    if args.data_path and not tokenizer_model:
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
    return DataConfig(seq_length=args.seq_length, seed=args.seed, mock_data=args.mock_data,
                      data_path=args.data_path, split=args.split,
                      tokenizer_model=tokenizer_model, tokenizer_type=tokenizer_type,
                      data_cache_path=args.data_cache_path, eod_mask_loss=args.eod_mask_loss,
                      reset_position_ids=args.reset_position_ids,
                      reset_attention_mask=args.reset_attention_mask,
                      num_workers=args.num_workers)


def _checkpointing(args, sharded: bool) -> CheckpointConfig:
    if args.load and not os.path.isdir(args.load) and args.load != args.save:
        raise ArgumentError(f"--load {args.load}: no such directory; check the path "
                            "(or use the same path for --save and --load to resume when present)")
    if args.save_interval and not args.save:
        raise ArgumentError("--save-interval needs --save DIR to write checkpoints to")
    fmt = args.ckpt_format or ("torch_dist" if sharded else "torch")
    if args.async_save:
        if fmt != "torch_dist":
            raise ArgumentError("--async-save needs --ckpt-format torch_dist (the single-file "
                                "format is written synchronously by rank 0); add it or drop --async-save")
        if not args.save:
            raise ArgumentError("--async-save needs --save DIR to write checkpoints to")
    return CheckpointConfig(save=args.save, load=args.load, save_interval=args.save_interval,
                            ckpt_format=fmt, async_save=args.async_save)


def _strategy_checks(args, strategy: str) -> bool:
    """The strategy and memory flags' combinations; returns whether SAC is on."""
    sac = strategy == "autosp" if args.sac is None else args.sac
    if sac and strategy in ("ulysses", "ring"):
        raise ArgumentError("--sac is a compiler pass: use it with --autosp or --compile, "
                            "not with the hand-written --ulysses/--ring baselines")
    if sac and strategy == "none" and not args.compile:
        raise ArgumentError("--sac without sequence parallelism needs --compile (it is a compiler pass)")
    memory_flags = [f for f, on in (("--sac-memory-target-gb", args.sac_memory_target_gb is not None),
                                    ("--offload-activations", args.offload_activations),
                                    ("--sac-never-recommunicate", args.sac_never_recommunicate),
                                    ("--sac-device", args.sac_device is not None),
                                    ("--no-sequence-tiling", not args.sequence_tiling),
                                    ("--max-context", args.max_context))
                    if on]
    validate_memory_budget(args, strategy, sac)
    if memory_flags and not (sac and strategy == "autosp"):
        raise ArgumentError(f"{', '.join(memory_flags)}: options of the AutoSP checkpointing pass; "
                            "use them with --autosp (and SAC on, the default)")
    groups = args.attention_head_groups
    if groups < 0:
        raise ArgumentError(f"--attention-head-groups {groups}: use a count >= 1, or 0 for the "
                            f"most the heads allow")
    if groups != 1 and strategy != "autosp":
        raise ArgumentError("--attention-head-groups is an AutoSP option (the compiler splits "
                            "each rank's heads into groups): use it with --autosp"
                            + ("; the --ulysses baseline chunks its heads with "
                               "--attention-head-chunks" if strategy == "ulysses" else ""))
    if args.attention_head_chunks != 1 and strategy != "ulysses":
        raise ArgumentError("--attention-head-chunks is an option of the hand-written --ulysses "
                            "baseline (UPipe's head chunks)"
                            + ("; under --autosp use --attention-head-groups"
                               if strategy == "autosp" else ""))
    recipe_on = [(flag, fix) for f, (flag, fix) in RECIPE_FLAGS.items() if getattr(args, f)]
    if recipe_on and (strategy == "autosp" or sac):
        flag, fix = recipe_on[0]
        where = "--autosp" if strategy == "autosp" else "--compile --sac"
        raise ArgumentError(f"{flag} is for none / --ulysses / --ring; under {where} {fix}")
    if args.sac_memory_target_gb is not None and args.sac_memory_target_gb < 0:
        raise ArgumentError(f"--sac-memory-target-gb must be >= 0, got {args.sac_memory_target_gb}")
    if args.offload_threshold_mb < 0:
        raise ArgumentError(f"--offload-threshold-mb must be >= 0, got {args.offload_threshold_mb}")
    if args.sac_device is not None:
        from ..compiler.cost_model import device_params
        try:
            device_params(args.sac_device)
        except ValueError as e:
            raise ArgumentError(f"--sac-device: {e}") from None
    if not 0 <= args.sac_recompute_budget <= 10:
        raise ArgumentError(f"--sac-recompute-budget must be in [0, 10], got {args.sac_recompute_budget}")
    return sac


def build_run_config(args: argparse.Namespace, world_size: int) -> RunConfig:
    """The flags of :func:`autosp_lm.config.arguments.parse_args`, checked against the world
    size, as the run's :class:`RunConfig`. Raises :class:`ArgumentError`; reads ``args`` only."""
    check_checkpoint_flags(args)
    cfg = model_config(args)  # the vocabulary may still change with the data's tokenizer
    tokenizer_model, tokenizer_type = checkpoint_tokenizer(args)
    strategies = [n for n in SP_STRATEGIES if getattr(args, n)]
    if len(strategies) > 1:
        raise ArgumentError(f"--{' and --'.join(strategies)} are mutually exclusive; choose one strategy")
    strategy = strategy_name(args)
    parallel = _layout(args, world_size, strategy)
    per_step = args.micro_batch_size * parallel.data_parallel_size
    if args.global_batch_size % per_step:
        raise ArgumentError(
            f"--global-batch-size {args.global_batch_size} is not divisible by --micro-batch-size "
            f"{args.micro_batch_size} x data-parallel size {parallel.data_parallel_size} (= {per_step}); "
            f"use a global batch that is a multiple of {per_step}")
    if args.group_query_attention and args.num_query_groups is None:
        raise ArgumentError("--group-query-attention needs --num-query-groups N (the number of key/value heads)")
    if args.num_query_groups is not None and not args.group_query_attention:
        raise ArgumentError("--num-query-groups only takes effect with --group-query-attention; add that flag")
    if args.fp32_residual_connection and not args.bf16:
        raise ArgumentError("--fp32-residual-connection only takes effect with --bf16; add --bf16 "
                            "or drop it")
    if not 0.0 <= args.hidden_dropout < 1.0:
        raise ArgumentError(f"--hidden-dropout must be in [0, 1), got {args.hidden_dropout}")
    optimizer = _optimizer(args)
    data = _data(args, tokenizer_model, tokenizer_type)
    checkpoint = _checkpointing(args, parallel.sharded)
    sac = _strategy_checks(args, strategy)

    if args.seq_length > cfg.max_position_embeddings:
        raise ArgumentError(f"--seq-length {args.seq_length} exceeds --max-position-embeddings "
                            f"{cfg.max_position_embeddings} of model {args.hf_checkpoint or args.model}; raise "
                            "--max-position-embeddings or shorten the sequence")
    options = strategy_options(args, strategy, sac)
    try:
        check_strategy(strategy, cfg, parallel.sequence_parallel_size, args.seq_length, options)
    except ValueError as e:
        raise ArgumentError(str(e)) from None
    training = TrainingConfig(
        train_iters=args.train_iters, micro_batch_size=args.micro_batch_size,
        global_batch_size=args.global_batch_size, grad_accum_steps=args.global_batch_size // per_step,
        seq_length=args.seq_length, bf16=args.bf16,
        fp32_residual_connection=args.fp32_residual_connection,
        eval_interval=args.eval_interval, eval_iters=args.eval_iters,
        exit_interval=args.exit_interval, num_workers=args.num_workers,
        compiling=compile_description(strategy, options, parallel.sequence_parallel_size),
        optimizer=optimizer, checkpoint=checkpoint,
        logging=LoggingConfig(log_interval=args.log_interval, metrics_file=args.metrics_file,
                              wandb_project=args.wandb_project, wandb_exp_name=args.wandb_exp_name,
                              wandb_save_dir=args.wandb_save_dir))
    model = ModelSpec(config=cfg, name=args.hf_checkpoint or args.model,
                      hf_checkpoint=args.hf_checkpoint, vocab_size=args.vocab_size,
                      make_vocab_size_divisible_by=args.make_vocab_size_divisible_by)
    return RunConfig(model=model, parallel=parallel, strategy=strategy, strategy_options=options,
                     data=data, training=training, seed=args.seed,
                     memory_budget_gb=args.memory_budget_gb, recipe=args.recipe)


def parse_run_config(argv, world_size: int) -> RunConfig:
    """``build_run_config(parse_args(argv), world_size)``: a command line's run configuration."""
    from .arguments import parse_args
    return build_run_config(parse_args(argv), world_size)


__all__ = ["build_run_config", "parse_run_config", "model_config", "strategy_name",
           "compile_description"]
