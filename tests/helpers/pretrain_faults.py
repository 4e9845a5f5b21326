"""``pretrain.py`` with one fault injected on an attempt of a job (tests only).

Run it like pretrain.py (under torchrun, or as one rank of a hand-made launch) with:

* ``AUTOSP_FAULT``: ``kill`` (SIGKILL in the middle of an iteration: after its forward and
  backward, before the gradient reduction), ``kill-in-async-save`` (SIGKILL in the background
  thread of an ``--async-save`` checkpoint, after this rank's shard files are written and before
  the checkpoint is complete), ``stop`` (SIGSTOP at the same point as ``kill``: a hung rank);
* ``AUTOSP_FAULT_RANK``: the rank that fails (default 1);
* ``AUTOSP_FAULT_ITERATION``: the iteration (``kill``, ``stop``) or the checkpoint's iteration
  (``kill-in-async-save``).

The fault fires only where torchrun's ``TORCHELASTIC_RESTART_COUNT`` is 0 (or unset), so a
restarted attempt runs clean; with comma-separated lists in ``AUTOSP_FAULT`` and
``AUTOSP_FAULT_ITERATION`` the i-th fault fires in attempt i (restart count i), e.g.
``kill-in-async-save,kill`` and ``4,3``, and the attempt after the last runs clean. Nothing here
is part of the product: it patches two functions of this process before ``pretrain.main`` runs.
"""
import os
import signal
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import pretrain  # noqa: E402
from autosp_lm.training import trainer as trainer_mod  # noqa: E402
from autosp_lm.training.checkpoint import iter_dirname  # noqa: E402

ATTEMPT = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
_FAULTS = os.environ.get("AUTOSP_FAULT", "").split(",")
_ITERATIONS = os.environ.get("AUTOSP_FAULT_ITERATION", "0").split(",")
FAULT = _FAULTS[ATTEMPT] if ATTEMPT < len(_FAULTS) else ""  # this attempt's
RANK = int(os.environ.get("AUTOSP_FAULT_RANK", "1"))
ITERATION = int(_ITERATIONS[ATTEMPT]) if FAULT else 0
ARMED = bool(FAULT) and int(os.environ.get("RANK", "0")) == RANK
_current = {"iteration": 0}


def _fire():
    sys.stdout.flush()
    sys.stderr.flush()
    os.kill(os.getpid(), signal.SIGSTOP if FAULT == "stop" else signal.SIGKILL)


def _install():
    if not ARMED:
        return
    if FAULT in ("kill", "stop"):
        train_step, finish_step = trainer_mod.Trainer.train_step, trainer_mod.finish_step

        def tracked_train_step(self, batches):
            _current["iteration"] = self.iteration + 1
            return train_step(self, batches)

        def faulty_finish_step(*args, **kwargs):
            if _current["iteration"] == ITERATION:
                print(f"[fault] rank {RANK} (pid {os.getpid()}): {FAULT} in iteration {ITERATION}",
                      flush=True)
                _fire()
            return finish_step(*args, **kwargs)

        trainer_mod.Trainer.train_step = tracked_train_step
        trainer_mod.finish_step = faulty_finish_step
    elif FAULT == "kill-in-async-save":
        import torch.distributed.checkpoint as dcp
        real_async_save = dcp.async_save

        class DyingWriter(dcp.FileSystemWriter):
            def write_data(self, plan, planner):
                future = super().write_data(plan, planner)
                future.wait()  # this rank's shard files are on disk; the checkpoint is not complete
                print(f"[fault] rank {RANK}: killed while writing the checkpoint of iteration "
                      f"{ITERATION}", flush=True)
                _fire()
                return future

        def faulty_async_save(state_dict, *, checkpoint_id=None, **kwargs):
            if os.path.basename(str(checkpoint_id)) == f".{iter_dirname(ITERATION)}.tmp":
                kwargs["storage_writer"] = DyingWriter(checkpoint_id)
            return real_async_save(state_dict, checkpoint_id=checkpoint_id, **kwargs)

        dcp.async_save = faulty_async_save
    else:
        raise SystemExit(f"pretrain_faults.py: unknown AUTOSP_FAULT={FAULT!r}")


if __name__ == "__main__":
    _install()
    outcome = pretrain.main()
    pretrain.destroy_parallel()
    sys.exit(pretrain.exit_status(outcome))
