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
import socket
import sys
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


class SavedBytes:
    """Bytes saved for backward inside the block, once per storage, ``exclude`` storages skipped."""

    def __init__(self, exclude=()):
        self.exclude = {t.untyped_storage().data_ptr() for t in exclude}
        self.storages: dict[int, int] = {}

    def _pack(self, t):
        st = t.untyped_storage()
        if st.data_ptr() not in self.exclude:
            self.storages.setdefault(st.data_ptr(), st.nbytes())
        return t

    def __enter__(self):
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc):
        self._hooks.__exit__(*exc)

    @property
    def bytes(self) -> int:
        return sum(self.storages.values())


def _measure(rank, world, args, queue):
    try:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(args["port"]), RANK=str(rank),
                          WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
        torch.set_num_threads(args["threads"])
        from autosp_lm.models import build_model, preset_config
        from autosp_lm.parallel import init_parallel
        from autosp_lm.parallel.strategy import build_strategy

        if world > 1:
            dist.init_process_group("gloo", rank=rank, world_size=world)
        ps = init_parallel(sp_size=world, device="cpu")
        torch.manual_seed(0)
        model = build_model(preset_config(args["model"]))
        strategy = build_strategy(args["strategy"], ps)
        strategy.setup(model)
        g = torch.Generator().manual_seed(1)
        tokens = torch.randint(0, model.config.vocab_size, (args["batch"], args["seq"] + 1), generator=g)
        batch = {"input_ids": tokens[:, :-1], "labels": tokens[:, 1:]}
        params = list(model.parameters()) + list(model.buffers())
        with SavedBytes(exclude=params) as m:
            loss, _ = strategy.forward_loss(batch)
        loss.backward()
        queue.put((rank, "ok", (m.bytes, len(m.storages))))
    except BaseException:  # noqa: BLE001
        queue.put((rank, "error", traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def measure(strategy: str, sp: int, model: str, seq: int, batch: int, threads: int = 1):
    """Per-rank ``(saved bytes, storages)`` of one forward of ``strategy`` on ``sp`` ranks."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    args = dict(strategy=strategy, model=model, seq=seq, batch=batch, port=port, threads=threads)
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_measure, args=(r, sp, args, queue)) for r in range(sp)]
    for p in procs:
        p.start()
    results = {}
    try:
        for _ in range(sp):
            rank, status, payload = queue.get(timeout=900)
            if status != "ok":
                raise RuntimeError(f"{strategy} P={sp} rank {rank} failed:\n{payload}")
            results[rank] = payload
    finally:
        for p in procs:
            p.join(timeout=60)
            if p.is_alive():
                p.terminate()
    return [results[r] for r in range(sp)]


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="llama-tiny")
    p.add_argument("--seq-length", type=int, default=2048)
    p.add_argument("--micro-batch-size", type=int, default=1)
    p.add_argument("--sp", type=int, nargs="+", default=[1, 2, 4], help="sequence-parallel sizes")
    p.add_argument("--strategies", nargs="+", default=["ulysses", "ring"])
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
