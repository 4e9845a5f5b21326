"""The planner's model of a step, handed to the compiler so that AutoSP chooses a plan that fits.

:func:`step_predictor` wraps the graphs AutoSP is compiling (one candidate plan's partitioned
forward and backward, :mod:`autosp_lm.compiler.memory_plan`) as a :class:`~.trace.TracedStep`
and predicts them as ``tools/plan_memory.py`` predicts a traced step (:func:`~.plan.predict`):
the liveness simulation at the batch's length plus parameters, gradients, optimizer states, the
batch, the gradient buckets and FSDP2's units, the cost model's step time, and
(:func:`~.plan.search_max`) the longest length that fits a budget. The compiler may not import
the planner, so the entry point builds the predictor here and passes it in
``AutoSPOptions.memory_predictor``; :func:`memory_plan_options` is that hand-over.
"""
from __future__ import annotations

from typing import Callable, Optional

from ..compiler.memory_plan import PlanPrediction
from .capture import Partition
from .plan import DEFAULT_RESERVE_GB, GiB, Layout, predict, search_max
from .trace import TracedStep, input_length_of, model_bytes


def step_predictor(param_bytes: list, block_bytes: list, layout: Layout, sp: int, *,
                   graph_fsdp: bool = False, seq_length: Optional[int] = None) -> Callable:
    """``predictor(partitions, plan) -> PlanPrediction`` for AutoSP's graphs of one rank of
    ``sp``: ``partitions`` are ``(fw, bw, num_fwd_outputs)`` traced with the sequence dims
    symbolic (AutoSP's inputs are full length), ``plan`` the compile report's U x R plan.
    ``param_bytes``/``block_bytes``: :func:`~.trace.model_bytes` of the unsharded model;
    ``graph_fsdp``: its parameters are gathered in the graph over ``layout.world`` ranks."""

    inner_cache: dict = {}  # custom ops' inner peaks by (op, shapes): the candidates share them

    def predictor(partitions: list, plan: dict) -> PlanPrediction:
        parts = [Partition(*p) for p in partitions]
        length = input_length_of(parts) or seq_length or int(plan.get("traced_length") or 0)
        traced = TracedStep("autosp", sp, length, length, parts, param_bytes, block_bytes,
                            dict(plan), zigzag=plan.get("layout") == "zigzag",
                            graph_fsdp_world=layout.world if graph_fsdp else 0,
                            inner_cache=inner_cache)
        out = predict(traced, length, layout)

        def longest(budget: int, cap: int) -> int:
            return search_max(traced, layout, budget, cap=max(cap, 1))

        return PlanPrediction(peak=int(out["peak_bytes"]), step_s=float(out["predicted_step_s"]),
                              host=int(out["host_bytes"]),
                              static=int(out["static_bytes"]),
                              longest=longest)
    return predictor


def default_budget(device) -> Optional[int]:
    """The budget without ``--memory-budget-gb``: a CUDA device's memory minus the planner's
    reserve (:data:`~.plan.DEFAULT_RESERVE_GB`); None elsewhere (no budget, no choice)."""
    import torch
    if getattr(device, "type", str(device)) != "cuda" or not torch.cuda.is_available():
        return None
    total = torch.cuda.get_device_properties(device).total_memory
    return int(total - DEFAULT_RESERVE_GB * GiB)


def memory_plan_options(model, *, budget_gb: Optional[float], device, world: int, sp: int,
                        fsdp2: bool = False, bf16: bool = False,
                        seq_length: Optional[int] = None) -> dict:
    """The ``AutoSPOptions`` fields of the memory plan for ``model`` (unsharded, before FSDP
    wraps it): ``memory_budget`` (``budget_gb`` GiB, else :func:`default_budget`) and
    ``memory_predictor``; {} when there is no budget."""
    budget = int(budget_gb * GiB) if budget_gb is not None else default_budget(device)
    if budget is None:
        return {}
    pbytes, block_bytes = model_bytes(model)
    kind = getattr(device, "type", str(device))
    layout = Layout(world=world, fsdp2=fsdp2, bf16=bf16, device="cuda" if kind == "cuda" else "cpu")
    return dict(memory_budget=budget,
                memory_predictor=step_predictor(pbytes, block_bytes, layout, sp,
                                                graph_fsdp=fsdp2 and world > 1,
                                                seq_length=seq_length))


__all__ = ["default_budget", "memory_plan_options", "step_predictor"]
