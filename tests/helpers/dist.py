"""Run a test function on N CPU processes with the gloo backend (see autosp_lm.parallel.spawn)."""
from __future__ import annotations

from autosp_lm.parallel.spawn import free_port, run_local


def run_distributed(fn, world_size: int, *args, timeout: float = 600):
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` gloo processes (one thread each);
    return the results by rank. Any rank's exception fails the call with its traceback."""
    return run_local(fn, world_size, *args, timeout=timeout, threads=1)


__all__ = ["run_distributed", "free_port"]
