#!/usr/bin/env python
"""Loss curves of the strategies on one model, seed and data order, in one plot.

Trains the model once per strategy with ``pretrain.py`` (a ``torchrun`` job of ``--nproc``
gloo ranks on CPU), logging every iteration to ``--metrics-file`` (JSON lines) and to W&B
offline, reads the per-iteration ``lm_loss`` back and draws the curves, with the largest
absolute difference between any two of them, into ``OUTPUT.png``; ``OUTPUT.json`` holds the
command, date, machine, the per-strategy final loss, the maximum difference and the curves.

    python tools/loss_curves.py --output docs/bench/loss_curves_bf16       # the README's plot
    python tools/loss_curves.py --replot --output docs/bench/loss_curves_bf16  # redraw the JSON

Every run gets the same ``--seed`` (initial weights, data order) and global batch, so the same
samples make each step; the strategies differ only in how the work is split over the ranks.
The metrics and W&B folders stay in ``--work-dir`` (``wandb sync DIR/wandb/offline-run-*``).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from autosp_lm.config.shared_flags import add_model, add_seq_length  # noqa: E402

#: the pretrain.py flag that selects each strategy ("none": data parallel, whole sequence per rank;
#: "none+compile": the same through Inductor, which tells the compiler's rounding from AutoSP's)
STRATEGY_FLAGS = {"none": [], "ulysses": ["--ulysses"], "ring": ["--ring"], "autosp": ["--autosp"],
                  "none+compile": ["--compile"]}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--strategies", default="none,ulysses,ring,autosp",
                   help="comma-separated, from " + ", ".join(STRATEGY_FLAGS) + " (default: %(default)s)")
    add_model(p, "llama-tiny", help="pretrain.py's --model preset (default: %(default)s)")
    add_seq_length(p, 512, help="tokens per sample (default: %(default)s)")
    p.add_argument("--global-batch-size", type=int, default=4, help="samples per iteration (default: %(default)s)")
    p.add_argument("--train-iters", type=int, default=300, help="iterations per strategy (default: %(default)s)")
    p.add_argument("--nproc", type=int, default=2, help="ranks per run (torchrun, gloo on CPU) (default: %(default)s)")
    p.add_argument("--seed", type=int, default=1234, help="seed of every run (default: %(default)s)")
    p.add_argument("--fp32", action="store_true", help="train in fp32 instead of Megatron-style bf16")
    p.add_argument("--threads", type=int, default=1, help="OMP_NUM_THREADS of each rank (default: %(default)s)")
    p.add_argument("--output", default="docs/bench/loss_curves_bf16",
                   help="writes OUTPUT.png and OUTPUT.json (default: %(default)s)")
    p.add_argument("--work-dir", help="metrics files, logs and W&B runs (default: a new temporary folder)")
    p.add_argument("--replot", action="store_true",
                   help="train nothing: redraw OUTPUT.png from the curves in OUTPUT.json")
    args = p.parse_args(argv)
    args.strategies = [s for s in args.strategies.split(",") if s]
    unknown = [s for s in args.strategies if s not in STRATEGY_FLAGS]
    if unknown or len(args.strategies) < 2:
        p.error(f"--strategies: need at least two of {', '.join(STRATEGY_FLAGS)}; got {unknown or args.strategies}")
    return args


def pretrain_command(args, strategy: str, metrics_file: str, wandb_dir: str) -> list:
    """The torchrun command line of one strategy's run (``[6:]`` are pretrain.py's flags)."""
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={args.nproc}",
            os.path.join(ROOT, "pretrain.py"), "--model", args.model, "--seq-length", str(args.seq_length),
            "--micro-batch-size", "1", "--global-batch-size", str(args.global_batch_size),
            "--train-iters", str(args.train_iters), "--seed", str(args.seed), "--log-interval", "1",
            "--eval-iters", "0", "--metrics-file", metrics_file, "--wandb-project", "autosp_lm_loss_curves",
            "--wandb-exp-name", strategy, "--wandb-save-dir", wandb_dir,
            *([] if args.fp32 else ["--bf16"]), *STRATEGY_FLAGS[strategy]]


def read_losses(metrics_file: str) -> dict:
    """{iteration: lm_loss} of the training records of a ``--metrics-file`` (JSON lines); a
    repeated iteration (a resumed run appends) keeps its last value."""
    losses = {}
    with open(metrics_file) as f:
        for line in f:
            record = json.loads(line)
            if "lm_loss" in record:
                losses[int(record["iteration"])] = float(record["lm_loss"])
    return losses


def max_difference(curves: dict) -> dict:
    """The largest ``|a - b|`` between any two curves ({name: {iteration: loss}}) at an iteration
    they all have: {"value", "iteration", "between": [lowest, highest]}."""
    common = sorted(set.intersection(*(set(c) for c in curves.values())))
    if not common:
        raise ValueError("the curves share no iteration")
    best = None
    for it in common:
        low = min(curves, key=lambda name: curves[name][it])
        high = max(curves, key=lambda name: curves[name][it])
        value = curves[high][it] - curves[low][it]
        if best is None or value > best["value"]:
            best = {"value": value, "iteration": it, "between": [low, high]}
    return best


def summary_line(diff: dict) -> str:
    return (f"max |difference| {diff['value']:.3g} at iteration {diff['iteration']} "
            f"({diff['between'][0]} vs {diff['between'][1]})")


def machine() -> dict:
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(l.split(":", 1)[1].strip() for l in f if l.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return {"cpu": cpu, "cores": os.cpu_count(), "platform": platform.platform(),
            "python": platform.python_version()}


def plot(curves: dict, diff: dict, path: str, title: str) -> None:
    """Top: the loss curves (styles differ so that overlapping curves stay visible); bottom: each
    curve minus the first one, where the differences are large enough to see."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(9, 7), sharex=True,
                                      gridspec_kw={"height_ratios": [3, 2]})
    styles = ["-", "--", "-.", ":"]
    names = list(curves)
    for i, name in enumerate(names):
        its = sorted(curves[name])
        top.plot(its, [curves[name][k] for k in its], styles[i % 4], color=f"C{i}", lw=2.2 - 0.4 * (i % 4),
                 label=f"{name}: final {curves[name][its[-1]]:.4f}")
    top.set_ylabel("training loss (lm loss)")
    top.set_title(f"{title}\n{summary_line(diff)}", fontsize=10)
    top.legend()
    top.grid(alpha=0.3)
    ref = names[0]
    for i, name in enumerate(names[1:], 1):
        its = sorted(set(curves[name]) & set(curves[ref]))
        bottom.plot(its, [curves[name][k] - curves[ref][k] for k in its], styles[i % 4], color=f"C{i}", lw=1.2,
                    label=f"{name} - {ref}")
    bottom.axhline(0, color="black", lw=0.6)
    bottom.axvline(diff["iteration"], color="gray", lw=0.8, ls=":")
    bottom.set_xlabel("iteration")
    bottom.set_ylabel(f"loss - {ref}'s loss")
    bottom.legend(fontsize=8)
    bottom.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def write_outputs(output: str, curves: dict, meta: dict) -> dict:
    """OUTPUT.json (meta, final losses, maximum difference, the curves) and OUTPUT.png."""
    diff = max_difference(curves)
    result = dict(meta, final_loss={n: c[max(c)] for n, c in curves.items()}, max_difference=diff,
                  curves={n: [c[k] for k in sorted(c)] for n, c in curves.items()},
                  curve_iterations={n: [min(c), max(c)] for n, c in curves.items()})
    os.makedirs(os.path.dirname(os.path.abspath(output)), exist_ok=True)
    with open(output + ".json", "w") as f:
        json.dump(result, f, indent=1)
        f.write("\n")
    plot(curves, diff, output + ".png", meta.get("title", ""))
    return result


def curves_from_json(path: str) -> tuple:
    with open(path) as f:
        data = json.load(f)
    curves = {n: dict(zip(range(lo, hi + 1), data["curves"][n]))
              for n, (lo, hi) in data["curve_iterations"].items()}
    meta = {k: v for k, v in data.items()
            if k not in ("final_loss", "max_difference", "curves", "curve_iterations")}
    return curves, meta


def run_strategy(args, strategy: str, work_dir: str) -> tuple:
    """Train one strategy; -> ({iteration: loss}, wall seconds). Its output goes to a log file."""
    metrics = os.path.join(work_dir, f"{strategy}.jsonl")
    if os.path.exists(metrics):
        os.unlink(metrics)  # the trainer appends
    cmd = pretrain_command(args, strategy, metrics, work_dir)
    path = os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p)
    env = dict(os.environ, PYTHONPATH=path, WANDB_MODE="offline", WANDB_DIR=work_dir,
               OMP_NUM_THREADS=str(args.threads))
    log = os.path.join(work_dir, f"{strategy}.log")
    t0 = time.time()
    with open(log, "w") as out:
        code = subprocess.call(cmd, env=env, stdout=out, stderr=subprocess.STDOUT, cwd=ROOT)
    wall = time.time() - t0
    if code != 0:
        with open(log) as f:
            tail = f.read()[-3000:]
        raise SystemExit(f"loss_curves.py: {strategy} failed (exit {code}); its log {log} ends:\n{tail}")
    losses = read_losses(metrics)
    if len(losses) < args.train_iters:
        raise SystemExit(f"loss_curves.py: {strategy} logged {len(losses)} of {args.train_iters} iterations ({metrics})")
    return losses, wall


def main(argv=None):
    args = parse_args(argv)
    output = os.path.abspath(args.output)
    if args.replot:
        curves, meta = curves_from_json(output + ".json")
        result = write_outputs(output, curves, meta)
        print(f"{summary_line(result['max_difference'])}; redrew {output}.png")
        return result
    import torch
    work_dir = os.path.abspath(args.work_dir or tempfile.mkdtemp(prefix="loss_curves_"))
    os.makedirs(work_dir, exist_ok=True)
    print(f"runs, logs and W&B (offline) in {work_dir}", flush=True)
    curves, walls = {}, {}
    for strategy in args.strategies:
        print(f"== {strategy}: torchrun --nproc-per-node {args.nproc} pretrain.py "
              f"{shlex.join(pretrain_command(args, strategy, 'METRICS', 'WORK_DIR')[6:])}", flush=True)
        curves[strategy], walls[strategy] = run_strategy(args, strategy, work_dir)
        last = max(curves[strategy])
        print(f"   {walls[strategy]:.0f} s; loss at iteration {last}: {curves[strategy][last]:.5f}", flush=True)
    precision = "fp32" if args.fp32 else "bf16"
    meta = {"title": f"{args.model}, {precision}, {args.nproc} ranks ({platform.machine()} CPU, gloo), seq "
                     f"{args.seq_length}, global batch {args.global_batch_size}, seed {args.seed}",
            "command": shlex.join(["python", "tools/loss_curves.py"] + list(sys.argv[1:] if argv is None else argv)),
            "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()), "torch": torch.__version__,
            "machine": machine(), "model": args.model, "precision": precision, "nproc": args.nproc,
            "seq_length": args.seq_length, "global_batch_size": args.global_batch_size,
            "iterations": args.train_iters, "seed": args.seed, "wall_s": {k: round(v, 1) for k, v in walls.items()},
            "pretrain_flags": {s: shlex.join(pretrain_command(args, s, "METRICS", "WORK_DIR")[6:])
                               for s in args.strategies}}
    result = write_outputs(output, curves, meta)
    print(f"{summary_line(result['max_difference'])}; wrote {output}.png and {output}.json")
    return result


if __name__ == "__main__":
    main()
