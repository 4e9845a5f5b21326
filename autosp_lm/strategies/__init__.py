"""Where sequence parallelism happens, for every strategy: the registry and the flag checks.

==========  ======================================================  ===========================
name        what runs                                               module
==========  ======================================================  ===========================
none        data parallel; ``--compile``, ``--compile --sac``       :mod:`.none`
ulysses     hand-written all-to-all around attention                :mod:`.ulysses`
ring        hand-written load-balanced ring attention               :mod:`.ring`
autosp      the AutoSP compiler on the unchanged model              :mod:`.autosp`
==========  ======================================================  ===========================

Strategy modules are imported only when chosen (the baselines never import the compiler).
"""
from __future__ import annotations

import importlib

from .base import Strategy, extract_loss, model_inputs

#: name -> "module:class", in the order the flags are documented
REGISTRY = {
    "none": "autosp_lm.strategies.none:NoneStrategy",
    "ulysses": "autosp_lm.strategies.ulysses:UlyssesStrategy",
    "ring": "autosp_lm.strategies.ring:RingStrategy",
    "autosp": "autosp_lm.strategies.autosp:AutoSPStrategy",
}
#: the strategies chosen by a flag of their own (``--autosp`` ...); ``none`` is the default
SP_STRATEGIES = tuple(n for n in REGISTRY if n != "none")


def strategy_class(name: str) -> type:
    if name not in REGISTRY:
        raise ValueError(f"unknown strategy {name!r}; choose one of {', '.join(REGISTRY)}")
    module, cls = REGISTRY[name].split(":")
    return getattr(importlib.import_module(module), cls)


def build_strategy(name: str, ps, options=None, **kwargs) -> Strategy:
    """An instance of strategy ``name`` on the parallel state ``ps``; ``options`` is its
    options dataclass, or its fields are given as keywords."""
    return strategy_class(name)(ps, options, **kwargs)


def check_strategy(name: str, model_config, sp_size: int, seq_length: int, options=None) -> None:
    """Refuse before any work a configuration strategy ``name`` cannot run exactly."""
    strategy_class(name).check(model_config, sp_size, seq_length, options)


__all__ = ["REGISTRY", "SP_STRATEGIES", "Strategy", "build_strategy", "check_strategy",
           "strategy_class", "extract_loss", "model_inputs"]
