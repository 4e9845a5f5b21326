#!/usr/bin/env python
"""Pretrain a GPT or Llama model. Launch with torchrun:

    torchrun --nproc-per-node 2 pretrain.py --autosp      # sequence-parallel via the AutoSP compiler
    torchrun --nproc-per-node 2 pretrain.py --ulysses     # hand-written Ulysses baseline
    python pretrain.py --mock-data --train-iters 20       # single process

Flags: `python pretrain.py --help`. This file only wires the pieces together.
"""
from __future__ import annotations

import os
import random
import sys

import numpy as np
import torch

from autosp_lm.arguments import (ArgumentError, model_config, pad_vocab, parse_args, strategy_options,
                                 validate_args)
from autosp_lm.data import build_data
from autosp_lm.models import build_model
from autosp_lm.parallel import destroy_parallel, init_parallel
from autosp_lm.parallel.sharding import build_sharding, sharding_kind
from autosp_lm.strategies import build_strategy
from autosp_lm.training import CheckpointError, Trainer, TrainingError
from autosp_lm.training.metrics import MetricsLogger


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def main(argv=None):
    args = parse_args(argv)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        world = torch.distributed.get_world_size()
    try:
        validate_args(args, world)
    except ArgumentError as e:
        sys.exit(f"pretrain.py: error: {e}")

    sharded = bool(args.use_torch_fsdp2 or args.use_distributed_optimizer)
    ps = init_parallel(args.sequence_parallel_size, backend=args.distributed_backend,
                       device=args.device, timeout_minutes=args.distributed_timeout_minutes,
                       shard_mesh=sharded)
    logger = MetricsLogger(enabled=ps.is_main, metrics_file=args.metrics_file,
                           wandb_project=args.wandb_project, wandb_name=args.wandb_exp_name,
                           wandb_dir=args.wandb_save_dir, config=vars(args))
    try:
        seed_everything(args.seed)
        n_eval = args.eval_iters * args.global_batch_size
        data = build_data(args, (args.train_iters * args.global_batch_size, n_eval, n_eval),
                          mock_vocab_size=args.vocab_size or model_config(args).vocab_size,
                          rank=ps.rank, barrier=ps.barrier if ps.is_distributed else None)
        vocab = data.vocab_size if args.mock_data else pad_vocab(data.vocab_size, args.make_vocab_size_divisible_by)
        if args.vocab_size and args.vocab_size < data.vocab_size:
            raise ArgumentError(f"--vocab-size {args.vocab_size} is smaller than the tokenizer's "
                                f"vocabulary {data.vocab_size}; drop the flag or raise it")
        cfg = model_config(args, vocab_size=vocab)
        seed_everything(args.seed)  # identical initial weights on every rank
        if args.hf_checkpoint:  # weights (and shape, from config.json) of a Hugging Face model
            if data.vocab_size > cfg.vocab_size:
                raise ArgumentError(f"the tokenizer's vocabulary {data.vocab_size} exceeds vocab_size "
                                    f"{cfg.vocab_size} of --hf-checkpoint {args.hf_checkpoint}; use "
                                    "the checkpoint's tokenizer")
            from autosp_lm.models.hf import HFCheckpointError, load_hf_checkpoint
            try:
                model, cfg = load_hf_checkpoint(args.hf_checkpoint, ps.device, config=cfg)
            except HFCheckpointError as e:
                raise CheckpointError(f"--hf-checkpoint: {e}") from None
        else:
            model = build_model(cfg).to(ps.device)
        # the trainer prints the strategy's report after step 1 (compiled strategies know then)
        strategy = build_strategy(args.strategy, ps, strategy_options(args))
        # where the model state lives: FSDP2 / graph FSDP (--autosp) / distributed optimizer
        sharding = build_sharding(sharding_kind(args.use_torch_fsdp2, args.use_distributed_optimizer,
                                                strategy.needs_full_graph), ps, bf16=args.bf16)
        sharding.wrap(model)
        strategy.setup(model)
        logger.print(f"model {args.hf_checkpoint or args.model}: {cfg.num_parameters() / 1e6:.2f}M parameters, "
                     f"{cfg.num_layers} layers, hidden {cfg.hidden_size}, heads {cfg.num_attention_heads}"
                     f"/{cfg.num_query_groups} kv, vocab {cfg.vocab_size} | data: {data.description} | "
                     f"world {ps.world_size} = data-parallel {ps.dp_size} x sequence-parallel "
                     f"{ps.sp_size} ({args.strategy}) | seq {args.seq_length}, global batch "
                     f"{args.global_batch_size} = micro {args.micro_batch_size} x dp {ps.dp_size} x "
                     f"accumulation {args.grad_accum_steps} | device {ps.device}")
        logger.print(sharding.report())
        trainer = Trainer(args, ps, model, cfg, strategy, data, logger, sharding=sharding)
        return trainer.train()
    except (ArgumentError, CheckpointError, TrainingError) as e:
        print(f"pretrain.py: error: {e}", file=sys.stderr, flush=True)
        if ps.is_distributed:
            os._exit(1)  # peers may be waiting in a collective: do not hang them
        sys.exit(1)
    finally:
        logger.close()
        if ps.owns_group:  # the 1-rank group of a single sharded process
            destroy_parallel()


if __name__ == "__main__":
    main()
    destroy_parallel()
