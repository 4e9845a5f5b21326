"""The ``autosp`` training strategy: the model compiled by the AutoSP pass stack."""
from __future__ import annotations

from typing import Optional

import torch

from autosp_lm.parallel.strategy import Strategy

from .api import autosp_compile


class AutoSPStrategy(Strategy):
    """Every SP rank gets the full-length batch; the compiled program shards it itself.

    Options: ``backend`` ("inductor" default, or "aot_eager"), ``sac_recompute_budget`` (passed
    to the SAC pass), ``verbose`` (print the report at start-up on rank 0),
    ``attention_output_once`` and ``chunked_loss`` (default True, see :func:`autosp_compile`).
    """

    name = "autosp"

    def __init__(self, ps, *, compile: bool = False, sac: bool = True, **options):
        super().__init__(ps, compile=compile, sac=sac, **options)
        self.runner = None

    def setup(self, model: torch.nn.Module) -> None:
        self.model = model
        self.runner = autosp_compile(model, self.ps.sp_group, sac=self.sac,
                                     backend=self.options.get("backend") or "inductor",
                                     sac_budget=self.options.get("sac_recompute_budget"),
                                     verbose=self.options.get("verbose", True),
                                     attention_output_once=self.options.get(
                                         "attention_output_once", True),
                                     chunked_loss=self.options.get("chunked_loss", True))

    def forward_loss(self, batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
        kwargs = {"input_ids": batch["input_ids"], "labels": batch["labels"]}
        if batch.get("position_ids") is not None:
            kwargs["position_ids"] = batch["position_ids"]
        out = self.runner(**kwargs)
        loss = extract_loss(out)
        return loss, loss.detach()

    def report(self) -> Optional[str]:
        if self.runner is None or self.runner.report is None:
            return None
        return self.runner.report.text()


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
