"""Process groups: world = data-parallel x sequence-parallel, SP groups of consecutive ranks.

With world size W and sequence-parallel size P, ranks ``[g*P, (g+1)*P)`` form SP group ``g``
(they share one full-length batch and split its sequence); ranks with the same position inside
their SP group form a data-parallel group. Consecutive SP ranks keep the all-to-all traffic on
one node when P <= GPUs per node.

With a sharding flag (``--use-torch-fsdp2``, ``--use-distributed-optimizer``) there is also
``shard_mesh``: one flat 1-D ``DeviceMesh`` over all W ranks (dimension ``dp_sp``), over which
parameters, gradients and optimizer states are sharded (SP ranks hold identical copies of them,
so the whole dp x sp mesh shares the state). One process with sharding still gets a (1-rank)
process group, so every code path is the same.
"""
from __future__ import annotations

import datetime
import os
from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.distributed as dist

from . import rendezvous
from .gloo import use_single_worker_gloo


@dataclass
class ParallelState:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    sp_size: int = 1
    sp_rank: int = 0
    dp_size: int = 1
    dp_rank: int = 0
    device: torch.device = torch.device("cpu")
    sp_group: Optional[dist.ProcessGroup] = None
    dp_group: Optional[dist.ProcessGroup] = None
    backend: Optional[str] = None
    shard_mesh: Any = None  # DeviceMesh over all ranks, with sharding
    owns_group: bool = False  # init_parallel created a 1-rank process group (destroy it after)

    @property
    def is_distributed(self) -> bool:
        return self.world_size > 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def sp_ranks(self) -> list[int]:
        first = self.rank - self.sp_rank
        return list(range(first, first + self.sp_size))

    def barrier(self) -> None:
        if dist.is_available() and dist.is_initialized():
            dist.barrier()


def layout(world_size: int, sp_size: int) -> tuple[list[list[int]], list[list[int]]]:
    """The SP groups and DP groups (lists of global ranks) for a world of ``world_size``."""
    if sp_size < 1 or world_size % sp_size:
        raise ValueError(f"world size {world_size} is not divisible by --sequence-parallel-size "
                         f"{sp_size}; launch a multiple of {sp_size} processes or change the size")
    dp_size = world_size // sp_size
    sp_groups = [list(range(g * sp_size, (g + 1) * sp_size)) for g in range(dp_size)]
    dp_groups = [list(range(r, world_size, sp_size)) for r in range(sp_size)]
    return sp_groups, dp_groups


def default_device(requested: Optional[str] = None, local_rank: int = 0) -> torch.device:
    if requested in (None, "auto"):
        requested = "cuda" if torch.cuda.is_available() else "cpu"
    if requested == "cuda":
        if not torch.cuda.is_available():
            raise ValueError("--device cuda was requested but CUDA is not available; use --device cpu")
        return torch.device("cuda", local_rank)
    return torch.device(requested)


def init_parallel(sp_size: int = 1, backend: Optional[str] = None, device: Optional[str] = None,
                  timeout_minutes: float = 30, shard_mesh: bool = False) -> ParallelState:
    """Set up process groups from the torchrun environment (or reuse an initialized default group).

    Without ``WORLD_SIZE`` in the environment and no initialized group this is a single process
    (with ``shard_mesh``: one with a 1-rank process group). ``shard_mesh``: also build the flat
    mesh of all ranks the sharded modes use (collective).
    """
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if dist.is_available() and dist.is_initialized():
        world = dist.get_world_size()
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    dev = default_device(device, local_rank)
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    sp_groups, dp_groups = layout(world, sp_size)
    use_single_worker_gloo()  # gloo's concurrent async collectives corrupted the heap (gloo.py)
    owns = False
    if world == 1 and not (dist.is_available() and dist.is_initialized()):
        if not shard_mesh:
            return ParallelState(sp_size=1, dp_size=1, device=dev)
        owns = True
        dist.init_process_group(backend=backend or ("nccl" if dev.type == "cuda" else "gloo"),
                                store=dist.HashStore(), rank=0, world_size=1,
                                device_id=dev if dev.type == "cuda" else None)
    if not dist.is_initialized():
        # this attempt's own rendezvous: a restarted job must not meet the last attempt's keys
        backend = backend or ("nccl" if dev.type == "cuda" else "gloo")
        rendezvous.init_default_group(backend, datetime.timedelta(minutes=timeout_minutes),
                                      device_id=dev if dev.type == "cuda" else None)
    rank = dist.get_rank()
    sp_group = dp_group = None
    for ranks in sp_groups:  # every rank must take part in creating every group
        g = rendezvous.new_group(ranks, "sequence-parallel group")  # the default group's timeout
        if rank in ranks:
            sp_group = g
    for ranks in dp_groups:
        g = rendezvous.new_group(ranks, "data-parallel group")
        if rank in ranks:
            dp_group = g
    mesh = None
    if shard_mesh:
        from torch.distributed.device_mesh import init_device_mesh
        mesh = init_device_mesh(dev.type, (world,), mesh_dim_names=("dp_sp",))
    return ParallelState(rank=rank, world_size=world, local_rank=local_rank, sp_size=sp_size,
                         sp_rank=rank % sp_size, dp_size=world // sp_size, dp_rank=rank // sp_size,
                         device=dev, sp_group=sp_group, dp_group=dp_group,
                         backend=dist.get_backend(), shard_mesh=mesh, owns_group=owns)


def destroy_parallel() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    rendezvous.forget()


def init_simulated_world(world: int, ranks_per_node: Optional[int] = None) -> None:
    """Make this process rank 0 of a ``world``-rank job with a fake process group (collectives
    return correctly shaped, meaningless tensors): one rank's memory and compute of a large job
    in one process (``tools/benchmark_sp.py --simulate-world-size``, the memory planner).
    ``ranks_per_node`` (default: all ``world`` on one node) is what AutoSP's plan reads as the
    node size (``LOCAL_WORLD_SIZE``): torchrun launches this process alone and would say 1, and
    the plan would give the SP group a ring where a real one-node job gets Ulysses."""
    from torch.testing._internal.distributed.fake_pg import FakeStore
    os.environ["LOCAL_WORLD_SIZE"] = str(ranks_per_node or world)
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)
