"""``--use-torch-fsdp2``: parameters, gradients and optimizer states sharded over all W ranks.

Two implementations of one layout (every parameter a ``Shard(0)`` DTensor over the flat mesh of
all dp x sp ranks), chosen by the strategy (:attr:`Strategy.needs_full_graph`):

* :class:`FSDP2Sharding` -- PyTorch FSDP2 itself: ``fully_shard`` on every block of the model's
  block list (the children of its largest ``nn.ModuleList``), on each embedding and linear layer
  outside the blocks that shares no weight (the vocabulary matrices: so the root does not hold
  them unsharded through the whole step), then on the root (the rest: final norm, tied weights).
  For the strategies whose module hooks can run: none (eager, ``--compile``, ``--compile --sac``:
  graph breaks at the units), ``--ulysses``, ``--ring``.
* :class:`GraphFSDPSharding` -- the gathers inside the model's graph (:mod:`.fsdp_graph`), for
  ``--autosp``, which compiles the whole model as one graph.

**Gradient contract.** FSDP2 divides the reduce-scattered gradient by the mesh size W; the
contract (sum over SP, mean over DP) needs a division by dp. Every unit gets
``set_gradient_divide_factor(dp)`` (the setting is per unit, not recursive). NCCL then reduces
with ``PREMUL_SUM(1/dp)``; gloo has no PREMUL_SUM, so there the units also get
``set_force_sum_reduction_for_comms(True)`` (SUM, then a separate division).

**bf16** (``--bf16``, Megatron-style, :mod:`.precision`): every unit gathers bf16 parameters
(``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)``, the embeddings' too, so the
residual stream is bf16); the sharded fp32 parameters are the main parameters. With
``--fp32-residual-connection`` only the units of blocks and linear layers gather in bf16 and no
unit casts its inputs (``cast_forward_inputs=False``: the residual stream keeps autocast's fp32);
units holding an embedding keep the master dtype; the norm weights inside the blocks are then
used in bf16, the one difference from the unsharded run.

**Tied embeddings** stay in the root unit; after wrapping, every tie is checked (torch 2.11's
``fully_shard`` unties a shared weight silently when its modules land in different units).
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn as nn

from .fsdp_graph import graph_fully_shard, graph_shard_info
from .sharding import Sharding, check_ties, tied_groups


def block_list(model: nn.Module) -> Optional[nn.ModuleList]:
    """The model's list of transformer blocks: its largest ``nn.ModuleList`` (by parameters)."""
    best, size = None, 0
    for m in model.modules():
        if isinstance(m, nn.ModuleList) and len(m) > 0:
            n = sum(p.numel() for p in m.parameters())
            if n > size:
                best, size = m, n
    return best


class _ShardedBase(Sharding):
    flag = "--use-torch-fsdp2"

    @property
    def mesh(self):
        return self.ps.shard_mesh

    def reduce_gradients(self) -> None:
        """Nothing left: the backward reduce-scattered every gradient (sum over W, / dp)."""


class FSDP2Sharding(_ShardedBase):
    """Native FSDP2 (``torch.distributed.fsdp.fully_shard``)."""

    kind = "fsdp2"

    def __init__(self, ps, *, bf16: bool = False, fp32_residual: bool = False):
        super().__init__(ps, bf16=bf16, fp32_residual=fp32_residual)
        self.units: list = []

    def _policy(self, module_or_modules, low_precision: bool):
        from torch.distributed.fsdp import MixedPrecisionPolicy
        # Megatron-style bf16: every unit computes in bf16 (the embedding's output, so the
        # residual stream, is bf16); the sharded fp32 parameters are the main parameters
        if not (self.bf16 and (low_precision or self.bf16_params)):
            return MixedPrecisionPolicy()
        return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32,
                                    cast_forward_inputs=False)

    def wrap(self, model: nn.Module) -> nn.Module:
        from torch.distributed.fsdp import fully_shard

        self.model = model
        ties = tied_groups(model)
        shared = {n for g in ties for n in g}
        blocks = block_list(model)
        in_blocks = {id(m) for m in blocks.modules()} if blocks is not None else set()

        def shard(mod, low):
            self.units.append(fully_shard(mod, mesh=self.mesh, mp_policy=self._policy(mod, low),
                                          reshard_after_forward=True))

        if blocks is not None:
            for block in blocks:
                shard(block, True)
        for name, mod in model.named_modules():
            if id(mod) in in_blocks or mod is model:
                continue
            own = [f"{name}.{n}" for n, _ in mod.named_parameters(recurse=False)]
            if not own or any(n in shared for n in own) or list(mod.children()):
                continue
            if isinstance(mod, nn.Embedding):
                shard(mod, False)
            elif isinstance(mod, nn.Linear):
                shard(mod, True)
        # the root: the rest (final norm, tied weights); an embedding among them keeps the
        # master dtype
        taken = {id(p) for unit in self.units for p in unit.parameters()}
        owners = [m for m in model.modules()
                  if any(id(p) not in taken for p in m.parameters(recurse=False))]
        root_low = not ties and all(isinstance(m, nn.Linear) for m in owners)
        shard(model, root_low)
        check_ties(model, ties, "fully_shard")
        dp, world = self.ps.dp_size, self.ps.world_size
        gloo = self.ps.backend == "gloo"
        for unit in self.units:
            if dp != world:
                unit.set_gradient_divide_factor(float(dp))
                if gloo:  # gloo has no PREMUL_SUM: SUM, then divide
                    unit.set_force_sum_reduction_for_comms(True)
        return model

    def set_grad_sync(self, enabled: bool) -> None:
        """Skip the reduce-scatter of all but the last micro batch (gradients then stay whole
        until it: less communication, more memory). Not used by default."""
        for unit in self.units:
            unit.set_requires_gradient_sync(enabled, recurse=False)

    def describe(self) -> str:
        mp = ("bf16 compute (every unit) / fp32 reduce" if self.bf16_params
              else "bf16 compute / fp32 reduce" if self.bf16 else "fp32")
        return (f"PyTorch FSDP2, {len(self.units)} units (blocks, vocabulary layers, root) over "
                f"{self.ps.world_size} ranks (dp {self.ps.dp_size} x sp {self.ps.sp_size}), {mp}")


class GraphFSDPSharding(_ShardedBase):
    """The same layout, gathered inside the compiled graph (:mod:`.fsdp_graph`)."""

    kind = "graph_fsdp"

    def wrap(self, model: nn.Module) -> nn.Module:
        self.model = model
        ties = tied_groups(model)
        graph_fully_shard(model, self.mesh, dp=self.ps.dp_size,
                          param_dtype=torch.bfloat16 if self.bf16 else None,
                          reduce_dtype=torch.float32 if self.bf16 else None,
                          every_parameter=self.bf16_params)
        check_ties(model, ties, "graph FSDP")
        return model

    def describe(self) -> str:
        info = graph_shard_info(self.model)
        which = "every parameter" if self.bf16_params else "the ones autocast casts"
        mp = (f"{info.low_precision} of {info.parameters} parameters gathered in bf16 ({which}), "
              f"reduced in fp32" if self.bf16 else "fp32")
        return (f"graph FSDP: {info.parameters} parameters sharded over {info.world} ranks "
                f"(dp {self.ps.dp_size} x sp {self.ps.sp_size}), gathered in the compiled graph "
                f"and re-gathered in the backward, {mp}")


__all__ = ["FSDP2Sharding", "GraphFSDPSharding", "block_list"]
