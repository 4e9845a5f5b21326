#!/usr/bin/env python
"""Activation memory per rank of the hand-written Ulysses and Ring baselines.

For each strategy and sequence-parallel size P, spawns P gloo processes (CPU) that run one forward
of the strategy on the same full-length batch and count the bytes saved for backward on their
rank through ``torch.autograd.graph.saved_tensors_hooks``, once per storage (deduplicated by
``untyped_storage().data_ptr()``), the model's parameters excluded. Prints bytes per rank and per
local token (``B * S / P``); an O(S/P)-memory strategy keeps bytes/token constant as P grows.

    python tools/measure_activation_memory.py --model llama-tiny --seq-length 2048 --sp 1 2 4
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from autosp_lm.config.cli import RawDescriptionHelpFormatter  # noqa: E402
from autosp_lm.config.shared_flags import add_model, add_seq_length  # noqa: E402


def _measure(rank, world, args):
    from autosp_lm.models import build_model, preset_config
    from autosp_lm.parallel import init_parallel
    from autosp_lm.strategies import build_strategy
    from autosp_lm.training.memory import SavedTensorBytes

    ps = init_parallel(sp_size=world, device="cpu")
    torch.manual_seed(0)
    model = build_model(preset_config(args["model"]))
    strategy = build_strategy(args["strategy"], ps)
    strategy.setup(model)
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, model.config.vocab_size, (args["batch"], args["seq"] + 1),
                           generator=g)
    batch = {"input_ids": tokens[:, :-1], "labels": tokens[:, 1:]}
    with SavedTensorBytes(exclude=model) as m:
        loss, _ = strategy.forward_loss(batch)
    loss.backward()
    return m.bytes, m.count


def measure(strategy: str, sp: int, model: str, seq: int, batch: int, threads: int = 1):
    """Per-rank ``(saved bytes, storages)`` of one forward of ``strategy`` on ``sp`` ranks."""
    from autosp_lm.parallel.spawn import run_local
    args = dict(strategy=strategy, model=model, seq=seq, batch=batch)
    return run_local(_measure, sp, args, timeout=900, threads=threads)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=RawDescriptionHelpFormatter)
    add_model(p, "llama-tiny", help="model preset")
    add_seq_length(p, 2048, help="global sequence length")
    p.add_argument("--micro-batch-size", type=int, default=1, help="samples per forward")
    p.add_argument("--sp", type=int, nargs="+", default=[1, 2, 4], help="sequence-parallel sizes")
    p.add_argument("--strategies", nargs="+", default=["ulysses", "ring"], help="baselines to measure")
    p.add_argument("--threads", type=int, default=1, help="torch threads per process")
    args = p.parse_args(argv)

    print(f"bytes saved for backward per rank (parameters excluded), {args.model}, "
          f"seq {args.seq_length}, micro batch {args.micro_batch_size}\n")
    print("| strategy | P | local tokens | bytes/rank (max) | bytes per local token | vs P=1 |")
    print("|---|---|---|---|---|---|")
    for strategy in args.strategies:
        base = None
        for sp in args.sp:
            per_rank = measure(strategy, sp, args.model, args.seq_length, args.micro_batch_size,
                               args.threads)
            worst = max(b for b, _ in per_rank)
            tokens = args.micro_batch_size * args.seq_length // sp
            per_token = worst / tokens
            base = base or per_token
            print(f"| {strategy} | {sp} | {tokens} | {worst:,} | {per_token:,.0f} | "
                  f"{per_token / base:.3f} |", flush=True)


if __name__ == "__main__":
    main()
