"""``--autosp``: the unchanged model compiled by the AutoSP pass stack (:mod:`autosp_lm.compiler`).

Every SP rank passes the full-length batch to the compiled program, which shards it itself.
"""
from __future__ import annotations

import dataclasses
from typing import Optional

import torch

from ..compiler import AutoSPError, AutoSPOptions, autosp_compile
from ..parallel.fsdp_graph import graph_shard_info
from ..parallel.heads import splittable, working_sizes
from ..parallel.slicing import CONTIGUOUS, check_sequence_length
from .base import Strategy, extract_loss, model_inputs


class AutoSPStrategy(Strategy):
    name = "autosp"
    Options = AutoSPOptions
    needs_full_graph = True  # one graph of the whole model: FSDP2's hooks cannot run in it

    @classmethod
    def check(cls, model_config, sp_size, seq_length, options) -> None:
        if sp_size > 1:
            check_sequence_length(seq_length, sp_size, CONTIGUOUS, "--autosp")
        if sp_size > 1 and model_config is not None and not splittable(
                model_config.num_attention_heads, model_config.num_query_groups, sp_size):
            ok = working_sizes(model_config.num_attention_heads, model_config.num_query_groups)
            raise ValueError(
                f"--autosp: {model_config.num_attention_heads} query heads and "
                f"{model_config.num_query_groups} key/value heads cannot be split over "
                f"sequence-parallel size {sp_size}; sequence-parallel sizes that work: "
                f"{', '.join(map(str, ok)) or 'none'}; or use --ring, which has no head "
                f"constraint")

    def setup(self, model: torch.nn.Module) -> None:
        self.model = model
        if graph_shard_info(model) is not None:  # parameters gathered in the graph: tag them
            self.options = dataclasses.replace(self.options, param_sharding="graph_fsdp")
        self.runner = autosp_compile(model, self.ps.sp_group, **vars(self.options))

    def forward_loss(self, batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
        loss = extract_loss(self.runner(**model_inputs(self.model, batch)))
        return loss, loss.detach()

    def report(self) -> Optional[str]:
        if self.runner is None or self.runner.report is None:
            return None
        return self.runner.report.text()


__all__ = ["AutoSPStrategy", "AutoSPError"]
