"""Training strategies: how one full-length micro batch becomes a loss on this rank.

Every strategy keeps the contracts of DESIGN.md. ``forward_loss(batch)`` receives the *same
full-length* micro batch on every rank of the SP group and returns ``(loss, reported)``:

* ``loss`` is what this rank calls ``backward()`` on; after backward, summing each parameter's
  gradient over the SP group gives the single-device gradient of the micro batch's mean loss;
* ``reported`` (detached) is the single-device loss of the full micro batch, identical on every
  rank of the SP group.

Strategies are registered by name; the baselines and AutoSP live in their own modules and are
imported only when chosen.
"""
from __future__ import annotations

import importlib
from typing import Optional

import torch

from .state import ParallelState


class Strategy:
    """Plain (data-parallel only) training: the whole sequence on one rank."""

    name = "none"

    def __init__(self, ps: ParallelState, *, compile: bool = False, sac: bool = False, **options):
        self.ps = ps
        self.compile = compile
        self.sac = sac
        self.options = options
        self.model = None
        self.runner = None

    def setup(self, model: torch.nn.Module) -> None:
        """Prepare ``model`` (already on its device) for training with this strategy.

        ``compile`` alone is a plain ``torch.compile``; with ``sac`` the compile goes through the
        sequence-aware activation-checkpointing partitioner (long context on one device).
        """
        self.model = model
        if self.compile and self.sac:
            from ..compiler.sac_compile import sac_compile
            self.runner = sac_compile(model, budget=self.options.get("sac_recompute_budget", 0.1),
                                      backend=self.options.get("backend", "inductor"))
        else:
            self.runner = torch.compile(model) if self.compile else model

    def forward_loss(self, batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
        loss = self.runner(batch["input_ids"], position_ids=batch.get("position_ids"),
                           labels=batch["labels"])
        return loss, loss.detach()

    def report(self) -> Optional[str]:
        """A start-up report of what the strategy did (printed by rank 0)."""
        stats = getattr(self.runner, "sac_stats", None)
        if not stats:
            return None
        lines = ["SAC (single device): " + ", ".join(
            f"graph {i}: {s.get('nodes_recomputed')} nodes recomputed / {s.get('nodes_saved')} saved, "
            f"{s.get('saved_bytes_per_token', 0):.0f} B/token saved, recompute "
            f"{100 * s.get('recompute_fraction', 0):.1f}% of step FLOPs" for i, s in enumerate(stats))]
        lines += [f"  loss head {f}" for f in getattr(self.runner, "sac_fused_losses", [])]
        return "\n".join(lines)


_REGISTRY = {
    "none": "autosp_lm.parallel.strategy:Strategy",
    "ulysses": "autosp_lm.parallel.ulysses:UlyssesStrategy",
    "ring": "autosp_lm.parallel.ring:RingStrategy",
    "autosp": "autosp_lm.compiler.strategy:AutoSPStrategy",
}


def build_strategy(name: str, ps: ParallelState, **options) -> Strategy:
    if name not in _REGISTRY:
        raise ValueError(f"unknown strategy {name!r}; choose one of {sorted(_REGISTRY)}")
    module, cls = _REGISTRY[name].split(":")
    return getattr(importlib.import_module(module), cls)(ps, **options)
