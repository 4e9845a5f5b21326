"""What every strategy is: how one full-length micro batch becomes a loss on this rank.

Every strategy keeps the contracts stated in the README ("Strategies"). ``forward_loss(batch)`` receives the *same
full-length* micro batch on every rank of the SP group and returns ``(loss, reported)``:

* ``loss`` is what this rank calls ``backward()`` on; after backward, summing each parameter's
  gradient over the SP group gives the single-device gradient of the micro batch's mean loss;
* ``reported`` (detached) is the single-device loss of the full micro batch, identical on every
  rank of the SP group.

A strategy holds no parallel algorithm itself: it calls :mod:`autosp_lm.parallel` (hand-written
baselines) or :mod:`autosp_lm.compiler` (AutoSP). Its options are a typed dataclass; unknown
options are an error, never silently ignored.
"""
from __future__ import annotations

import dataclasses
import inspect
from typing import Any, ClassVar, Optional

import torch

from ..parallel.state import ParallelState


class Strategy:
    """Base class: subclasses set ``name`` and ``Options`` and implement the three methods."""

    name: ClassVar[str] = ""
    Options: ClassVar[type] = object
    #: True when the model runs as one whole compiled graph (``fullgraph=True``): FSDP2's
    #: module hooks cannot run inside it, so ``--use-torch-fsdp2`` gathers the parameters in the
    #: graph instead (:mod:`autosp_lm.parallel.fsdp_graph`)
    needs_full_graph: bool = False

    def __init__(self, ps: ParallelState, options: Any = None, **kwargs):
        if options is None:
            try:
                options = self.Options(**kwargs)
            except TypeError as e:
                known = ", ".join(f.name for f in dataclasses.fields(self.Options))
                raise TypeError(f"strategy {self.name!r}: {e}; its options are: {known}") from None
        elif kwargs:
            options = dataclasses.replace(options, **kwargs)
        self.ps = ps
        self.options = options
        self.model: Optional[torch.nn.Module] = None
        self.runner = None

    @classmethod
    def check(cls, model_config, sp_size: int, seq_length: int, options) -> None:
        """Refuse, before any work, a configuration this strategy cannot run exactly (ValueError
        naming the numbers and the fix). The default accepts everything."""

    def setup(self, model: torch.nn.Module) -> None:  # pragma: no cover - abstract
        raise NotImplementedError

    def forward_loss(self, batch: dict) -> tuple[torch.Tensor, torch.Tensor]:  # pragma: no cover
        raise NotImplementedError

    def report(self) -> Optional[str]:
        """A start-up report of what the strategy did (printed by rank 0 after step 1)."""
        return None

    def report_fields(self) -> dict:
        """What the start-up report decided, as figures for the metrics file and W&B (after
        step 1; {}: nothing)."""
        return {}


def model_inputs(model: torch.nn.Module, batch: dict) -> dict:
    """The entries of ``batch`` that ``model.forward`` takes by name."""
    params = inspect.signature(model.forward).parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return {k: v for k, v in batch.items() if v is not None}
    return {k: v for k, v in batch.items() if k in params and v is not None}


def extract_loss(out) -> torch.Tensor:
    """The scalar loss of whatever the model returned (tensor, ``.loss``, ``["loss"]``)."""
    if isinstance(out, torch.Tensor):
        return out
    if isinstance(out, dict) and "loss" in out:
        return out["loss"]
    if hasattr(out, "loss"):
        return out.loss
    if isinstance(out, (tuple, list)) and out and isinstance(out[0], torch.Tensor):
        return out[0]
    raise TypeError(f"cannot find the loss in the model output of type {type(out).__name__}")
