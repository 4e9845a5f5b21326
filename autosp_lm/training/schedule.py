"""Learning-rate schedule: linear warm-up from 0, then constant/linear/cosine decay to min_lr."""
from __future__ import annotations

import math


class LRSchedule:
    def __init__(self, optimizer, *, max_lr: float, min_lr: float, warmup_iters: int,
                 decay_iters: int, style: str = "cosine"):
        if style not in ("constant", "linear", "cosine"):
            raise ValueError(f"unknown --lr-decay-style {style!r}")
        self.optimizer = optimizer
        self.max_lr, self.min_lr = max_lr, min_lr
        self.warmup_iters, self.decay_iters = warmup_iters, decay_iters
        self.style = style
        self.num_steps = 0
        self._apply()

    def lr_at(self, step: int) -> float:
        if self.warmup_iters > 0 and step < self.warmup_iters:
            return self.max_lr * (step + 1) / self.warmup_iters
        if self.style == "constant":
            return self.max_lr
        if step >= self.decay_iters:
            return self.min_lr
        span = max(1, self.decay_iters - self.warmup_iters)
        ratio = (step - self.warmup_iters) / span
        if self.style == "linear":
            coeff = 1.0 - ratio
        else:
            coeff = 0.5 * (math.cos(math.pi * ratio) + 1.0)
        return self.min_lr + coeff * (self.max_lr - self.min_lr)

    @property
    def lr(self) -> float:
        return self.lr_at(self.num_steps)

    def _apply(self):
        lr = self.lr
        for g in self.optimizer.param_groups:
            g["lr"] = lr

    def step(self):
        self.num_steps += 1
        self._apply()

    def state_dict(self) -> dict:
        return {"num_steps": self.num_steps, "max_lr": self.max_lr, "min_lr": self.min_lr,
                "warmup_iters": self.warmup_iters, "decay_iters": self.decay_iters, "style": self.style}

    def load_state_dict(self, state: dict):
        self.num_steps = state["num_steps"]
        self._apply()
