"""``pretrain.py``'s command-line flags (Megatron-LM names where one exists), declared once.

``parse_args`` returns an ``argparse.Namespace``; :func:`autosp_lm.config.build.build_run_config`
checks every combination and turns it into the run's typed configuration, the only reader of the
namespace.
"""
from __future__ import annotations

import argparse
from typing import Optional, Sequence

from ..compiler import DEFAULT_BUDGET
from ..models.config import preset_config
from ..strategies import SP_STRATEGIES
from .checkpoint_flags import add_checkpoint_import_args
from .cli import ArgumentError, HelpFormatter, Parser, UsageError  # noqa: F401 (re-exported)
from .cli import nonneg_int as _nonneg_int, positive_int as _positive_int
from .shared_flags import (add_bf16, add_fp32_residual_connection, add_model, add_seq_length,
                           add_sequence_parallel_size, add_ulysses_degree)
from .strategy_flags import add_memory_budget_arg


DEFAULT_MODEL = "llama-tiny"


def _from_preset(field: str) -> str:
    """Help suffix of a shape flag: where its default comes from, and the default preset's value."""
    value = getattr(preset_config(DEFAULT_MODEL), field)
    return f" (default: the --model preset's; {DEFAULT_MODEL}: {value})"


def build_parser() -> argparse.ArgumentParser:
    p = Parser(
        prog="pretrain.py",
        description="Pretrain a GPT or Llama model, optionally sequence-parallel. Launch with "
                    "torchrun, e.g. `torchrun --nproc-per-node 2 pretrain.py --autosp`.",
        formatter_class=HelpFormatter)

    g = p.add_argument_group("model")
    add_model(g, DEFAULT_MODEL)
    g.add_argument("--num-layers", type=_positive_int, help="number of transformer layers" + _from_preset("num_layers"))
    g.add_argument("--hidden-size", type=_positive_int, help="transformer hidden size" + _from_preset("hidden_size"))
    g.add_argument("--num-attention-heads", type=_positive_int, help="number of query heads" + _from_preset("num_attention_heads"))
    g.add_argument("--group-query-attention", action="store_true",
                   help="use grouped-query attention (llama); set the group count with --num-query-groups")
    g.add_argument("--num-query-groups", type=_positive_int,
                   help="number of key/value heads with --group-query-attention"
                        + _from_preset("num_query_groups"))
    g.add_argument("--ffn-hidden-size", type=_positive_int, help="MLP hidden size" + _from_preset("ffn_hidden_size"))
    g.add_argument("--max-position-embeddings", type=_positive_int,
                   help="maximum sequence length the model supports (size of GPT's position table)"
                        + _from_preset("max_position_embeddings"))
    g.add_argument("--rotary-base", type=float, help="RoPE theta (llama)" + _from_preset("rotary_base"))
    g.add_argument("--vocab-size", type=_positive_int,
                   help="model vocabulary size (default: the tokenizer's, padded; the preset's with --mock-data)")
    g.add_argument("--make-vocab-size-divisible-by", type=_positive_int, default=128,
                   help="pad the tokenizer's vocabulary to a multiple of this for efficient matmuls")
    g.add_argument("--norm-epsilon", type=float, help="epsilon of LayerNorm/RMSNorm" + _from_preset("norm_eps"))
    g.add_argument("--init-method-std", type=float, help="std of the normal weight init" + _from_preset("init_std"))
    g.add_argument("--hidden-dropout", type=float, default=0.0, help="dropout probability (0 for exact parity)")
    g.add_argument("--untie-embeddings-and-output-weights", action="store_true",
                   help="use a separate output layer even where the preset ties it")

    g = p.add_argument_group("training")
    add_seq_length(g, 1024)
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
    add_bf16(g, help="bf16 mixed precision as in Megatron: bf16 parameters for compute (the "
                     "residual stream and saved activations in bf16), fp32 main weights in the "
                     "optimizer, fp32 gradient accumulation and reduction")
    add_fp32_residual_connection(g, help="with --bf16: keep the parameters and the residual "
                                         "stream in fp32, bf16 only inside autocast's matmuls")
    g.add_argument("--compile", action="store_true", help="torch.compile the model (implied by --autosp)")
    g.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto",
                   help="device to train on (auto: cuda when available)")

    g = p.add_argument_group("sequence parallelism")
    helps = {"autosp": "compile the unchanged model into sequence-parallel training (AutoSP pass stack)",
             "ulysses": "hand-written Ulysses (all-to-all) attention baseline",
             "ring": "hand-written ring attention baseline (load-balanced zigzag)"}
    for name in SP_STRATEGIES:
        g.add_argument(f"--{name}", action="store_true", help=helps[name])
    g.add_argument("--recipe", metavar="NAME",
                   help="a named configuration, the strategy and its options (e.g. ulysses+ac, "
                        "ulysses+alst, autosp-max-offload; the names of tools/plan_memory.py "
                        "and tools/benchmark_sp.py, autosp_lm/strategies/recipes.py): `--recipe "
                        "list` lists them with what each runs; flags given beside it win, "
                        "another strategy flag is an error")
    add_sequence_parallel_size(g, help="ranks that split one sequence (default: the world size "
                                       "with a strategy flag, else 1)")
    add_ulysses_degree(g, help="ranks of the all-to-all over heads (inside a node); the rest of the "
                               "sequence-parallel size is a ring (P = U x R). Unset: chosen from "
                               "the heads and the node size under --autosp, all of P under "
                               "--ulysses")
    g.add_argument("--sac", dest="sac", action="store_true", default=None,
                   help="sequence-aware activation checkpointing: on by default with --autosp, off "
                        "otherwise; with --compile applies it on one device without SP")
    g.add_argument("--no-sac", dest="sac", action="store_false",
                   help="turn SAC off where it is on by default (--autosp)")
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
    add_memory_budget_arg(g)
    g.add_argument("--max-context", action="store_true",
                   help="AutoSP's max-context mode (--autosp): whole layers are the checkpointing "
                        "stages (attention recomputed in the backward, only each layer's input "
                        "saved; with --offload-activations in host memory) and attention runs "
                        "in head groups; the longest context, at about full recomputation's "
                        "step time (docs/sac.md)")
    g.add_argument("--attention-head-groups", type=int, default=1,
                   help="AutoSP: each rank's attention heads in this many groups, one after the "
                        "other (one group's all-to-all buffers and kernel scratch live at a time); "
                        "0: the most the heads allow (the --max-context default)")
    g.add_argument("--attention-head-chunks", type=_nonneg_int, default=1,
                   help="--ulysses: each rank's attention heads in this many chunks, one after "
                        "the other (UPipe's untied Ulysses: one chunk's all-to-all buffers and "
                        "attention intermediates live at a time, forward and backward); 0: one "
                        "query head of each rank a chunk (UPipe's choice); must split each "
                        "rank's query heads and the kv heads they use evenly (docs/baselines.md)")
    g.add_argument("--no-sequence-tiling", dest="sequence_tiling", action="store_false",
                   help="SAC (--autosp): do not run token-local regions (MLP, norms) in sequence chunks")
    g.add_argument("--compile-backend", "--autosp-backend", dest="compile_backend",
                   choices=["inductor", "aot_eager"], default="inductor",
                   help="code generation of every compiled strategy (--autosp, --compile, "
                        "--ulysses/--ring --compile); aot_eager skips Inductor")

    g = p.add_argument_group("activation memory of none, --ulysses and --ring (docs/baselines.md); "
                             "--autosp chooses its own with SAC")
    g.add_argument("--recompute-granularity", choices=["full", "selective"],
                   help="Megatron's activation recomputation: full keeps each checkpointed block's "
                        "input and recomputes the block in the backward; selective recomputes the "
                        "attention core. Under --autosp refused: SAC decides (--sac-memory-target-gb)")
    g.add_argument("--recompute-method", choices=["uniform", "block"], default="uniform",
                   help="with full: uniform checkpoints groups of --recompute-num-layers blocks; "
                        "block checkpoints only the first --recompute-num-layers blocks")
    g.add_argument("--recompute-num-layers", type=_positive_int, default=1,
                   help="blocks per checkpoint (uniform) or blocks checkpointed (block)")
    g.add_argument("--chunked-loss", action="store_true",
                   help="output projection + cross entropy as one op over token chunks: the "
                        "[tokens, vocab] logits never exist (SAC does this under --autosp)")
    g.add_argument("--tiled-mlp", action="store_true",
                   help="run each block's MLP over sequence chunks, each recomputed in the backward "
                        "(ALST's tiled MLP; SAC's sequence tiling does this under --autosp)")
    g.add_argument("--tiled-mlp-chunk-tokens", type=_nonneg_int, default=0,
                   help="tokens per --tiled-mlp chunk (0: the hidden size, ALST's choice)")
    g.add_argument("--cpu-offloading", action="store_true",
                   help="with --recompute-granularity full: keep the checkpointed block inputs in "
                        "pinned host memory, prefetched one block ahead in the backward (eager "
                        "only; --offload-activations under --autosp)")
    g.add_argument("--cpu-offloading-num-layers", type=_nonneg_int, default=0,
                   help="offload the inputs of the first N checkpoints only (0: all)")

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
    g.add_argument("--reset-attention-mask", action="store_true",
                   help="attention only within each document of a packed sample (causal inside "
                        "it); documents end at the end-of-document token")
    g.add_argument("--num-workers", type=_nonneg_int, default=0, help="background data loader workers")

    g = p.add_argument_group("checkpointing")
    g.add_argument("--save", help="directory to write checkpoints to (DIR/iter_NNNNNNN plus a `latest` tracker)")
    g.add_argument("--load", help="directory to resume from (the iteration in its `latest` tracker)")
    g.add_argument("--save-interval", type=_positive_int, help="save every N iterations (and at the end)")
    g.add_argument("--ckpt-format", choices=["torch", "torch_dist"],
                   help="torch: one file written by rank 0; torch_dist: every rank writes its shards "
                        "(torch.distributed.checkpoint), loadable at another world size or dp x sp "
                        "split (default: torch_dist with a sharding flag, else torch)")
    g.add_argument("--async-save", action="store_true",
                   help="write torch_dist checkpoints in the background while training goes on")

    g = p.add_argument_group("sharded model state (docs/fsdp.md)")
    g.add_argument("--use-torch-fsdp2", action="store_true",
                   help="shard parameters, gradients and optimizer states over all dp x sp ranks "
                        "(PyTorch FSDP2; gathered inside the compiled graph with --autosp)")
    g.add_argument("--use-distributed-optimizer", action="store_true",
                   help="keep parameters whole, shard gradients and optimizer states (ZeRO-1/2)")

    g = p.add_argument_group("evaluation and logging")
    g.add_argument("--eval-interval", type=_positive_int, default=1000, help="evaluate on the validation split every N iterations")
    g.add_argument("--eval-iters", type=_nonneg_int, default=10, help="global batches per evaluation (0 disables)")
    g.add_argument("--log-interval", type=_positive_int, default=10, help="log every N iterations")
    g.add_argument("--metrics-file", help="append one JSON object per logged iteration to this file")
    g.add_argument("--wandb-project", help="log to Weights & Biases under this project (offline unless an account is configured)")
    g.add_argument("--wandb-exp-name", help="W&B run name")
    g.add_argument("--wandb-save-dir", metavar="DIR",
                   help="W&B writes its run folders into DIR/wandb/ (e.g. DIR/wandb/offline-run-*; "
                        "default DIR: the current directory)")
    g.add_argument("--distributed-backend", choices=["nccl", "gloo"],
                   help="torch.distributed backend (default: nccl on CUDA, gloo on CPU)")
    g.add_argument("--distributed-timeout-minutes", type=float, default=30,
                   help="how long a collective waits for a rank that does not arrive (fractions "
                        "of a minute allowed) before the job ends with one line naming the "
                        "collective and the rank (docs/training.md, \"Restarts\")")
    g.add_argument("--debug", action="store_true",
                   help="print the Python traceback with an error (also: AUTOSP_LM_DEBUG=1); without "
                        "it an error is one line")
    add_checkpoint_import_args(p)
    return p


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.recipe:  # its flags become the defaults: the ones given win
        from .recipe_flags import apply_recipe
        args = apply_recipe(parser, argv, args)
    return args
