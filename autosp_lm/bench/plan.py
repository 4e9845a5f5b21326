"""The bench package's one door to the memory planner: every name the benchmark and the GPU
check take from it (its base in ``planner/workspace.py`` too) comes through here, so the
planner can move without touching the rest."""
from __future__ import annotations

from autosp_lm.planner.check import TOLERANCE, measure_step
from autosp_lm.planner.plan import Layout, predict, trace_step
from autosp_lm.planner.trace import HOST_OFFLOAD, STRATEGIES, model_config
from autosp_lm.planner.workspace import TensorSpec, kernel_workspace

__all__ = ["HOST_OFFLOAD", "STRATEGIES", "Layout", "model_config", "predict", "trace_step",
           "TOLERANCE", "measure_step", "TensorSpec", "kernel_workspace"]
