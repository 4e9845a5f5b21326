#!/usr/bin/env python
"""Pretrain a GPT or Llama model. Launch with torchrun:

    torchrun --nproc-per-node 2 pretrain.py --autosp      # sequence-parallel via the AutoSP compiler
    torchrun --nproc-per-node 2 pretrain.py --ulysses     # hand-written Ulysses baseline
    python pretrain.py --mock-data --train-iters 20       # single process

Flags: `python pretrain.py --help`. This file only wires the pieces together, and turns every
known error into one line (``pretrain.py: error: ...``) printed once, by the first rank that
failed, with a non-zero exit that does not leave the other ranks hanging (`--debug` or
``AUTOSP_LM_DEBUG=1`` adds the traceback).
"""
from __future__ import annotations

import dataclasses
import datetime
import json
import os
import random
import sys
import time
import traceback

import numpy as np
import torch

from autosp_lm.config.arguments import ArgumentError, parse_args
from autosp_lm.config.build import build_run_config
from autosp_lm.config.preflight import check_paths, check_resume
from autosp_lm.config.run_config import RunConfig
from autosp_lm.compiler import AutoSPError
from autosp_lm.data import build_data
from autosp_lm.data.indexed_dataset import IndexedDatasetError
from autosp_lm.models import build_model
from autosp_lm.parallel import destroy_parallel, health, init_parallel, rendezvous
from autosp_lm.parallel.sharding_kinds import build_sharding, sharding_kind
from autosp_lm.strategies import build_strategy
from autosp_lm.training import CheckpointError, Trainer, TrainingError, TrainResult
from autosp_lm.training.metrics import MetricsLogger
from autosp_lm.training.trainer import closing_line

EXIT_NOTHING_SAVED = 128 + 15  # stopped by SIGTERM with no --save: the shell's code for "terminated"


class DataError(RuntimeError):
    """The data or its tokenizer could not be read; the message names the file."""


KNOWN_ERRORS = (ArgumentError, AutoSPError, CheckpointError, DataError, TrainingError,
                rendezvous.RendezvousError)


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


# ------------------------------------------------------------------ errors: once, one line
def _world() -> int:
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_world_size()
    return int(os.environ.get("WORLD_SIZE", "1"))


def _first_to_fail() -> bool:
    """Whether this rank is the first of the job to fail, and so the one that reports.

    The job's key-value store decides: this attempt's own part of it once the process group is
    made (autosp_lm/parallel/rendezvous.py), else torchrun's agent store (it outlives every
    rank), else the default process group's; without either, rank 0 reports."""
    if _world() <= 1:
        return True
    key = f"autosp_lm/first_error/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"
    try:
        if rendezvous.current_store() is not None:
            store, key = rendezvous.current_store(), "first_error"
        elif os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
            store = torch.distributed.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                                               is_master=False, timeout=datetime.timedelta(seconds=10))
        elif torch.distributed.is_initialized():
            store = torch.distributed.distributed_c10d._get_default_store()
        else:
            store = None
        if store is not None:
            return store.add(key, 1) == 1
    except Exception:  # noqa: BLE001 - the store is unreachable: fall back to rank 0
        pass
    return int(os.environ.get("RANK", "0")) == 0


def _write_error_file(line: str, detail: str) -> None:
    """torchrun's per-rank error file: its failure summary then shows this line (not "To enable
    traceback see ...") as the root cause."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path:
        return
    try:
        with open(path, "w") as f:
            json.dump({"message": {"message": line, "extraInfo": {
                "py_callstack": detail, "timestamp": str(int(time.time()))}}}, f)
    except OSError:
        pass


def _exit(code: int, reported: bool):
    sys.stdout.flush()
    sys.stderr.flush()
    if _world() > 1:
        if not reported:
            time.sleep(2)  # let the launcher see the reporting rank's failure first
        os._exit(code)  # peers may be waiting in a collective: never hang in a clean shutdown
    sys.exit(code)


def report_error(line: str, code: int, debug: bool):
    """Print ``line`` (and with ``debug`` the traceback) if this rank is the first to fail; exit."""
    first = _first_to_fail()
    if first:
        if debug:
            traceback.print_exc()
        print(line, file=sys.stderr, flush=True)
        _write_error_file(line, traceback.format_exc() if debug else line)
    _exit(code, first)


def _debug_requested(argv) -> bool:
    args = sys.argv[1:] if argv is None else argv
    return "--debug" in args or os.environ.get("AUTOSP_LM_DEBUG", "") not in ("", "0")


def _message(e: BaseException) -> str:
    text = " ".join(str(e).split("\n"))  # one line, whatever the exception's layout
    if isinstance(e, DataError) and isinstance(e.__cause__, IndexedDatasetError):
        text += "; rebuild the dataset with tools/preprocess_data.py"
    return f"pretrain.py: error: {text}"


def _run(run: RunConfig) -> TrainResult:
    train, par = run.training, run.parallel
    resume_at = check_resume(run)  # before any set-up, like check_paths
    if resume_at >= train.train_iters:
        result = TrainResult(resume_at, 0, exit_reason="already-finished")
        if int(os.environ.get("RANK", "0")) == 0:
            print(closing_line(result, train), flush=True)
        return result

    ps = init_parallel(par.sequence_parallel_size, backend=par.distributed_backend,
                       device=par.device, timeout_minutes=par.distributed_timeout_minutes,
                       shard_mesh=par.sharded)
    record = run.to_dict()
    log = train.logging
    logger = MetricsLogger(enabled=ps.is_main, metrics_file=log.metrics_file,
                           wandb_project=log.wandb_project, wandb_name=log.wandb_exp_name,
                           wandb_dir=log.wandb_save_dir, config=record)
    try:
        seed_everything(run.seed)
        n_eval = train.eval_iters * train.global_batch_size
        try:
            data = build_data(run.data, (train.train_iters * train.global_batch_size, n_eval, n_eval),
                              mock_vocab_size=run.model.vocab_size or run.model.config.vocab_size,
                              rank=ps.rank, barrier=ps.barrier if ps.is_distributed else None)
        except (OSError, ValueError) as e:  # the data modules' errors name the file and the fix
            raise DataError(str(e)) from e
        try:
            cfg = run.model.with_vocab(data.vocab_size, mock=run.data.mock_data)
        except ValueError as e:
            raise ArgumentError(str(e)) from None
        seed_everything(run.seed)  # identical initial weights on every rank
        if run.model.hf_checkpoint:  # weights (and shape, from config.json) of a Hugging Face model
            if data.vocab_size > cfg.vocab_size:
                raise ArgumentError(f"the tokenizer's vocabulary {data.vocab_size} exceeds vocab_size "
                                    f"{cfg.vocab_size} of --hf-checkpoint {run.model.hf_checkpoint}; "
                                    "use the checkpoint's tokenizer")
            from autosp_lm.models.hf import HFCheckpointError, load_hf_checkpoint
            try:
                model, cfg = load_hf_checkpoint(run.model.hf_checkpoint, ps.device, config=cfg)
            except HFCheckpointError as e:
                raise CheckpointError(f"--hf-checkpoint: {e}") from None
        else:
            model = build_model(cfg).to(ps.device)
        # the trainer prints the strategy's report after step 1 (compiled strategies know then)
        options = run.strategy_options
        if run.strategy == "autosp" and run.sac:  # the memory plan AutoSP chooses to fit
            from autosp_lm.planner.fit import memory_plan_options
            options = dataclasses.replace(options, **memory_plan_options(
                model, budget_gb=run.memory_budget_gb, device=ps.device, world=ps.world_size,
                sp=ps.sp_size, fsdp2=par.use_torch_fsdp2, bf16=train.bf16,
                seq_length=train.seq_length))
        strategy = build_strategy(run.strategy, ps, options)
        # where the model state lives: FSDP2 / graph FSDP (--autosp) / distributed optimizer
        sharding = build_sharding(sharding_kind(par.use_torch_fsdp2, par.use_distributed_optimizer,
                                                strategy.needs_full_graph), ps, bf16=train.bf16,
                                  fp32_residual=train.fp32_residual_connection)
        sharding.wrap(model)
        strategy.setup(model)
        logger.print(f"model {run.model.name}: {cfg.num_parameters() / 1e6:.2f}M parameters, "
                     f"{cfg.num_layers} layers, hidden {cfg.hidden_size}, heads {cfg.num_attention_heads}"
                     f"/{cfg.num_query_groups} kv, vocab {cfg.vocab_size} | data: {data.description} | "
                     f"world {ps.world_size} = data-parallel {ps.dp_size} x sequence-parallel "
                     f"{ps.sp_size} ({run.strategy}) | seq {train.seq_length}, global batch "
                     f"{train.global_batch_size} = micro {train.micro_batch_size} x dp {ps.dp_size} x "
                     f"accumulation {train.grad_accum_steps} | device {ps.device}")
        logger.print(sharding.report())
        trainer = Trainer(train, ps, model, cfg, strategy, data, logger, sharding=sharding,
                          run_record=record)
        result = trainer.train()
        logger.print(closing_line(result, train))
        return result
    finally:
        logger.close()
        if ps.owns_group:  # the 1-rank group of a single sharded process
            destroy_parallel()


def main(argv=None):
    debug = _debug_requested(argv)
    try:
        run = build_run_config(parse_args(argv), _world())  # the last reader of the flags
        check_paths(run)
        return _run(run)
    except KNOWN_ERRORS as e:
        report_error(_message(e), getattr(e, "exit_code", 1), debug)
    except KeyboardInterrupt:
        report_error("pretrain.py: interrupted (SIGINT); nothing was saved since the last checkpoint",
                     128 + 2, debug)
    except Exception as e:
        line = health.describe_failure(e)  # a collective that timed out or lost a peer
        if line is not None:
            report_error(f"pretrain.py: error: {line}", 1, debug)
        if _world() > 1 and not _first_to_fail():
            _exit(1, reported=False)  # a consequence of the failure another rank reported
        raise


def exit_status(result) -> int:
    """0, except for a run stopped by SIGTERM that saved nothing."""
    if isinstance(result, TrainResult) and result.exit_reason == "preempted" and not result.checkpoint:
        return EXIT_NOTHING_SAVED
    return 0


if __name__ == "__main__":
    outcome = main()
    destroy_parallel()
    sys.exit(exit_status(outcome))
