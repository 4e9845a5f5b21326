"""The training loop: micro batches -> strategy loss -> backward -> gradient reduction -> clip ->
optimizer -> LR schedule -> log -> evaluate -> checkpoint.

Parallel algorithms live in the strategy (:mod:`autosp_lm.strategies`) and in
:mod:`autosp_lm.parallel`; one step is :mod:`.step`; this module only sequences them.
"""
from __future__ import annotations

import math
import os
import signal
import threading
import time
from dataclasses import dataclass, field
from typing import Optional

import torch
import torch.distributed as dist

from ..data import DataBundle, build_loader
from ..parallel import health
from ..parallel.sharding import Sharding
from ..parallel.state import ParallelState
from ..strategies.base import Strategy
from . import checkpoint as ckpt
from .config import TrainingConfig
from .flops import document_attention_pairs, flops_per_step, peak_tflops
from .metrics import MetricsLogger, memory_figures
from .optimizer import build_optimizer
from .schedule import LRSchedule
from .step import autocast_context, finish_step, forward_backward


class TrainingError(RuntimeError):
    pass


@dataclass
class TrainResult:
    iteration: int
    consumed_samples: int
    losses: dict = field(default_factory=dict)       # iteration -> lm loss
    grad_norms: dict = field(default_factory=dict)   # iteration -> pre-clip grad norm
    eval_losses: dict = field(default_factory=dict)  # iteration -> validation loss
    exit_reason: str = "finished"  # or "preempted", "exit-interval", "already-finished"
    checkpoint: Optional[str] = None  # the last checkpoint this run wrote
    seconds: float = 0.0  # wall time of the training loop
    report: Optional[str] = None  # the strategy's start-up report (after step 1)
    state_bytes: dict = field(default_factory=dict)  # this rank's parameter/gradient/optimizer bytes


class _Preemption:
    """Remembers a SIGTERM so the loop can save at the next iteration boundary."""

    def __init__(self):
        self.requested = False
        self._old = None

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():
            self._old = signal.signal(signal.SIGTERM, self._handler)
        return self

    def _handler(self, signum, frame):
        self.requested = True

    def __exit__(self, *exc):
        if self._old is not None:
            signal.signal(signal.SIGTERM, self._old)


def _to_device(batch: dict, device: torch.device) -> dict:
    return {k: v.to(device, non_blocking=True) for k, v in batch.items() if v is not None}


def _sync(device: torch.device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class Trainer:
    """Runs ``config`` (the run's training part) on a wrapped model and its strategy.
    ``run_record``: the whole run's typed configuration as a dict, stored in every checkpoint."""

    def __init__(self, config: TrainingConfig, ps: ParallelState, model: torch.nn.Module, model_cfg,
                 strategy: Strategy, data: DataBundle, logger: Optional[MetricsLogger] = None,
                 sharding: Optional[Sharding] = None, run_record: Optional[dict] = None):
        self.config, self.ps, self.model, self.cfg = config, ps, model, model_cfg
        self.run_record = dict(run_record or {})
        opt, self.ckpt = config.optimizer, config.checkpoint
        self.strategy, self.data = strategy, data
        self.device = ps.device
        self.logger = logger or MetricsLogger(enabled=False)
        if sharding is None:
            sharding = Sharding(ps, bf16=config.bf16, fp32_residual=config.fp32_residual_connection)
            sharding.wrap(model)
        self.sharding = sharding
        self.optimizer = build_optimizer(sharding.optimizer_module(), lr=opt.lr,
                                         weight_decay=opt.weight_decay,
                                         betas=(opt.adam_beta1, opt.adam_beta2), eps=opt.adam_eps,
                                         device=self.device, sharded=sharding.sharded)
        self.scheduler = LRSchedule(self.optimizer, max_lr=opt.lr, min_lr=opt.min_lr,
                                    warmup_iters=opt.lr_warmup_iters, decay_iters=opt.lr_decay_iters,
                                    style=opt.lr_decay_style)
        self.iteration = 0
        self.consumed_samples = 0
        self.bf16 = config.bf16
        self.last_checkpoint: Optional[str] = None
        self.ckpt_format = self.ckpt.ckpt_format
        self.async_save = self.ckpt.async_save
        self._pending: Optional[ckpt.PendingCheckpoint] = None
        self._ckpt_group = (ckpt.checkpoint_dist.checkpoint_group(ps.backend)
                            if self.async_save else None)

    # ------------------------------------------------------------------ checkpoints
    def save(self) -> None:
        self.wait_for_save()  # one checkpoint in flight at a time
        pending = ckpt.save_checkpoint(self.ckpt.save, self.iteration, model=self.model,
                                       optimizer=self.optimizer, scheduler=self.scheduler,
                                       consumed_samples=self.consumed_samples, ps=self.ps,
                                       run_config=self.run_record, model_config=self.cfg.to_dict(),
                                       sharding=self.sharding, fmt=self.ckpt_format,
                                       async_save=self.async_save, process_group=self._ckpt_group)
        if pending.path is not None:
            self.last_checkpoint = pending.path
            self.logger.print(f"saved checkpoint at iteration {self.iteration} to {pending.path}")
        else:
            self._pending = pending
            self.logger.print(f"checkpoint at iteration {self.iteration}: writing in the "
                              "background (--async-save)")

    def wait_for_save(self) -> None:
        """Complete a background checkpoint (every rank): it becomes `latest` only now."""
        if self._pending is not None:
            pending, self._pending = self._pending, None
            path = pending.wait()
            self.last_checkpoint = path
            self.logger.print(f"saved checkpoint at iteration {pending.iteration} to {path}")

    def maybe_load(self) -> None:
        conf = self.ckpt
        if not conf.load:
            return
        path = ckpt.find_checkpoint(conf.load, auto_resume=conf.auto_resume)
        if path is None:
            if conf.auto_resume:
                self.logger.print(f"no checkpoint in {conf.load} yet: starting from iteration 0 "
                                  "(--load equals --save, the auto-resume idiom)")
                return
            raise ckpt.CheckpointError(f"--load {conf.load}: no checkpoint found (no '{ckpt.TRACKER}' "
                                       "tracker and no iter_* directories); check the path, or drop "
                                       "--load to start fresh")
        info = ckpt.load_checkpoint(path, model=self.model, optimizer=self.optimizer,
                                    scheduler=self.scheduler, ps=self.ps,
                                    model_config=self.cfg.to_dict(), sharding=self.sharding)
        self.iteration, self.consumed_samples = info["iteration"], info["consumed_samples"]
        untracked = not os.path.exists(os.path.join(conf.load, ckpt.TRACKER))
        self.logger.print(f"resumed from {path} at iteration {self.iteration} "
                          f"({self.consumed_samples} consumed samples)" + (
                              f"; no '{ckpt.TRACKER}' tracker (the last save was interrupted after "
                              "its rename): the newest complete checkpoint" if untracked else ""))

    # ------------------------------------------------------------------ steps
    def _loader(self, dataset, consumed: int):
        conf = self.config
        return build_loader(dataset, micro_batch_size=conf.micro_batch_size,
                            global_batch_size=conf.global_batch_size, dp_rank=self.ps.dp_rank,
                            dp_size=self.ps.dp_size, consumed_samples=consumed,
                            num_workers=conf.num_workers)

    def _dp_mean(self, value: torch.Tensor) -> torch.Tensor:
        if self.ps.dp_size > 1:
            value = value.clone()
            dist.all_reduce(value, group=self.ps.dp_group)
            value /= self.ps.dp_size
        return value

    def train_step(self, batches) -> tuple[float, float, float]:
        """One optimizer step; returns (loss, pre-clip grad norm, learning rate used)."""
        conf = self.config
        health.note_iteration(self.iteration + 1)  # named in a collective failure's line
        self.model.train()
        self.sharding.zero_grad(self.optimizer)
        accum = conf.grad_accum_steps
        total = torch.zeros((), dtype=torch.float64, device=self.device)
        self.step_attention_pairs = None
        for _ in range(accum):
            batch = _to_device(next(batches), self.device)
            if batch.get("document_ids") is not None:
                self.step_attention_pairs = (self.step_attention_pairs or 0) + \
                    document_attention_pairs(batch["document_ids"])
            total += forward_backward(self.strategy, batch, bf16=self.bf16, accumulation=accum,
                                      device=self.device).double()
        grad_norm = finish_step(self.model, self.optimizer, dp_size=self.ps.dp_size,
                                clip_grad=conf.optimizer.clip_grad, step=False, sharding=self.sharding)
        loss_value = float(self._dp_mean(total / accum))
        grad_norm = float(grad_norm)
        if not (math.isfinite(loss_value) and math.isfinite(grad_norm)):
            raise TrainingError(f"non-finite loss ({loss_value}) or grad norm ({grad_norm}) at iteration "
                                f"{self.iteration + 1}; lower --lr, check the data, or resume from the "
                                "last checkpoint (it was not overwritten)")
        lr = self.optimizer.param_groups[0]["lr"]
        self.optimizer.step()
        self.sharding.after_optimizer_step()
        self.scheduler.step()
        return loss_value, grad_norm, lr

    @torch.no_grad()
    def evaluate(self) -> Optional[float]:
        conf = self.config
        if not conf.eval_iters or self.data.valid is None:
            return None
        self.model.eval()
        loader = iter(self._loader(self.data.valid, 0))
        total, count = torch.zeros((), dtype=torch.float64, device=self.device), 0
        try:
            for _ in range(conf.eval_iters * conf.grad_accum_steps):
                batch = _to_device(next(loader), self.device)
                with autocast_context(self.device, self.bf16):
                    _, reported = self.strategy.forward_loss(batch)
                total += reported.double()
                count += 1
        except StopIteration:
            pass
        self.model.train()
        if count == 0:
            return None
        return float(self._dp_mean(total / count))

    def _stop_requested(self, preempt: _Preemption) -> bool:
        flag = torch.tensor([1.0 if preempt.requested else 0.0])
        if self.ps.is_distributed:
            if self.ps.backend == "nccl":
                flag = flag.to(self.device)
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())

    # ------------------------------------------------------------------ loop
    def train(self) -> TrainResult:
        result = self._train()
        self.wait_for_save()  # at exit: a background checkpoint becomes `latest` before we return
        result.checkpoint = self.last_checkpoint
        return result

    def _train(self) -> TrainResult:
        conf, ps, save = self.config, self.ps, self.ckpt
        self.maybe_load()
        result = TrainResult(self.iteration, self.consumed_samples)
        if self.iteration >= conf.train_iters:
            result.exit_reason = "already-finished"
            return result
        compiling = conf.compiling
        if compiling:
            self.logger.print(f"compiling the model ({compiling}) during iteration {self.iteration + 1}; "
                              "it waits for the compiler (tens of seconds on a CPU, minutes for large models)")
        started = time.perf_counter()
        batches = iter(self._loader(self.data.train, self.consumed_samples))
        tokens_per_step = conf.global_batch_size * conf.seq_length
        step_flops = flops_per_step(self.cfg, tokens_per_step, conf.seq_length)
        peak = peak_tflops(self.device, conf.bf16)
        window_losses, window_time, window_steps, window_flops = [], 0.0, 0, 0.0
        with _Preemption() as preempt:
            while self.iteration < conf.train_iters:
                _sync(self.device)
                t0 = time.perf_counter()
                loss, grad_norm, lr = self.train_step(batches)
                _sync(self.device)
                dt = time.perf_counter() - t0
                if self.step_attention_pairs is not None:  # document masking: what attention did
                    pairs = self._dp_mean(torch.tensor(float(self.step_attention_pairs),
                                                       dtype=torch.float64, device=self.device))
                    step_flops = flops_per_step(self.cfg, tokens_per_step, conf.seq_length,
                                                attention_pairs=float(pairs) * ps.dp_size)
                self.iteration += 1
                self.consumed_samples += conf.global_batch_size
                if not result.losses:  # compiled strategies know what they did after step 1
                    if compiling:
                        self.logger.print(f"compiled: iteration {self.iteration} took {dt:.1f} s, compilation "
                                          "included; the next iterations reuse the compiled code")
                    report = self.strategy.report()
                    if report:
                        self.logger.print(report)
                    result.report = report
                    self.logger.log_fields(self.strategy.report_fields())
                result.losses[self.iteration] = loss
                result.grad_norms[self.iteration] = grad_norm
                window_losses.append(loss)
                window_time += dt
                window_flops += step_flops
                window_steps += 1
                if self.iteration % conf.logging.log_interval == 0 or self.iteration == conf.train_iters:
                    step_time = window_time / window_steps
                    tflops = window_flops / window_time / ps.world_size / 1e12
                    record = {"iteration": self.iteration, "train_iters": conf.train_iters,
                              "consumed_samples": self.consumed_samples,
                              "lm_loss": sum(window_losses) / len(window_losses),
                              "lr": lr, "grad_norm": grad_norm,
                              "step_time_ms": 1000 * step_time,
                              "tokens_per_s": tokens_per_step / step_time,
                              "tflops_per_device": tflops,
                              "mfu": (tflops / peak) if peak else None,
                              "global_batch_size": conf.global_batch_size,
                              **memory_figures(self.device),
                              **self.sharding.memory_bytes(self.optimizer)}
                    self.logger.log_train(record)
                    window_losses, window_time, window_steps, window_flops = [], 0.0, 0, 0.0
                if conf.eval_interval and self.iteration % conf.eval_interval == 0:
                    self._run_eval(result)
                stop = self._stop_requested(preempt)
                exiting = stop or (conf.exit_interval and self.iteration >= conf.exit_interval)
                if save.save and (exiting or (save.save_interval and self.iteration % save.save_interval == 0)):
                    self.save()
                if stop:
                    self.wait_for_save()
                    result.exit_reason = "preempted"
                    break
                if exiting:
                    result.exit_reason = "exit-interval"
                    break
            else:
                if save.save and not (save.save_interval and self.iteration % save.save_interval == 0):
                    self.save()
                if conf.eval_interval and self.iteration % conf.eval_interval != 0:
                    self._run_eval(result)
        result.iteration, result.consumed_samples = self.iteration, self.consumed_samples
        result.checkpoint, result.seconds = self.last_checkpoint, time.perf_counter() - started
        result.state_bytes = self.sharding.memory_bytes(self.optimizer)
        return result

    def _run_eval(self, result: TrainResult) -> None:
        val = self.evaluate()
        if val is None:
            return
        result.eval_losses[self.iteration] = val
        self.logger.log_eval({"iteration": self.iteration, "eval_lm_loss": val,
                              "eval_ppl": math.exp(min(val, 50.0))})


def _elapsed(seconds: float) -> str:
    return f"{seconds:.1f} s" if seconds < 120 else f"{seconds / 60:.1f} min"


def closing_line(result: TrainResult, config: TrainingConfig) -> str:
    """The last line of a run: how it ended, what was saved and how to go on."""
    ck = config.checkpoint
    if result.exit_reason == "already-finished":
        return (f"pretrain.py: nothing to train: the checkpoint in {ck.load} is at iteration "
                f"{result.iteration} and --train-iters is {config.train_iters}; raise --train-iters to "
                "train further")
    done = (f"iterations {min(result.losses)}-{max(result.losses)}" if len(result.losses) > 1
            else f"iteration {result.iteration}")
    if result.exit_reason == "preempted":
        head = f"pretrain.py: stopped by SIGTERM after iteration {result.iteration}"
    elif result.exit_reason == "exit-interval":
        head = f"pretrain.py: stopped after iteration {result.iteration} (--exit-interval {config.exit_interval})"
    else:
        head = f"pretrain.py: done: trained {done} in {_elapsed(result.seconds)}"
    if not result.checkpoint:
        lost = ", this run's progress is lost" if result.exit_reason != "finished" else ""
        return (f"{head}; nothing was saved (no --save){lost}: add --save DIR to keep a checkpoint "
                "and --load DIR to resume from it")
    if result.exit_reason == "finished":
        return (f"{head}; checkpoint saved to {result.checkpoint} (to train further: --load "
                f"{ck.save} and a larger --train-iters)")
    resume = ("rerun the same command (its --load is the --save directory)" if ck.load == ck.save
              else f"rerun the same command with --load {ck.save}")
    return f"{head}; checkpoint saved to {result.checkpoint}; to resume, {resume}"
