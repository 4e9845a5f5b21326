"""``--use-distributed-optimizer`` (ZeRO-1/2): parameters whole, gradients and optimizer states
sharded over all W = dp x sp ranks.

The model keeps whole parameters, so every strategy and every compiled graph runs unchanged. The
optimizer steps fp32 *main* parameters: ``Shard(0)`` DTensors over the flat mesh (the layout of
the FSDP modes), registered in a shadow module under the model's FQNs, so optimizer states,
clipping and checkpoints are the FSDP modes' (a checkpoint moves between the three modes and
across world sizes).

One step::

    backward (full gradients)  --bucketed reduce_scatter_tensor (SUM over W, then / dp)-->
    fp32 gradient shards of the main parameters (the full gradients are freed bucket by bucket)
    --> clip (global norm over the shards) --> AdamW on the shards
    --> bucketed all_gather_into_tensor back into the model's parameters

Buckets use FSDP2's copy-in layout (for each rank r, the r-th ``ceil(N/W)``-row chunk of every
parameter of the bucket, concatenated), so one collective moves a whole bucket. Summing over W
adds the SP ranks' partial gradients and the DP replicas; dividing by dp averages the replicas:
the gradient contract of every strategy.

bf16 (``--bf16``, Megatron-style, :mod:`.precision`): every parameter is held in bf16 in the model
and its gradients accumulate into fp32 buffers (a post-accumulate-grad hook per parameter) across
micro batches. With ``--fp32-residual-connection`` only the parameters that autocast casts on
every use (those owned only by ``nn.Linear`` modules) are bf16 -- the forward and backward are then
exactly those of the unsharded autocast run -- and embeddings and norms stay fp32. Master weights and
Adam moments are fp32 shards (Megatron's distributed-optimizer semantics: 6 + 12/W bytes per
parameter).
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn

from .fsdp_graph import autocast_cast_parameters
from .grads import BUCKET_BYTES
from .sharding import Sharding, set_parameter, storage_bytes

# torch 2.13 renames these (same signatures) and deprecates the old names; 2.11 has only those
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def _rows(n: int, world: int) -> int:
    return -(-n // world)


class DistributedOptimizerSharding(Sharding):
    kind = "distributed_optimizer"
    flag = "--use-distributed-optimizer"

    def __init__(self, ps, *, bf16: bool = False, fp32_residual: bool = False,
                 bucket_bytes: int = BUCKET_BYTES):
        super().__init__(ps, bf16=bf16, fp32_residual=fp32_residual)
        self.bucket_bytes = bucket_bytes
        self.main = nn.Module()
        self.params: list = []
        self.main_params: list = []
        self._acc: dict = {}  # index -> fp32 gradient accumulated from a bf16 parameter
        self._hooks: list = []

    @property
    def mesh(self):
        return self.ps.shard_mesh

    # -- set-up -----------------------------------------------------------------------------
    def wrap(self, model: nn.Module) -> nn.Module:
        from torch.distributed.tensor import Shard, distribute_tensor

        self.model = model
        names: dict = {}
        for n, p in model.named_parameters(remove_duplicate=False):
            if p.requires_grad:
                names.setdefault(id(p), (p, []))[1].append(n)
        low = ({id(p) for p in model.parameters() if p.is_floating_point()} if self.bf16_params
               else autocast_cast_parameters(model) if self.bf16 else set())
        for i, (p, fqns) in enumerate(names.values()):
            master = distribute_tensor(p.detach().float(), self.mesh, [Shard(0)])
            mp = nn.Parameter(master)
            for fqn in fqns:  # a tied weight keeps every name (checkpoint keys = the model's)
                set_parameter(self.main, fqn, mp)
            self.params.append(p)
            self.main_params.append(mp)
            if id(p) in low:
                p.data = p.data.to(torch.bfloat16)
                self._hooks.append(p.register_post_accumulate_grad_hook(self._accumulator(i)))
        self.buckets = self._make_buckets()
        return model

    def _accumulator(self, i: int):
        def hook(p):
            g = p.grad.float()
            if i in self._acc:
                self._acc[i].add_(g)
            else:
                self._acc[i] = g if g is not p.grad else g.clone()
            p.grad = None
        return hook

    def _chunk_numel(self, p) -> int:
        return _rows(p.shape[0], self.world) * (p.numel() // max(p.shape[0], 1))

    def _make_buckets(self) -> list:
        buckets, cur, size, dtype = [], [], 0, None
        for i, p in enumerate(self.params):
            n = self._chunk_numel(p) * self.world * 4
            if cur and (size + n > self.bucket_bytes or p.dtype != dtype):
                buckets.append(cur)
                cur, size = [], 0
            cur.append(i)
            size += n
            dtype = p.dtype
        if cur:
            buckets.append(cur)
        return buckets

    def optimizer_module(self) -> nn.Module:
        return self.main

    # -- one step -----------------------------------------------------------------------------
    def zero_grad(self, optimizer) -> None:
        optimizer.zero_grad(set_to_none=True)
        self.model.zero_grad(set_to_none=True)
        self._acc.clear()

    def _grad(self, i: int):
        if i in self._acc:
            return self._acc.pop(i)
        p = self.params[i]
        g = p.grad
        p.grad = None
        return g

    @torch.no_grad()
    def reduce_gradients(self) -> None:
        """Reduce-scatter (SUM over W, / dp) into the main parameters' fp32 gradient shards."""
        from torch.distributed.tensor import DTensor

        W, dev, group = self.world, self.ps.device, self.mesh.get_group()
        for bucket in self.buckets:
            per = [self._chunk_numel(self.params[i]) for i in bucket]
            total = sum(per)
            send = torch.zeros(W, total, dtype=torch.float32, device=dev)
            off = 0
            for i, n in zip(bucket, per):
                p, g = self.params[i], self._grad(i)
                if g is not None:
                    rows = _rows(p.shape[0], W)
                    flat = g.reshape(p.shape[0], -1).float()
                    padded = flat.new_zeros(W * rows, flat.shape[1])
                    padded[:p.shape[0]] = flat
                    send[:, off:off + n] = padded.view(W, n)
                    del g, flat, padded
                off += n
            out = torch.empty(total, dtype=torch.float32, device=dev)
            _reduce_scatter(out, send.view(-1), group=group)
            del send
            if self.ps.dp_size != 1:
                out.div_(self.ps.dp_size)
            off = 0
            for i, n in zip(bucket, per):
                mp = self.main_params[i]
                local = mp.to_local()
                grad = out[off:off + local.numel()].view_as(local).clone()
                mp.grad = DTensor.from_local(grad, self.mesh, mp.placements, shape=mp.shape,
                                             stride=mp.stride(), run_check=False)
                off += n

    @torch.no_grad()
    def gather_parameters(self) -> None:
        """All-gather the main shards into the model's whole parameters (in their dtype)."""
        W, dev, group = self.world, self.ps.device, self.mesh.get_group()
        for bucket in self.buckets:
            dtype = self.params[bucket[0]].dtype
            per = [self._chunk_numel(self.params[i]) for i in bucket]
            total = sum(per)
            mine = torch.zeros(total, dtype=dtype, device=dev)
            off = 0
            for i, n in zip(bucket, per):
                local = self.main_params[i].to_local().reshape(-1)
                mine[off:off + local.numel()] = local.to(dtype)
                off += n
            everything = torch.empty(W * total, dtype=dtype, device=dev)
            _all_gather(everything, mine, group=group)
            view = everything.view(W, total)
            off = 0
            for i, n in zip(bucket, per):
                p = self.params[i]
                rows = _rows(p.shape[0], W)
                full = view[:, off:off + n].reshape(W * rows, -1)[:p.shape[0]]
                p.data.copy_(full.reshape(p.shape))
                off += n

    def after_optimizer_step(self) -> None:
        self.gather_parameters()

    def after_load(self) -> None:
        self.gather_parameters()

    # -- figures -------------------------------------------------------------------------------
    def memory_bytes(self, optimizer=None) -> dict:
        out = super().memory_bytes(optimizer)
        out["grad_bytes"] += storage_bytes(self._acc.values())
        return out

    def expected_bytes(self) -> dict:
        out = self.memory_bytes()
        full = sum(p.numel() * 4 for p in self.params)  # fp32 gradients during the backward
        shards = sum(mp.to_local().numel() for mp in self.main_params)
        out["grad_bytes"] = full + shards * 4
        out["optimizer_bytes"] = 2 * shards * 4
        return out

    def describe(self) -> str:
        kind = ("bf16" if self.bf16_params else
                "bf16 linear weights, fp32 others" if self.bf16 else "fp32")
        return (f"distributed optimizer over {self.world} ranks (dp {self.ps.dp_size} x sp "
                f"{self.ps.sp_size}): parameters whole ({kind}), fp32 master shards and Adam "
                f"states sharded, gradients reduce-scattered in {len(self.buckets)} buckets "
                f"(whole fp32 gradients exist during the backward)")


__all__ = ["DistributedOptimizerSharding"]
