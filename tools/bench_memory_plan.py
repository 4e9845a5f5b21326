#!/usr/bin/env python
"""Benchmark AutoSP's memory-plan choice (``--memory-budget-gb``): one budget, several lengths.

For every length, rank 0 of an SP job (the other ranks simulated, as ``tools/plan_memory.py
--validate`` measures) runs a real training step (forward, backward, gradient reduction, AdamW)
three ways: with the budget (AutoSP chooses), without it (the default plan; the start-up
overhead of the choice is the difference of the first steps, compilation included), and with
every candidate the choice predicted to fit, compiled as given. Per row: the plan chosen, its
predicted and measured peak (``LivePeak`` above the state live before the step, plus that state)
against the budget, its measured step time against the fastest measured fitting candidate, and
the choice's seconds.

    python tools/bench_memory_plan.py --lengths 2048,8192,16384,32768 --memory-budget-gb 0.05 \\
        --out docs/bench/cpu_memory_plan
"""
from __future__ import annotations

import dataclasses
import json
import os
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from autosp_lm.config.cli import Parser  # noqa: E402
from autosp_lm.config.shared_flags import (add_model, add_model_overrides,  # noqa: E402
                                           add_sequence_parallel_size, parse_model_overrides)

MiB = 2 ** 20


def _measure(cfg, sp, seq, budget, *, changes=None, steps=2, backend="aot_eager"):
    """One measured step of AutoSP at ``seq``: with ``budget`` (bytes: the choice) or with the
    options ``changes`` as given (None: the default plan)."""
    from autosp_lm.planner.check import measure_step
    from autosp_lm.planner.fit import memory_plan_options
    box = {}

    def configure(strategy, model):
        opts = dataclasses.replace(strategy.options, backend=backend)
        if budget is not None:
            opts = dataclasses.replace(opts, **memory_plan_options(
                model, budget_gb=budget / 2**30, device="cpu", world=sp, sp=sp, seq_length=seq))
        if changes:
            opts = dataclasses.replace(opts, **changes)
        strategy.options = opts
        box["strategy"] = strategy

    # every run compiles cold (Inductor's kernels are not reused from an earlier run) into a
    # cache of its own, removed afterwards
    saved = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    with tempfile.TemporaryDirectory(prefix="bench_memory_plan_") as cache:
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = cache
        try:
            out = measure_step("autosp", cfg, sp, seq, configure=configure, timed_steps=steps)
        finally:
            if saved is None:
                del os.environ["TORCHINDUCTOR_CACHE_DIR"]
            else:
                os.environ["TORCHINDUCTOR_CACHE_DIR"] = saved
    report = box["strategy"].runner.report
    out["memory_plan"] = dict(report.memory_plan) if report is not None else {}
    return out


def run_length(cfg, sp, seq, budget, steps, backend) -> dict:
    from autosp_lm.compiler import AutoSPError
    row = {"seq_length": seq}
    try:
        chosen = _measure(cfg, sp, seq, budget, steps=steps, backend=backend)
    except AutoSPError as e:  # nothing fits: the one line is the result
        return dict(row, refused=str(e))
    plain = _measure(cfg, sp, seq, None, steps=steps, backend=backend)
    plan = chosen["memory_plan"]
    fitting = {}
    for c in plan["candidates"]:
        if c["fits"] and not c["why_not"]:
            m = chosen if c["name"] == plan["name"] else _measure(
                cfg, sp, seq, None, changes=c["changes"], steps=steps, backend=backend)
            fitting[c["name"]] = {"predicted_peak": c["peak"], "predicted_step_s": c["step_s"],
                                  "measured_peak": m["measured_peak_bytes"],
                                  "measured_step_s": m["measured_step_s"],
                                  "first_step_s": m["first_step_s"]}
    if "sac" not in fitting and plain["measured_peak_bytes"] <= budget:  # the default plan
        fitting["sac"] = {"predicted_peak": None, "predicted_step_s": None,  # fits, unpredicted
                          "measured_peak": plain["measured_peak_bytes"],
                          "measured_step_s": plain["measured_step_s"],
                          "first_step_s": plain["first_step_s"]}
    fastest = min(fitting, key=lambda k: fitting[k]["measured_step_s"])
    return dict(row, plan=plan["name"], flags=plan["flags"], round=plan["round"],
                predicted_peak=plan["peak"], measured_peak=chosen["measured_peak_bytes"],
                budget=budget, fits_measured=chosen["measured_peak_bytes"] <= budget,
                measured_step_s=chosen["measured_step_s"], fastest_fitting=fastest,
                step_vs_fastest=chosen["measured_step_s"] / fitting[fastest]["measured_step_s"],
                choice_s=plan["seconds"], first_step_s=chosen["first_step_s"],
                first_step_default_s=plain["first_step_s"],
                default_plan_step_s=plain["measured_step_s"],
                default_plan_peak=plain["measured_peak_bytes"],
                startup_overhead=(chosen["first_step_s"] - chosen["measured_step_s"])
                / (plain["first_step_s"] - plain["measured_step_s"]) - 1,
                fitting=fitting, candidates=plan["candidates"])


def trace_startup(model: str, overrides: dict, sp: int, seq: int, blocks: int, budget: int) -> dict:
    """The choice's cost on the planner's trace of a large model (fake tensors, ``blocks`` blocks,
    bf16, graph FSDP over ``sp`` ranks as the 8B plans run): the trace's seconds with and
    without the budget, and the plan chosen."""
    import time
    from autosp_lm.planner.fit import memory_plan_options
    from autosp_lm.planner.trace import model_config, sac_device_for, trace_full
    cfg = model_config(model, dict(overrides, num_layers=blocks), seq)
    box, out = {}, {}

    def configure(strategy, m):
        strategy.options = dataclasses.replace(strategy.options, **memory_plan_options(
            m, budget_gb=budget / 2**30, device="cuda", world=sp, sp=sp, fsdp2=True, bf16=True,
            seq_length=seq))
        box["strategy"] = strategy

    # a first trace (discarded) warms the process, then without and with the budget
    for name, hook in (("warm-up", None), ("without", None), ("with", configure)):
        t = time.perf_counter()
        trace_full("autosp", cfg, sp, seq, bf16=True, fsdp_world=sp,
                   sac_device=sac_device_for("cuda", sp), configure=hook)
        out[name + "_s"] = time.perf_counter() - t
    plan = box["strategy"].runner.report.memory_plan
    return dict(out, model=model, blocks=blocks, seq_length=seq, sp=sp, budget=budget,
                plan=plan.get("name"), choice_s=plan.get("seconds"),
                overhead=out["with_s"] / out["without_s"] - 1)


def decompose(cfg, sp: int, seq: int, budget: int, backend: str) -> dict:
    """First-step seconds, each cold after one discarded warm-up: the default plan, the
    no-recompute plan given explicitly, the choice under ``budget``, the default again (how much
    of a difference is the choice, how much the plan compiled, how much noise)."""
    from autosp_lm.compiler.memory_plan import KEEP_ALL
    _measure(cfg, sp, seq, None, steps=0, backend=backend)
    out = {}
    for name, b, changes in (("default", None, None),
                             ("keep-all explicit", None, {"sac_memory_target": KEEP_ALL}),
                             ("chosen", budget, None), ("default again", None, None)):
        m = _measure(cfg, sp, seq, b, changes=changes, steps=1, backend=backend)
        out[name] = dict(first_step_s=round(m["first_step_s"], 2),
                         step_s=round(m["measured_step_s"], 3),
                         plan=m["memory_plan"].get("name"), choice_s=m["memory_plan"].get("seconds"))
        print(name, out[name], flush=True)
    return out


def markdown(rows: list, head: str) -> str:
    lines = [head, "", "| S | plan chosen (round) | predicted / measured peak (MiB) | budget "
             "(MiB) | measured step | x fastest fitting (which) | default plan: peak, step | "
             "choice s | start-up overhead |", "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if "refused" in r:
            lines.append(f"| {r['seq_length']} | refused: {r['refused']} | | | | | | | |")
            continue
        lines.append(
            f"| {r['seq_length']} | {r['plan']} ({r['round']}) | {r['predicted_peak'] / MiB:.1f}"
            f" / {r['measured_peak'] / MiB:.1f} | {r['budget'] / MiB:.1f} | "
            f"{r['measured_step_s']:.3f} s | x{r['step_vs_fastest']:.3f} ({r['fastest_fitting']})"
            f" | {r['default_plan_peak'] / MiB:.1f} MiB, {r['default_plan_step_s']:.3f} s | "
            f"{r['choice_s']:.2f} | {100 * r['startup_overhead']:+.0f}% |")
    return "\n".join(lines) + "\n"


def main(argv=None):
    p = Parser(prog="tools/bench_memory_plan.py", description=__doc__.splitlines()[0])
    add_model(p, "llama-tiny", help="model preset")
    add_model_overrides(p, "{}", help="ModelConfig fields: a JSON object or key=value,...")
    p.add_argument("--lengths", default="2048,8192,16384,32768", help="sequence lengths")
    p.add_argument("--memory-budget-gb", type=float, required=True, help="the one budget (GiB)")
    add_sequence_parallel_size(p, 2, help="SP ranks")
    p.add_argument("--steps", type=int, default=2, help="timed steps per run (median)")
    p.add_argument("--compile-backend", default="aot_eager", choices=("aot_eager", "inductor"),
                   help="code generation of the compiled model")
    p.add_argument("--trace-startup", metavar="MODEL",
                   help="instead: time the choice on the planner's fake-tensor trace of MODEL "
                        "(bf16, graph FSDP over the SP size, --trace-blocks blocks, the first "
                        "length), with the budget against without")
    p.add_argument("--trace-blocks", type=int, default=2, help="--trace-startup: blocks traced")
    p.add_argument("--decompose", action="store_true",
                   help="instead: first-step seconds of the plan without a budget, the "
                        "no-recompute plan given explicitly, the choice, then the first plan "
                        "again (at the first length)")
    p.add_argument("--out", help="write OUT.json and OUT.md")
    a = p.parse_args(argv)
    if a.trace_startup:
        r = trace_startup(a.trace_startup, parse_model_overrides(a.model_overrides),
                          a.sequence_parallel_size, int(a.lengths.split(",")[0]),
                          a.trace_blocks, int(a.memory_budget_gb * 2**30))
        print(json.dumps(r, indent=1))
        if a.out:
            with open(a.out + ".json", "w") as f:
                json.dump(r, f, indent=1)
        return r
    from autosp_lm.planner.trace import model_config
    lengths = [int(x) for x in a.lengths.split(",")]
    cfg = model_config(a.model, parse_model_overrides(a.model_overrides), max(lengths))
    budget = int(a.memory_budget_gb * 2**30)
    if a.decompose:
        r = decompose(cfg, a.sequence_parallel_size, lengths[0], budget, a.compile_backend)
        if a.out:
            with open(a.out + ".json", "w") as f:
                json.dump(r, f, indent=1)
        return r
    _measure(cfg, a.sequence_parallel_size, lengths[0], None, steps=0,
             backend=a.compile_backend)  # warms the process (imports, first compile): discarded
    rows = []
    for seq in lengths:
        rows.append(run_length(cfg, a.sequence_parallel_size, seq, budget, a.steps,
                               a.compile_backend))
        print(json.dumps({k: v for k, v in rows[-1].items() if k != "candidates"}), flush=True)
    head = (f"AutoSP memory-plan choice, {a.model} {a.model_overrides}, SP "
            f"{a.sequence_parallel_size} (rank 0 measured, the other ranks simulated), "
            f"{a.compile_backend}, CPU, budget {budget / MiB:.1f} MiB per rank. Measured peak: "
            f"the whole training step (AdamW included) on the CPU allocator (LivePeak). Start-up "
            f"overhead: first step minus a later step, with the choice over without it (after one "
            f"discarded warm-up run; Inductor's kernel cache empty for every run).")
    md = markdown(rows, head)
    print(md)
    if a.out:
        with open(a.out + ".json", "w") as f:
            json.dump({"rows": rows, "argv": argv if argv is not None else sys.argv[1:]}, f,
                      indent=1)
        cmd = " ".join(["python tools/bench_memory_plan.py"] + (argv if argv is not None
                                                                 else sys.argv[1:]))
        with open(a.out + ".md", "w") as f:
            f.write(f"# AutoSP chooses the plan that fits\n\n`{cmd}`\n\n{md}")
    return rows


if __name__ == "__main__":
    main()
