"""``none``: plain data-parallel training, the whole sequence on one rank; optionally compiled
(``--compile``) and with sequence-aware activation checkpointing on one device (``--sac``)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from ..compiler.passes.sac import DEFAULT_BUDGET
from .base import Strategy, extract_loss, model_inputs


@dataclass
class NoneOptions:
    compile: bool = False
    sac: bool = False  # needs compile: the checkpointing policy is a compiler pass
    backend: str = "inductor"  # torch.compile backend of --compile
    sac_budget: float = DEFAULT_BUDGET
    chunked_loss: bool = True  # with sac: fuse and chunk the loss head

    def __post_init__(self):
        if self.sac and not self.compile:
            raise ValueError("--sac without sequence parallelism needs --compile (it is a "
                             "compiler pass)")


class NoneStrategy(Strategy):
    name = "none"
    Options = NoneOptions

    def setup(self, model: torch.nn.Module) -> None:
        self.model = model
        o = self.options
        if o.compile and o.sac:
            from ..compiler import sac_compile
            self.runner = sac_compile(model, budget=o.sac_budget, backend=o.backend,
                                      chunked_loss=o.chunked_loss)
        elif o.compile:
            self.runner = torch.compile(model, backend=o.backend)
        else:
            self.runner = model

    def forward_loss(self, batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
        loss = extract_loss(self.runner(**model_inputs(self.model, batch)))
        return loss, loss.detach()

    def report(self) -> Optional[str]:
        stats = getattr(self.runner, "sac_stats", None)
        if not stats:
            return None
        lines = ["SAC (single device): " + ", ".join(
            f"graph {i}: {s.get('nodes_recomputed')} nodes recomputed / {s.get('nodes_saved')} "
            f"saved, {s.get('saved_bytes_per_token') or 0:.0f} B/token saved, recompute "
            f"{100 * s.get('recompute_fraction', 0):.1f}% of step FLOPs"
            for i, s in enumerate(stats))]
        lines += [f"  loss head {f}" for f in getattr(self.runner, "sac_fused_losses", [])]
        return "\n".join(lines)
