"""AutoSP: compiler passes that turn a single-device decoder into sequence-parallel training.

``run = autosp_compile(model, sp_group)`` then ``run(input_ids=..., labels=...)``; see
docs/autosp.md for the design and :mod:`autosp_lm.compiler.backend` for the pass order.
"""
from .api import AutoSPRunner, autosp_compile, mark_sequence
from .common import AutoSPError

__all__ = ["autosp_compile", "mark_sequence", "AutoSPRunner", "AutoSPError"]
