"""Checkpoints: ``DIR/iter_NNNNNNN/`` plus a ``DIR/latest`` tracker holding the iteration.

A checkpoint holds the model, optimizer and LR-scheduler states, the iteration and consumed
samples, the run's typed configuration (``metadata.json``'s ``config``: parts as
:class:`autosp_lm.config.RunConfig` writes them; checkpoints written before it hold the flags
under ``args`` instead, and load the same) and every rank's RNG states (python, numpy, torch, cuda).
It is written into a hidden temporary directory and renamed into place only when complete; the
tracker is replaced atomically afterwards. A crash mid-save therefore leaves the previous
checkpoint as the latest. Loading verifies what it reads and raises ``CheckpointError`` naming
the file otherwise.

Two formats (``--ckpt-format``):

* ``torch``: one file, ``model_optim.pt``, written by rank 0 (the default without sharding;
  after gradient reduction every rank's copy is identical). With sharding the whole state is
  first gathered (FQN-keyed, as DCP's state dicts): for small models only.
* ``torch_dist``: :mod:`.checkpoint_dist` -- every rank writes its shards with
  ``torch.distributed.checkpoint``; loads into any world size, dp x sp split and sharding mode
  (the default with ``--use-torch-fsdp2`` / ``--use-distributed-optimizer``). With
  ``async_save`` the write runs in the background: :func:`save_checkpoint` returns a
  :class:`PendingCheckpoint` whose ``wait()`` (every rank, before the next save, at SIGTERM
  and at exit) completes it and only then renames it into place and updates the tracker.

The scheduler state, iteration and consumed samples live in ``metadata.json`` for both formats
(and also in ``model_optim.pt`` for ``torch``); the data position is the consumed samples, so a
resumed run continues with the same global batches at any data-parallel size.
"""
from __future__ import annotations

import json
import os
import random
import re
import shutil
from typing import Optional

import numpy as np
import torch

from ..parallel.state import ParallelState
from . import checkpoint_dist

TRACKER = "latest"
MODEL_FILE = "model_optim.pt"
META_FILE = "metadata.json"


class CheckpointError(RuntimeError):
    """A missing, incomplete or unreadable checkpoint; the message names the file and the fix."""


def iter_dirname(iteration: int) -> str:
    return f"iter_{iteration:07d}"


def _rng_file(rank: int) -> str:
    return f"rng_rank_{rank:05d}.pt"


def rng_state() -> dict:
    state = {"python": random.getstate(), "numpy": np.random.get_state(),
             "torch": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _fsync_dir(path: str) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _write_atomic(path: str, text: str) -> None:
    tmp = f"{path}.tmp.{os.getpid()}"
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


class PendingCheckpoint:
    """A checkpoint being written; ``wait()`` (collective) completes it and returns its path."""

    def __init__(self, finalize, future=None, iteration: int = 0):
        self._finalize, self.future, self.iteration = finalize, future, iteration
        self.path: Optional[str] = None

    def wait(self) -> str:
        if self.path is None:
            if self.future is not None:
                self.future.result()
            self.path = self._finalize()
        return self.path


def _state_module(model, sharding):
    return model if sharding is None else sharding.state_dict_module()


def save_checkpoint(save_dir: str, iteration: int, *, model, optimizer, scheduler,
                    consumed_samples: int, ps: ParallelState, run_config: dict,
                    model_config: dict, sharding=None, fmt: str = "torch",
                    async_save: bool = False, process_group=None) -> PendingCheckpoint:
    """Write checkpoint ``iteration`` under ``save_dir`` (collective: every rank calls it).
    Returns a :class:`PendingCheckpoint`; unless ``async_save`` it is complete already."""
    final = os.path.join(save_dir, iter_dirname(iteration))
    tmp = os.path.join(save_dir, f".{iter_dirname(iteration)}.tmp")
    if ps.is_main:
        os.makedirs(save_dir, exist_ok=True)
        if os.path.exists(tmp):
            shutil.rmtree(tmp)
        os.makedirs(tmp)
    ps.barrier()
    torch.save(rng_state(), os.path.join(tmp, _rng_file(ps.rank)))
    sharded = sharding is not None and sharding.sharded
    future = None
    if fmt == "torch_dist":
        future = checkpoint_dist.save(tmp, _state_module(model, sharding), optimizer,
                                      async_save=async_save, process_group=process_group)
    elif sharded:  # the whole state, gathered (FQN-keyed)
        full = checkpoint_dist.full_state(_state_module(model, sharding), optimizer)
        if ps.is_main:
            torch.save({**full, "optim_keys": "fqn", "scheduler": scheduler.state_dict(),
                        "iteration": iteration, "consumed_samples": consumed_samples},
                       os.path.join(tmp, MODEL_FILE))
    elif ps.is_main:
        # the unsharded mode's state module: the model, or its fp32 main parameters (bf16)
        torch.save({"model": _state_module(model, sharding).state_dict(),
                    "optimizer": optimizer.state_dict(),
                    "scheduler": scheduler.state_dict(), "iteration": iteration,
                    "consumed_samples": consumed_samples}, os.path.join(tmp, MODEL_FILE))
    meta = {"iteration": iteration, "consumed_samples": consumed_samples,
            "world_size": ps.world_size, "sp_size": ps.sp_size, "format": fmt,
            "param_sharding": sharding.kind if sharding is not None else "none",
            "scheduler": scheduler.state_dict(), "config": run_config,
            "model_config": model_config, "torch_version": torch.__version__}

    def finalize() -> str:
        ps.barrier()
        if ps.is_main:
            _write_atomic(os.path.join(tmp, META_FILE), json.dumps(meta, indent=1, default=str))
            _fsync_dir(tmp)
            if os.path.exists(final):  # re-saving the same iteration: replace it as a whole
                old = final + ".old"
                shutil.rmtree(old, ignore_errors=True)
                os.replace(final, old)
                os.replace(tmp, final)
                shutil.rmtree(old, ignore_errors=True)
            else:
                os.replace(tmp, final)
            _fsync_dir(save_dir)
            _write_atomic(os.path.join(save_dir, TRACKER), f"{iteration}\n")
        ps.barrier()
        return final

    pending = PendingCheckpoint(finalize, future, iteration)
    if future is None:
        pending.wait()
    return pending


def newest_complete(load_dir: str) -> Optional[str]:
    """The newest ``iter_NNNNNNN`` directory of ``load_dir`` holding its metadata (written last,
    before the rename that completes a checkpoint); None if there is none."""
    done = [n for n in os.listdir(load_dir) if re.fullmatch(r"iter_\d{7}", n)
            and os.path.exists(os.path.join(load_dir, n, META_FILE))]
    return os.path.join(load_dir, max(done)) if done else None


def find_checkpoint(load_dir: str, auto_resume: bool = False) -> Optional[str]:
    """The directory of the latest checkpoint in ``load_dir``; None when it holds none at all.

    ``auto_resume`` (``--load`` equal to ``--save``: this job wrote the directory): without a
    tracker, the newest complete checkpoint. A save renames a complete checkpoint into place and
    then writes the tracker; a job killed between the two (e.g. SIGKILL after a preemption's
    grace time) would otherwise not restart from its first checkpoint."""
    if not os.path.isdir(load_dir):
        return None
    tracker = os.path.join(load_dir, TRACKER)
    if not os.path.exists(tracker):
        if auto_resume and newest_complete(load_dir):
            return newest_complete(load_dir)
        if any(n.startswith("iter_") for n in os.listdir(load_dir)):
            raise CheckpointError(
                f"{load_dir} has checkpoint directories but no '{TRACKER}' tracker file; write the "
                f"iteration to resume from into {tracker} (e.g. `echo 100 > {tracker}`)")
        return None
    text = open(tracker).read().strip()
    try:
        iteration = int(text)
    except ValueError:
        raise CheckpointError(f"tracker {tracker} holds {text!r}, not an iteration number; write the "
                              "iteration to resume from into it") from None
    path = os.path.join(load_dir, iter_dirname(iteration))
    if not os.path.isdir(path):
        raise CheckpointError(f"tracker {tracker} names iteration {iteration} but {path} does not "
                              "exist; point the tracker at an existing iter_* directory")
    return path


def _load(path: str, weights_only: bool):
    if not os.path.exists(path):
        raise CheckpointError(f"checkpoint file {path} is missing; the checkpoint is incomplete — "
                              "point the tracker at an earlier iteration")
    try:
        return torch.load(path, map_location="cpu", weights_only=weights_only)
    except Exception as e:  # truncated zip, pickle errors, ...
        raise CheckpointError(f"checkpoint file {path} is unreadable ({type(e).__name__}: {e}); it "
                              "is probably truncated or corrupt — restore it or point the tracker "
                              "at an earlier iteration") from e


def _fqn_keyed(osd: dict, optimizer, module, where: str) -> dict:
    """An optimizer state dict keyed by parameter index (``optimizer.state_dict()`` of an
    unsharded run) keyed by FQN instead, matching the current optimizer's parameters in order
    (both come from ``param_groups`` over the same model)."""
    names = {id(p): n for n, p in module.named_parameters()}
    current = [[names[id(p)] for p in g["params"]] for g in optimizer.param_groups]
    saved = [g["params"] for g in osd["param_groups"]]
    if [len(g) for g in saved] != [len(g) for g in current]:
        raise CheckpointError(f"{where}: the optimizer groups ({[len(g) for g in saved]} "
                              f"parameters) do not match this model's "
                              f"({[len(g) for g in current]})")
    index = {i: n for gs, gc in zip(saved, current) for i, n in zip(gs, gc)}
    groups = [dict(g, params=list(c)) for g, c in zip(osd["param_groups"], current)]
    return {"state": {index[i]: v for i, v in osd["state"].items()}, "param_groups": groups}


def read_metadata(path: str, model_config: Optional[dict] = None, ignore: tuple = ()) -> dict:
    """The metadata of checkpoint directory ``path``; with ``model_config``, refuses a checkpoint
    of another model shape (fields in ``ignore`` not compared). Cheap: reads one JSON file, so it
    can run before any set-up."""
    meta_path = os.path.join(path, META_FILE)
    try:
        meta = json.load(open(meta_path))
    except FileNotFoundError:
        raise CheckpointError(f"{meta_path} is missing; {path} is not a complete checkpoint") from None
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{meta_path} is corrupt ({e})") from None
    saved_cfg = meta.get("model_config", {})
    diffs = {k: (saved_cfg.get(k), v) for k, v in (model_config or {}).items()
             if k in saved_cfg and k not in ignore and saved_cfg.get(k) != v}
    if diffs:
        text = ", ".join(f"{k}: checkpoint {a} vs now {b}" for k, (a, b) in diffs.items())
        raise CheckpointError(f"checkpoint {path} was saved with a different model shape ({text}); "
                              "use the same model flags to resume")
    return meta


def load_checkpoint(path: str, *, model, optimizer, scheduler, ps: ParallelState,
                    model_config: dict, sharding=None) -> dict:
    """Restore everything from checkpoint directory ``path``; returns its metadata. Either
    format loads into any run; ``torch_dist`` ones reshard to the current world and mode."""
    meta = read_metadata(path, model_config)
    module = _state_module(model, sharding)
    sharded = sharding is not None and sharding.sharded
    if meta.get("format") == "torch_dist" or not os.path.exists(os.path.join(path, MODEL_FILE)) \
            and checkpoint_dist.is_dcp_checkpoint(path):
        try:
            checkpoint_dist.load(path, module, optimizer)
        except checkpoint_dist.ShardedCheckpointError as e:
            raise CheckpointError(str(e)) from e
        info = {"iteration": meta["iteration"], "consumed_samples": meta["consumed_samples"]}
        scheduler_state = meta["scheduler"]
    else:
        where = os.path.join(path, MODEL_FILE)
        state = _load(where, weights_only=True)
        try:
            if state.get("optim_keys") == "fqn":
                checkpoint_dist.set_full_state(module, optimizer, state["model"], state["optim"])
            elif sharded:  # written without sharding: whole tensors, optimizer by index
                checkpoint_dist.set_full_state(module, optimizer, state["model"],
                                               _fqn_keyed(state["optimizer"], optimizer,
                                                          module, where))
            else:
                module.load_state_dict(state["model"])
                optimizer.load_state_dict(state["optimizer"])
        except (RuntimeError, ValueError, KeyError) as e:
            raise CheckpointError(f"cannot restore {where} into this model/optimizer: {e}") from e
        info = {"iteration": state["iteration"], "consumed_samples": state["consumed_samples"]}
        scheduler_state = state["scheduler"]
    if sharding is not None:
        sharding.after_load()
    scheduler.load_state_dict(scheduler_state)
    rng_path = os.path.join(path, _rng_file(ps.rank))
    if meta.get("world_size") == ps.world_size:
        set_rng_state(_load(rng_path, weights_only=False))
    elif ps.is_main:
        print(f"[checkpoint] saved with world size {meta.get('world_size')}, now {ps.world_size}: "
              "RNG states not restored (data order and weights are)", flush=True)
    return {**info, "meta": meta}
