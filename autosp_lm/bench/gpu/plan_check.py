"""The ``plan_vs_measured`` sections: the memory planner's predicted peak and host bytes of one
rank (a trace on fake tensors on the CPU) against the measured ones of the same step run for real.

``plan_vs_measured`` is the GPU check's first section: the :data:`~.decisive.DECISIVE` recipes in
the decisive cells' job (:mod:`.decisive`), each where its prediction is exact: AutoSP's recipes
with the model state sharded by graph FSDP (``--use-torch-fsdp2``: the planner traces the
gathers and reduce-scatters), the hand-written ones unsharded (their native FSDP2 is an analytic
upper bound in the planner). ``plan_vs_measured_baselines``, near the end: plain ``none`` and
``ulysses`` (no memory technique), unsharded."""
from __future__ import annotations

import os
import time

import torch

from .common import Row, run_cells, unfinished_row
from . import decisive
from .decisive import PLAN_CELL_EST, in_tree, not_in_tree, shape

#: the strategies without a memory technique, after the decisive ones, at a length where
#: ``none`` (the whole sequence on the rank, fp32 logits) fits one device
BASELINE_STRATEGIES = ("none", "ulysses")
BASELINE_SEQ = 8192


def traced_sharded(name: str) -> bool:
    """Whether the planner traces strategy ``name``'s ``--use-torch-fsdp2`` exactly (AutoSP's
    graph FSDP: its gathers and reduce-scatters are nodes of the traced graphs), not as an
    analytic upper bound (native FSDP2's hooks, outside the graphs)."""
    from ..plan import STRATEGIES
    return STRATEGIES[name][0] == "autosp"


def plan_worker(cell: dict) -> dict:
    """The planner's prediction of strategy ``cell["strategy"]`` at ``cell["seq"]`` tokens (a
    trace on fake tensors on the CPU) and the measured peak of the same step run for real on
    ``cell["device"]`` (the planner's ``measure_step``), one rank of ``cell["sp"]`` (the model
    state sharded over them with ``cell["fsdp2"]``). On CUDA also the forward/backward phase
    alone: its peak above the step's start against the simulated step's (the activations'
    part, whichever phase holds the whole peak)."""
    from ..plan import Layout, measure_step, model_config, predict, trace_step
    name, sp, seq, bf16 = cell["strategy"], cell["sp"], cell["seq"], cell["bf16"]
    fsdp2 = bool(cell.get("fsdp2"))
    cfg = model_config(cell["model"], {}, seq=seq)
    layout = Layout(world=sp, fsdp2=fsdp2, bf16=bf16, device=cell["device"])
    t0 = time.perf_counter()
    traced = trace_step(name, cfg, sp, seq, bf16=bf16, layout=layout)
    pred = predict(traced, seq, layout)
    trace_s = time.perf_counter() - t0
    cuda = cell["device"] == "cuda"
    after_backward = []

    def on_phase(phase):
        if cuda and phase == "forward_backward":
            torch.cuda.synchronize()
            after_backward.append(torch.cuda.max_memory_allocated())
    meas = measure_step(name, cfg, sp, seq, world=sp, bf16=bf16, device=cell["device"],
                        fsdp2=fsdp2, on_phase=on_phase)
    fb_meas = None
    if after_backward:  # the measured step's peak up to its backward's end, above its start
        whole = torch.cuda.max_memory_allocated()
        fb_meas = meas["measured_step_peak_bytes"] - (whole - after_backward[-1])
    p_step = pred["peak_bytes"] - pred["static_bytes"]
    host_p, host_m = pred.get("host_bytes", 0), meas.get("measured_host_bytes") or 0
    fb_pred = pred["step_live_peak_bytes"]
    # the host bytes counted a second time outside the offload code (numpy's tracemalloc
    # domain on CPU, the caching host allocator on CUDA), where measure_step gives them
    host_i = meas.get("measured_host_bytes_independent")
    return {"predicted_host_gib": host_p / 2**30, "measured_host_gib": host_m / 2**30,
            "measured_host_independent_gib": None if host_i is None else host_i / 2**30,
            "host_error": (host_p / host_m - 1) if host_m else (0.0 if not host_p else 1.0),
            "predicted_gib": pred["peak_bytes"] / 2**30,
            "measured_gib": meas["measured_peak_bytes"] / 2**30,
            "peak_error": pred["peak_bytes"] / meas["measured_peak_bytes"] - 1,
            "step_error": p_step / max(1, meas["measured_step_peak_bytes"]) - 1,
            "predicted_fb_gib": fb_pred / 2**30,
            "measured_fb_gib": None if fb_meas is None else fb_meas / 2**30,
            "fb_error": None if fb_meas is None else fb_pred / max(1, fb_meas) - 1,
            "predicted_phase": pred["peak_phase"], "trace_s": trace_s,
            "measure_s": meas["measure_s"], "depth": traced.depth,
            "custom_ops_not_counted": pred["custom_ops_not_counted"]}


def plan_row(section: str, check: str, res: dict, note: str = "") -> Row:
    """The row of one predicted-against-measured cell: ok within the planner's tolerance (its CPU
    validation's, 10%) on the whole peak, the step's part of it, the forward/backward phase's
    peak (CUDA) and the host bytes."""
    from ..plan import TOLERANCE
    row = unfinished_row(section, check, res)
    if row is not None:
        return row
    errors = [res["peak_error"], res["step_error"], res["host_error"]]
    if res.get("fb_error") is not None:
        errors.append(res["fb_error"])
    ok = all(abs(e) <= TOLERANCE for e in errors)
    missed = res["custom_ops_not_counted"]
    other = res.get("measured_host_independent_gib")
    host = (f"; pinned host {res['predicted_host_gib']:.4g} GiB predicted vs "
            f"{res['measured_host_gib']:.4g} measured ({100 * res['host_error']:+.1f}%"
            + (f"; {other:.4g} counted by the host allocator" if other is not None else "")
            + ")" if res["predicted_host_gib"] or res["measured_host_gib"] else "")
    fb = (f"; forward/backward {res['predicted_fb_gib']:.4g} vs {res['measured_fb_gib']:.4g} GiB "
          f"({100 * res['fb_error']:+.1f}%)" if res.get("fb_error") is not None else "")
    return Row(section, check, "ok" if ok else "FAIL",
               f"predicted {res['predicted_gib']:.4g} GiB vs measured {res['measured_gib']:.4g} "
               f"GiB ({100 * res['peak_error']:+.1f}%, step {100 * res['step_error']:+.1f}%; "
               f"peak in the {res['predicted_phase']} phase; tolerance "
               f"{100 * TOLERANCE:.0f}%)" + fb + host
               + (f"; not counted: {missed}" if missed else "") + note,
               peak_mem_gib=res["measured_gib"], predicted_gib=res["predicted_gib"],
               peak_error=res["peak_error"], step_error=res["step_error"],
               **({"fb_error": res["fb_error"]} if res.get("fb_error") is not None else {}),
               predicted_host_gib=res["predicted_host_gib"],
               measured_host_gib=res["measured_host_gib"],
               **({"cell_s": res["cell_s"]} if "cell_s" in res else {}))


def device_gib(cfg, world: int, fsdp2: bool, seq: int) -> float:
    """A cell's device memory, roughly, for running cells side by side: Megatron-style bf16
    model state (fp32 and bf16 parameters, fp32 gradients, AdamW's two moments: 18 bytes a
    parameter; 1/world of it sharded; the whole fp32 model on the device before it is sharded),
    the step's activations (allowance: 256 KiB a local token), the CUDA context."""
    n = cfg.num_parameters()
    state = max(18 * n / (world if fsdp2 else 1), 4 * n)
    return (state + 262144 * seq / world) / 2**30 + 1.0


def _cells(names, smoke: bool, seq: int = 0) -> list:
    """The cells of ``names`` in the decisive job (at ``seq`` tokens instead of its length); a
    name not in this tree is a cell to skip, in its place."""
    s = shape(smoke)
    if seq and not smoke:
        s["seq"] = seq
    from ..plan import model_config
    cfg = model_config(s["model"], {}, seq=s["seq"])
    cells = []
    for name in names:
        if not in_tree(name):
            cells.append((f"{name} S={s['seq']} SP={s['world']}", {"skip": not_in_tree(name)}))
            continue
        # sharded where the planner traces the sharding (AutoSP's graph FSDP), unsharded where
        # it would only bound it (native FSDP2): each recipe where its prediction is exact
        fsdp2 = traced_sharded(name)
        check = f"{name} S={s['seq']} SP={s['world']}{' FSDP2' if fsdp2 else ''}"
        cells.append((check, dict(worker="plan", strategy=name, sp=s["world"], seq=s["seq"],
                                  bf16=True, fsdp2=fsdp2, model=s["model"], device=s["device"],
                                  est_s=20.0 if smoke else PLAN_CELL_EST,
                                  mem_gib=device_gib(cfg, s["world"], fsdp2, s["seq"]))))
    return cells


def _parallel(smoke: bool, n: int) -> int:
    """Plan cells measure memory, not time, and their time is the CPU's (tracing, compiling):
    they run side by side, as many as the cores allow (three cores each: the trace, the
    compile, the worker threads) and the device's memory (:func:`device_gib`, 70% of it)."""
    cores = os.cpu_count() or 1
    return max(1, min(n, cores // 2 if smoke else cores // 3, 6))


def _memory_gib(smoke: bool) -> float:
    if smoke or not torch.cuda.is_available():
        return float("inf")
    return 0.7 * torch.cuda.get_device_properties(0).total_memory / 2**30


def _section(section: str, names, args, deadline, seq: int = 0):
    if not args.smoke and not torch.cuda.is_available():
        yield Row(section, "planner vs max_memory_allocated", "skipped", "no CUDA device")
        return
    cells = _cells(names, args.smoke, seq)
    for check, res in run_cells(section, cells, deadline,
                                parallel=_parallel(args.smoke, len(cells)),
                                memory_gib=_memory_gib(args.smoke)):
        yield plan_row(section, check, res, note=(
            f"; depth extrapolated from {res['depth'].get('extrapolated_from')}"
            if isinstance(res.get("depth"), dict) and res["depth"].get("extrapolated") else ""))


def section_plan_vs_measured(args, deadline):
    """The decisive cells: each :data:`~.decisive.DECISIVE` recipe's predicted peak and host
    bytes against ``max_memory_allocated`` and the pinned host bytes of the same compiled
    program run for real (the planner's ``measure_step``: AutoSP on aot_eager, the others op by
    op; Inductor's fused kernels allocate less), one rank of the decisive job, sharded where the
    planner traces the sharding; on CUDA the forward/backward phase's peak too (the activations,
    wherever the whole peak is); cells side by side (:func:`_parallel`). ``--smoke``:
    llama-tiny, SP 2, on CPU (``LivePeak``, exact; no phase split)."""
    yield from _section("plan_vs_measured", decisive.DECISIVE, args, deadline)


def section_plan_vs_measured_baselines(args, deadline):
    """``none`` and plain ``ulysses`` in the decisive job (unsharded, as the hand-written
    recipes there) at :data:`BASELINE_SEQ` tokens, predicted against measured."""
    yield from _section("plan_vs_measured_baselines", BASELINE_STRATEGIES, args, deadline,
                        seq=BASELINE_SEQ)
