"""The memory planner's prediction: per-GPU peak memory and the longest trainable context.

On a traced step (:mod:`.trace`: the partitioned graphs of one rank's step, compiled on fake tensors;
:mod:`.depth`: extrapolated from 2 and 3 blocks where the blocks are alike) the live tensors are
simulated in execution order (:func:`~autosp_lm.planner.liveness.simulate_step`) at any sequence
length (the sizes are sympy expressions of the traced length), and :func:`predict` adds what the
graphs do not hold: parameters, optimizer states, the batch, the gradient-reduction buckets and the
optimizer's temporaries, per the sharding. :func:`search_max` / :func:`find_max_seq_length`: the
longest length that fits a budget. ``docs/plan_memory.md`` states the model and its limits;
``tools/plan_memory.py`` is the command line, ``--validate`` (:mod:`autosp_lm.planner.check`)
compares predictions with measured peaks.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Callable, Optional

from ..parallel.grads import BUCKET_BYTES
from .capture import simulate_captured
from .depth import trace_by_depth, traced_progress
from .trace import BATCH_KEYS, STRATEGIES, TracedStep, sac_device_for, trace_full

GiB = 2 ** 30
DEFAULT_RESERVE_GB = 4.0  # CUDA context, NCCL and cuBLAS workspaces, allocator fragmentation


def graph_fsdp_world(name: str, layout: Optional["Layout"]) -> int:
    """The ranks to trace strategy ``name``'s parameters sharded over: ``layout.world`` for
    AutoSP under ``--use-torch-fsdp2`` (graph FSDP: its gathers are ops of the compiled graph, so
    the trace holds them), else 0 (traced unsharded; native FSDP2's gathers run in module hooks
    outside the graphs and :func:`predict` adds them analytically)."""
    if layout is None or not layout.fsdp2 or layout.world <= 1:
        return 0
    return layout.world if STRATEGIES[name][0] == "autosp" else 0


def trace_step(name: str, cfg, sp: int, seq: int, *, bf16: bool = False, offload: bool = False,
               depth: bool = True, check_depth: bool = False,
               layout: Optional["Layout"] = None,
               sac_device: Optional[str] = None,
               progress: Optional[Callable[[str], None]] = None) -> TracedStep:
    """Compile strategy ``name``'s step for one of ``sp`` ranks at ``seq`` tokens on fake tensors
    and capture its partitioned graphs (nothing is allocated: the process stays small). With
    ``depth`` (the default) a model of alike blocks is traced cut to 2 and 3 blocks and its step
    extrapolated to the full depth (:mod:`autosp_lm.planner.depth`; ``check_depth``: a third trace
    at 4 blocks checks the extrapolation at every length); otherwise the full model is traced.
    ``layout``: the job's placement of the model state; AutoSP under FSDP2 is traced with its
    parameters sharded over ``layout.world`` ranks (:func:`graph_fsdp_world`), and AutoSP's SAC
    prices its plan on ``layout.device`` (:func:`~autosp_lm.planner.trace.sac_device_for`; the
    CPU without a layout, as the measured CPU steps run) unless ``sac_device`` names a preset.
    ``progress``: called with one line before and after each trace (``trace n of m``, the cut
    models of the depth extrapolation included)."""
    fsdp_world = graph_fsdp_world(name, layout)
    sac_device = sac_device or sac_device_for(layout.device if layout else "cpu", sp)
    if depth:
        return trace_by_depth(name, cfg, sp, seq, bf16=bf16, offload=offload, check=check_depth,
                              fsdp_world=fsdp_world, sac_device=sac_device, progress=progress)
    with traced_progress(progress, name, sp, seq, 1, 1, f"all {cfg.num_layers} blocks"):
        traced = trace_full(name, cfg, sp, seq, bf16=bf16, offload=offload,
                            fsdp_world=fsdp_world, sac_device=sac_device)
    traced.depth = {"extrapolated": False, "reason": "--no-depth-extrapolation",
                    "blocks": len(traced.block_bytes)}
    return traced


@dataclass
class Layout:
    """How the job places the model state on ``world`` ranks."""

    world: int
    fsdp2: bool = False
    bf16: bool = False  # Megatron-style: bf16 compute parameters, fp32 main ones (precision.py)
    # the step's device: the attention kernels' workspace (planner/workspace.py) is that of
    # its kernels; the optimizer path is torch's fused AdamW on both (no temporaries)
    device: str = "cuda"
    host_bytes: int = 0  # host memory per GPU for offloaded activations (0: no limit)
    time_device: Optional[str] = None  # cost-model preset of the predicted step time


def time_device(layout: "Layout", sp: int):
    """The cost-model device the step time is predicted for: ``layout.time_device`` (a preset
    or ``name,field=value``), else the preset of ``layout.device`` for an SP group of ``sp``."""
    from ..compiler.cost_model import device_params
    return device_params(layout.time_device or sac_device_for(layout.device, sp))


def _grad_buckets(param_bytes: list, limit: int) -> int:
    """The largest flat buffer of the gradient all-reduce (parallel/grads.py's buckets)."""
    limit = limit or BUCKET_BYTES
    best = size = 0
    for b in param_bytes:
        if size and size + b > limit:
            best, size = max(best, size), 0
        size += b
    return max(best, size)


def predict(traced: TracedStep, seq: int, layout: Layout) -> dict:
    """Per-rank bytes of one training step at ``seq`` tokens: the breakdown at the peak, the
    peak and the phase it is in (``step``: forward/backward, ``optimizer``: after it)."""
    W = layout.world
    n_bytes = sum(traced.param_bytes)  # fp32
    shard = 1.0 / W if layout.fsdp2 else 1.0
    params = int(n_bytes * shard)  # fp32 (main) parameters
    optimizer = 2 * params
    grads = params
    if layout.bf16 and not layout.fsdp2:  # Megatron-style bf16: the bf16 compute copies too
        params += n_bytes // 2
    batch = 8 * seq * len(BATCH_KEYS)
    if traced.strategy == "ring":  # the zigzag slices are copies (contiguous ones are views)
        batch += 8 * (seq // traced.sp) * len(BATCH_KEYS)
    graph_fsdp = traced.graph_fsdp_world
    if graph_fsdp and (not layout.fsdp2 or graph_fsdp != W):
        raise ValueError(f"memory plan: {traced.strategy!r} was traced with its parameters "
                         f"sharded over {graph_fsdp} ranks (graph FSDP); predict it for that "
                         f"layout (FSDP2 on {graph_fsdp} ranks), not "
                         f"{'FSDP2 on ' + str(W) if layout.fsdp2 else 'unsharded on ' + str(W)}"
                         f" ranks: trace it again with this layout")
    # graph FSDP's gradients leave the graph reduce-scattered (their traced size is the shard)
    timed = time_device(layout, traced.sp)
    # on CUDA the offload ops' copies run on a side stream: their sources' memory is held until
    # each copy ends (timed on the step's device); on CPU they are synchronous
    sim = traced.step(seq, grad_fraction=1.0 if graph_fsdp else shard, target=layout.device,
                      clock=timed if layout.device == "cuda" else None)
    not_counted = dict(simulate_captured.not_counted)
    fsdp = 0
    if layout.fsdp2 and W > 1 and not graph_fsdp:
        # native FSDP2 (module hooks, outside the graphs), gathered units: the root (vocabulary
        # matrices) kept for the step, two blocks (current + prefetch), one block's full fp32
        # gradients before its reduce-scatter
        gdt = 2 if layout.bf16 else 4
        block = max(traced.block_bytes or [0])
        root = n_bytes - sum(traced.block_bytes)
        fsdp = int((root + 2 * block) * gdt / 4 + block)
    bucket = _grad_buckets(traced.param_bytes, 0) if (W > 1 and not layout.fsdp2) else 0
    temp = 0  # fused AdamW (CUDA and CPU, training/optimizer.py) allocates no temporaries
    step_phase = {"parameters": params, "optimizer states": optimizer, "batch": batch,
                  "step (activations, gradients, transients)": sim.peak}
    if fsdp:
        step_phase["FSDP gathered parameters / gradient buffers"] = fsdp
    opt_phase = {"parameters": params, "optimizer states": optimizer, "batch": batch,
                 "gradients": grads,
                 "gradient all-reduce bucket / optimizer temporaries": max(bucket, temp)}
    s_total, o_total = sum(step_phase.values()), sum(opt_phase.values())
    phase, breakdown = (("step", step_phase) if s_total >= o_total else ("optimizer", opt_phase))
    return {"strategy": traced.strategy, "seq_length": seq, "sp": traced.sp, "world_size": W,
            # the cost model's forward + backward seconds per step (planner/timing.py)
            "predicted_step_s": traced.step_time(seq, timed), "time_device": timed.name,
            # of which the compute stream waits for offloaded activations' copies back
            "predicted_offload_stall_s": traced.stall(seq, timed),
            "peak_bytes": max(s_total, o_total), "peak_phase": phase,
            # offloaded activations (AutoSP's offload, ALST's checkpoint inputs) in host memory
            "host_bytes": sim.host, "host_budget_bytes": layout.host_bytes,
            "fits_host": not layout.host_bytes or sim.host <= layout.host_bytes,
            "peak_node": sim.peak_at if phase == "step" else "optimizer step",
            "step_peak_phase": sim.peak_phase, "breakdown": breakdown,
            "saved_activations_bytes": sim.saved, "step_live_peak_bytes": sim.peak,
            "static_bytes": params + optimizer + batch, "plan": traced.plan,
            "depth": traced.depth,
            "custom_ops_not_counted": not_counted, "notes": _notes(traced, layout)}


def _notes(traced: TracedStep, layout: Layout) -> list:
    """What the prediction stands for where it is not exactly the program the trainer runs."""
    from .trace import HOST_OFFLOAD
    out = []
    if layout.fsdp2 and layout.world > 1 and traced.strategy in HOST_OFFLOAD:
        out.append("under --use-torch-fsdp2 the trainer runs this recipe's offload eagerly "
                   "(saved-tensor hooks: the compiled offload needs the blocks in one graph, "
                   "FSDP2's units split it); predicted: the compiled program, its FSDP2 term "
                   "an upper bound")
    return out


def granularity(traced: TracedStep) -> int:
    """Sequence lengths searched: multiples of the SP size (twice it for the zigzag layout) and
    of 128."""
    step = 2 * traced.sp if traced.zigzag else traced.sp
    return step * 128 // math.gcd(step, 128)


def search_max(traced: TracedStep, layout: Layout, budget: int, *, cap: int = 1 << 26,
               stats: Optional[dict] = None,
               progress: Optional[Callable[[str], None]] = None) -> int:
    """The longest length (a multiple of :func:`granularity`, at most ``cap``) whose predicted
    peak fits ``budget`` bytes, on this trace (0: not even the smallest). The peak grows with the
    length; the answer is the one a bisection gives (``L`` fits, ``L + granularity`` does not),
    found by interpolation in a bracket (the peak is nearly affine in the length: a handful of
    predictions instead of a doubling and a bisection; bisection steps where it is not).
    ``stats["predictions"]`` counts the lengths evaluated; ``progress`` is called with one line
    per length evaluated (its peak against the budget and the seconds it took)."""
    g = granularity(traced)
    top = max(g, cap // g * g)
    memo: dict = {}

    def peak(L: int) -> int:
        # a plan over the host budget does not fit: its host bytes, scaled to the device
        # budget, stand for the peak (both grow with L)
        if L not in memo:
            t0 = time.time()
            r = predict(traced, L, layout)
            host = r["host_bytes"] * budget // layout.host_bytes if layout.host_bytes else 0
            memo[L] = max(r["peak_bytes"], host if r["fits_host"] else max(host, budget + 1))
            if stats is not None:
                stats["predictions"] = stats.get("predictions", 0) + 1
            if progress is not None:
                on_host = (f", host {r['host_bytes'] / GiB:.2f} GiB"
                           + ("" if r["fits_host"] else " (over the host budget)")
                           if r["host_bytes"] else "")
                progress(f"{traced.strategy} SP {traced.sp}: {L} tokens: peak "
                         f"{r['peak_bytes'] / GiB:.2f} GiB of {budget / GiB:.2f}"
                         f"{on_host}: {'fits' if memo[L] <= budget else 'does not fit'} "
                         f"({time.time() - t0:.0f} s)")
        return memo[L]

    def down(x: float) -> int:
        return int(x // g) * g

    if peak(g) > budget:
        return 0
    lo, hi = g, None  # lo fits; hi (None: not found yet) does not
    prev = None  # the fitting point before lo: the slope while no hi is known
    side, run = None, 0  # the end moved last inside a bracket, and how many times in a row
    while hi is None or hi - lo > g:
        if hi is None:
            if lo == top:
                return lo
            if prev is None:  # one point: probe at the traced length (at least twice lo)
                guess = max(2 * lo, down(traced.traced_seq))
            else:  # extrapolate the last two fitting points
                slope = (peak(lo) - peak(prev)) / (lo - prev)
                guess = top if slope <= 0 else down(lo + (budget - peak(lo)) / slope)
            guess = min(top, max(lo + g, guess))
        else:
            span = peak(hi) - peak(lo)
            guess = down(lo + (budget - peak(lo)) * (hi - lo) / span) if span > 0 else lo
            if run >= 2:  # interpolation keeps moving one end (regula falsi's stall): bisect
                guess = down((lo + hi) // 2)
            guess = min(hi - g, max(lo + g, guess))
        bracketed, fits = hi is not None, peak(guess) <= budget
        if fits:
            prev, lo = lo, guess
        else:
            hi = guess
        if bracketed:
            run = run + 1 if side == fits else 1
            side = fits
    return lo


def longest_within(results: list, traces: dict, layout: Layout, percent: float) -> dict:
    """The longest context whose plan is at most ``percent`` % slower than the fastest plan at
    that length. ``results``: :func:`find_max_seq_length` answers of one SP size; ``traces``:
    strategy -> its final trace. At each strategy's longest length every traced strategy's step
    time is predicted (:meth:`TracedStep.step_time`; memory ignored, so the fastest may not fit);
    the answer is the longest of those lengths whose own plan is within the margin."""
    rows = []
    for r in results:
        L, name = r["max_seq_length"], r["strategy"]
        if not L or name not in traces:
            continue
        times = {}
        for other, traced in traces.items():
            try:
                times[other] = traced.step_time(L, time_device(layout, traced.sp))
            except ValueError:  # L does not split like that plan's layout
                continue
        fastest = min(times, key=times.get)
        rows.append({"strategy": name, "seq_length": L, "step_s": times[name],
                     "fastest": fastest, "fastest_s": times[fastest],
                     "ratio": times[name] / times[fastest] if times[fastest] else 1.0})
    ok = [x for x in rows if x["ratio"] <= 1 + percent / 100]
    best = max(ok, key=lambda x: (x["seq_length"], -x["ratio"]), default=None)
    return {"percent": percent, "answer": best, "candidates": rows}


def find_max_seq_length(name: str, cfg, sp: int, layout: Layout, budget: int, *,
                        bf16: bool = False, offload: bool = False, traced: TracedStep = None,
                        confirm: bool = True, rounds: int = 3, depth: bool = True,
                        check_depth: bool = False, sac_device: Optional[str] = None,
                        keep: Optional[dict] = None,
                        progress: Optional[Callable[[str], None]] = None) -> dict:
    """:func:`search_max` for strategy ``name``; with ``confirm`` the step is traced again at the
    length found (the compiler's choices, e.g. SAC's, depend on the traced length) and searched
    on that trace until the length is stable (at most ``rounds`` traces). Traces are made for
    ``layout`` (AutoSP under FSDP2: its parameters sharded, :func:`graph_fsdp_world`).
    ``progress``: one line per trace and per length evaluated (:func:`search_max`)."""
    traced = traced or trace_step(name, cfg, sp, 16384 if sp <= 8 else 2048 * sp, bf16=bf16,
                                  offload=offload, depth=depth, check_depth=check_depth,
                                  layout=layout, sac_device=sac_device, progress=progress)
    history = []
    stats: dict = {}
    best = search_max(traced, layout, budget, stats=stats, progress=progress)
    history.append({"traced_seq": traced.traced_seq, "found": best, **stats})
    for round_ in range(rounds - 1 if confirm else 0):
        if best == 0 or best == traced.traced_seq:
            break
        if progress is not None:
            progress(f"{name} SP {sp}: {best} tokens on the trace at {traced.traced_seq}; "
                     f"confirming by a trace at {best} (round {round_ + 2} of at most {rounds})")
        traced = trace_step(name, cfg, sp, best, bf16=bf16, offload=offload, depth=depth,
                            check_depth=check_depth, layout=layout, sac_device=sac_device,
                            progress=progress)
        stats = {}
        again = search_max(traced, layout, budget, stats=stats, progress=progress)
        history.append({"traced_seq": traced.traced_seq, "found": again, **stats})
        if again == best:
            break
        best = again
    out = {"strategy": name, "sp": traced.sp, "world_size": layout.world,
           "max_seq_length": best, "budget_bytes": budget, "traces": history,
           "confirmed": best == 0 or best == traced.traced_seq, "depth": traced.depth}
    if best:
        out["at_max"] = predict(traced, best, layout)
    if keep is not None:  # the final trace, for longest_within
        keep[name] = traced
    return out
