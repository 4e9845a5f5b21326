"""The benchmark's command-line values turned into cells: the strategy names and sequence
lengths, the overrides of a model preset (``cli.parse_overrides``), the checks between flags,
the fields every cell shares and the environment a run records."""
from __future__ import annotations

import os
import platform
import time

from autosp_lm.config import cli
from autosp_lm.config.cli import ArgumentError

from .names import STRATEGIES, known

#: ``--curve-fractions``' default: memory targets as fractions of AutoSP-without-SAC's saved bytes
CURVE_FRACTIONS = "0.5,0.3,0.2,0.1,0.05,0"


class BenchConfigError(ArgumentError):
    """Flags the benchmark cannot run (the message names the flag and the fix)."""


#: ``--model-overrides``: ``key=value,...``, each value an int, else a float, else a string
parse_overrides = cli.parse_overrides


def parse_strategies(text: str) -> list[str]:
    """``--strategies``: the comma-separated names, each one :func:`names.known`."""
    strategies = [s.strip() for s in text.split(",") if s.strip()]
    unknown = [s for s in strategies if not known(s)]
    if unknown:
        raise BenchConfigError(f"unknown strategy {unknown}; choose from {', '.join(STRATEGIES)}"
                               f", or autosp-u<U> / ulysses-u<U> (a 2-D plan with Ulysses degree U)")
    return strategies


def parse_lengths(text: str) -> list[int]:
    """``--seq-lengths``: comma-separated integers, sorted."""
    try:
        return sorted(int(s) for s in text.split(","))
    except ValueError:
        raise BenchConfigError(f"--seq-lengths {text!r} must be comma-separated integers") from None


def parse_fractions(text: str) -> list[float]:
    """``--curve-fractions`` / ``--curve-offload-fractions``: comma-separated numbers (empty:
    none)."""
    return [float(x) for x in text.split(",") if x.strip()]


def check_steps(steps: int, needs_times: bool) -> None:
    """``--steps``: 0 or more; 0 (memory only) not with a mode that needs step times
    (``needs_times``: --curve, --interleave, --memory-budget-gb)."""
    if steps < 0:
        raise BenchConfigError(f"--steps {steps}: give a number of timed steps, or 0 for "
                               "memory only")
    if steps == 0 and needs_times:
        raise BenchConfigError("--steps 0 measures memory only; --curve, --interleave and "
                               "--memory-budget-gb need step times: give --steps 1 or more")


def base_cell(args, device: str, overrides: dict) -> dict:
    """The fields every cell of a run shares (all but strategy and length)."""
    threads = args.threads or max(1, (os.cpu_count() or 1) // max(1, args.nproc))
    return {"model": args.model, "nproc": args.nproc, "steps": args.steps, "bf16": args.bf16,
            "fp32_residual": args.fp32_residual_connection,
            "device": device, "seed": args.seed, "micro_batch_size": args.micro_batch_size,
            "simulate_world_size": args.simulate_world_size, "threads": threads,
            "compile_backend": args.compile_backend, "packed": args.packed,
            "warm_compile_cache": args.warm_compile_cache, "overrides": overrides,
            "peak_repeats": max(0, args.peak_repeats)}


def table_cells(base: dict, strategies: list[str], lengths: list[int],
                interleave: bool) -> list[dict]:
    """The strategy table's cells, length by length; with ``interleave`` they measure memory
    only (``steps`` 0: the step times come from one job per length)."""
    cell_base = dict(base, steps=0) if interleave else base
    return [dict(cell_base, strategy=s, seq_length=L) for L in lengths for s in strategies]


def environment(args, device: str, curve: bool = False) -> dict:
    """What a run records of its machine and flags (``curve``: the shorter record of
    ``curve.json``)."""
    import torch
    env = {"torch": torch.__version__,
           "device": device if device == "cpu" else torch.cuda.get_device_name(),
           "cpu_count": os.cpu_count()}
    if not curve:
        env.update(machine=f"{platform.machine()} {platform.processor() or ''}".strip(),
                   python=platform.python_version())
    env.update(model=args.model, nproc=args.nproc, steps=args.steps)
    if not curve:
        env.update(simulate_world_size=args.simulate_world_size,
                   warm_compile_cache=args.warm_compile_cache)
    env.update(flags=vars(args), date=time.strftime("%Y-%m-%d %H:%M:%S"))
    return env
