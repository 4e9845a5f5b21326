"""The benchmark's strategy names and what each one builds: ``(strategy registry name,
options)``, the recipes of :mod:`autosp_lm.strategies.recipes` (the same names as
``pretrain.py --recipe`` and the memory planner's)."""
from __future__ import annotations

from autosp_lm.strategies.recipes import RECIPES, recipe

#: name: (strategy registry name, options), every recipe as users run it (the ALST recipes
#: eagerly, with their block inputs in host memory through saved-tensor hooks;
#: ``<name>-compiled`` is the compiled program the planner traces for them)
STRATEGIES = {n: (r.strategy, dict(r.options)) for n, r in RECIPES.items()}


def strategy_spec(name: str):
    """``(registry name, options)`` of a benchmark strategy name: the table above, or
    ``autosp-u<U>`` / ``ulysses-u<U>`` for a 2-D plan with Ulysses degree ``U`` (the rest of the
    SP size is a ring). KeyError for an unknown name."""
    if name in STRATEGIES:
        return STRATEGIES[name]
    try:
        r = recipe(name)
    except ValueError:
        raise KeyError(name) from None
    return r.strategy, dict(r.options)


def known(name: str) -> bool:
    """Whether :func:`strategy_spec` knows ``name``."""
    try:
        strategy_spec(name)
        return True
    except KeyError:
        return False
