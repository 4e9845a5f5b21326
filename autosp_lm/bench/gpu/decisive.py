"""The GPU check's decisive cells, the first it runs: for each recipe of :data:`DECISIVE`, the
memory planner's predicted peak and host bytes against the measured ones (``plan_vs_measured``,
:mod:`.plan_check`), then its tokens/s and MFU (``throughput``, here).

Every cell is one rank of an :data:`WORLD`-way job on one device (a fake process group:
collectives return correctly shaped, meaningless tensors, so memory and compute are one rank's and
communication is excluded), :data:`MODEL` in Megatron-style bf16, :data:`SEQ` tokens, SP = world.
The throughput cells shard the model state over the job's ranks (``--use-torch-fsdp2``: graph
FSDP under AutoSP, PyTorch FSDP2 for the hand-written strategies, as the README's planner
table); the predicted-against-measured cells shard it where the planner traces the sharding
(AutoSP's graph FSDP) and not where the planner only bounds it (native FSDP2: an analytic upper
bound), so that each compares an exact prediction (:mod:`.plan_check`).

What a cell costs on one H100 (:data:`PLAN_CELL_EST`, :data:`THROUGHPUT_WARMUP_EST`): estimates,
not measurements; every row records its worker's wall time (``cell_s``) and the throughput rows
the first step's (``first_step_s``: compilation), so a run replaces them. How they were made: on
the 2-core CPU machine the package is developed on (torch 2.13, machine shared, load 1.5-3), the
planner's trace of ``llama-3.2-1b`` at SP 8 under FSDP2 at 64K tokens took 12-25 s with depth
extrapolation (the cut models of 2 and 3 blocks: the prediction) and 48-60 s with all 16 blocks
(AutoSP, ``ulysses+ac``); the measured program compiles all 16 blocks through the same Dynamo and
AOTAutograd work (aot_eager / op by op: no code generation), so a plan cell is about start-up and
model build (~20 s) + prediction (~25 s) + that compile (~60 s) + two steps (~10 s): 120 s,
assuming the GPU host's cores are no faster (they share the work with the other cells). An
Inductor compile is assumed to cost twice the Dynamo/AOTAutograd part (lowering, scheduling,
Triton kernels): ~180 s a compiled recipe's warm-up; the eager ALST recipe ~60 s.
"""
from __future__ import annotations

import os
import tempfile
import time

import torch

from .common import Row, init_fake_world, run_together, unfinished_row, wait_for_turn

#: the recipes whose GPU figures decide the README's claims, in the order their cells run: the
#: memory planner's strategy names (planner.trace.STRATEGIES; the benchmark's recipes of the same
#: names, bench/names.py, for tokens/s). A name this tree does not have (a recipe added on
#: another branch, as ``ulysses+upipe`` was) is reported as "skipped: not in this tree" and runs
#: as soon as it is merged.
DECISIVE = ("autosp", "autosp-max", "autosp-max-offload", "ulysses+ac", "ulysses+alst",
            "ulysses+upipe")
MODEL, WORLD, SEQ = "llama-3.2-1b", 8, 65536
#: what the smoke run (CPU) uses instead: the same code on tiny shapes
SMOKE_MODEL, SMOKE_WORLD, SMOKE_SEQ = "llama-tiny", 2, 256
#: estimated seconds on one H100 (module docstring): a plan cell; a throughput cell's warm-up
#: (compiled, eager) and its timed part
PLAN_CELL_EST = 120.0
THROUGHPUT_WARMUP_EST = {"compiled": 180.0, "eager": 60.0}
THROUGHPUT_TIMED_EST = 15.0


def not_in_tree(name: str) -> str:
    return (f"not in this tree: planner.trace.STRATEGIES has no {name!r} yet (it runs once the "
            f"strategy is merged)")


def in_tree(name: str) -> bool:
    from ..plan import STRATEGIES
    return name in STRATEGIES


def shape(smoke: bool) -> dict:
    """The decisive cells' model, world (= SP) and length; ``smoke``: the CPU dry run's."""
    if smoke:
        return dict(model=SMOKE_MODEL, world=SMOKE_WORLD, seq=SMOKE_SEQ, device="cpu",
                    backend="aot_eager")
    return dict(model=MODEL, world=WORLD, seq=SEQ, device="cuda", backend="inductor")


def throughput_worker(cell: dict) -> dict:
    """Benchmark recipe ``cell["strategy"]`` (bench/names.py: as users run it, the ALST recipe
    eagerly with its host offload) as one rank of ``cell["world"]`` with the model state sharded
    (FSDP2 / graph FSDP): two warm-up steps (the first compiles), then, alone on the device
    (:func:`~.common.wait_for_turn`), ``cell["steps"]`` timed steps: the fastest one's tokens/s,
    TFLOP/s per device and MFU, and the peak memory of those steps."""
    from autosp_lm.models import build_model, preset_config
    from autosp_lm.parallel.sharding_kinds import build_sharding, sharding_kind
    from autosp_lm.parallel.state import init_parallel
    from autosp_lm.strategies import build_strategy
    from autosp_lm.training.flops import flops_per_step, peak_tflops
    from autosp_lm.training.optimizer import build_optimizer

    from ..job import cell_options
    from ..names import strategy_spec
    from ..steps import mock_batch, train_step

    world, seq = cell["world"], cell["seq"]
    init_fake_world(world)
    ps = init_parallel(world, device=cell["device"], shard_mesh=True)
    cfg = preset_config(cell["model"], max_position_embeddings=max(seq, 1 << 17))
    reg, options = strategy_spec(cell["strategy"])
    options = cell_options({"compile_backend": cell["backend"]}, reg, dict(options))
    torch.manual_seed(0)
    t0 = time.perf_counter()
    model = build_model(cfg).to(ps.device)
    strategy = build_strategy(reg, ps, **options)
    sharding = build_sharding(sharding_kind(True, False, strategy.needs_full_graph), ps,
                              bf16=True)
    sharding.wrap(model)
    strategy.setup(model)
    optimizer = build_optimizer(sharding.optimizer_module(), lr=1e-5, weight_decay=0.0,
                                device=ps.device, sharded=sharding.sharded)
    batch = mock_batch(cfg.vocab_size, seq, 1, 0, ps.device,
                       keys=("input_ids", "labels", "position_ids"))
    cuda = ps.device.type == "cuda"

    def step():
        train_step(strategy, model, optimizer, batch, bf16=True, device=ps.device,
                   sharding=sharding)

    build_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    step()  # compiles
    first = time.perf_counter() - t0
    step()
    wait_for_turn(cell)
    if cuda:
        torch.cuda.reset_peak_memory_stats(ps.device)
    times = []
    for _ in range(cell["steps"]):
        t = time.perf_counter()
        step()
        times.append(time.perf_counter() - t)
    dt = min(times)
    tflops = flops_per_step(cfg, seq, seq) / world / dt / 1e12
    peak = peak_tflops(ps.device, True)
    return {"step_s": dt, "steps_s": times, "first_step_s": first, "build_s": build_s,
            "tokens_per_s": seq / dt, "tokens_per_s_per_device": seq / world / dt,
            "tflops_per_device": tflops, "mfu": tflops / peak if peak else None,
            "peak_mem_gib": (torch.cuda.max_memory_allocated(ps.device) / 2**30 if cuda
                             else None),
            "sharding": sharding_kind(True, False, strategy.needs_full_graph)}


def section_throughput(args, deadline):
    """Tokens/s and MFU of each :data:`DECISIVE` recipe, one rank of the decisive cells' job
    (their model, length, sharding): every recipe's worker compiles at once, then each is timed
    alone on the device (:func:`~.common.run_together`). ``--smoke``: the harness on CPU."""
    from ..names import known, strategy_spec
    section = "throughput"
    if not args.smoke and not torch.cuda.is_available():
        yield Row(section, "tokens/s and MFU", "skipped", "no CUDA device")
        return
    s = shape(args.smoke)
    cells = []
    for name in DECISIVE:
        check = f"{name} S={s['seq']} SP={s['world']} FSDP2"
        if not known(name):
            cells.append((check, {"skip": not_in_tree(name)}))
            continue
        reg, options = strategy_spec(name)
        kind = "compiled" if reg == "autosp" or options.get("compile") else "eager"
        est = 10.0 if args.smoke else THROUGHPUT_WARMUP_EST[kind] + THROUGHPUT_TIMED_EST
        cells.append((check, dict(worker="throughput", strategy=name, steps=1 if args.smoke else 3,
                                  est_s=est, **s)))
    threads = max(1, (os.cpu_count() or 2) // max(1, sum("skip" not in c for _, c in cells)))
    for _, cell in cells:
        cell["compile_threads"] = threads
    with tempfile.TemporaryDirectory() as sync:
        for check, res in run_together(section, cells, deadline, sync):
            row = unfinished_row(section, check, res)
            if row is None:
                row = Row(section, check, "ok",
                          f"{res['sharding']}; compile + first step {res['first_step_s']:.0f} s",
                          **{k: res[k] for k in ("tokens_per_s", "tflops_per_device", "mfu",
                                                 "step_s", "peak_mem_gib", "first_step_s",
                                                 "cell_s") if res.get(k) is not None})
            yield row
