"""Logging of training figures: a Megatron-like line on stdout, JSON lines, and W&B.

Only one rank (global rank 0) logs. W&B is imported lazily and runs offline unless the user has
configured an account (``WANDB_API_KEY``, a ``wandb login`` entry in ~/.netrc) or chose a mode
with ``WANDB_MODE``.
"""
from __future__ import annotations

import json
import os
import resource
import sys
from typing import Optional

import torch


def peak_rss_bytes() -> int:
    """Peak resident set size of this process so far (Linux reports KiB)."""
    kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return kb * 1024 if sys.platform != "darwin" else kb


def memory_figures(device: torch.device) -> dict:
    if device.type == "cuda":
        return {"mem_allocated_bytes": torch.cuda.memory_allocated(device),
                "mem_max_allocated_bytes": torch.cuda.max_memory_allocated(device)}
    return {"mem_peak_rss_bytes": peak_rss_bytes()}


def wandb_mode() -> str:
    """'online' when an account is configured, else 'offline' (never requires an account)."""
    if os.environ.get("WANDB_MODE"):
        return os.environ["WANDB_MODE"]
    if os.environ.get("WANDB_API_KEY"):
        return "online"
    netrc = os.path.expanduser("~/.netrc")
    try:
        if "api.wandb.ai" in open(netrc).read():
            return "online"
    except OSError:
        pass
    return "offline"


class MetricsLogger:
    def __init__(self, *, enabled: bool, metrics_file: Optional[str] = None,
                 wandb_project: Optional[str] = None, wandb_name: Optional[str] = None,
                 wandb_dir: Optional[str] = None, config: Optional[dict] = None):
        self.enabled = enabled
        self._file = None
        self._wandb = None
        if not enabled:
            return
        if metrics_file:
            os.makedirs(os.path.dirname(os.path.abspath(metrics_file)), exist_ok=True)
            self._file = open(metrics_file, "a", buffering=1)
        if wandb_project:
            try:
                import wandb
            except ImportError:
                raise RuntimeError("--wandb-project needs the wandb package: pip install wandb") from None
            # W&B puts its run folders into DIR/wandb/ (as --wandb-save-dir's help says)
            wandb_dir = os.path.abspath(wandb_dir or os.getcwd())
            os.makedirs(wandb_dir, exist_ok=True)
            mode = wandb_mode()
            self._wandb = wandb.init(project=wandb_project, name=wandb_name, dir=wandb_dir,
                                     config=config or {}, mode=mode)
            run_dir = os.path.dirname(self._wandb.dir.rstrip(os.sep))  # .../wandb/<run>/files
            sync = f"; upload it later with `wandb sync {run_dir}`" if mode == "offline" else ""
            print(f"[wandb] logging {mode} to {run_dir}{sync}", flush=True)

    def print(self, text: str) -> None:
        if self.enabled:
            print(text, flush=True)

    def _record(self, record: dict, step: int) -> None:
        if self._file:
            self._file.write(json.dumps(record) + "\n")
        if self._wandb is not None:
            self._wandb.log({k: v for k, v in record.items() if isinstance(v, (int, float))}, step=step)

    def log_fields(self, fields: dict) -> None:
        """Facts of the run decided once (the memory plan AutoSP chose): one ``{"run": ...}``
        line in the metrics file, the W&B run's summary."""
        if not self.enabled or not fields:
            return
        if self._file:
            self._file.write(json.dumps({"run": fields}) + "\n")
        if self._wandb is not None:
            self._wandb.summary.update(fields)

    def log_train(self, r: dict) -> None:
        if not self.enabled:
            return
        parts = [f" iteration {r['iteration']:8d}/{r['train_iters']:8d}",
                 f"consumed samples: {r['consumed_samples']:10d}",
                 f"elapsed time per iteration (ms): {r['step_time_ms']:.1f}",
                 f"learning rate: {r['lr']:.6E}",
                 f"global batch size: {r['global_batch_size']:5d}",
                 f"lm loss: {r['lm_loss']:.6E}",
                 f"grad norm: {r['grad_norm']:.4f}",
                 f"tokens/s: {r['tokens_per_s']:.0f}",
                 f"TFLOP/s/device: {r['tflops_per_device']:.3f}"]
        if r.get("mfu") is not None:
            parts.append(f"MFU: {100 * r['mfu']:.1f}%")
        if "mem_max_allocated_bytes" in r:
            parts.append(f"mem alloc/max (GB): {r['mem_allocated_bytes'] / 2**30:.2f}/"
                         f"{r['mem_max_allocated_bytes'] / 2**30:.2f}")
        elif "mem_peak_rss_bytes" in r:
            parts.append(f"peak RSS (GB): {r['mem_peak_rss_bytes'] / 2**30:.2f}")
        print(" | ".join(parts), flush=True)
        self._record(r, r["iteration"])

    def log_eval(self, r: dict) -> None:
        if not self.enabled:
            return
        print("-" * 80 + f"\n validation loss at iteration {r['iteration']} | lm loss: "
              f"{r['eval_lm_loss']:.6E} | lm loss PPL: {r['eval_ppl']:.6E}\n" + "-" * 80, flush=True)
        self._record(r, r["iteration"])

    def close(self) -> None:
        if self._file:
            self._file.close()
            self._file = None
        if self._wandb is not None:
            self._wandb.finish()
            self._wandb = None
