"""``--autosp``: the unchanged model compiled by the AutoSP pass stack (:mod:`autosp_lm.compiler`).

Every SP rank passes the full-length batch to the compiled program, which shards it itself.
"""
from __future__ import annotations

import dataclasses
from typing import Optional

import torch

from ..compiler import AutoSPError, AutoSPOptions, autosp_compile
from ..parallel.fsdp_graph import graph_shard_info
from ..parallel.mesh import choose_ulysses_degree, node_size, ulysses_degree_problem
from ..parallel.slicing import CONTIGUOUS, ZIGZAG, check_sequence_length
from .base import Strategy, extract_loss, model_inputs


class AutoSPStrategy(Strategy):
    name = "autosp"
    Options = AutoSPOptions
    needs_full_graph = True  # one graph of the whole model: FSDP2's hooks cannot run in it

    @classmethod
    def check(cls, model_config, sp_size, seq_length, options) -> None:
        """The plan the compiler will choose for our models (passes/plan.py decides the same
        from the graph): the Ulysses degree given, or the largest that fits the heads and the
        node; a ring for the rest of the SP size."""
        if sp_size == 1:
            return
        U = getattr(options, "ulysses_degree", None)
        if U is not None:  # without a model config only the divisor can be checked here
            h, hk = ((model_config.num_attention_heads, model_config.num_query_groups)
                     if model_config is not None else (U, U))
            problem = ulysses_degree_problem(sp_size, U, h, hk)
            if problem:
                raise ValueError("--autosp: " + problem)
        elif model_config is not None:
            U, _ = choose_ulysses_degree(sp_size, [(model_config.num_attention_heads,
                                                    model_config.num_query_groups)], node_size())
        ring = U is not None and U < sp_size
        check_sequence_length(seq_length, sp_size, ZIGZAG if ring else CONTIGUOUS, "--autosp")

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

    def report_fields(self) -> dict:
        """The memory plan chosen to fit the budget (compiler/memory_plan.py), if one was."""
        plan = self.runner.report.memory_plan if self.runner and self.runner.report else {}
        if not plan:
            return {}
        nxt = plan.get("next") or {}
        return {"memory_plan": plan["name"], "memory_plan_flags": plan["flags"],
                "memory_plan_predicted_peak_bytes": plan["peak"],
                "memory_budget_bytes": plan["budget"],
                "memory_plan_predicted_step_s": plan["step_s"],
                "memory_plan_next": nxt.get("name"),
                "memory_plan_choice_s": plan.get("seconds")}


__all__ = ["AutoSPStrategy", "AutoSPError"]
