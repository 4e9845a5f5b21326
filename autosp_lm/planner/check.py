"""The memory planner validated: its prediction against the measured peak of the same real step.

:func:`measure_step` runs strategy ``name``'s real training step on CPU as one rank of an
``sp``-way job (the fake process group of ``--simulate-world-size``: collectives return correctly
shaped, meaningless tensors, so this rank allocates exactly what a rank of a real job does), with
the same compiled program the planner traced (AutoSP on aot_eager; the hand-written strategies
through the capture backend: op-by-op execution), after one warm-up step (compilation, optimizer
states), and measures the step's peak of live tensor memory with
:class:`~autosp_lm.training.memory.LivePeak` (exact on CPU) above what was live before it
(parameters, optimizer states, the batch; their bytes are counted from the tensors).
:func:`validate` puts both side by side (``tools/plan_memory.py --validate``).
"""
from __future__ import annotations

import time

import torch

from ..compiler import offload as offload_ops
from ..models import build_model
from ..parallel.sharding import storage_bytes
from ..parallel.sharding_kinds import build_sharding, sharding_kind
from ..training.memory import HostBytesAfterForward, LivePeak
from ..training.optimizer import build_optimizer
from ..training.step import finish_step, forward_backward
from .plan import Layout, predict, trace_step
from .workspace import reference_kernels
from .trace import (build_strategy_for, dynamic_inputs, model_config, simulated_world,
                    synthetic_batch)

#: the shapes of the CPU validation: the tiny preset and a wider one
VALIDATION_SHAPES = {
    "llama-tiny": ("llama-tiny", {}),
    "llama-wide": ("llama-tiny", dict(hidden_size=512, num_layers=4, num_attention_heads=8,
                                      num_query_groups=4, ffn_hidden_size=1536,
                                      vocab_size=8192)),
    # saved activations dominate the step (24 blocks, a small vocabulary, long sequences): the
    # shape where offload and depth extrapolation move the measured peak
    "llama-deep": ("llama-tiny", dict(num_layers=24)),
}
TOLERANCE = 0.05


def measure_step(name: str, cfg, sp: int, seq: int, *, world: int = 0,
                 bf16: bool = False, device: str = "cpu", fsdp2: bool = False,
                 on_phase=None, configure=None, timed_steps: int = 0) -> dict:
    """The measured peak of one real training step (forward, backward, gradient reduction,
    optimizer step) of rank 0 of a ``world``-rank (default ``sp``) job on ``device``: on CPU
    :class:`~autosp_lm.training.memory.LivePeak` (exact; the kernels on their reference path,
    oneDNN off: :func:`~autosp_lm.planner.workspace.reference_kernels`), on CUDA
    ``torch.cuda.max_memory_allocated`` above ``memory_allocated`` before the step.
    ``fsdp2``: the model state sharded over the ``world`` ranks as ``pretrain.py
    --use-torch-fsdp2`` does (PyTorch FSDP2; AutoSP: graph FSDP), FSDP2's collectives on the
    fake group (their buffers are allocated as on a real rank). Offloaded activations (AutoSP's
    ``--offload-activations``, the recipes' compiled ``--cpu-offloading``) move through the
    offload ops as in training, with the trainer's prefetch depth: on CPU their host copies are
    memory outside torch's allocator (``measured_host_bytes``: the offload ops' count;
    ``measured_host_bytes_independent``: the same bytes counted outside the offload code,
    :class:`~autosp_lm.training.memory.HostBytesAfterForward`). ``on_phase``: called with
    ``"forward_backward"`` when each step's backward is done (before the gradient reduction and
    the optimizer), e.g. to read the device's peak of that phase. ``configure(strategy,
    model)``: called before the strategy compiles the (unsharded) model, e.g. to change its
    options; ``timed_steps``: that many more steps after the measured one, their median time
    in ``measured_step_s`` (``first_step_s``: the first step's, compilation included)."""
    torch._dynamo.reset()
    dev = torch.device(device)
    cuda = dev.type == "cuda"
    with simulated_world(world or sp), reference_kernels(not cuda):
        torch.manual_seed(0)
        model = build_model(cfg)
        strategy, ps = build_strategy_for(name, sp, store=[], device=device, shard_mesh=fsdp2)
        model = model.to(ps.device)
        if configure is not None:
            configure(strategy, model)
        sharding = build_sharding(sharding_kind(fsdp2, False, strategy.needs_full_graph), ps,
                                  bf16=bf16)
        sharding.wrap(model)
        strategy.setup(model)
        optimizer = build_optimizer(sharding.optimizer_module(), lr=1e-4, weight_decay=0.0,
                                    device=ps.device, sharded=sharding.sharded)
        batch = {k: v.to(ps.device)
                 for k, v in synthetic_batch(seq, cfg.vocab_size, fake=False).items()}

        def step(counter=None):
            with dynamic_inputs(name):
                forward_backward(strategy, batch, bf16=bf16, device=ps.device,
                                 saved_counter=counter)
            if on_phase is not None:
                on_phase("forward_backward")
            # as the trainer calls it: under Megatron-style bf16 the gradients to reduce are
            # the fp32 main ones the sharding holds, not the bf16 parameters' (None: zeros)
            finish_step(model, optimizer, dp_size=ps.dp_size, sharding=sharding)
            if cuda:
                torch.cuda.synchronize(ps.device)

        t0 = time.perf_counter()
        offload_ops.reset()  # (the trainer's own prefetch depth: the planner models it)
        sharding.zero_grad(optimizer)
        step()  # compiles; creates the optimizer states
        first = time.perf_counter() - t0
        sharding.zero_grad(optimizer)
        main = sharding.optimizer_module()  # fp32 main parameters (bf16) or the model
        start = storage_bytes(list(model.parameters())
                              + (list(main.parameters()) if main is not model else [])
                              + list(batch.values())
                              + [v for s in optimizer.state.values() for v in s.values()])
        offload_ops.reset_host_peak()
        host = HostBytesAfterForward(ps.device)  # the same bytes, counted by another party
        if cuda:
            torch.cuda.reset_peak_memory_stats(ps.device)
            before = torch.cuda.memory_allocated(ps.device)
            step(host)
            step_peak = torch.cuda.max_memory_allocated(ps.device) - before
        else:
            with LivePeak() as lp:
                step(host)
            step_peak = lp.peak
        host_peak = offload_ops.host_peak_bytes  # the offloaded copies (pinned on CUDA)
        seconds = time.perf_counter() - t0
        times = []
        for _ in range(timed_steps):
            sharding.zero_grad(optimizer)
            t1 = time.perf_counter()
            step()
            times.append(time.perf_counter() - t1)
    torch._dynamo.reset()
    return {"measured_step_peak_bytes": step_peak, "measured_start_bytes": start,
            "measured_peak_bytes": start + step_peak, "measure_s": seconds,
            "first_step_s": first,
            "measured_step_s": sorted(times)[len(times) // 2] if times else None,
            "measured_host_bytes": host_peak,
            # numpy's tracemalloc domain on CPU, the caching host allocator on CUDA
            "measured_host_bytes_independent": host.bytes}


def validate(shapes: dict, strategies: list, lengths: dict, *, sp: int = 2, bf16: bool = False,
             fsdp2: bool = False, trace_each_length: bool = False, log=print,
             on_row=None) -> list:
    """For every shape (name -> (preset, overrides)), strategy and length (shape -> list): the
    planner's prediction (one trace per shape and strategy, at the shortest length, evaluated
    symbolically at the others; with ``trace_each_length`` a trace at every length, as the
    max-length search confirms its answer: the compiler's length-dependent choices, such as
    SAC's recompute set, are then made at that length) against :func:`measure_step`. Rows with the relative errors of
    the whole peak and of the step's part of it (the peak above parameters, optimizer states
    and batch: the part the graphs predict). ``fsdp2``: the model state sharded over the ``sp``
    ranks (world = SP) as ``--use-torch-fsdp2`` does, predicted and measured."""
    rows = []
    for shape, (preset, over) in shapes.items():
        Ls = sorted(lengths[shape])
        cfg = model_config(preset, over, seq=Ls[-1])
        layout = Layout(world=sp, fsdp2=fsdp2, bf16=bf16, device="cpu")
        for name in strategies:
            t0 = time.perf_counter()
            traced = trace_step(name, cfg, sp, Ls[0], bf16=bf16, layout=layout)
            trace_s = time.perf_counter() - t0
            for L in Ls:
                if trace_each_length and L != traced.traced_seq:
                    t0 = time.perf_counter()
                    traced = trace_step(name, cfg, sp, L, bf16=bf16, layout=layout)
                    trace_s = time.perf_counter() - t0
                pred = predict(traced, L, layout)
                meas = measure_step(name, cfg, sp, L, world=sp, bf16=bf16, fsdp2=fsdp2)
                p_step = pred["peak_bytes"] - pred["static_bytes"]
                row = {"shape": shape, "preset": preset, "overrides": over, "strategy": name,
                       "seq_length": L, "sp": sp, "bf16": bf16, "fsdp2": fsdp2,
                       "traced_seq": traced.traced_seq,
                       "predicted_peak_bytes": pred["peak_bytes"],
                       "predicted_step_peak_bytes": p_step, "predicted_phase": pred["peak_phase"],
                       "predicted_host_bytes": pred.get("host_bytes", 0),
                       "trace_s": trace_s, **meas}
                row["error"] = pred["peak_bytes"] / meas["measured_peak_bytes"] - 1
                row["step_error"] = p_step / max(1, meas["measured_step_peak_bytes"]) - 1
                row["ok"] = abs(row["error"]) <= TOLERANCE and abs(row["step_error"]) <= TOLERANCE
                if row["predicted_host_bytes"] or meas.get("measured_host_bytes"):
                    row["host_error"] = row["predicted_host_bytes"] / max(
                        1, meas["measured_host_bytes"]) - 1
                    indep = meas.get("measured_host_bytes_independent")
                    row["host_error_independent"] = (row["predicted_host_bytes"] / max(1, indep)
                                                     - 1) if indep is not None else None
                    row["ok"] = row["ok"] and abs(row["host_error"]) <= TOLERANCE and (
                        indep is None or abs(row["host_error_independent"]) <= TOLERANCE)
                rows.append(row)
                if on_row is not None:  # e.g. write the table so far
                    on_row(rows)
                log(f"{shape:>10} {name:>12}{' fsdp2' if fsdp2 else ''} {L:>6}: predicted {pred['peak_bytes'] / 2**20:9.1f} "
                    f"MiB, measured {meas['measured_peak_bytes'] / 2**20:9.1f} MiB "
                    f"({100 * row['error']:+.2f}%; step {100 * row['step_error']:+.2f}%)")
    return rows


def _over_tolerance(rows: list) -> list:
    """The rows whose error exceeds :data:`TOLERANCE`, said plainly; and what ring's error is."""
    bad = [r for r in rows if not r["ok"]]
    out = []
    if bad:
        out += [f"**Over the {100 * TOLERANCE:.0f}% tolerance**: " + "; ".join(
            f"{r['shape']} {r['strategy']} at {r['seq_length']} tokens ({100 * r['error']:+.2f}%, "
            f"step {100 * r['step_error']:+.2f}%)" for r in bad) + ".", ""]
    return out


def _modelled(rows: list) -> list:
    """The recipes whose rows are their compiled program (the trace's and the measured one):
    once, not per row."""
    from .trace import modelled_lines
    lines = [f"*Modelled*{line[len('modelled'):]}." for line in
             modelled_lines(r["strategy"] for r in rows)]
    return [" ".join(lines) + " Predicted and measured here: that compiled program.", ""] \
        if lines else []


def markdown(rows: list, env: dict) -> str:
    worst = max((abs(r["step_error"]) for r in rows), default=0.0)
    worst_total = max((abs(r["error"]) for r in rows), default=0.0)
    lines = ["# Memory planner: predicted vs measured peak memory (CPU)", "",
             f"Produced by `{env['command']}` ({env['date']}, torch {env['torch']}, "
             f"{env['cpu_count']} CPU cores, machine shared with other jobs: the figures are "
             f"bytes, not times, and do not depend on the load).", "",
             "Each row: one rank of a simulated SP=2 job (fake process group; the rank allocates "
             "what a rank of a real job does), micro batch 1, fp32" + (" / bf16" if any(
                 r["bf16"] for r in rows) else "") + ". *Predicted*: `tools/plan_memory.py` "
             "on fake tensors, " + ("one trace per shape, strategy and length" if any(
                 r["traced_seq"] != min(x["seq_length"] for x in rows if x["shape"] == r["shape"])
                 for r in rows) else "one trace per shape and strategy at the shortest length, "
                 "evaluated symbolically at the others") + " (column *traced at*). *Measured*: the same compiled program run "
             "for real (AutoSP on aot_eager, the others through the planner's capture backend: "
             "op by op), `LivePeak` (exact CPU allocator peak) around the second training step "
             "(forward, backward, gradient all-reduce, AdamW step) plus the bytes live before it "
             "(parameters, optimizer states, batch). *Step*: the peak above those.", "",
             *(["**FSDP2** (`--use-torch-fsdp2`): the model state sharded over the job's 2 "
                "ranks as `pretrain.py` does it (PyTorch FSDP2 per block, per vocabulary layer "
                "and the root; AutoSP: graph FSDP, its gathers inside the compiled graph), "
                "FSDP2's all-gathers and reduce-scatters on the fake group (their buffers are "
                "allocated as on a real rank). The prediction: AutoSP traced with its "
                "parameters sharded the same way (its gathers, re-gathers and reduce-scatters "
                "are nodes of the simulated graphs); the others (FSDP2's module hooks run outside "
                "their graphs) the unsharded trace plus the analytic FSDP term of "
                "docs/plan_memory.md, an upper bound of what FSDP2 holds gathered at the peak.",
                ""]
               if any(r.get("fsdp2") for r in rows) else []),
             f"Worst error: **{100 * worst_total:.2f}%** of the whole peak, **{100 * worst:.2f}%** "
             f"of the step's part (tolerance {100 * TOLERANCE:.0f}%).", "",
             *_over_tolerance(rows),
             *_modelled(rows),
             "| shape | strategy | tokens | traced at | predicted MiB | measured MiB | error | "
             "step predicted MiB | step measured MiB | step error | host predicted MiB | "
             "host measured MiB | host error | host measured independently MiB |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        indep = r.get("measured_host_bytes_independent")
        host = (f"| {r['predicted_host_bytes'] / 2**20:.2f} "
                f"| {r['measured_host_bytes'] / 2**20:.2f} | {100 * r['host_error']:+.2f}% "
                f"| {'-' if indep is None else f'{indep / 2**20:.2f}'} |"
                if "host_error" in r else "| - | - | - | - |")
        lines.append(
            f"| {r['shape']} | {r['strategy']}{' bf16' if r['bf16'] else ''}"
            f"{' FSDP2' if r.get('fsdp2') else ''} | {r['seq_length']} "
            f"| {r['traced_seq']} | {r['predicted_peak_bytes'] / 2**20:.2f} "
            f"| {r['measured_peak_bytes'] / 2**20:.2f} | {100 * r['error']:+.2f}% "
            f"| {r['predicted_step_peak_bytes'] / 2**20:.2f} "
            f"| {r['measured_step_peak_bytes'] / 2**20:.2f} | {100 * r['step_error']:+.2f}% "
            + host)
    shapes = {r["shape"]: r["overrides"] for r in rows}
    lines += ["", "Shapes: " + "; ".join(
        f"`{s}` = llama-tiny" + (" with " + ", ".join(f"{k}={v}" for k, v in o.items()) if o
                                 else " (2 layers, hidden 64, 4/2 heads, vocab 512)")
        for s, o in shapes.items()), ""]
    return "\n".join(lines)
