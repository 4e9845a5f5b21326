"""``none``: plain data-parallel training, the whole sequence on one rank; optionally compiled
(``--compile``) and with sequence-aware activation checkpointing on one device (``--sac``)."""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Optional

import torch

from ..compiler.passes.sac import DEFAULT_BUDGET
from ..models.attention import get_attention, use_attention
from ..parallel.slicing import LocalLossSum, sp_loss
from .base import Strategy, extract_loss, model_inputs
from .memory import MemoryRecipe, RecipeOptions, check_recipe, describe_recipe


@dataclass
class NoneOptions(RecipeOptions):
    compile: bool = False
    sac: bool = False  # needs compile: the checkpointing policy is a compiler pass
    backend: str = "inductor"  # torch.compile backend of --compile
    sac_budget: float = DEFAULT_BUDGET
    # chunked_loss (RecipeOptions): with sac, the compiler's loss-head fusion (on unless False)

    def __post_init__(self):
        check_recipe(self, compiled=self.compile)
        if self.sac and not self.compile:
            raise ValueError("--sac without sequence parallelism needs --compile (it is a "
                             "compiler pass)")
        if self.sac and (self.recompute_granularity or self.tiled_mlp or self.cpu_offloading):
            raise ValueError("--compile --sac chooses what to recompute itself; drop "
                             "--recompute-granularity / --tiled-mlp / --cpu-offloading, or --sac")


class NoneStrategy(Strategy):
    name = "none"
    Options = NoneOptions

    recipe = None

    def setup(self, model: torch.nn.Module) -> None:
        self.model = model
        o = self.options
        if o.compile and o.sac:
            from ..compiler import sac_compile
            self.runner = sac_compile(model, budget=o.sac_budget, backend=o.backend,
                                      chunked_loss=o.chunked_loss is not False)
            return
        self.recipe = MemoryRecipe(model, o) if o.recipe_on else None
        selective = o.recompute_granularity == "selective"
        self._attention = self.recipe.attention(get_attention()) if selective else None
        target = model
        if self.recipe is not None and self.recipe.head is not None:
            target = LocalLossSum(model, self.recipe.head)  # the loss sum inside the head
        backend = self.recipe.backend(o.backend) if self.recipe is not None else o.backend
        self.runner = torch.compile(target, backend=backend) if o.compile else target

    def forward_loss(self, batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
        if self.recipe is None:
            loss = extract_loss(self.runner(**model_inputs(self.model, batch)))
            return loss, loss.detach()
        self.recipe.start_step()
        with (use_attention(self._attention) if self._attention is not None
              else contextlib.nullcontext()):
            if self.recipe.head is None:
                loss = extract_loss(self.runner(**model_inputs(self.model, batch)))
                return loss, loss.detach()
            if batch.get("labels") is None:
                raise ValueError("--chunked-loss: the batch has no labels")
            docs = batch.get("document_ids")
            args = (batch["input_ids"], batch.get("position_ids"), batch["labels"])
            local_sum = self.runner(*args) if docs is None else self.runner(*args, docs)
        return sp_loss(local_sum, batch["labels"], None)

    def report(self) -> Optional[str]:
        stats = getattr(self.runner, "sac_stats", None)
        if not stats:
            m = describe_recipe(self.options) if self.recipe is not None else ""
            return f"strategy none: memory: {m}" if m else None
        lines = ["SAC (single device): " + ", ".join(
            f"graph {i}: {s.get('nodes_recomputed')} nodes recomputed / {s.get('nodes_saved')} "
            f"saved, {s.get('saved_bytes_per_token') or 0:.0f} B/token saved, recompute "
            f"{100 * s.get('recompute_fraction', 0):.1f}% of step FLOPs"
            for i, s in enumerate(stats))]
        lines += [f"  loss head {f}" for f in getattr(self.runner, "sac_fused_losses", [])]
        return "\n".join(lines)
