#!/usr/bin/env python
"""Will it fit? Per-GPU peak memory and the longest trainable context, predicted without a GPU.

    python tools/plan_memory.py --model llama-3.1-8b --seq-length 131072 --world-size 8 \\
        --sequence-parallel-size 8 --strategy autosp --bf16 --gpu-memory-gb 80 --output plan.json
    python tools/plan_memory.py --model llama-3.1-8b --world-size 8 --sequence-parallel-size 8 \\
        --strategy none,ulysses,ring,autosp,autosp-nosac --bf16 --find-max-seq-length --output max.json
    python tools/plan_memory.py --validate --output docs/bench/plan_memory_cpu.json

The real graphs of each strategy are compiled for one rank on fake tensors (nothing is allocated;
the process group is faked), with the sequence length symbolic, and the live tensors of one
training step are simulated in execution order (autosp_lm/planner/; the model of memory,
what it counts and what it does not, is docs/plan_memory.md). The breakdown at the peak is
printed and written to JSON. ``--find-max-seq-length`` searches, per strategy and per SP size of
``--sp-sizes``, the longest length (a multiple of the SP size and of 128) whose predicted peak fits
``--gpu-memory-gb`` minus ``--reserve-gb``, and plots max context vs SP size (PNG next to the
JSON; skipped, with a line saying so, where matplotlib is not installed: it is an extra, and the
JSON is written first). ``--validate`` compares predictions with the measured CPU peak of real
runs and writes the table (Markdown next to the JSON).

Progress goes to stderr, one line per event with the seconds so far (the strategy and SP size,
each trace with its number, the depth extrapolation's cut models included, each length tried);
``--quiet`` turns it off. Flags are checked before any trace: a bad value or combination is one
line naming it and the fix, and so is an error inside the planner (``--debug``: its traceback).
"""
from __future__ import annotations

import argparse
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from autosp_lm.config import cli  # noqa: E402
from autosp_lm.config.cli import HelpFormatter  # noqa: E402
from autosp_lm.config.plan_report import (command_of as _command, flag, given_flags,  # noqa: E402
                                          length_check, model_of, number_errors, option_checks,
                                          sp_sizes as _sp_sizes, strategy_checks,
                                          validate_shapes)
from autosp_lm.config.shared_flags import (add_bf16, add_model, add_model_overrides,  # noqa: E402
                                           add_seq_length, add_sequence_parallel_size)
from autosp_lm.planner import search  # noqa: E402
from autosp_lm.planner.search import plot  # noqa: E402 (called here: a test stands in for it)

PROG = "plan_memory.py"


def parse_args(argv=None):
    return build_parser().parse_args(argv)


def build_parser() -> argparse.ArgumentParser:
    from autosp_lm.planner.plan import DEFAULT_RESERVE_GB
    from autosp_lm.planner.trace import STRATEGIES
    p = cli.Parser(prog=PROG, description=__doc__.split("\n\n")[0],
                   formatter_class=HelpFormatter)
    add_model(p, "llama-3.1-8b", help="model preset")
    add_model_overrides(p, help="shape overrides of the preset, e.g. "
                                "num_layers=4,hidden_size=512 (or a JSON object)")
    add_seq_length(p, 131072, help="tokens per micro batch (micro batch size 1); with --find-max-"
                                   "seq-length the length the graphs are first traced at")
    p.add_argument("--world-size", type=int, default=8, help="GPUs of the job (dp x sp)")
    add_sequence_parallel_size(p, 8, help="SP size")
    p.add_argument("--strategy", default="autosp",
                   help=f"comma-separated, from: {','.join(STRATEGIES)}")
    add_bf16(p, help="bf16 autocast (fp32 master weights)")
    p.add_argument("--use-torch-fsdp2", action="store_true",
                   help="parameters, gradients and optimizer states sharded over all ranks "
                        "(PyTorch FSDP2; an analytic term for the gathered units: "
                        "docs/plan_memory.md); with --validate: the measured runs shard too")
    p.add_argument("--offload-activations", action="store_true",
                   help="AutoSP's activation offload to host memory (AutoSP's strategies only)")
    p.add_argument("--gpu-memory-gb", type=float, default=80.0,
                   help="the device's memory in GiB (with --device cpu: the memory the step "
                        "may use)")
    p.add_argument("--host-memory-gb", type=float, default=2048.0,
                   help="host memory per node in GiB, shared by its GPUs (planner.trace."
                        "GPUS_PER_NODE): a plan whose offloaded activations (ulysses+alst / "
                        "ring+alst checkpoint inputs, AutoSP's --offload-activations) exceed "
                        "the per-GPU share does not fit; 0: no limit")
    p.add_argument("--reserve-gb", type=float, default=DEFAULT_RESERVE_GB,
                   help="allocator reserve in GiB, subtracted from --gpu-memory-gb: CUDA context, "
                        "NCCL/cuBLAS workspaces, caching-allocator fragmentation")
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda",
                   help="the device the step runs on: its attention kernels' own workspace "
                        "(autosp_lm/planner/workspace.py) and the optimizer path (both torch's "
                        "fused AdamW, updates in place: no temporaries)")
    p.add_argument("--sac-device", default=None,
                   help="the cost-model preset AutoSP's SAC prices its plan with (as pretrain.py "
                        "--sac-device: a preset name or 'name,field=value,...'); default: the "
                        "one the step's --device picks there, h100-nvlink on CUDA "
                        "(h100-cross-node when SP spans more than a node of 8), cpu on CPU")
    p.add_argument("--no-depth-extrapolation", action="store_true",
                   help="trace every block of the model (default: a model of more than 4 alike "
                        "blocks is traced cut to 2 and 3 blocks and extrapolated to its depth; "
                        "docs/plan_memory.md)")
    p.add_argument("--check-depth", action="store_true",
                   help="with depth extrapolation: trace 4 blocks too and refuse a prediction "
                        "whose extrapolation to 4 blocks differs from that trace")
    p.add_argument("--output", help="JSON file to write (PNG / Markdown next to it)")
    p.add_argument("--find-max-seq-length", action="store_true",
                   help="search the longest length that fits, per strategy and SP size")
    p.add_argument("--sp-sizes", default="",
                   help="--find-max-seq-length: SP sizes of the plot, each dividing "
                        "--world-size (empty: the powers of two up to --sequence-parallel-size "
                        "that divide it, and --sequence-parallel-size)")
    p.add_argument("--within-percent", type=float, default=10.0,
                   help="with --find-max-seq-length: also answer the longest context whose plan "
                        "is at most this many %% slower (predicted step time, the cost model of "
                        "--sac-device) than the fastest of the strategies at that length")
    p.add_argument("--no-confirm", action="store_true",
                   help="--find-max-seq-length: do not trace again at the length found (the "
                        "compiler's choices depend on the traced length; see docs/plan_memory.md)")
    p.add_argument("--validate", action="store_true",
                   help="compare predictions with measured CPU peaks of real runs (llama-tiny and "
                        "a wider shape, SP=2) and write the table")
    p.add_argument("--validate-shapes", default="llama-tiny,llama-wide",
                   help="--validate: shapes (llama-tiny, llama-wide)")
    p.add_argument("--validate-lengths", default="llama-tiny=4096:16384,llama-wide=4096:8192",
                   help="--validate: shape=L1:L2 ... per shape")
    p.add_argument("--validate-trace-each-length", action="store_true",
                   help="--validate: trace at every length, as the search's confirmation does "
                        "(without it: one trace at the shortest length, evaluated at the others, "
                        "which checks the symbolic extrapolation; AutoSP's SAC plan is chosen at "
                        "the traced length)")
    p.add_argument("--quiet", action="store_true",
                   help="no progress lines on stderr (each trace, each length tried, the time "
                        "so far); the results still go to stdout")
    p.add_argument("--debug", action="store_true",
                   help="an error prints its traceback (default: one line naming the problem)")
    return p


# ------------------------------------------------------------------ the flags, checked up front
#: flags only the search reads, only --validate reads, and the prediction's flags --validate
#: does not read (it measures its own shapes, --validate-shapes, on SP 2 of a CPU world)
SEARCH_ONLY = ("sp_sizes", "within_percent", "no_confirm")
VALIDATE_ONLY = ("validate_shapes", "validate_lengths", "validate_trace_each_length")
NOT_VALIDATED = ("model", "model_overrides", "seq_length", "world_size", "sequence_parallel_size",
                 "offload_activations", "gpu_memory_gb", "host_memory_gb", "reserve_gb",
                 "device", "sac_device", "no_depth_extrapolation", "check_depth")


def check_flags(args, given: set) -> dict:
    """Every flag and combination refused before any trace, each with one line naming the problem
    and the fix (:class:`autosp_lm.config.cli.ArgumentError`; the helpers are
    :mod:`autosp_lm.config.plan_report`'s). Returns what the checks parsed:
    ``names`` (strategies), ``sp_sizes``, ``cfg`` (the model), ``shapes``/``lengths``
    (--validate)."""
    from autosp_lm.planner.trace import parse_strategies

    def fail(msg):
        raise cli.ArgumentError(msg)

    mode = "--validate" if args.validate else "--find-max-seq-length" \
        if args.find_max_seq_length else "a plan at --seq-length"
    if args.validate and args.find_max_seq_length:
        fail("--validate and --find-max-seq-length are two runs: choose one")
    if args.no_depth_extrapolation and args.check_depth:
        fail("--check-depth checks the depth extrapolation that --no-depth-extrapolation turns "
             "off: drop one")
    misplaced = [d for d in SEARCH_ONLY if d in given and not args.find_max_seq_length]
    if misplaced:
        fail(f"{', '.join(map(flag, misplaced))} only apply to --find-max-seq-length "
             f"(this is {mode}): add --find-max-seq-length or drop them")
    misplaced = [d for d in VALIDATE_ONLY if d in given and not args.validate]
    if misplaced:
        fail(f"{', '.join(map(flag, misplaced))} only apply to --validate: add --validate or "
             f"drop them")
    if args.output and os.path.isdir(args.output):
        fail(f"--output {args.output} is a directory: name the JSON file to write "
             f"(e.g. {os.path.join(args.output, 'plan.json')})")
    try:
        names = parse_strategies(args.strategy)
    except ValueError as e:
        fail(f"--strategy: {e}")
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        fail(f"--strategy names {', '.join(twice)} more than once: name each strategy once")
    out = {"names": names}
    if args.validate:
        ignored = [d for d in NOT_VALIDATED if d in given]
        if ignored:
            fail(f"--validate measures its own shapes (--validate-shapes, --validate-lengths) "
                 f"as one rank of SP 2 on CPU and does not read {', '.join(map(flag, ignored))}: "
                 f"drop them")
        out.update(validate_shapes(args, fail))
        return out
    for msg in number_errors(args):
        fail(msg)
    W, P = args.world_size, args.sequence_parallel_size
    if W % P:
        fail(f"--world-size {W} must be a multiple of --sequence-parallel-size {P} (the job is "
             f"dp x sp)")
    option_checks(args, names, fail)
    if args.find_max_seq_length:
        out["sp_sizes"] = _sp_sizes(args, fail)
    else:
        length_check(args, names, fail)
    out["cfg"] = model_of(args, fail)
    strategy_checks(args, names, out["cfg"], out.get("sp_sizes") or [P], fail)
    return out


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    debug = "--debug" in argv
    try:
        return _main(argv)
    except cli.ArgumentError as e:
        raise SystemExit(f"{PROG}: {e}") from None
    except KeyboardInterrupt:
        raise SystemExit(f"{PROG}: interrupted; with --output the file holds what was done") \
            from None
    except Exception as e:  # noqa: BLE001 - one line, not a traceback (--debug: the traceback)
        if debug:
            raise
        text = " ".join(str(e).split())
        kind = "" if isinstance(e, ValueError) else f"{type(e).__name__}: "
        raise SystemExit(f"{PROG}: {kind}{text} (--debug prints the traceback)") from None


def _main(argv: list):
    parser = build_parser()
    args = parser.parse_args(argv)
    checked = check_flags(args, given_flags(args, parser))
    if hasattr(sys.stdout, "reconfigure"):  # each result line as it is printed
        sys.stdout.reconfigure(line_buffering=True)
    if args.output and os.path.dirname(args.output):  # before minutes of tracing, not after
        try:
            os.makedirs(os.path.dirname(args.output), exist_ok=True)
        except OSError as e:
            raise cli.ArgumentError(f"--output {args.output}: {e.strerror}: {e.filename}") \
                from None
    from autosp_lm.planner.plan import GiB, Layout
    from autosp_lm.planner.trace import GPUS_PER_NODE, STRATEGIES
    if args.validate:  # the default --strategy: every strategy (`autosp,` selects autosp alone)
        names = list(STRATEGIES) if args.strategy == "autosp" else checked["names"]
        return search.validate_run(
            checked["shapes"], checked["lengths"], names, bf16=args.bf16,
            fsdp2=args.use_torch_fsdp2, trace_each_length=args.validate_trace_each_length,
            output=args.output, command="python tools/plan_memory.py " + " ".join(sys.argv[1:]))
    names, cfg = checked["names"], checked["cfg"]
    W, P = args.world_size, args.sequence_parallel_size
    budget = int((args.gpu_memory_gb - args.reserve_gb) * GiB)
    layout = Layout(world=W, fsdp2=args.use_torch_fsdp2, bf16=args.bf16, device=args.device,
                    host_bytes=int(args.host_memory_gb * GiB / GPUS_PER_NODE),
                    time_device=args.sac_device)
    flags = dict(vars(args))
    depth = {"depth": not args.no_depth_extrapolation, "check_depth": args.check_depth,
             "sac_device": args.sac_device, "progress": search.Progress(args.quiet)}
    run = dict(bf16=args.bf16, offload=args.offload_activations, depth=depth)
    t0 = time.time()
    if not args.find_max_seq_length:
        plans = search.plan_each(names, cfg, P, args.seq_length, layout, budget, **run)
        out = {"plans": plans, "flags": flags, "seconds": time.time() - t0}
    else:
        def keep(results):  # after every strategy: a run cut short keeps what it found
            if args.output:
                search.write_json(args.output, {
                    "max_seq_length": results, "flags": flags, "budget_bytes": budget,
                    "host_budget_bytes": layout.host_bytes, "seconds": time.time() - t0,
                    "complete": False})
        results, within = search.search_each(
            names, cfg, checked["sp_sizes"], layout, budget, seq_length=args.seq_length,
            confirm=not args.no_confirm, within_percent=args.within_percent,
            command=lambda name, seq, sp: _command(args, name, seq, sp), on_result=keep, **run)
        out = {"max_seq_length": results, "within_percent": within, "flags": flags,
               "budget_bytes": budget, "host_budget_bytes": layout.host_bytes,
               "seconds": time.time() - t0, "complete": True}
    from autosp_lm.planner.trace import MODELLED, modelled_lines
    for line in modelled_lines(names):  # once per report: the plans traced for another program
        print(line)
    out["modelled"] = {n: MODELLED[n] for n in names if n in MODELLED}
    print(f"planned in {out['seconds']:.0f} s")
    if args.output:  # the results first: a plot that fails must not lose them
        search.write_json(args.output, out)
        print(f"wrote {args.output}")
        if args.find_max_seq_length:
            png = os.path.splitext(args.output)[0] + ".png"
            if plot(png, out["max_seq_length"],
                    f"{args.model}, {W} x {args.gpu_memory_gb:g} GiB (reserve "
                    f"{args.reserve_gb:g}){', bf16' if args.bf16 else ''}"
                    f"{', FSDP2' if args.use_torch_fsdp2 else ''}: predicted"):
                print(f"wrote {png}")
            else:
                print(f"skipped the plot {png}: matplotlib is not installed "
                      f"(pip install -e \".[bench]\")")
    return out


if __name__ == "__main__":
    main()
