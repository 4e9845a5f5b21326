"""The ``memory_plan`` section: AutoSP chooses the plan that fits (``--memory-budget-gb``) on the
device, as one rank of a 2-rank SP job (the other rank simulated: ``planner.check.measure_step``).

Per budget, one bf16 training step (AdamW, Megatron-style bf16) of a wide llama at a long
length: the plan the compiler chose, its predicted peak, the measured one
(``max_memory_allocated``, the state before the step included) against the budget, and the
seconds the choice took. The budgets: the CUDA default (the device's memory minus the planner's
4 GiB reserve), then a tight one (a quarter of it) that makes the choice escalate. A row is ok
when the measured peak is within the budget.

``--smoke``: the same on CPU (aot_eager, llama-tiny at 2K tokens, budgets from its predictions).
"""
from __future__ import annotations

import dataclasses

import torch

from .common import Row, run_one_cell

EST_S = 150.0  # two Inductor compiles with the choice and two long-context steps (estimate)
GiB = 2 ** 30
SHAPE = dict(hidden_size=2048, num_layers=8, num_attention_heads=16, num_query_groups=8,
             ffn_hidden_size=5632, vocab_size=32000)


def memory_plan_worker(cell: dict) -> dict:
    from autosp_lm.planner.check import measure_step
    from autosp_lm.planner.fit import default_budget, memory_plan_options
    from autosp_lm.planner.trace import model_config
    cfg = model_config("llama-tiny", cell["overrides"], cell["seq"])
    device = torch.device(cell["device"])
    full = default_budget(device) if device.type == "cuda" else cell["cpu_budget"]
    out = {}
    for name, budget in (("default budget", full), ("a quarter of it", full // 4)):
        box = {}

        def configure(strategy, model, budget=budget):
            opts = dataclasses.replace(strategy.options, backend=cell["backend"])
            strategy.options = dataclasses.replace(opts, **memory_plan_options(
                model, budget_gb=budget / GiB, device=device, world=2, sp=2,
                seq_length=cell["seq"], bf16=cell["bf16"]))
            box["strategy"] = strategy
        try:
            m = measure_step("autosp", cfg, 2, cell["seq"], bf16=cell["bf16"],
                             device=cell["device"], configure=configure)
            plan = box["strategy"].runner.report.memory_plan
            out[name] = {"budget": budget, "plan": plan["name"], "flags": plan["flags"],
                         "predicted": plan["peak"], "measured": m["measured_peak_bytes"],
                         "choice_s": plan["seconds"], "cell_s": m["measure_s"]}
        except Exception as e:  # noqa: BLE001 - the row says what failed (a refusal included)
            out[name] = {"budget": budget, "error": f"{type(e).__name__}: {str(e)[:300]}"}
    return out


def section_memory_plan(args, deadline):
    cell = dict(worker="memory_plan", device="cpu" if args.smoke else "cuda",
                backend="aot_eager" if args.smoke else "inductor", bf16=not args.smoke,
                overrides={} if args.smoke else SHAPE, seq=2048 if args.smoke else 131072,
                cpu_budget=64 * 2 ** 20, est_s=30.0 if args.smoke else EST_S)
    row, results = run_one_cell("memory_plan", "budgets", cell, args, deadline)
    if row is not None:
        yield row
        return
    for name, r in results.items():
        if "error" in r:
            yield Row("memory_plan", name, "FAIL", r["error"],
                      budget_gib=r["budget"] / GiB)
            continue
        ok = r["measured"] <= r["budget"]
        yield Row("memory_plan", name, "ok" if ok else "FAIL",
                  f"{r['plan']} ({r['flags']}); predicted {r['predicted'] / GiB:.2f} GiB, "
                  f"measured {r['measured'] / GiB:.2f} GiB of {r['budget'] / GiB:.2f} GiB; "
                  f"chosen in {r['choice_s']:.1f} s",
                  budget_gib=r["budget"] / GiB, predicted_gib=r["predicted"] / GiB,
                  measured_gib=r["measured"] / GiB, cell_s=r["cell_s"])
