"""Graph FSDP: fully sharded parameters whose all-gathers are ops of the model's own graph.

FSDP2's per-module hooks cannot run inside one whole-model graph (torch 2.13 wraps every one in
``torch._dynamo.disable``; Traceable FSDP2 is gone), so for the whole-graph compilers (``--autosp``)
the gather happens *in the forward*, where Dynamo and AOTAutograd see it:

* **storage**: every parameter is replaced, once per parameter object (a tied weight stays one
  parameter), by ``nn.Parameter(distribute_tensor(p, mesh, [Shard(0)]))`` over the flat mesh of
  all dp x sp ranks: the layout ``fully_shard`` registers (``torch.chunk`` rows), so the optimizer,
  clipping and DCP checkpoints are those of native FSDP2 and checkpoints move between the two.
* **reads**: each module's class is swapped for a cached subclass with one ``property`` per
  parameter name, returning :func:`gather_parameter` of the local shard. ``state_dict`` keys and
  ``named_parameters`` are unchanged (they read ``_parameters``).
* **the gather** (:class:`_GatherParameter`, an ``autograd.Function`` over the
  ``_c10d_functional`` ops, which Inductor can issue early and bucket): cast the local rows to the
  gather dtype, pad to ``ceil(N/W)`` rows, ``all_gather_into_tensor`` + ``wait_tensor``, drop the
  padding. Backward: cast the gradient to the reduce dtype, pad, ``reduce_scatter_tensor`` (sum
  over all W ranks) + ``wait_tensor``, divide by dp, keep this rank's rows, cast to the master
  dtype. Summing over W adds the SP ranks' partial gradients and the DP replicas; dividing by dp
  averages the replicas: the gradient contract of every strategy.

The compiler recognises these gathers by op and provenance (an all-gather derived from exactly one
parameter input) and tags them to be re-gathered in the backward (FSDP's reshard after forward;
``compiler/passes/tag_param_gathers.py``). In eager mode autograd keeps every gathered weight until
its backward, so eager strategies use native FSDP2 (:mod:`.fsdp`) instead.

bf16 (``--bf16``): parameters that autocast casts to bf16 anyway -- those owned only by
``nn.Linear`` modules -- are gathered in bf16 (the same rounding autocast applies, so results are
those of the unsharded bf16 run, at half the traffic); the others (embeddings, norms) in their
master dtype. Gradients are reduced in fp32.
"""
from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn as nn

_CLASSES: dict = {}
MARK = "_autosp_graph_fsdp"


def _rows(n: int, world: int) -> int:
    return -(-n // world)


def _pad_rows(x: torch.Tensor, rows: int) -> torch.Tensor:
    if x.shape[0] == rows:
        return x
    return torch.cat([x, x.new_zeros((rows - x.shape[0],) + tuple(x.shape[1:]))])


class _GatherParameter(torch.autograd.Function):
    """Forward: the whole parameter from this rank's rows; backward: the reduce-scatter."""

    @staticmethod
    def forward(ctx, local, dim0: int, group: str, world: int, dp: int,
                gather_dtype: Optional[torch.dtype], reduce_dtype: Optional[torch.dtype]):
        ctx.meta = (local.shape[0], local.dtype, group, world, dp, reduce_dtype)
        rows = _rows(dim0, world)
        x = local if gather_dtype is None else local.to(gather_dtype)
        x = _pad_rows(x, rows).contiguous()
        out = torch.ops._c10d_functional.all_gather_into_tensor(x, world, group)
        out = torch.ops._c10d_functional.wait_tensor(out)
        return out if rows * world == dim0 else out[:dim0]

    @staticmethod
    def backward(ctx, grad):
        local_rows, master_dtype, group, world, dp, reduce_dtype = ctx.meta
        dim0 = grad.shape[0]
        rows = _rows(dim0, world)
        g = grad if reduce_dtype is None else grad.to(reduce_dtype)
        g = _pad_rows(g, rows * world).contiguous()
        out = torch.ops._c10d_functional.reduce_scatter_tensor(g, "sum", world, group)
        out = torch.ops._c10d_functional.wait_tensor(out)
        if dp != 1:
            out = out / dp
        if local_rows != rows:
            out = out[:local_rows]
        return out.to(master_dtype), None, None, None, None, None, None


@dataclass(frozen=True)
class GatherConfig:
    """How one parameter is gathered: the group (by name), its size, dp, the dtypes."""

    group: str
    world: int
    dp: int
    gather_dtype: Optional[torch.dtype] = None
    reduce_dtype: Optional[torch.dtype] = None


def gather_parameter(p: torch.Tensor, cfg: GatherConfig) -> torch.Tensor:
    """The whole value of the sharded parameter ``p`` (a ``Shard(0)`` DTensor)."""
    return _GatherParameter.apply(p.to_local(), p.shape[0], cfg.group, cfg.world, cfg.dp,
                                  cfg.gather_dtype, cfg.reduce_dtype)


def _swap_class(module: nn.Module, configs: dict) -> None:
    key = (module.__class__, tuple(sorted((n, c) for n, c in configs.items())))
    cls = _CLASSES.get(key)
    if cls is None:
        props = {n: property(lambda self, n=n, c=c: gather_parameter(self._parameters[n], c))
                 for n, c in configs.items()}
        cls = type(f"GraphFSDP{module.__class__.__name__}", (module.__class__,), props)
        cls.__module__ = __name__
        # a module-level name so the class can be found again (pickle, repr); unique per key
        cls.__qualname__ = cls.__name__ = f"{cls.__name__}_{len(_CLASSES)}"
        setattr(sys.modules[__name__], cls.__name__, cls)
        _CLASSES[key] = cls
    module.__class__ = cls


def autocast_cast_parameters(model: nn.Module) -> set:
    """ids of the parameters autocast casts to the low-precision dtype on every use: those owned
    only by ``nn.Linear`` modules (weights and biases of ``F.linear``). A parameter also held by
    another module (a tied embedding) is not in the set."""
    owners: dict = {}
    for mod in model.modules():
        for _, p in mod.named_parameters(recurse=False):
            owners.setdefault(id(p), set()).add(isinstance(mod, nn.Linear))
    return {pid for pid, kinds in owners.items() if kinds == {True}}


@dataclass
class GraphShardInfo:
    mesh: object
    dp: int
    world: int
    gather_dtype: Optional[torch.dtype]
    parameters: int  # distinct parameters
    low_precision: int  # of which gathered in gather_dtype


def graph_fully_shard(model: nn.Module, mesh, *, dp: int,
                      param_dtype: Optional[torch.dtype] = None,
                      reduce_dtype: Optional[torch.dtype] = None,
                      every_parameter: bool = False) -> nn.Module:
    """Shard every parameter of ``model`` on dim 0 over the 1-D ``mesh``; gather on each read.

    ``dp``: the data-parallel size the reduce-scattered gradient is divided by. ``param_dtype``
    (e.g. bf16): the gather dtype of the parameters autocast casts anyway
    (:func:`autocast_cast_parameters`), or of every parameter with ``every_parameter``
    (Megatron-style bf16: the sharded fp32 parameters are the main parameters);
    ``reduce_dtype``: the dtype of the reduce-scatter."""
    from torch.distributed.tensor import Shard, distribute_tensor

    if getattr(model, MARK, None) is not None:
        raise RuntimeError("graph_fully_shard: the model is already sharded")
    group = mesh.get_group()
    world = mesh.size()
    low = (set() if param_dtype is None else
           {id(p) for p in model.parameters() if p.is_floating_point()} if every_parameter
           else autocast_cast_parameters(model))
    converted: dict = {}  # id(original Parameter) -> sharded Parameter (keeps ties)
    n_low = 0
    for mod in list(model.modules()):
        configs = {}
        for name, p in list(mod._parameters.items()):
            if p is None:
                continue
            if id(p) not in converted:
                if p.dim() == 0:
                    raise ValueError(f"graph FSDP shards parameters along dim 0; {name} of "
                                     f"{type(mod).__name__} is a scalar: make it a 1-element "
                                     f"tensor")
                sharded = distribute_tensor(p.detach(), mesh, [Shard(0)])
                converted[id(p)] = (nn.Parameter(sharded, requires_grad=p.requires_grad), id(p))
                n_low += id(p) in low
            q, pid = converted[id(p)]
            mod._parameters[name] = q
            configs[name] = GatherConfig(group.group_name, world, dp,
                                         param_dtype if pid in low else None,
                                         reduce_dtype if pid in low else None)
        if configs:
            _swap_class(mod, configs)
    setattr(model, MARK, GraphShardInfo(mesh, dp, world, param_dtype, len(converted), n_low))
    return model


def graph_shard_info(model: nn.Module) -> Optional[GraphShardInfo]:
    """What :func:`graph_fully_shard` did to ``model`` (None when it is not graph-sharded)."""
    return getattr(model, MARK, None)


__all__ = ["graph_fully_shard", "graph_shard_info", "gather_parameter", "GatherConfig",
           "autocast_cast_parameters"]
