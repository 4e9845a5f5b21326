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
import json
import math
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from autosp_lm.config import cli  # noqa: E402
from autosp_lm.config.cli import HelpFormatter  # noqa: E402

PROG = "plan_memory.py"


def parse_args(argv=None):
    return build_parser().parse_args(argv)


def build_parser() -> argparse.ArgumentParser:
    from autosp_lm.planner.plan import DEFAULT_RESERVE_GB
    from autosp_lm.planner.trace import STRATEGIES
    p = cli.Parser(prog=PROG, description=__doc__.split("\n\n")[0],
                   formatter_class=HelpFormatter)
    p.add_argument("--model", default="llama-3.1-8b", help="model preset")
    p.add_argument("--model-overrides", default="",
                   help="shape overrides of the preset, e.g. num_layers=4,hidden_size=512")
    p.add_argument("--seq-length", type=int, default=131072,
                   help="tokens per micro batch (micro batch size 1); with --find-max-seq-length "
                        "the length the graphs are first traced at")
    p.add_argument("--world-size", type=int, default=8, help="GPUs of the job (dp x sp)")
    p.add_argument("--sequence-parallel-size", type=int, default=8, help="SP size")
    p.add_argument("--strategy", default="autosp",
                   help=f"comma-separated, from: {','.join(STRATEGIES)}")
    p.add_argument("--bf16", action="store_true", help="bf16 autocast (fp32 master weights)")
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


def flag(dest: str) -> str:
    return "--" + dest.replace("_", "-")


def given_flags(args, parser) -> set:
    """The flags whose value is not their default (what the user set)."""
    return {k for k, v in vars(args).items() if v != parser.get_default(k)}


def _number_errors(args) -> list:
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


def check_flags(args, given: set) -> dict:
    """Every flag and combination refused before any trace, each with one line naming the problem
    and the fix (:class:`autosp_lm.config.cli.ArgumentError`). Returns what the checks parsed:
    ``names`` (strategies), ``sp_sizes``, ``cfg`` (the model), ``shapes``/``lengths``
    (--validate)."""
    from autosp_lm.planner.trace import STRATEGIES, parse_strategies

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
        out.update(_validate_shapes(args, fail))
        return out
    for msg in _number_errors(args):
        fail(msg)
    W, P = args.world_size, args.sequence_parallel_size
    if W % P:
        fail(f"--world-size {W} must be a multiple of --sequence-parallel-size {P} (the job is "
             f"dp x sp)")
    if args.offload_activations:
        other = [n for n in names if STRATEGIES[n][0] != "autosp"]
        if other:
            from autosp_lm.planner.trace import HOST_OFFLOAD
            fail(f"--offload-activations is AutoSP's activation offload; {', '.join(other)} "
                 f"{'has' if len(other) == 1 else 'have'} none: drop the flag, or plan "
                 f"{', '.join(sorted(HOST_OFFLOAD))} (the hand-written recipes with their "
                 f"block inputs in host memory)")
        nosac = [n for n in names if STRATEGIES[n][1].get("sac") is False]
        if nosac:
            fail(f"--offload-activations is part of AutoSP's checkpointing pass (SAC), which "
                 f"{', '.join(nosac)} turns off: plan autosp or autosp-max-offload with it")
    if args.sac_device is not None:
        from autosp_lm.compiler.cost_model import device_params
        try:
            device_params(args.sac_device)
        except (ValueError, TypeError) as e:
            fail(f"--sac-device: {e}")
    if args.find_max_seq_length:
        out["sp_sizes"] = _sp_sizes(args, fail)
    else:
        step = 2 * P if any(STRATEGIES[n][0] == "ring" for n in names) else P
        if args.seq_length % step:
            zigzag = ", two zigzag halves for ring" if step != P else ""
            fail(f"--seq-length {args.seq_length} must be a multiple of {step} (each of the "
                 f"{P} SP ranks gets an equal share{zigzag}): "
                 f"e.g. {max(step, args.seq_length // step * step)}")
    out["cfg"] = _model(args, fail)
    _strategy_checks(args, names, out["cfg"], out.get("sp_sizes") or [P], fail)
    return out


def _strategy_checks(args, names: list, cfg, sizes: list, fail) -> None:
    """Each strategy's own refusals (``strategies.check_strategy``: heads against the SP size,
    lengths the layout cannot split), at each SP size and the length first traced."""
    from autosp_lm.planner.trace import STRATEGIES
    from autosp_lm.strategies import check_strategy, strategy_class
    for sp in sizes:
        seq = _first(args, sp) if args.find_max_seq_length else args.seq_length
        for name in names:
            reg, extra = STRATEGIES[name]
            try:
                check_strategy(reg, cfg, 1 if reg == "none" else sp, seq,
                               strategy_class(reg).Options(**extra))
            except ValueError as e:
                fail(f"--strategy {name} at SP {sp}, {seq} tokens: {e}")


def _model(args, fail):
    import dataclasses

    from autosp_lm.models.config import PRESETS, ModelConfig
    from autosp_lm.planner.trace import model_config
    if args.model not in PRESETS:
        fail(f"unknown --model {args.model!r}; choose one of: {', '.join(PRESETS)}")
    try:
        over = cli.parse_overrides(args.model_overrides)
    except cli.ArgumentError as e:
        fail(str(e))
    fields = {f.name for f in dataclasses.fields(ModelConfig)}
    bad = sorted(set(over) - fields)
    if bad:
        fail(f"--model-overrides: unknown key {', '.join(bad)}; the keys are the model config's "
             f"fields: {', '.join(sorted(fields))}")
    try:
        return model_config(args.model, over, seq=max(args.seq_length, 1 << 20))
    except (ValueError, TypeError) as e:
        fail(f"--model {args.model} --model-overrides {args.model_overrides!r}: {e}")


def _sp_sizes(args, fail) -> list:
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


def _validate_shapes(args, fail) -> dict:
    from autosp_lm.planner.check import VALIDATION_SHAPES
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


# ------------------------------------------------------------------ progress
class Progress:
    """One line per event on ``stream`` (stderr: stdout keeps the results), flushed, each with the
    seconds since the start: the planner's traces (``trace n of m``, the depth extrapolation's
    cut models included), each length tried, the strategy and SP size being searched. ``quiet``:
    nothing."""

    def __init__(self, quiet: bool = False, stream=None):
        self.quiet, self.stream, self.t0 = quiet, stream, time.time()

    def __call__(self, line: str) -> None:
        if not self.quiet:
            print(f"[plan_memory {time.time() - self.t0:6.0f} s] {line}",
                  file=self.stream or sys.stderr, flush=True)


def _gib(n: int) -> str:
    return f"{n / 2**30:.2f} GiB"


def print_plan(r: dict) -> None:
    print(f"{r['strategy']} at {r['seq_length']} tokens, SP {r['sp']}, world {r['world_size']}: "
          f"peak {_gib(r['peak_bytes'])} ({r['peak_phase']} phase; at {r['peak_node']})")
    for k, v in r["breakdown"].items():
        print(f"  {k:<52} {_gib(v):>12}")
    print(f"  (saved for backward on the device: {_gib(r['saved_activations_bytes'])}; fits in "
          f"{r['budget_gib']:.1f} GiB: {'yes' if r['fits'] else 'NO'})")
    if r.get("host_bytes"):
        cap = r["host_budget_bytes"]
        print(f"  host memory (offloaded activations): {_gib(r['host_bytes'])}"
              + (f" of {_gib(cap)} per GPU: {'fits' if r['fits_host'] else 'does NOT fit'}"
                 if cap else ""))


def plot(path: str, results: list, title: str) -> bool:
    """The max-context-vs-SP-size plot; False (nothing drawn) where matplotlib is not installed
    (it is an extra: ``pip install -e ".[bench]"``)."""
    try:
        import matplotlib
    except ImportError:
        return False
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(6.5, 4.2))
    for name in dict.fromkeys(r["strategy"] for r in results):
        pts = sorted((r["sp_requested"], r["max_seq_length"]) for r in results
                     if r["strategy"] == name and r["max_seq_length"] > 0)
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=name)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log", base=2)
    ax.set_xlabel("sequence-parallel size")
    ax.set_ylabel("max trainable tokens (predicted)")
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def write_json(path: str, data: dict) -> None:
    """``data`` as JSON at ``path``, atomically (a run stopped while writing keeps the last
    file)."""
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(data, f, indent=1, default=str)
    os.replace(tmp, path)


def run_validate(args, shapes: dict, lengths: dict, names: list) -> dict:
    import torch
    from autosp_lm.planner.check import markdown, validate
    from autosp_lm.planner.trace import STRATEGIES
    if args.strategy == "autosp":  # the default: every strategy (`autosp,` selects autosp alone)
        names = list(STRATEGIES)
    env = {"torch": torch.__version__, "cpu_count": os.cpu_count(),
           "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
           "command": "python tools/plan_memory.py " + " ".join(sys.argv[1:])}
    md = os.path.splitext(args.output)[0] + ".md" if args.output else None

    def write(rows, done):
        # after every row: a run cut short (a timeout) keeps the rows it measured, marked
        out = {"rows": rows, "environment": dict(env, complete=done)}
        if args.output:
            write_json(args.output, out)
            with open(md, "w") as f:
                f.write(markdown(rows, env) + ("" if done else
                        "\n**Incomplete**: the run stopped before every row was measured.\n"))
        return out

    rows = validate(shapes, names, lengths, sp=2, bf16=args.bf16, fsdp2=args.use_torch_fsdp2,
                    trace_each_length=args.validate_trace_each_length,
                    log=lambda line: print(line, flush=True),
                    on_row=lambda rs: write(rs, False))
    out = write(rows, True)
    if args.output:
        print(f"wrote {args.output}, {md}")
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
    if args.validate:
        return run_validate(args, checked["shapes"], checked["lengths"], checked["names"])
    from autosp_lm.planner.plan import (GiB, Layout, find_max_seq_length, longest_within,
                                        predict, trace_step)
    from autosp_lm.planner.trace import GPUS_PER_NODE
    progress = Progress(args.quiet)
    names, cfg = checked["names"], checked["cfg"]
    W, P = args.world_size, args.sequence_parallel_size
    budget = int((args.gpu_memory_gb - args.reserve_gb) * GiB)
    layout = Layout(world=W, fsdp2=args.use_torch_fsdp2, bf16=args.bf16, device=args.device,
                    host_bytes=int(args.host_memory_gb * GiB / GPUS_PER_NODE),
                    time_device=args.sac_device)
    flags = {k: v for k, v in vars(args).items()}
    depth = {"depth": not args.no_depth_extrapolation, "check_depth": args.check_depth,
             "sac_device": args.sac_device, "progress": progress}
    t0 = time.time()
    if not args.find_max_seq_length:
        plans = []
        for i, name in enumerate(names):
            progress(f"strategy {i + 1} of {len(names)}: {name}, SP {P}, {args.seq_length} tokens")
            traced = trace_step(name, cfg, P, args.seq_length, bf16=args.bf16,
                                offload=args.offload_activations, layout=layout, **depth)
            t1 = time.time()
            r = predict(traced, args.seq_length, layout)
            progress(f"{name} SP {P}: predicted at {args.seq_length} tokens "
                     f"({time.time() - t1:.0f} s)")
            r.update(budget_gib=budget / GiB,
                     fits=r["peak_bytes"] <= budget and r["fits_host"])
            print_plan(r)
            plans.append(r)
        out = {"plans": plans, "flags": flags, "seconds": time.time() - t0}
    else:
        results, within = [], []
        sizes = checked["sp_sizes"]
        for j, sp in enumerate(sizes):
            traces: dict = {}
            for i, name in enumerate(names):
                where = (f"strategy {i + 1} of {len(names)}: {name}, SP {sp} "
                         f"(SP size {j + 1} of {len(sizes)})")
                if name == "none" and sp != sizes[0]:
                    prev = next(r for r in results if r["strategy"] == "none")
                    results.append(dict(prev, sp_requested=sp))
                    progress(f"{where}: none does not shard the sequence; SP {sizes[0]}'s answer")
                    continue
                first = _first(args, sp)
                progress(f"{where}: searching the longest length (first trace at {first} tokens)")
                t1 = time.time()
                traced = trace_step(name, cfg, sp, first, bf16=args.bf16,
                                    offload=args.offload_activations, layout=layout, **depth)
                t2 = time.time()
                r = find_max_seq_length(name, cfg, sp, layout, budget, bf16=args.bf16,
                                        offload=args.offload_activations,
                                        confirm=not args.no_confirm, traced=traced,
                                        keep=traces, **depth)
                r.update(sp_requested=sp, first_trace_s=t2 - t1, search_s=time.time() - t2)
                results.append(r)
                host = r.get("at_max", {}).get("host_bytes", 0)
                step = r.get("at_max", {}).get("predicted_step_s")
                print(f"{name:>13} SP {sp:>3}: max {r['max_seq_length']:>9} tokens "
                      + (f"(host {host / GiB:.1f} GiB per GPU) " if host else "")
                      + (f"(step {step:.3g} s predicted) " if step else "") +
                      f"({'confirmed by a trace at that length' if r['confirmed'] else 'NOT confirmed: ' + str(r['traces'])}; "
                      f"trace {t2 - t1:.0f} s, search {r['search_s']:.0f} s)", flush=True)
                r.update(_command(args, name, r["max_seq_length"], sp))
                print(f"{'':>13} run: {r['command']}"
                      + (f"\n{'':>13} ({r['command_note']})" if r["command_note"] else ""),
                      flush=True)
                if args.output:  # after every strategy: a run cut short keeps what it found
                    write_json(args.output, {"max_seq_length": results, "flags": flags,
                                             "budget_bytes": budget,
                                             "host_budget_bytes": layout.host_bytes,
                                             "seconds": time.time() - t0, "complete": False})
            progress(f"SP {sp}: step times of every plan at each longest length "
                     f"(--within-percent {args.within_percent:g})")
            w = longest_within([r for r in results if r["sp_requested"] == sp], traces, layout,
                               args.within_percent)
            within.append(dict(w, sp=sp))
            a = w["answer"]
            print(f"longest context within {args.within_percent:g}% of the fastest plan's step "
                  f"time, SP {sp}: " + (f"{a['seq_length']} tokens ({a['strategy']}, "
                                        f"{a['ratio']:.2f}x {a['fastest']})" if a else "none"),
                  flush=True)
        out = {"max_seq_length": results, "within_percent": within, "flags": flags,
               "budget_bytes": budget,
               "host_budget_bytes": layout.host_bytes, "seconds": time.time() - t0,
               "complete": True}
    print(f"planned in {out['seconds']:.0f} s")
    if args.output:  # the results first: a plot that fails must not lose them
        write_json(args.output, out)
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


def _command(args, name: str, seq: int, sp: int) -> dict:
    """The pretrain.py command of a plan (autosp_lm/config/plan_command.py: checked through the
    trainer's own parser), or why there is none."""
    from autosp_lm.config.plan_command import pretrain_command
    if not seq:
        return {"command": "(none: nothing fits)", "command_note": ""}
    try:
        c = pretrain_command(name, model=args.model, seq=seq, world=args.world_size, sp=sp,
                             overrides=cli.parse_overrides(args.model_overrides),
                             bf16=args.bf16, fsdp2=args.use_torch_fsdp2)
    except (ValueError, cli.ArgumentError) as e:
        return {"command": f"(none: {e})", "command_note": ""}
    return {"command": c["command"], "command_note": c["note"]}


def _first(args, sp: int) -> int:
    """The length the search first traces at: --seq-length rounded to the granularity."""
    g = 256 * sp
    return max(g, args.seq_length // g * g)


if __name__ == "__main__":
    main()
