"""The bench package's one door to the memory planner: every name the benchmark and the GPU
check take from it (its base in ``compiler/workspace.py`` too) comes through here, so the
planner can move without touching the rest."""
from __future__ import annotations

from autosp_lm.compiler.workspace import TensorSpec, kernel_workspace
from autosp_lm.memory_plan import (HOST_OFFLOAD, STRATEGIES, Layout, model_config, predict,
                                   trace_step)
from autosp_lm.memory_plan_check import TOLERANCE, measure_step

__all__ = ["HOST_OFFLOAD", "STRATEGIES", "Layout", "model_config", "predict", "trace_step",
           "TOLERANCE", "measure_step", "TensorSpec", "kernel_workspace"]
