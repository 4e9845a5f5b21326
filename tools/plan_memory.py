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
JSON). ``--validate`` compares predictions with the measured CPU peak of real runs and writes the
table (Markdown next to the JSON).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from autosp_lm import cli  # noqa: E402
from autosp_lm.cli import HelpFormatter  # noqa: E402


def parse_overrides(text: str) -> dict:
    try:
        return cli.parse_overrides(text)
    except cli.ArgumentError as e:
        raise SystemExit(f"plan_memory.py: {e}") from None


def parse_args(argv=None):
    from autosp_lm.planner.plan import DEFAULT_RESERVE_GB
    from autosp_lm.planner.trace import STRATEGIES
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=HelpFormatter)
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
                   help="AutoSP's activation offload to host memory (autosp only)")
    p.add_argument("--gpu-memory-gb", type=float, default=80.0, help="GPU memory in GiB")
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
                   help="--find-max-seq-length: SP sizes of the plot (empty: powers of two up "
                        "to --sequence-parallel-size)")
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
    return p.parse_args(argv)


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


def sp_sizes(args) -> list:
    if args.sp_sizes:
        return sorted({int(x) for x in args.sp_sizes.split(",") if x.strip()})
    out, s = [], 1
    while s <= args.sequence_parallel_size:
        out.append(s)
        s *= 2
    if args.sequence_parallel_size not in out:
        out.append(args.sequence_parallel_size)
    return out


def plot(path: str, results: list, title: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(6.5, 4.2))
    for name in dict.fromkeys(r["strategy"] for r in results):
        pts = sorted((r["sp_requested"], r["max_seq_length"]) for r in results
                     if r["strategy"] == name)
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


def run_validate(args) -> dict:
    import torch
    from autosp_lm.planner.check import VALIDATION_SHAPES, markdown, validate
    from autosp_lm.planner.trace import STRATEGIES, parse_strategies
    shapes = {s: VALIDATION_SHAPES[s] for s in args.validate_shapes.split(",") if s}
    lengths = {}
    for item in args.validate_lengths.split(","):
        shape, _, ls = item.partition("=")
        lengths[shape] = [int(x) for x in ls.split(":")]
    names = parse_strategies(args.strategy if args.strategy != "autosp" else ",".join(STRATEGIES))
    env = {"torch": torch.__version__, "cpu_count": os.cpu_count(),
           "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
           "command": "python tools/plan_memory.py " + " ".join(sys.argv[1:])}
    md = os.path.splitext(args.output)[0] + ".md" if args.output else None

    def write(rows, done):
        # after every row: a run cut short (a timeout) keeps the rows it measured, marked
        out = {"rows": rows, "environment": dict(env, complete=done)}
        if args.output:
            with open(args.output, "w") as f:
                json.dump(out, f, indent=1)
            with open(md, "w") as f:
                f.write(markdown(rows, env) + ("" if done else
                        "\n**Incomplete**: the run stopped before every row was measured.\n"))
        return out

    rows = validate(shapes, names, lengths, sp=2, bf16=args.bf16, fsdp2=args.use_torch_fsdp2,
                    trace_each_length=args.validate_trace_each_length,
                    on_row=lambda rs: write(rs, False))
    out = write(rows, True)
    if args.output:
        print(f"wrote {args.output}, {md}")
    return out


def main(argv=None):
    args = parse_args(argv)
    if args.output and os.path.dirname(args.output):  # before minutes of tracing, not after
        os.makedirs(os.path.dirname(args.output), exist_ok=True)
    if args.validate:
        return run_validate(args)
    from autosp_lm.planner.plan import (GiB, Layout, find_max_seq_length, longest_within,
                                        predict, trace_step)
    from autosp_lm.planner.trace import GPUS_PER_NODE, model_config, parse_strategies
    try:
        names = parse_strategies(args.strategy)
    except ValueError as e:
        raise SystemExit(f"plan_memory.py: {e}") from None
    if args.sac_device is not None:
        from autosp_lm.compiler.cost_model import device_params
        try:
            device_params(args.sac_device)
        except (ValueError, TypeError) as e:
            raise SystemExit(f"plan_memory.py: --sac-device: {e}") from None
    W, P = args.world_size, args.sequence_parallel_size
    if P < 1 or W % P:
        raise SystemExit(f"plan_memory.py: --world-size {W} must be a multiple of "
                         f"--sequence-parallel-size {P}")
    over = parse_overrides(args.model_overrides)
    budget = int((args.gpu_memory_gb - args.reserve_gb) * GiB)
    layout = Layout(world=W, fsdp2=args.use_torch_fsdp2, bf16=args.bf16, device=args.device,
                    host_bytes=int(args.host_memory_gb * GiB / GPUS_PER_NODE),
                    time_device=args.sac_device)
    cfg = model_config(args.model, over, seq=max(args.seq_length, 1 << 20))
    flags = {k: v for k, v in vars(args).items()}
    depth = {"depth": not args.no_depth_extrapolation, "check_depth": args.check_depth,
             "sac_device": args.sac_device}
    t0 = time.time()
    if not args.find_max_seq_length:
        plans = []
        for name in names:
            traced = trace_step(name, cfg, P, args.seq_length, bf16=args.bf16,
                                offload=args.offload_activations, layout=layout, **depth)
            r = predict(traced, args.seq_length, layout)
            r.update(budget_gib=budget / GiB,
                     fits=r["peak_bytes"] <= budget and r["fits_host"])
            print_plan(r)
            plans.append(r)
        out = {"plans": plans, "flags": flags, "seconds": time.time() - t0}
    else:
        results, within = [], []
        for sp in sp_sizes(args):
            traces: dict = {}
            for name in names:
                if name == "none" and sp != sp_sizes(args)[0]:
                    prev = next(r for r in results if r["strategy"] == "none")
                    results.append(dict(prev, sp_requested=sp))
                    continue
                t1 = time.time()
                traced = trace_step(name, cfg, sp, _first(args, sp), bf16=args.bf16,
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
                if args.output:  # after every strategy: a run cut short keeps what it found
                    with open(args.output, "w") as f:
                        json.dump({"max_seq_length": results, "flags": flags,
                                   "budget_bytes": budget,
                                   "host_budget_bytes": layout.host_bytes,
                                   "seconds": time.time() - t0,
                                   "complete": False}, f, indent=1, default=str)
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
        if args.output:
            png = os.path.splitext(args.output)[0] + ".png"
            plot(png, results, f"{args.model}, {W} x {args.gpu_memory_gb:g} GiB "
                 f"(reserve {args.reserve_gb:g}){', bf16' if args.bf16 else ''}"
                 f"{', FSDP2' if args.use_torch_fsdp2 else ''}: predicted")
            print(f"wrote {png}")
    print(f"planned in {out['seconds']:.0f} s")
    if args.output:
        with open(args.output, "w") as f:
            json.dump(out, f, indent=1, default=str)
        print(f"wrote {args.output}")
    return out


def _first(args, sp: int) -> int:
    """The length the search first traces at: --seq-length rounded to the granularity."""
    g = 256 * sp
    return max(g, args.seq_length // g * g)


if __name__ == "__main__":
    main()
