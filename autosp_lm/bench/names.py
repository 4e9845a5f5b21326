"""The benchmark's strategy names and what each one builds: ``(strategy registry name,
options)``."""
from __future__ import annotations

from . import plan

STRATEGIES = {
    # name: (strategy registry name, options): the memory planner's names, and
    **plan.STRATEGIES,
    # the never-communicate-twice policy without sequence tiling (SAC before the cost model)
    "autosp-keepcomm": ("autosp", {"sac": True, "sac_recommunicate": False,
                                   "sequence_tiling": False}),
    "ulysses-eager": ("ulysses", {"compile": False}),
    "ring-eager": ("ring", {"compile": False}),
    "none-eager": ("none", {"compile": False}),
    # ALST as its users run it: eagerly, the checkpointed block inputs in host memory through
    # saved-tensor hooks. "<name>-compiled" is the program the planner traces and predicts
    # (planner.trace.HOST_OFFLOAD: pretrain.py --compile --cpu-offloading, the offload ops in
    # the compiled graph)
    **{n: (plan.STRATEGIES[n][0], dict(plan.STRATEGIES[n][1], compile=False))
       for n in plan.HOST_OFFLOAD},
    **{f"{n}-compiled": plan.STRATEGIES[n] for n in plan.HOST_OFFLOAD},
}


def strategy_spec(name: str):
    """``(registry name, options)`` of a benchmark strategy name: the table above, or
    ``autosp-u<U>`` / ``ulysses-u<U>`` for a 2-D plan with Ulysses degree ``U`` (the rest of the
    SP size is a ring)."""
    if name in STRATEGIES:
        return STRATEGIES[name]
    for base in ("autosp", "ulysses"):
        prefix = f"{base}-u"
        if name.startswith(prefix) and name[len(prefix):].isdigit():
            reg, options = STRATEGIES[base]
            return reg, dict(options, ulysses_degree=int(name[len(prefix):]))
    raise KeyError(name)


def known(name: str) -> bool:
    """Whether :func:`strategy_spec` knows ``name``."""
    try:
        strategy_spec(name)
        return True
    except KeyError:
        return False
