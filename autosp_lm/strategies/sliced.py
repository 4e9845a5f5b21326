"""What the hand-written baselines share: slice the batch by hand, swap the attention function.

``forward_loss`` slices this rank's share of the full batch (:mod:`autosp_lm.parallel.slicing`:
contiguous for Ulysses, zigzag for Ring), runs the (optionally compiled) model plus the summed
cross entropy with the baseline's attention installed through the model's one attention entry
point (``use_attention``; restored right after the forward, the autograd graph already holds
the baseline's ops for the backward), and divides by the batch's global token count.
"""
from __future__ import annotations

from typing import Optional

import torch

from ..models.attention import use_attention
from ..parallel.slicing import CONTIGUOUS, LocalLossSum, check_sequence_length, slice_batch, sp_loss
from .base import Strategy
from .memory import MemoryRecipe, describe_recipe


class SlicedSPStrategy(Strategy):
    """Base of ``--ulysses`` and ``--ring``: subclasses set ``layout`` and ``make_attention``."""

    layout = CONTIGUOUS
    ulysses_degree = 1  # of the zigzag layout (1: the plain ring split)

    def __init__(self, ps, options=None, **kwargs):
        super().__init__(ps, options, **kwargs)
        self.attention_fn = None
        self.installed_attention = None
        self.recipe = None
        self.loss_module = None

    @classmethod
    def check(cls, model_config, sp_size, seq_length, options) -> None:
        if sp_size > 1:
            check_sequence_length(seq_length, sp_size, cls.layout, f"--{cls.name}")

    @property
    def needs_full_graph(self) -> bool:
        return bool(self.options.compile and self.options.fullgraph)

    def make_attention(self):  # pragma: no cover - abstract
        raise NotImplementedError

    def describe(self) -> str:
        return ""

    def prepare_attention(self, model: torch.nn.Module) -> None:
        """Set now what the attention implementation would set at its first call: inside a
        compiled checkpoint region (``--recompute-granularity`` with ``--compile``) no Python
        state may change."""
        if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
            return  # no process group to name yet (a strategy built for its checks only)
        for fn in (self.attention_fn, getattr(self.attention_fn, "ring", None)):
            if fn is not None and isinstance(getattr(type(fn), "group_name", None), property):
                fn.group_name  # noqa: B018 - resolves the lazily named process group

    def setup(self, model: torch.nn.Module) -> None:
        self.model = model
        self.attention_fn = self.make_attention()
        self.prepare_attention(model)
        self.recipe = MemoryRecipe(model, self.options)
        self.installed_attention = self.recipe.attention(self.attention_fn)
        self.loss_module = LocalLossSum(model, self.recipe.head)
        o = self.options
        self.runner = (torch.compile(self.loss_module, backend=self.recipe.backend(o.backend),
                                     fullgraph=o.fullgraph)
                       if o.compile else self.loss_module)

    def forward_loss(self, batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
        if self.runner is None:
            raise RuntimeError(f"{type(self).__name__}.setup(model) must be called before "
                               f"forward_loss")
        if batch.get("labels") is None:
            raise ValueError(f"--{self.name}: the batch has no labels")
        local = slice_batch(batch, self.ps.sp_size, self.ps.sp_rank, self.layout,
                            strategy=f"--{self.name}", ulysses_degree=self.ulysses_degree)
        docs = batch.get("document_ids")
        self.attention_fn.document_ids = docs  # the attention masks need the whole sequence's
        self.recipe.start_step()
        with use_attention(self.installed_attention):
            if docs is None:
                local_sum = self.runner(local["input_ids"], local["position_ids"], local["labels"])
            else:
                local_sum = self.runner(local["input_ids"], local["position_ids"], local["labels"],
                                        local["document_ids"])
        group = self.ps.sp_group if self.ps.sp_size > 1 else None
        return sp_loss(local_sum, batch["labels"], group)

    def report(self) -> Optional[str]:
        o = self.options
        mode = f"compiled ({o.backend})" if o.compile else "eager"
        return (f"strategy --{self.name}: sequence-parallel size {self.ps.sp_size}, "
                f"data-parallel size {self.ps.dp_size}, {self.layout} sequence split, {mode}; "
                f"{self.describe()}" + (f"; memory: {m}" if (m := describe_recipe(o)) else ""))
