"""The recipes: named presets of a strategy and its options, one table for every tool.

``pretrain.py --recipe NAME``, the memory planner (``tools/plan_memory.py --strategy NAME``)
and the benchmark (``tools/benchmark_sp.py --strategies NAME``) read :data:`RECIPES`, so a name
means the same program everywhere: the strategy (its registry name, :mod:`autosp_lm.strategies`)
and the fields of its ``Options`` the preset sets (the rest keep their defaults).

The plain name is the program users run: the hand-written strategies compiled (``none``,
``ulysses``, ``ring``, the ``+ac`` recipes), ALST and UPipe eagerly, their checkpointed block
inputs moved to host memory by saved-tensor hooks (``ulysses+alst``, ``ring+alst``,
``ulysses+upipe``); ``<name>-compiled`` is that recipe compiled, its offload done by the offload
ops in the graph, and ``<name>-eager`` the strategy without compilation.

The planner traces compiled programs. A recipe it cannot trace as it runs carries
``traced_options``, the program the planner traces instead, and ``modelled``, why that program
stands for it; the ``-eager`` recipes it does not model at all (:func:`planner_spec` refuses
them). Beside the table, ``autosp-u<U>`` and ``ulysses-u<U>`` are ``autosp`` and ``ulysses``
with Ulysses degree ``U`` (the rest of the SP size a ring).
"""
from __future__ import annotations

from dataclasses import dataclass
from types import MappingProxyType
from typing import Mapping, Optional

__all__ = ["ALST_MODELLED", "RECIPES", "Recipe", "planner_spec", "recipe"]


@dataclass(frozen=True)
class Recipe:
    """One named configuration: ``strategy`` (registry name) with ``options`` (fields of the
    strategy's ``Options``); ``traced_options`` and ``modelled``: where the planner traces
    another program for it, that program's options and why it stands for this one."""

    name: str
    strategy: str
    options: Mapping
    description: str
    traced_options: Optional[Mapping] = None
    modelled: Optional[str] = None

    def __post_init__(self):
        object.__setattr__(self, "options", MappingProxyType(dict(self.options)))
        if self.traced_options is not None:
            object.__setattr__(self, "traced_options",
                               MappingProxyType(dict(self.traced_options)))
        if (self.traced_options is None) != (self.modelled is None):
            raise ValueError(f"recipe {self.name!r}: traced_options and modelled go together")

    @property
    def eager(self) -> bool:
        """Whether the program runs eagerly (a hand-written strategy without ``compile``)."""
        return self.strategy != "autosp" and not self.options.get("compile", False)

    @property
    def program(self) -> str:
        """``compiled`` or ``eager``."""
        return "eager" if self.eager else "compiled"


#: why the planner's prediction of the eager ALST / UPipe recipes holds
ALST_MODELLED = ("the recipe runs eagerly, its checkpointed block inputs moved to host memory by "
                 "saved-tensor hooks; the planner traces its compiled program (`<name>-compiled`, "
                 "pretrain.py --compile --cpu-offloading), whose offload ops move the same block "
                 "inputs")

_AC = {"compile": True, "recompute_granularity": "full", "recompute_method": "uniform",
       "recompute_num_layers": 1, "chunked_loss": True}
_ALST = dict(_AC, tiled_mlp=True, cpu_offloading=True)
# UPipe: +alst with each rank's heads attended in chunks, one query head of each rank a chunk
# (attention_head_chunks=0: the official implementation's stages)
_UPIPE = dict(_ALST, attention_head_chunks=0)


def _table() -> dict:
    rows = [
        ("none", "none", {"compile": True}, "data parallel, compiled"),
        ("ulysses", "ulysses", {"compile": True},
         "hand-written Ulysses, compiled; every activation kept"),
        ("ring", "ring", {"compile": True},
         "hand-written zigzag ring attention, compiled; every activation kept"),
        ("autosp", "autosp", {"sac": True}, "AutoSP, its default SAC plan"),
        ("autosp-nosac", "autosp", {"sac": False}, "AutoSP without SAC"),
        ("autosp-offload", "autosp", {"sac": True, "offload_activations": True},
         "AutoSP's SAC plan, its saved activations in host memory (--offload-activations)"),
        ("autosp-max", "autosp", {"sac": True, "max_context": True},
         "AutoSP's max-context mode (--max-context)"),
        ("autosp-max-offload", "autosp",
         {"sac": True, "max_context": True, "offload_activations": True},
         "the max-context mode, its layer inputs in host memory"),
        ("none+ac", "none", _AC,
         "full recomputation (one block a checkpoint), chunked loss, compiled"),
        ("ulysses+ac", "ulysses", _AC,
         "Ulysses + full recomputation, chunked loss, compiled (Megatron, torchtitan)"),
        ("ring+ac", "ring", _AC, "ring + full recomputation, chunked loss, compiled"),
    ]
    out = {n: Recipe(n, reg, opts, text) for n, reg, opts, text in rows}
    offloading = [("ulysses+alst", "ulysses", _ALST,
                   "ALST: Ulysses + full recomputation, chunked loss, tiled MLP, block inputs "
                   "in host memory"),
                  ("ring+alst", "ring", _ALST, "the ALST recipe on ring attention"),
                  ("ulysses+upipe", "ulysses", _UPIPE,
                   "UPipe: the ALST recipe, attention one query head of each rank at a time")]
    for n, reg, opts, text in offloading:  # as users run them: eagerly
        out[n] = Recipe(n, reg, dict(opts, compile=False), f"{text}; eager",
                        traced_options=opts, modelled=ALST_MODELLED)
    out["autosp-keepcomm"] = Recipe(
        "autosp-keepcomm", "autosp",
        {"sac": True, "sac_recommunicate": False, "sequence_tiling": False},
        "AutoSP's SAC never running a collective twice, no sequence tiling (SAC before its "
        "cost model)")
    for base in ("ulysses", "ring", "none"):
        out[f"{base}-eager"] = Recipe(f"{base}-eager", base, {"compile": False},
                                      f"{out[base].description.split(',')[0]}, eager")
    for n, reg, opts, text in offloading:
        out[f"{n}-compiled"] = Recipe(f"{n}-compiled", reg, opts,
                                      f"{text}; compiled, the offload ops in the graph")
    return out


#: name -> :class:`Recipe`, in the order the tools list them
RECIPES: dict = _table()


def _two_d(name: str) -> Optional[Recipe]:
    """``autosp-u<U>`` / ``ulysses-u<U>``: the base recipe with Ulysses degree ``U``."""
    for base in ("autosp", "ulysses"):
        prefix = f"{base}-u"
        if name.startswith(prefix) and name[len(prefix):].isdigit():
            b, degree = RECIPES[base], int(name[len(prefix):])
            return Recipe(name, b.strategy, dict(b.options, ulysses_degree=degree),
                          f"{b.description}; Ulysses degree {degree}, the rest of the SP "
                          f"size a ring")
    return None


def recipe(name: str) -> Recipe:
    """The recipe called ``name`` (a name of :data:`RECIPES`, or ``autosp-u<U>`` /
    ``ulysses-u<U>``); ValueError naming the known names."""
    found = RECIPES.get(name) or _two_d(name)
    if found is None:
        raise ValueError(f"unknown recipe {name!r}; the recipes: {', '.join(RECIPES)} (and "
                         f"autosp-u<U>, ulysses-u<U>: Ulysses degree U)")
    return found


def planner_spec(name: str) -> tuple:
    """``(registry name, options the planner traces, why they model the recipe or None)`` of
    recipe ``name``. ValueError for a recipe the planner does not model (an ``-eager`` one:
    eager autograd saves what each op saves, which no traced graph says)."""
    r = recipe(name)
    if r.traced_options is not None:
        return r.strategy, dict(r.traced_options), r.modelled
    if r.eager:
        twin = name[:-len("-eager")] if name.endswith("-eager") else None
        raise ValueError(
            f"recipe {name!r} runs eagerly: the memory planner traces compiled graphs and has "
            f"no model of what eager autograd saves"
            + (f"; plan {twin!r} (the same strategy, compiled)" if twin in RECIPES else ""))
    return r.strategy, dict(r.options), None
