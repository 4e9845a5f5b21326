"""The ``pretrain.py`` command that runs a plan: the planner's answer as the flags of the run.

A planner strategy name (:data:`autosp_lm.planner.trace.STRATEGIES`) is a strategy and its
options; the command names the same strategy with the flags whose options are those, plus the
model, the length, the parallel layout and the precision of the plan. The command is checked before it is returned: its
flags go through the trainer's own parser and checks (``autosp_lm.config.arguments``: ``parse_args``,
``validate_args``, ``strategy_options``, ``model_config``), and every option of the plan and every
field of the model must come back equal, or it raises. So the offline answer and the run cannot
drift apart silently: a new option without a flag, or a flag that means something else, fails
here (and in ``tests/tools/test_plan_command.py``, for every planner strategy). It sits with
pretrain's flags (beside ``arguments``), above the planner, since it reads the flags back.

Where the trainer runs a plan differently from the traced program, the command says so in its
``note``: under ``--use-torch-fsdp2`` the recipes' compiled ``--cpu-offloading`` is refused (FSDP2's
units split the graph) and the trainer runs the recipe eagerly, with the same offload by
saved-tensor hooks.
"""
from __future__ import annotations

import dataclasses
import shlex
from typing import Optional

from ..planner.trace import GPUS_PER_NODE, HOST_OFFLOAD, STRATEGIES, model_config

def _option_flags(key: str, value) -> list:
    flag = "--" + key.replace("_", "-")
    if value is True:
        return [flag]
    if value is False:
        return ["--no-" + key.replace("_", "-")]  # --no-sac
    return [flag, str(value)]


def _override_flags(overrides: dict) -> list:
    out = []
    for k, v in overrides.items():
        out += ["--" + k.replace("_", "-"), str(v)]
    return out


def _check(argv: list, world: int, name: str, options: dict, cfg) -> None:
    """``argv`` through the trainer's parser and checks: the plan's options and model back."""
    from .arguments import model_config as args_model_config
    from .arguments import parse_args, strategy_options, validate_args
    args = validate_args(parse_args(argv), world)
    got = strategy_options(args)
    bad = [f"{k}={getattr(got, k, None)!r} (plan: {v!r})" for k, v in options.items()
           if getattr(got, k, None) != v]
    if args.strategy != STRATEGIES[name][0]:
        bad.append(f"strategy {args.strategy!r} (plan: {STRATEGIES[name][0]!r})")
    want = {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg)}
    have = args_model_config(args)
    bad += [f"model {k}={getattr(have, k, None)!r} (plan: {v!r})" for k, v in want.items()
            if getattr(have, k, None) != v]
    if bad:
        raise ValueError(f"plan command for {name!r}: the trainer reads {' '.join(argv)} as "
                         f"{'; '.join(bad)}")


def pretrain_command(name: str, *, model: str, seq: int, world: int, sp: int,
                     overrides: Optional[dict] = None, bf16: bool = False,
                     fsdp2: bool = False) -> dict:
    """``{"command": the shell line, "flags": pretrain.py's arguments, "note": ...}`` that runs
    planner strategy ``name`` on ``world`` GPUs (``sp`` of them one sequence-parallel group) at
    ``seq`` tokens (micro batch 1, one micro batch a data-parallel rank and step). Add the data
    flags (``--data-path`` ... or ``--mock-data``) and the schedule; the rest is the plan."""
    if name not in STRATEGIES:
        raise ValueError(f"unknown planner strategy {name!r}")
    registry, options = STRATEGIES[name]
    options = dict(options)
    overrides = dict(overrides or {})
    note = ""
    if fsdp2 and name in HOST_OFFLOAD and options.get("compile"):
        options.pop("compile")  # the trainer refuses it: it runs the recipe eagerly
        note = ("eager: under --use-torch-fsdp2 the trainer runs the recipe's offload by "
                "saved-tensor hooks (the compiled offload needs the blocks in one graph); the "
                "plan traced the compiled program")
    cfg = model_config(model, overrides, seq=seq)
    if cfg.max_position_embeddings != model_config(model, overrides).max_position_embeddings:
        overrides["max_position_embeddings"] = cfg.max_position_embeddings  # as the plan's
    dp = world // (sp if registry != "none" else 1)
    flags = ["--model", model, *_override_flags(overrides), "--seq-length", str(seq),
             "--micro-batch-size", "1", "--global-batch-size", str(dp)]
    if registry != "none":
        flags += [f"--{registry}", "--sequence-parallel-size", str(sp)]
    for key, value in options.items():
        if key == "sac" and value is True and registry == "autosp":
            continue  # AutoSP's default
        flags += _option_flags(key, value)
    if bf16:
        flags.append("--bf16")
    if fsdp2:
        flags.append("--use-torch-fsdp2")
    _check(flags, world, name, options, cfg)
    nodes = max(1, world // GPUS_PER_NODE)
    launch = ["torchrun"] + (["--nnodes", str(nodes)] if nodes > 1 else []) + \
        ["--nproc-per-node", str(world // nodes), "pretrain.py"]
    return {"command": shlex.join(launch + flags), "flags": flags, "note": note}
