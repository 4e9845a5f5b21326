"""Sharded checkpoints (``--ckpt-format torch_dist``) with ``torch.distributed.checkpoint`` (DCP).

Every rank writes its own shards of ``{"model": ..., "optim": ...}`` as returned by
``torch.distributed.checkpoint.state_dict.get_state_dict``: parameters and optimizer states
keyed by parameter FQN, their values ``Shard(0)`` DTensors in the sharded modes and plain tensors
without sharding. DCP's ``.metadata`` (written last, by the coordinator) records the global
shape of every tensor and where each piece lies, so a checkpoint loads into any world size, any
dp x sp split and any mode (FSDP2, graph FSDP, distributed optimizer, none): ``dcp.load``
reads, for each tensor this rank holds, exactly the rows it owns now.

:func:`verify` checks, before any read, that every file ``.metadata`` names exists and is long
enough, so a partial checkpoint is an error naming the missing shard instead of a failure deep in
a collective. The orchestration (temporary directory, rename, tracker, RNG, scheduler) is
:mod:`.checkpoint`'s.
"""
from __future__ import annotations

import os
import warnings
from typing import Optional

import torch.distributed as dist

DCP_METADATA = ".metadata"


class ShardedCheckpointError(RuntimeError):
    pass


def is_dcp_checkpoint(path: str) -> bool:
    return os.path.exists(os.path.join(path, DCP_METADATA)) or any(
        n.endswith(".distcp") for n in os.listdir(path))


def state(module, optimizer) -> dict:
    """The DCP state of ``module`` and ``optimizer`` (also initialises the optimizer state,
    which a load needs as the target)."""
    from torch.distributed.checkpoint.state_dict import get_state_dict
    msd, osd = get_state_dict(module, optimizer)
    return {"model": msd, "optim": osd}


def save(path: str, module, optimizer, *, async_save: bool = False, process_group=None):
    """Write the state into directory ``path`` (collective). Returns the future of
    ``dcp.async_save`` (the state is staged to CPU memory before it returns, so training may
    go on) or None once written."""
    import torch.distributed.checkpoint as dcp
    st = state(module, optimizer)
    if async_save:
        return dcp.async_save(st, checkpoint_id=path, process_group=process_group)
    dcp.save(st, checkpoint_id=path, process_group=process_group)
    return None


def verify(path: str) -> None:
    """Raise :class:`ShardedCheckpointError` naming the first missing or truncated file."""
    meta = os.path.join(path, DCP_METADATA)
    if not os.path.exists(meta):
        raise ShardedCheckpointError(
            f"{meta} is missing: the sharded checkpoint {path} is incomplete (DCP writes it last) "
            "— point the tracker at an earlier iteration")
    from torch.distributed.checkpoint import FileSystemReader
    try:
        md = FileSystemReader(path).read_metadata()
    except Exception as e:  # truncated pickle, ...
        raise ShardedCheckpointError(f"{meta} is unreadable ({type(e).__name__}: {e}); the "
                                     "checkpoint is corrupt — point the tracker at an earlier "
                                     "iteration") from e
    need: dict = {}
    for info in (getattr(md, "storage_data", None) or {}).values():
        rel = info.relative_path
        need[rel] = max(need.get(rel, 0), int(info.offset) + int(info.length))
    for rel in sorted(need):
        f = os.path.join(path, rel)
        if not os.path.exists(f):
            raise ShardedCheckpointError(
                f"shard file {f} is missing from the sharded checkpoint {path} ({len(need)} "
                "files listed in its .metadata); restore it or point the tracker at an "
                "earlier iteration")
        size = os.path.getsize(f)
        if size < need[rel]:
            raise ShardedCheckpointError(
                f"shard file {f} is truncated ({size} of at least {need[rel]} bytes); restore it "
                "or point the tracker at an earlier iteration")


def load(path: str, module, optimizer) -> None:
    """Read the checkpoint at ``path`` into ``module`` and ``optimizer`` (collective),
    resharding to the current layout."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_state_dict
    verify(path)
    st = state(module, optimizer)
    try:
        dcp.load(st, checkpoint_id=path)
    except Exception as e:  # noqa: BLE001 - DCP wraps per-rank failures
        first = str(e).strip().splitlines()
        raise ShardedCheckpointError(f"cannot read the sharded checkpoint {path} into this model/"
                                     f"optimizer: {type(e).__name__}: "
                                     f"{' | '.join(first[:4])[:800]}") from e
    set_state_dict(module, optimizer, model_state_dict=st["model"], optim_state_dict=st["optim"])


def read_model_state(path: str, template: dict) -> dict:
    """The model tensors of the checkpoint at ``path``, whole, in one process without a process
    group (export tools). ``template``: the model's state dict (meta tensors are fine): names,
    shapes and dtypes of what to read; the optimizer state is not read."""
    import torch
    import torch.distributed.checkpoint as dcp
    verify(path)
    state = {"model": {k: torch.empty(v.shape, dtype=v.dtype) for k, v in template.items()}}
    try:
        with warnings.catch_warnings():  # "assuming the intent is to load in a single process"
            warnings.simplefilter("ignore", UserWarning)
            dcp.load(state, checkpoint_id=path, no_dist=True)
    except Exception as e:  # noqa: BLE001
        raise ShardedCheckpointError(f"cannot read the model from the sharded checkpoint {path}: "
                                     f"{type(e).__name__}: {str(e)[:600]}") from e
    return state["model"]


def full_state(module, optimizer) -> dict:
    """The whole (unsharded) state on CPU, for the single-file format with sharding (collective;
    the result is complete on every rank)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict
    opts = StateDictOptions(full_state_dict=True, cpu_offload=True)
    msd, osd = get_state_dict(module, optimizer, options=opts)
    return {"model": msd, "optim": osd}


def set_full_state(module, optimizer, model_sd: dict, optim_sd: dict) -> None:
    """Load a whole state (FQN-keyed, from :func:`full_state`) into a sharded module."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_state_dict
    set_state_dict(module, optimizer, model_state_dict=model_sd, optim_state_dict=optim_sd,
                   options=StateDictOptions(full_state_dict=True))


def checkpoint_group(backend: Optional[str]):
    """A process group for background (async) checkpoint traffic: a separate gloo group, so
    the saving thread never issues collectives on the training communicator. It has the
    default group's timeout and lives under this attempt's store prefix
    (:mod:`autosp_lm.parallel.rendezvous`)."""
    if not (dist.is_available() and dist.is_initialized()):
        return None
    from ..parallel.rendezvous import new_group
    return new_group(description="checkpoint group", backend="gloo")
