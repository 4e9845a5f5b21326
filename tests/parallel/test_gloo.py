"""gloo groups run one collective at a time (autosp_lm/parallel/gloo.py).

Two asynchronous all-gathers running at once on one gloo group corrupted the heap when the ranks
reached them at different times (a 2-rank --max-context --use-torch-fsdp2 run on Inductor). Every
group our launchers create has one worker thread, and back-to-back asynchronous collectives on it,
one rank held back, still deliver every rank's data in order.
"""
from __future__ import annotations

import time

from tests.helpers.dist import run_distributed
from tests.helpers.launch import Job


def _worker(rank, world):
    import torch
    import torch.distributed as dist
    from autosp_lm.parallel.gloo import gloo_worker_threads
    from autosp_lm.parallel.state import init_parallel
    ps = init_parallel(2)  # the launchers' path: the default group exists, sp/dp groups are new
    threads = [gloo_worker_threads(), gloo_worker_threads(ps.sp_group)]
    if rank == 1:
        time.sleep(0.5)  # the other rank issues its collectives first
    name = dist.group.WORLD.group_name
    outs = [torch.ops._c10d_functional.all_gather_into_tensor(
        torch.full((n, 3), float(rank * 100 + n), dtype=torch.bfloat16), world, name)
        for n in (1, 7, 64, 5, 300, 2)]
    got = [torch.ops._c10d_functional.wait_tensor(o) for o in outs]
    ok = all(torch.equal(g, torch.cat([torch.full((n, 3), float(r * 100 + n), dtype=torch.bfloat16)
                                       for r in range(world)]))
             for g, n in zip(got, (1, 7, 64, 5, 300, 2)))
    return threads, ok


ORDER = Job("tests.parallel.test_gloo:_worker")
LAUNCH = {2: [ORDER]}  # in the session's shared launch (tests/helpers/launch.py)


def test_gloo_groups_have_one_worker_thread_and_keep_order(launch2):
    for threads, ok in launch2(ORDER):
        assert threads == [1, 1]
        assert ok


def exits_early(rank, world):
    import os
    if rank == 1:
        os._exit(3)  # dies without reporting, as a rank killed by a signal or a crash does
    return rank


def test_a_rank_that_dies_without_a_result_fails_the_launch_at_once():
    """A rank that exits without putting a result (os._exit, a segfault) fails run_local with
    its exit code within seconds, instead of leaving the launch waiting for the whole timeout
    (a shared test launch hung that way, its peers stuck in the rendezvous)."""
    import pytest
    t = time.monotonic()
    with pytest.raises(RuntimeError, match="rank 1: exited with code 3 without a result"):
        run_distributed(exits_early, 2, timeout=300)
    assert time.monotonic() - t < 60
