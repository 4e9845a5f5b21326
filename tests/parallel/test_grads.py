"""Gradient reduction (parallel/grads.py): its memory, on one process of a simulated world."""
from __future__ import annotations

import torch

from autosp_lm.planner.trace import simulated_world
from autosp_lm.parallel.grads import reduce_gradients
from autosp_lm.training.memory import LivePeak

MIB = 1 << 20


def test_reduce_gradients_holds_one_bucket_at_a_time():
    """Gradients are all-reduced in flat buckets; the next bucket is built only after the last
    one was released, so the transient is the largest bucket (what the memory planner counts),
    not two buckets side by side (3 MiB here: the code before the fix)."""
    with simulated_world(2):
        params = [torch.nn.Parameter(torch.zeros(MIB // 4)) for _ in range(3)]  # 1 MiB each
        for p in params:
            p.grad = torch.ones_like(p)
        with LivePeak() as lp:
            reduce_gradients(params, dp_size=1, bucket_bytes=2 * MIB)  # buckets of 2 and 1 MiB
        assert lp.peak == 2 * MIB and lp.end == 0
        assert all(p.grad.shape == p.shape for p in params)
