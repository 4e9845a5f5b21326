"""Where the model state lives: one small interface the trainer talks to, four implementations
(:mod:`.sharding_kinds` picks one; this module imports none of them).

==========================  ===================================================================
``none`` (:class:`Sharding`)  every rank holds the whole model, its gradients and optimizer
                              states; gradients all-reduced (sum over SP, mean over DP)
``fsdp2``                     ``--use-torch-fsdp2`` with PyTorch FSDP2 (``fully_shard`` per block
                              + root, :mod:`.fsdp`): for strategies whose module hooks can run
``graph_fsdp``                ``--use-torch-fsdp2`` for whole-graph compilers (``--autosp``): the
                              same sharded layout, the gathers in the graph (:mod:`.fsdp_graph`)
``distributed_optimizer``     ``--use-distributed-optimizer`` (ZeRO-1/2): parameters whole,
                              gradients reduce-scattered into sharded fp32 master shards,
                              AdamW on the shards (:mod:`.distributed_optimizer`)
==========================  ===================================================================

All sharded modes use one layout: every (master) parameter a ``Shard(0)`` DTensor over one flat
mesh of all W = dp x sp ranks (``ParallelState.shard_mesh``). SP ranks hold identical copies of
the state, so sharding over the whole dp x sp mesh divides it by W. Optimizer, clipping and
``torch.distributed.checkpoint`` code is therefore the same for every mode, and checkpoints move
between modes and world sizes.

Order of use (the trainer's): ``wrap(model)`` before ``strategy.setup(model)``; the optimizer over
``optimizer_module()``; per step ``zero_grad`` -> forward/backward -> ``reduce_gradients()`` ->
``clip_grad_norm_()`` -> ``optimizer.step()`` -> ``after_optimizer_step()``; checkpoints from
``state_dict_module()``, ``after_load()`` after restoring.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn as nn

from .grads import reduce_gradients


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """The local part of a DTensor (the tensor itself otherwise)."""
    return t.to_local() if hasattr(t, "to_local") else t


def storage_bytes(tensors) -> int:
    """Bytes of the storages behind ``tensors`` (local shards only; each storage once)."""
    seen, total = set(), 0
    for t in tensors:
        if not isinstance(t, torch.Tensor):
            continue
        loc = local_tensor(t)
        try:
            key = (loc.device, loc.untyped_storage().data_ptr())
            n = loc.untyped_storage().nbytes()
        except (RuntimeError, NotImplementedError):
            key, n = id(loc), loc.numel() * loc.element_size()
        if key in seen or n == 0:
            continue
        seen.add(key)
        total += n
    return total


def optimizer_state_bytes(optimizer) -> int:
    return storage_bytes(v for st in optimizer.state.values() for v in st.values())


def tied_groups(model: nn.Module) -> list[list[str]]:
    """FQNs that name one shared parameter (``lm_head.weight`` and the embedding's)."""
    names: dict = {}
    for n, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(n)
    return [v for v in names.values() if len(v) > 1]


def check_ties(model: nn.Module, groups: list[list[str]], what: str) -> None:
    """Raise when wrapping broke a tie (torch 2.11's FSDP2 does so silently)."""
    def get(fqn):  # through _parameters: graph FSDP's properties return gathered values
        prefix, _, leaf = fqn.rpartition(".")
        return model.get_submodule(prefix)._parameters[leaf]

    for group in groups:
        objs = {id(get(n)) for n in group}
        if len(objs) != 1:
            raise RuntimeError(f"{what} untied the shared parameter {' = '.join(group)}; keep "
                               f"the modules that share it in one FSDP unit")


class Sharding:
    """``none``: the whole state on every rank (today's data-parallel path).

    ``bf16``: Megatron-style (:mod:`.precision`): the model's parameters in bf16 for compute,
    fp32 main parameters (a shadow module under the model's FQNs) for the optimizer and the
    checkpoints, gradients accumulated and reduced in fp32. With ``fp32_residual`` the
    parameters stay fp32 and only autocast runs in bf16."""

    kind = "none"
    flag = ""

    def __init__(self, ps, *, bf16: bool = False, fp32_residual: bool = False):
        self.ps = ps
        self.bf16 = bool(bf16)
        self.fp32_residual = bool(fp32_residual)
        self.model: Optional[nn.Module] = None
        self.main: Optional[nn.Module] = None  # fp32 main parameters (bf16 parameters)
        self._pairs: list = []  # (model parameter, main parameter)
        self._hooks: list = []
        self._accumulated: dict = {}

    @property
    def bf16_params(self) -> bool:
        """True when the model computes with bf16 parameters (``--bf16`` without
        ``--fp32-residual-connection``)."""
        return self.bf16 and not self.fp32_residual

    @property
    def sharded(self) -> bool:
        """True when parameters/optimizer states are DTensor shards (needs a process group)."""
        return self.kind != "none"

    @property
    def world(self) -> int:
        return self.ps.world_size

    # -- set-up -----------------------------------------------------------------------------
    def wrap(self, model: nn.Module) -> nn.Module:
        self.model = model
        if self.bf16_params:
            from .precision import fp32_accumulator
            self.main = nn.Module()
            names: dict = {}
            for n, p in model.named_parameters(remove_duplicate=False):
                names.setdefault(id(p), (p, []))[1].append(n)
            for i, (p, fqns) in enumerate(names.values()):
                mp = nn.Parameter(p.detach().float().clone(), requires_grad=p.requires_grad)
                for fqn in fqns:  # a tied weight keeps every name (checkpoint keys = the model's)
                    set_parameter(self.main, fqn, mp)
                p.data = p.data.to(torch.bfloat16)
                self._pairs.append((p, mp))
                if p.requires_grad:
                    self._hooks.append(p.register_post_accumulate_grad_hook(
                        fp32_accumulator(self._accumulated, i, mp)))
        return model

    def optimizer_module(self) -> nn.Module:
        """The module whose parameters the optimizer steps."""
        return self.main if self.main is not None else self.model

    def state_dict_module(self) -> nn.Module:
        """The module whose state dict a checkpoint holds (keys: the model's FQNs)."""
        return self.optimizer_module()

    # -- one step -----------------------------------------------------------------------------
    def zero_grad(self, optimizer) -> None:
        optimizer.zero_grad(set_to_none=True)
        if self.optimizer_module() is not self.model:
            self.model.zero_grad(set_to_none=True)

    def reduce_gradients(self) -> None:
        """Sum over SP, mean over DP (sharded modes: reduce-scatter, or nothing left to do)."""
        reduce_gradients(self.optimizer_module().parameters(), self.ps.dp_size)

    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        """Clip the gradients of ``optimizer_module()`` to ``max_norm`` (``inf``: no clipping);
        returns the pre-clip global norm as a plain scalar tensor."""
        norm = torch.nn.utils.clip_grad_norm_(list(self.optimizer_module().parameters()),
                                              max_norm)
        return norm.full_tensor() if hasattr(norm, "full_tensor") else norm

    @torch.no_grad()
    def after_optimizer_step(self) -> None:
        for p, mp in self._pairs:  # the main parameters' new values, for compute
            p.data.copy_(mp.data)
        self._accumulated.clear()

    def after_load(self) -> None:
        self.after_optimizer_step()

    # -- figures -------------------------------------------------------------------------------
    def memory_bytes(self, optimizer=None) -> dict:
        """Bytes of parameters, gradients and optimizer states held by this rank now
        (local shards only; each storage once)."""
        mods = [self.model] + ([self.optimizer_module()]
                               if self.optimizer_module() is not self.model else [])
        params = [p for m in mods for p in m.parameters()]
        out = {"param_bytes": storage_bytes(params),
               "grad_bytes": storage_bytes(p.grad for p in params)}
        out["optimizer_bytes"] = optimizer_state_bytes(optimizer) if optimizer is not None else 0
        return out

    def expected_bytes(self) -> dict:
        """This rank's bytes at the optimizer step, from the layout (AdamW: two fp32 moments of
        every optimizer parameter), before any step has run."""
        params = [p for p in self.optimizer_module().parameters() if p.requires_grad]
        locals_ = [local_tensor(p) for p in params]
        out = self.memory_bytes()
        out["grad_bytes"] = sum(t.numel() * t.element_size() for t in locals_)
        out["optimizer_bytes"] = sum(2 * t.numel() * 4 for t in locals_)
        return out

    def describe(self) -> str:
        mp = ("; bf16 parameters for compute, fp32 main parameters, fp32 gradients"
              if self.bf16_params else "")
        return "parameters, gradients and optimizer states whole on every rank" + mp

    def report(self) -> str:
        b = self.expected_bytes()
        gib = 2 ** 30
        total = b["param_bytes"] + b["grad_bytes"] + b["optimizer_bytes"]
        return (f"model state per rank ({self.kind}: {self.describe()}): parameters "
                f"{b['param_bytes'] / gib:.3f} GiB, gradients {b['grad_bytes'] / gib:.3f} GiB, "
                f"optimizer states {b['optimizer_bytes'] / gib:.3f} GiB, total "
                f"{total / gib:.3f} GiB")


def set_parameter(root: nn.Module, fqn: str, p: nn.Parameter) -> None:
    """Register ``p`` under ``fqn`` in ``root``, making the intermediate modules."""
    *path, leaf = fqn.split(".")
    m = root
    for k in path:
        if not hasattr(m, k):
            m.add_module(k, nn.Module())
        m = getattr(m, k)
    m.register_parameter(leaf, p)


__all__ = ["Sharding", "local_tensor", "set_parameter", "storage_bytes", "optimizer_state_bytes",
           "tied_groups", "check_ties"]
