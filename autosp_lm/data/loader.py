"""Micro-batch loader: the contract between datasets and every training strategy.

A dataset is map-style: ``len(ds)`` samples, ``ds[i]`` a dict of LongTensors of length
``seq_length``: ``input_ids``, ``labels`` (aligned with the inputs, ``-100`` = ignored) and
``position_ids``. The loader hands each rank its micro batches ``[micro_batch_size, seq_length]``:

* every rank of one sequence-parallel group receives the *same full-length* batch (the strategy
  slices its own share);
* data-parallel ranks receive different samples: within one global batch, micro batch ``a`` of
  data-parallel rank ``d`` holds samples ``start + (a * dp + d) * mbs + [0, mbs)`` (Megatron's
  order), so the union over ranks and accumulation steps is exactly the global batch whatever the
  data-parallel size;
* the order is a pure function of ``consumed_samples`` so a resumed run continues exactly.
"""
from __future__ import annotations

import signal
from typing import Iterator

import torch


class MicroBatchSampler:
    """Yields index lists for one data-parallel rank, starting after ``consumed_samples``."""

    def __init__(self, total_samples: int, consumed_samples: int, micro_batch_size: int,
                 dp_rank: int, dp_size: int, global_batch_size: int):
        if global_batch_size % (micro_batch_size * dp_size):
            raise ValueError(f"global batch {global_batch_size} is not divisible by micro batch "
                             f"{micro_batch_size} x data-parallel size {dp_size}")
        self.total = total_samples
        self.consumed = consumed_samples
        self.mbs = micro_batch_size
        self.dp_rank = dp_rank
        self.dp_size = dp_size
        self.gbs = global_batch_size

    def __iter__(self) -> Iterator[list[int]]:
        start = self.consumed
        per_step = self.mbs * self.dp_size
        while start + self.gbs <= self.total:
            for a in range(self.gbs // per_step):
                first = start + a * per_step + self.dp_rank * self.mbs
                yield list(range(first, first + self.mbs))
            start += self.gbs

    def __len__(self):
        return max(0, (self.total - self.consumed) // self.gbs) * (self.gbs // (self.mbs * self.dp_size))


def _ignore_sigterm(worker_id: int) -> None:
    """Loader workers leave SIGTERM to the training process: a preemption signal sent to the
    whole process group (torchrun's shutdown, Slurm) must not kill them before the checkpoint is
    saved. They still exit with the training process."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)


def build_loader(dataset, *, micro_batch_size: int, global_batch_size: int, dp_rank: int,
                 dp_size: int, consumed_samples: int = 0, num_workers: int = 0):
    """A ``torch.utils.data.DataLoader`` over this rank's micro batches."""
    sampler = MicroBatchSampler(len(dataset), consumed_samples, micro_batch_size, dp_rank, dp_size,
                                global_batch_size)
    return torch.utils.data.DataLoader(dataset, batch_sampler=sampler, num_workers=num_workers,
                                       pin_memory=False, persistent_workers=num_workers > 0,
                                       worker_init_fn=_ignore_sigterm if num_workers > 0 else None)
