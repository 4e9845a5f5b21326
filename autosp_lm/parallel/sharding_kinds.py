"""The kinds of model-state sharding and the builder that picks an implementation.

The interface (:class:`~autosp_lm.parallel.sharding.Sharding`, the ``none`` kind) imports none of
its implementations; this module imports them all, so the builder sits above both.
"""
from __future__ import annotations

from .distributed_optimizer import DistributedOptimizerSharding
from .fsdp import FSDP2Sharding, GraphFSDPSharding
from .sharding import Sharding

IMPLEMENTATIONS = {"none": Sharding, "fsdp2": FSDP2Sharding, "graph_fsdp": GraphFSDPSharding,
                   "distributed_optimizer": DistributedOptimizerSharding}
KINDS = tuple(IMPLEMENTATIONS)


def sharding_kind(use_torch_fsdp2: bool, use_distributed_optimizer: bool,
                  full_graph: bool) -> str:
    """The implementation for the flags and the strategy (``Strategy.needs_full_graph``)."""
    if use_torch_fsdp2 and use_distributed_optimizer:
        raise ValueError("--use-torch-fsdp2 and --use-distributed-optimizer are exclusive: "
                         "FSDP2 already shards gradients and optimizer states; choose one")
    if use_torch_fsdp2:
        return "graph_fsdp" if full_graph else "fsdp2"
    if use_distributed_optimizer:
        return "distributed_optimizer"
    return "none"


def build_sharding(kind: str, ps, *, bf16: bool = False, fp32_residual: bool = False) -> Sharding:
    """A sharding of kind ``kind`` (:data:`KINDS`) on the parallel state ``ps``; ``bf16``:
    Megatron-style (bf16 parameters for compute, fp32 main parameters), or with
    ``fp32_residual`` fp32 parameters under autocast (:mod:`.precision`)."""
    if kind not in IMPLEMENTATIONS:
        raise ValueError(f"unknown sharding {kind!r}; choose one of {', '.join(KINDS)}")
    if kind != "none" and ps.shard_mesh is None:
        raise RuntimeError(f"sharding {kind!r} needs the flat mesh of all ranks: call "
                           "init_parallel(..., shard_mesh=True)")
    return IMPLEMENTATIONS[kind](ps, bf16=bf16, fp32_residual=fp32_residual)


__all__ = ["KINDS", "IMPLEMENTATIONS", "build_sharding", "sharding_kind"]
