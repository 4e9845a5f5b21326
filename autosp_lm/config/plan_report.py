"""What ``tools/plan_memory.py`` checks of its flags before any trace and what it reports with
each plan beyond the planner's numbers: the checks of the model and its overrides, the numbers,
the options against the strategies, the length, the strategies at each SP size, ``--sp-sizes``
and ``--validate``'s shapes (each refusal one
line naming the flag and the fix, :class:`~autosp_lm.config.cli.ArgumentError`); and each plan's
``pretrain.py`` command (:mod:`.plan_command`, read back through the trainer's own flags).

The tool's ``check_flags`` runs these in order; the runs themselves are
:mod:`autosp_lm.planner.search`'s.
"""
from __future__ import annotations

import math

from .cli import ArgumentError
from .shared_flags import parse_model_overrides


def flag(dest: str) -> str:
    """The flag of an argparse ``dest`` (``seq_length``: ``--seq-length``)."""
    return "--" + dest.replace("_", "-")


def given_flags(args, parser) -> set:
    """The flags whose value is not their default (what the user set)."""
    return {k for k, v in vars(args).items() if v != parser.get_default(k)}


def number_errors(args) -> list:
    """The refusals of the plan's numbers: the sizes positive, the memories finite and not
    negative (the device's positive), a reserve that leaves some of the device."""
    out = []
    for dest in ("seq_length", "world_size", "sequence_parallel_size"):
        if getattr(args, dest) < 1:
            out.append(f"{flag(dest)} {getattr(args, dest)} must be a positive integer")
    for dest, low, strict in (("gpu_memory_gb", 0, True), ("host_memory_gb", 0, False),
                              ("reserve_gb", 0, False), ("within_percent", 0, False)):
        v = getattr(args, dest)
        if not math.isfinite(v) or v < low or (strict and v == low):
            out.append(f"{flag(dest)} {v:g} must be a {'positive' if strict else 'non-negative'} "
                       f"number")
    if not out and args.reserve_gb >= args.gpu_memory_gb:
        out.append(f"--reserve-gb {args.reserve_gb:g} leaves nothing of --gpu-memory-gb "
                   f"{args.gpu_memory_gb:g}: raise --gpu-memory-gb or lower --reserve-gb")
    return out


def option_checks(args, names: list, fail) -> None:
    """``--offload-activations`` (AutoSP's, with SAC on) and ``--sac-device`` (a cost-model
    preset) against the strategies planned."""
    from ..planner.trace import HOST_OFFLOAD, STRATEGIES
    if args.offload_activations:
        other = [n for n in names if STRATEGIES[n][0] != "autosp"]
        if other:
            fail(f"--offload-activations is AutoSP's activation offload; {', '.join(other)} "
                 f"{'has' if len(other) == 1 else 'have'} none: drop the flag, or plan "
                 f"{', '.join(sorted(HOST_OFFLOAD))} (the hand-written recipes with their "
                 f"block inputs in host memory)")
        nosac = [n for n in names if STRATEGIES[n][1].get("sac") is False]
        if nosac:
            fail(f"--offload-activations is part of AutoSP's checkpointing pass (SAC), which "
                 f"{', '.join(nosac)} turns off: plan autosp or autosp-max-offload with it")
    if args.sac_device is not None:
        from ..compiler.cost_model import device_params
        try:
            device_params(args.sac_device)
        except (ValueError, TypeError) as e:
            fail(f"--sac-device: {e}")


def length_check(args, names: list, fail) -> None:
    """A plan at ``--seq-length``: the length splits evenly over the SP ranks (into two zigzag
    halves per rank for ring)."""
    from ..planner.trace import STRATEGIES
    P = args.sequence_parallel_size
    step = 2 * P if any(STRATEGIES[n][0] == "ring" for n in names) else P
    if args.seq_length % step:
        zigzag = ", two zigzag halves for ring" if step != P else ""
        fail(f"--seq-length {args.seq_length} must be a multiple of {step} (each of the "
             f"{P} SP ranks gets an equal share{zigzag}): "
             f"e.g. {max(step, args.seq_length // step * step)}")


def strategy_checks(args, names: list, cfg, sizes: list, fail) -> None:
    """Each strategy's own refusals (``strategies.check_strategy``: heads against the SP size,
    lengths the layout cannot split), at each SP size and the length first traced."""
    from ..planner.search import first_length
    from ..planner.trace import STRATEGIES
    from ..strategies import check_strategy, strategy_class
    for sp in sizes:
        seq = first_length(args.seq_length, sp) if args.find_max_seq_length else args.seq_length
        for name in names:
            reg, extra = STRATEGIES[name]
            try:
                check_strategy(reg, cfg, 1 if reg == "none" else sp, seq,
                               strategy_class(reg).Options(**extra))
            except ValueError as e:
                fail(f"--strategy {name} at SP {sp}, {seq} tokens: {e}")


def model_of(args, fail):
    """The model config of ``--model`` with ``--model-overrides`` (both checked as parsed:
    :mod:`.shared_flags`), at a length long enough for the search; a shape the config refuses
    is ``fail``'s one line."""
    from ..planner.trace import model_config
    over = parse_model_overrides(args.model_overrides)
    try:
        return model_config(args.model, over, seq=max(args.seq_length, 1 << 20))
    except (ValueError, TypeError) as e:
        fail(f"--model {args.model} --model-overrides {args.model_overrides!r}: {e}")


def sp_sizes(args, fail) -> list:
    """The SP sizes of the search: ``--sp-sizes``, else the powers of two up to the SP size that
    divide the world, and the SP size."""
    W, P = args.world_size, args.sequence_parallel_size
    if not args.sp_sizes:
        out, s = [], 1
        while s <= P:
            if W % s == 0:
                out.append(s)
            s *= 2
        return sorted(set(out) | {P})
    try:
        sizes = sorted({int(x) for x in args.sp_sizes.split(",") if x.strip()})
    except ValueError:
        fail(f"--sp-sizes {args.sp_sizes!r} must be a comma list of integers, e.g. 1,2,4,8")
    bad = [s for s in sizes if s < 1 or W % s]
    if bad or not sizes:
        fail(f"--sp-sizes {args.sp_sizes}: each SP size must be a positive divisor of "
             f"--world-size {W} (the job is dp x sp); {', '.join(map(str, bad)) or 'none given'}"
             f" {'is' if len(bad) == 1 else 'are'} not")
    return sizes


def validate_shapes(args, fail) -> dict:
    """``--validate-shapes`` and ``--validate-lengths``: ``{"shapes": {name: config fields},
    "lengths": {name: [lengths]}}``."""
    from ..planner.check import VALIDATION_SHAPES
    names = [s for s in args.validate_shapes.split(",") if s.strip()]
    bad = [s for s in names if s not in VALIDATION_SHAPES]
    if bad or not names:
        fail(f"--validate-shapes: unknown shape {', '.join(bad) or repr(args.validate_shapes)}; "
             f"choose from {', '.join(VALIDATION_SHAPES)}")
    lengths = {}
    for item in filter(None, (x.strip() for x in args.validate_lengths.split(","))):
        shape, sep, ls = item.partition("=")
        try:
            lengths[shape] = [int(x) for x in ls.split(":")]
        except ValueError:
            lengths[shape] = []
        if not sep or not lengths[shape] or min(lengths[shape]) < 1:
            fail(f"--validate-lengths {item!r} must be shape=L1:L2:... with positive lengths, "
                 f"e.g. llama-tiny=4096:8192")
    missing = [s for s in names if s not in lengths]
    if missing:
        fail(f"--validate-lengths gives no length for {', '.join(missing)}: add "
             f"{missing[0]}=L1:L2 (e.g. {missing[0]}=4096)")
    return {"shapes": {s: VALIDATION_SHAPES[s] for s in names},
            "lengths": {s: lengths[s] for s in names}}


def command_of(args, name: str, seq: int, sp: int) -> dict:
    """The ``pretrain.py`` command of a plan (:mod:`.plan_command`: checked through the trainer's
    own parser), or why there is none: ``{"command", "command_note"}``."""
    from .plan_command import pretrain_command
    if not seq:
        return {"command": "(none: nothing fits)", "command_note": ""}
    try:
        c = pretrain_command(name, model=args.model, seq=seq, world=args.world_size, sp=sp,
                             overrides=parse_model_overrides(args.model_overrides),
                             bf16=args.bf16, fsdp2=args.use_torch_fsdp2)
    except (ValueError, ArgumentError) as e:
        return {"command": f"(none: {e})", "command_note": ""}
    # (a modelled recipe's note: once per report, tools/plan_memory.py's `modelled:` line)
    return {"command": c["command"], "command_note": "; ".join(
        n for n in c["notes"] if not n.startswith("modelled: "))}


__all__ = ["flag", "given_flags", "number_errors", "option_checks", "length_check",
           "strategy_checks", "model_of", "sp_sizes", "validate_shapes", "command_of"]
