"""The ``simulated_sp``, ``simulated_2d`` and ``peak_memory`` sections: a strategy as one rank
of a large SP job on one device (a fake process group: collectives return correctly shaped,
meaningless tensors, so memory and compute are one rank's and communication is excluded), and
the longest sequence that fits there."""
from __future__ import annotations

import time

import torch

from ...planner.trace import STRATEGIES
from ..fit import longest_fit
from ..steps import mock_batch, train_step
from .common import Row, init_fake_world, length_row, run_cells


def compiled_options(strategy: str, backend: str) -> dict:
    """The options of a compiled ``ulysses`` or ``autosp`` on ``backend``."""
    return dict(compile=True, backend=backend) if strategy == "ulysses" \
        else dict(backend=backend, verbose=False)


def simulated_worker(cell: dict) -> dict:
    """One strategy as one rank of a ``world``-way SP job (fake process group): each length in
    ``cell["lengths"]``, then the longest length that fits (doubling, then bisecting)."""
    from autosp_lm.models import build_model, preset_config
    from autosp_lm.parallel.state import init_parallel
    from autosp_lm.strategies import build_strategy
    from autosp_lm.training.flops import flops_per_step, peak_tflops
    from autosp_lm.training.optimizer import build_optimizer

    world = cell["world"]
    init_fake_world(world)
    ps = init_parallel(world, device=cell["device"])
    cfg = preset_config(cell["model"], max_position_embeddings=1 << 24)
    torch.manual_seed(0)
    model = build_model(cfg).to(ps.device)
    options = compiled_options(cell["strategy"], cell["backend"])
    if cell.get("ulysses_degree"):
        options["ulysses_degree"] = cell["ulysses_degree"]
    options.update(cell.get("options") or {})
    strategy = build_strategy(cell["strategy"], ps, **options)
    strategy.setup(model)
    optimizer = build_optimizer(model, lr=1e-5, weight_decay=0.0, device=ps.device)
    peak = peak_tflops(ps.device, cell["bf16"])
    deadline = time.time() + cell["budget_s"]

    def measure(seq: int, steps: int) -> dict:
        batch = mock_batch(cfg.vocab_size, seq, 1, 0, ps.device)

        def step(zero=True):
            train_step(strategy, model, optimizer, batch, bf16=cell["bf16"], device=ps.device,
                       zero=zero)

        try:
            t0 = time.perf_counter()
            step()  # warm-up (compiles at the first length)
            first = time.perf_counter() - t0
            live = None
            if cell.get("live_peak"):
                from autosp_lm.training.memory import LivePeak
                optimizer.zero_grad(set_to_none=True)
                with LivePeak(ps.device) as lp:  # the step's own tensors above weights + states
                    step(zero=False)
                live = lp.peak
            if ps.device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(ps.device)
            times = []
            for _ in range(steps):
                t = time.perf_counter()
                step()
                times.append(time.perf_counter() - t)
        except torch.OutOfMemoryError:
            optimizer.zero_grad(set_to_none=True)
            if ps.device.type == "cuda":
                torch.cuda.empty_cache()
            return {"seq_length": seq, "status": "oom"}
        dt = min(times)
        tflops = flops_per_step(cfg, seq, seq) / world / dt / 1e12
        out = {"seq_length": seq, "status": "ok", "step_s": dt, "first_step_s": first,
               "tokens_per_s": seq / dt, "tokens_per_s_per_device": seq / world / dt,
               "tflops_per_device": tflops, "mfu": tflops / peak if peak else None}
        if ps.device.type == "cuda":
            out["peak_mem_gib"] = torch.cuda.max_memory_allocated(ps.device) / 2**30
        if live is not None:
            out["peak_live_gib"] = live / 2**30
        return out

    results = [measure(L, cell["steps"]) for L in cell["lengths"]]
    fits = max([r["seq_length"] for r in results if r["status"] == "ok"], default=0)

    def ok(seq):
        results.append(measure(seq, 1))
        return results[-1]["status"] == "ok"

    lo, hi, seq = longest_fit(ok, fits, max(cell["lengths"]) * 2, cell["max_search"],
                              cell["granularity"], more=lambda: time.time() < deadline)
    return {"strategy": cell["strategy"], "results": results, "max_fit": lo,
            "first_oom": hi, "search_done": hi is not None or seq > cell["max_search"]}



def section_simulated_sp(args, deadline) -> list:
    smoke = args.smoke
    if not smoke and not torch.cuda.is_available():
        return [Row("simulated_sp", "--autosp / --ulysses", "skipped", "no CUDA device")]
    rows = []
    cells = [(strategy, dict(strategy=strategy, world=2 if smoke else 8,
                             model="llama-tiny" if smoke else "llama-3.2-1b",
                             device="cpu" if smoke else "cuda", bf16=True,
                             backend="aot_eager" if smoke else "inductor",
                             lengths=[128, 256] if smoke else [8192, 32768],
                             steps=1 if smoke else 3, max_search=1024 if smoke else 1 << 21,
                             granularity=128 if smoke else 8192))
             for strategy in ("autosp", "ulysses")]
    for strategy, res in run_cells("simulated_sp", cells, deadline, rows):
        rows.extend(length_row("simulated_sp", strategy, r) for r in res["results"])
        rows.append(Row("simulated_sp", f"{strategy} longest sequence that fits", "ok",
                        "" if res["search_done"] else "search stopped by the time limit",
                        max_fit=res["max_fit"], first_oom=res["first_oom"]))
    return rows


def section_simulated_2d(args, deadline) -> list:
    """AutoSP's 2-D plan at SP=8 on one GPU (one simulated rank): U x R in 8x1, 4x2, 2x4 at 32K
    tokens of llama-3.2-1b in bf16 (communication excluded: what each factorisation costs in
    compute and memory per rank)."""
    smoke = args.smoke
    if not smoke and not torch.cuda.is_available():
        return [Row("simulated_2d", "--autosp U x R", "skipped", "no CUDA device")]
    world = 4 if smoke else 8
    degrees = (2,) if smoke else (8, 4, 2)  # smoke: 2 x 2, both the all-to-all and the ring
    cells = [(f"autosp {U}x{world // U}",
              dict(strategy="autosp", world=world, ulysses_degree=U,
                   model="llama-tiny" if smoke else "llama-3.2-1b",
                   device="cpu" if smoke else "cuda", bf16=True,
                   backend="aot_eager" if smoke else "inductor",
                   lengths=[256] if smoke else [32768], steps=1 if smoke else 3,
                   max_search=0, granularity=8192)) for U in degrees]
    rows = []
    for name, res in run_cells("simulated_2d", cells, deadline, rows, slack=10.0):
        rows.append(length_row("simulated_2d", name, res["results"][0]))
    return rows


#: ``peak_memory``: the strategies compared (name, registry name, options).
PEAK_STRATEGIES = [("ulysses", "ulysses", {}),
                   ("autosp-nosac", "autosp", {"sac": False}),
                   ("autosp", "autosp", {}),
                   ("autosp-offload", "autosp", {"offload_activations": True}),
                   # the strongest hand-written recipe without offload (full recomputation and
                   # the chunked loss) and the max-context mode, without and with its offload:
                   # the planner's strategies of the same names (planner/trace.py STRATEGIES)
                   *((n, STRATEGIES[n][0], dict(STRATEGIES[n][1]))
                     for n in ("ulysses+ac", "autosp-max", "autosp-max-offload"))]


def section_peak_memory(args, deadline) -> list:
    """Peak memory and the longest context per GPU: hand-written Ulysses (plain and with full
    recomputation + the chunked loss), AutoSP without SAC, AutoSP (communication-aware SAC,
    sequence tiling), AutoSP with activation offload and the max-context mode (without and with
    its offload), as one
    rank of an 8-way SP job (fake process group) on ``llama-3.2-1b`` in bf16 at 16K tokens:
    ``max_memory_allocated`` (weights and states included), the step's live peak above them, and
    the longest sequence that fits (doubling, then bisecting). ``--smoke``: llama-tiny, 2 ranks,
    Ulysses and AutoSP with offload at 256 tokens, no search."""
    smoke = args.smoke
    if not smoke and not torch.cuda.is_available():
        return [Row("peak_memory", "peak memory and max context", "skipped", "no CUDA device")]
    chosen = [PEAK_STRATEGIES[0], PEAK_STRATEGIES[3]] if smoke else PEAK_STRATEGIES
    share = 0.5 * (deadline - time.time())  # the other half is left to simulated_sp
    stop = time.time() + share
    cells = [(label, dict(strategy=name, options=options, live_peak=True, world=2 if smoke else 8,
                          model="llama-tiny" if smoke else "llama-3.2-1b",
                          device="cpu" if smoke else "cuda", bf16=True,
                          backend="aot_eager" if smoke else "inductor",
                          lengths=[256] if smoke else [16384], steps=1,
                          max_search=256 if smoke else 1 << 21,
                          granularity=128 if smoke else 8192))
             for label, name, options in chosen]
    rows, fits = [], {}
    for label, res in run_cells("peak_memory", cells, stop, rows):
        rows.extend(length_row("peak_memory", label, r, keep=("peak_mem_gib", "peak_live_gib",
                                                               "tokens_per_s", "step_s"))
                    for r in res["results"])
        fits[label] = res["max_fit"]
        if not smoke:
            rows.append(Row("peak_memory", f"{label} longest sequence that fits", "ok",
                            "" if res["search_done"] else "search stopped by the time limit",
                            max_fit=res["max_fit"], first_oom=res["first_oom"]))
    baselines = [k for k in ("ulysses", "ulysses+ac") if fits.get(k)]
    if baselines and not smoke:  # against the strongest hand-written recipe that ran
        ref = max(baselines, key=fits.get)
        best = max((v, k) for k, v in fits.items())
        rows.append(Row("peak_memory", f"max context vs {ref} (the strongest baseline run)", "ok",
                        ", ".join(f"{k} {v / max(1, fits[ref]):.2f}x" for k, v in fits.items())
                        + f"; longest: {best[1]}"))
    return rows


#: ``plan_vs_measured``: the planner's strategies compared (full run; --smoke: autosp only), and
