"""AutoSP: compiler passes that turn a single-device decoder into sequence-parallel training.

``run = autosp_compile(model, sp_group)`` then ``run(input_ids=..., labels=...)``; the pass stack
is listed in :mod:`autosp_lm.compiler.pipeline`, the design in docs/autosp.md.
"""
from .api import AutoSPRunner, autosp_compile, check_sequence_length, mark_sequence, sac_compile
from .graph import AutoSPError
from .kernels import register_kernel
from .memory_plan import NoPlanFits
from .passes.sac import DEFAULT_BUDGET
from .pipeline import AutoSPOptions

__all__ = ["autosp_compile", "sac_compile", "mark_sequence", "AutoSPRunner", "AutoSPError",
           "AutoSPOptions", "DEFAULT_BUDGET", "check_sequence_length", "register_kernel",
           "NoPlanFits"]
