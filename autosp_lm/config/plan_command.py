"""The ``pretrain.py`` command that runs a plan: the planner's answer as the flags of the run.

A planner strategy name is a recipe (:mod:`autosp_lm.strategies.recipes`, the names of
``pretrain.py --recipe``); the command names it with ``--recipe NAME``, plus the model, the
length, the parallel layout and the precision of the plan. The command is checked before it is
returned: its flags go through the trainer's own parser and checks (``autosp_lm.config``:
``arguments.parse_args``, ``build.build_run_config``), and the recipe's strategy, each of its
options and every field of the model must come back equal, or it raises. So the offline answer
and the run cannot drift apart silently: a new option without a flag, or a flag that means
something else, fails here (and in ``tests/tools/test_plan_command.py``, for every planner
strategy). It sits with pretrain's flags, above the planner, since it reads the flags back.

Where the trainer runs another program than the one the planner traced, the command says so in
its ``note``: the eager ALST / UPipe recipes are planned as their compiled program (the recipe's
``modelled``), and under ``--use-torch-fsdp2`` a recipe's compiled ``--cpu-offloading`` is refused
(FSDP2's units split the graph): the trainer runs that recipe eagerly, with the same offload by
saved-tensor hooks, and the command names its strategy and options instead of the recipe.
"""
from __future__ import annotations

import dataclasses
import shlex
from typing import Optional

from ..planner.trace import GPUS_PER_NODE, model_config
from ..strategies.recipes import planner_spec, recipe
from .recipe_flags import options_argv, strategy_flag

FSDP2_EAGER = ("eager: under --use-torch-fsdp2 the trainer runs the recipe's offload by "
               "saved-tensor hooks (the compiled offload needs the blocks in one graph); the "
               "plan traced the compiled program")


def _override_flags(overrides: dict) -> list:
    out = []
    for k, v in overrides.items():
        out += ["--" + k.replace("_", "-"), str(v)]
    return out


def _check(argv: list, world: int, name: str, registry: str, options: dict, cfg) -> None:
    """``argv`` through the trainer's parser and checks: the plan's options and model back."""
    from .arguments import parse_args
    from .build import build_run_config
    run = build_run_config(parse_args(argv), world)
    got = run.strategy_options
    bad = [f"{k}={getattr(got, k, None)!r} (plan: {v!r})" for k, v in options.items()
           if getattr(got, k, None) != v]
    if run.strategy != registry:
        bad.append(f"strategy {run.strategy!r} (plan: {registry!r})")
    want = {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg)}
    have = run.model.config
    bad += [f"model {k}={getattr(have, k, None)!r} (plan: {v!r})" for k, v in want.items()
            if getattr(have, k, None) != v]
    if bad:
        raise ValueError(f"plan command for {name!r}: the trainer reads {' '.join(argv)} as "
                         f"{'; '.join(bad)}")


def pretrain_command(name: str, *, model: str, seq: int, world: int, sp: int,
                     overrides: Optional[dict] = None, bf16: bool = False,
                     fsdp2: bool = False) -> dict:
    """``{"command": the shell line, "flags": pretrain.py's arguments, "note": ..., "notes":
    the note's sentences}`` that runs planner strategy (recipe) ``name`` on ``world`` GPUs
    (``sp`` of them one sequence-parallel group) at ``seq`` tokens (micro batch 1, one micro
    batch a data-parallel rank and step). Add the data flags (``--data-path`` ... or
    ``--mock-data``) and the schedule; the rest is the plan."""
    try:
        r = recipe(name)
        modelled = planner_spec(name)[2]
    except ValueError as e:
        raise ValueError(f"plan command: {e}") from None
    registry, options = r.strategy, dict(r.options)
    overrides = dict(overrides or {})
    notes = [f"modelled: {modelled}"] if modelled else []
    as_is = True
    if fsdp2 and options.get("cpu_offloading") and options.get("compile"):
        options["compile"] = False  # the trainer refuses it: it runs the recipe eagerly
        as_is = False
        notes.append(FSDP2_EAGER)
    cfg = model_config(model, overrides, seq=seq)
    if cfg.max_position_embeddings != model_config(model, overrides).max_position_embeddings:
        overrides["max_position_embeddings"] = cfg.max_position_embeddings  # as the plan's
    dp = world // (sp if registry != "none" else 1)
    flags = ["--model", model, *_override_flags(overrides), "--seq-length", str(seq),
             "--micro-batch-size", "1", "--global-batch-size", str(dp)]
    flags += ["--recipe", name] if as_is else strategy_flag(registry)
    if registry != "none":
        flags += ["--sequence-parallel-size", str(sp)]
    if not as_is:
        flags += options_argv(registry, options)
    if bf16:
        flags.append("--bf16")
    if fsdp2:
        flags.append("--use-torch-fsdp2")
    _check(flags, world, name, registry, options, cfg)
    nodes = max(1, world // GPUS_PER_NODE)
    launch = ["torchrun"] + (["--nnodes", str(nodes)] if nodes > 1 else []) + \
        ["--nproc-per-node", str(world // nodes), "pretrain.py"]
    return {"command": shlex.join(launch + flags), "flags": flags, "note": "; ".join(notes),
            "notes": notes}
