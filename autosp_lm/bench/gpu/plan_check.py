"""The ``plan_vs_measured`` section: the memory planner's predicted peak of one rank (a trace on
fake tensors on the CPU) against the measured peak of the same step run for real."""
from __future__ import annotations

import time

import torch

from .common import Row, run_cells


#: AutoSP under graph FSDP in both
PLAN_STRATEGIES = ("none", "autosp", "ulysses")
#: AutoSP's max-context mode (docs/sac.md), under graph FSDP, without and with the offload of its
#: layer inputs: the device peak and the pinned host bytes against the prediction
MAX_CONTEXT_STRATEGIES = ("autosp-max", "autosp-max-offload")


def plan_worker(cell: dict) -> dict:
    """The planner's prediction of strategy ``cell["strategy"]`` at ``cell["seq"]`` tokens (a
    trace on fake tensors on the CPU) and the measured peak of the same step run for real on
    ``cell["device"]`` (the planner's ``measure_step``), one rank of ``cell["sp"]``."""
    from ..plan import Layout, measure_step, model_config, predict, trace_step
    name, sp, seq, bf16 = cell["strategy"], cell["sp"], cell["seq"], cell["bf16"]
    fsdp2 = bool(cell.get("fsdp2"))
    cfg = model_config(cell["model"], {}, seq=seq)
    layout = Layout(world=sp, fsdp2=fsdp2, bf16=bf16, device=cell["device"])
    t0 = time.perf_counter()
    traced = trace_step(name, cfg, sp, seq, bf16=bf16, layout=layout)
    pred = predict(traced, seq, layout)
    trace_s = time.perf_counter() - t0
    meas = measure_step(name, cfg, sp, seq, world=sp, bf16=bf16, device=cell["device"],
                        fsdp2=fsdp2)
    p_step = pred["peak_bytes"] - pred["static_bytes"]
    host_p, host_m = pred.get("host_bytes", 0), meas.get("measured_host_bytes") or 0
    return {"predicted_host_gib": host_p / 2**30, "measured_host_gib": host_m / 2**30,
            "host_error": (host_p / host_m - 1) if host_m else (0.0 if not host_p else 1.0),
            "predicted_gib": pred["peak_bytes"] / 2**30,
            "measured_gib": meas["measured_peak_bytes"] / 2**30,
            "peak_error": pred["peak_bytes"] / meas["measured_peak_bytes"] - 1,
            "step_error": p_step / max(1, meas["measured_step_peak_bytes"]) - 1,
            "predicted_phase": pred["peak_phase"], "trace_s": trace_s,
            "measure_s": meas["measure_s"],
            "custom_ops_not_counted": pred["custom_ops_not_counted"]}


def section_plan_vs_measured(args, deadline) -> list:
    """The memory planner's predicted peak against the measured one (``max_memory_allocated``
    on CUDA; on CPU, ``--smoke``, the exact ``LivePeak``: llama-tiny, SP=2, 256 tokens)."""
    from ..plan import TOLERANCE
    smoke = args.smoke
    if not smoke and not torch.cuda.is_available():
        return [Row("plan_vs_measured", "planner vs max_memory_allocated", "skipped",
                    "no CUDA device")]
    # (strategy, FSDP2): AutoSP also with its parameters sharded by graph FSDP over the SP
    # ranks, which the planner traces (its gathers and reduce-scatters are graph nodes)
    chosen = ([("autosp", False), ("autosp", True)] if smoke
              else [(n, False) for n in PLAN_STRATEGIES] + [("autosp", True)]
              + [(n, True) for n in MAX_CONTEXT_STRATEGIES])
    stop = time.time() + 0.3 * (deadline - time.time())  # the rest is left to the others
    seq, sp = (256, 2) if smoke else (8192, 8)
    cells = [(f"{name}{' FSDP2' if fsdp2 else ''} S={seq} SP={sp}",
              dict(worker="plan", strategy=name, sp=sp, seq=seq, bf16=True, fsdp2=fsdp2,
                   model="llama-tiny" if smoke else "llama-3.2-1b",
                   device="cpu" if smoke else "cuda")) for name, fsdp2 in chosen]
    rows = []
    for check, res in run_cells("plan_vs_measured", cells, stop, rows):
        ok = abs(res["peak_error"]) <= TOLERANCE and abs(res["step_error"]) <= TOLERANCE \
            and abs(res["host_error"]) <= TOLERANCE
        missed = res["custom_ops_not_counted"]
        host = (f"; pinned host {res['predicted_host_gib']:.4g} GiB predicted vs "
                f"{res['measured_host_gib']:.4g} measured ({100 * res['host_error']:+.1f}%)"
                if res["predicted_host_gib"] or res["measured_host_gib"] else "")
        rows.append(Row("plan_vs_measured", check, "ok" if ok else "FAIL",
                        f"predicted {res['predicted_gib']:.4g} GiB vs measured "
                        f"{res['measured_gib']:.4g} GiB ({100 * res['peak_error']:+.1f}%, step "
                        f"{100 * res['step_error']:+.1f}%; tolerance {100 * TOLERANCE:.0f}%)"
                        + host + (f"; not counted: {missed}" if missed else ""),
                        peak_mem_gib=res["measured_gib"], predicted_gib=res["predicted_gib"],
                        peak_error=res["peak_error"], step_error=res["step_error"]))
    return rows

