#!/usr/bin/env python
"""Side-by-side benchmark of the sequence-parallel strategies.

    python tools/benchmark_sp.py --model llama-tiny --strategies none,ulysses,ring,autosp,autosp-nosac \
        --seq-lengths 2048,4096 --nproc 2 --output bench_out

Each (strategy, sequence length) cell runs as its own ``torchrun`` job (a crash or OOM of one cell
is recorded as a failed cell, the others go on), on the same model, seed and batch. Per cell:
median step time after warm-up, tokens/s, TFLOP/s per device, bytes saved for backward per local
token (deterministic), peak memory of one steady-state step, the first step's loss (all strategies
must agree; disagreements are flagged) and compile time: the first step's time minus the median
step's (Dynamo tracing, the passes, AOTAutograd and code generation), measured with empty compile
caches (each cell gets fresh Inductor/Triton cache directories), i.e. what the first iteration of a
first run costs (``--warm-compile-cache`` reuses your caches instead). ``none`` is one rank holding
the whole sequence: the reference row.

Writes ``DIR/results.json``, ``DIR/results.md`` and PNG plots; logs to W&B with --wandb-project.
``--memory-budget-gb B`` finds the longest trainable sequence per strategy within B per rank: by a
real search on CUDA (double, then bisect; each trial a fresh process; an OOM is a result), by a
fit of the exact peak live tensor memory of a step (above weights and optimizer state) against
sequence length on CPU (labelled as a fit everywhere; it needs two or more --seq-lengths, and says
so otherwise). Plots need matplotlib (the ``bench`` extra:
``pip install -e ".[bench]"``).
``--curve`` prints and writes the memory vs step-time curve of the SAC memory target (AutoSP
without SAC, Ulysses, the default policy, the never-communicate-twice flag, offload, and memory
targets at ``--curve-fractions`` of the no-SAC saved bytes; ``--curve-offload-fractions``: targets
with ``--offload-activations``; saved bytes are those kept on the device, offload's host copies
apart). Peak live memory (exact on CPU:
:class:`~autosp_lm.training.memory.LivePeak`) is reported for every strategy.
``--simulate-world-size P`` runs one rank's share of a P-way job on one device with a fake process
group (collectives return correctly shaped, meaningless tensors): per-rank memory and compute of
large SP jobs on one GPU; communication time is excluded and losses are not comparable.
"""
from __future__ import annotations

import argparse
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from autosp_lm.bench import cell, harness, options, report  # noqa: E402
from autosp_lm.bench.names import STRATEGIES  # noqa: E402
from autosp_lm.bench.options import CURVE_FRACTIONS  # noqa: E402
from autosp_lm.bench.plots import make_plots  # noqa: E402
from autosp_lm.config.cli import ArgumentError, HelpFormatter  # noqa: E402
from autosp_lm.config.shared_flags import (add_bf16, add_fp32_residual_connection,  # noqa: E402
                                           add_model, add_model_overrides,
                                           add_sequence_parallel_size, parse_model_overrides)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=HelpFormatter)
    add_model(p, "llama-tiny", help="model preset")
    add_model_overrides(p, help="shape overrides of the preset, e.g. "
                                "hidden_size=512,num_layers=4,vocab_size=8192 (or a JSON object)")
    p.add_argument("--strategies", default="none,ulysses,ring,autosp,autosp-nosac",
                   help=f"comma-separated, from: {','.join(STRATEGIES)}")
    p.add_argument("--seq-lengths", default="2048,4096", help="comma-separated sequence lengths")
    add_sequence_parallel_size(p, 2, help="ranks per sequence-parallel job", flags=("--nproc",))
    p.add_argument("--output", default="bench_out", help="output directory")
    p.add_argument("--steps", type=int, default=5,
                   help="timed steps per cell (median reported; 0: memory only, for cells too "
                        "slow to time: saved bytes and peak live, no step time)")
    p.add_argument("--peak-repeats", type=int, default=3,
                   help="steps measured for the resident-set / max_memory_allocated peak (median; "
                        "0: none, for slow cells; the exact live peak is always measured)")
    p.add_argument("--micro-batch-size", type=int, default=1, help="samples per step")
    add_bf16(p)
    add_fp32_residual_connection(p)
    p.add_argument("--packed", action="store_true",
                   help="train on packed samples of the built-in corpus with document masking "
                        "(--reset-attention-mask --reset-position-ids --eod-mask-loss); TFLOP/s "
                        "count the attention the masks leave")
    p.add_argument("--device", choices=["cpu", "cuda"], default=None, help="device of every cell (default: cuda when available)")
    p.add_argument("--memory-budget-gb", type=float, help="find the longest sequence per strategy within this per-rank budget")
    p.add_argument("--simulate-world-size", type=int, help="one rank's share of a P-way SP job on one device (fake process group)")
    p.add_argument("--seed", type=int, default=1234, help="model and data seed")
    p.add_argument("--threads", type=int, default=0, help="CPU threads per rank (0: cores / ranks)")
    p.add_argument("--cell-timeout", type=float, default=1200, help="seconds before a cell is recorded as failed")
    p.add_argument("--compile-backend", "--autosp-backend", dest="compile_backend",
                   choices=["inductor", "aot_eager"], default="inductor",
                   help="code generation of the compiled strategies")
    p.add_argument("--warm-compile-cache", action="store_true",
                   help="reuse the on-disk Inductor/Triton caches (the compile column then measures a "
                        "cache hit where there is one; default: fresh caches per cell)")
    p.add_argument("--curve", action="store_true",
                   help="instead of the strategy table: the memory vs step-time curve of the SAC "
                        "memory target at each --seq-lengths (curve.md, curve.json, curve.png)")
    p.add_argument("--curve-fractions", default=CURVE_FRACTIONS,
                   help="--curve: memory targets as fractions of the bytes AutoSP without SAC saves")
    p.add_argument("--curve-offload-fractions", default="",
                   help="--curve: memory targets (same fractions) with --offload-activations, "
                        "met by offload first (empty: none)")
    p.add_argument("--interleave", action="store_true",
                   help="time the strategies (or --curve's points) of each length in one job, "
                        "one step of each in turn (the order rotated every round), instead of one "
                        "job after the other: on a machine whose speed drifts (shared hosts, "
                        "clocks) the ratios then compare like with like; memory is still "
                        "measured one job per cell; the table also gives the per-round ratio of "
                        "each step's thread CPU time (compute without waiting in collectives); "
                        "the timing job holds every strategy's model and optimizer state at once")
    p.add_argument("--wandb-project", help="log the table and plots to W&B (offline unless configured)")
    return p.parse_args(argv)



def main(argv=None):
    if argv is None:
        argv = sys.argv[1:]
    if argv and argv[0] == "--worker":  # a cell's job (the launcher runs autosp_lm.bench.cell)
        return cell.worker_main(argv[1:])
    args = parse_args(argv)
    try:
        return run(args)
    except ArgumentError as e:  # options.BenchConfigError, --model-overrides
        sys.exit(f"benchmark_sp.py: {e}")


def run(args):
    import torch
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    strategies = options.parse_strategies(args.strategies)
    seqs = options.parse_lengths(args.seq_lengths)
    options.check_steps(args.steps, bool(args.curve or args.memory_budget_gb or args.interleave))
    if args.simulate_world_size and device != "cuda":
        print("note: --simulate-world-size on CPU: figures are per-rank compute only", file=sys.stderr)
    overrides = parse_model_overrides(args.model_overrides)
    os.makedirs(args.output, exist_ok=True)
    base = options.base_cell(args, device, overrides)
    out = args.output
    if args.curve:
        fractions = options.parse_fractions(args.curve_fractions)
        off = options.parse_fractions(args.curve_offload_fractions)
        curves = {L: harness.run_curve(base, L, fractions, args.cell_timeout, off, args.interleave)
                  for L in seqs}
        env = options.environment(args, device, curve=True)
        report.write_json(os.path.join(out, "curve.json"),
                          curves={str(k): v for k, v in curves.items()}, environment=env)
        plots = report.write_curve(out, curves, env)
        print(open(os.path.join(out, "curve.md")).read())
        print(f"wrote {out}/curve.json, curve.md" + "".join(f", {os.path.basename(p)}" for p in plots))
        return curves
    cells = options.table_cells(base, strategies, seqs, args.interleave)
    results = harness.run_cells(cells, args.cell_timeout)
    if args.interleave:
        harness.interleave_table(base, seqs, strategies, results, args.cell_timeout)
    if not args.simulate_world_size:
        harness.flag_loss_mismatch(results, seqs)
    max_ctx = (harness.max_context(base, strategies, seqs, results, args.memory_budget_gb,
                                   args.cell_timeout) if args.memory_budget_gb else {})
    env = options.environment(args, device)
    report.write_json(os.path.join(out, "results.json"), results=results, environment=env,
                      max_context=max_ctx)
    report.write_markdown(os.path.join(out, "results.md"), results, env, max_ctx)
    plots = make_plots(out, results, max_ctx)
    if args.wandb_project:
        report.log_wandb(args.wandb_project, out, env, results, plots)
    print(open(os.path.join(out, "results.md")).read())
    print(f"wrote {out}/results.json, results.md" + "".join(f", {os.path.basename(p)}" for p in plots))
    return results


if __name__ == "__main__":
    main()
