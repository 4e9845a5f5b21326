"""The ``simulated_sp``, ``simulated_2d`` and ``peak_memory`` sections: a strategy as one rank
of a large SP job on one device (a fake process group: collectives return correctly shaped,
meaningless tensors, so memory and compute are one rank's and communication is excluded), and
the longest sequence that fits there."""
from __future__ import annotations

import time

import torch

from ..fit import longest_fit
from ..steps import mock_batch, train_step
from .common import Row, init_fake_world, length_row, run_cells, unfinished_row


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



#: estimated seconds on one H100 (decisive.py's docstring says how): a compiled strategy's
#: build and first step (Inductor), its lengths, and a longest-fit search (the rest of its share)
COMPILED_WARMUP_EST = 180.0


def section_simulated_sp(args, deadline):
    smoke = args.smoke
    if not smoke and not torch.cuda.is_available():
        yield Row("simulated_sp", "--autosp / --ulysses", "skipped", "no CUDA device")
        return
    cells = [(strategy, dict(strategy=strategy, world=2 if smoke else 8,
                             model="llama-tiny" if smoke else "llama-3.2-1b",
                             device="cpu" if smoke else "cuda", bf16=True,
                             backend="aot_eager" if smoke else "inductor",
                             lengths=[128, 256] if smoke else [8192, 32768],
                             steps=1 if smoke else 3, max_search=1024 if smoke else 1 << 21,
                             granularity=128 if smoke else 8192,
                             est_s=20.0 if smoke else COMPILED_WARMUP_EST + 60))
             for strategy in ("autosp", "ulysses")]
    for strategy, res in run_cells("simulated_sp", cells, deadline):
        row = unfinished_row("simulated_sp", strategy, res)
        if row is not None:
            yield row
            continue
        for r in res["results"]:
            yield length_row("simulated_sp", strategy, r)
        yield Row("simulated_sp", f"{strategy} longest sequence that fits", "ok",
                  "" if res["search_done"] else "search stopped by the time limit",
                  max_fit=res["max_fit"], first_oom=res["first_oom"], cell_s=res["cell_s"])


def section_simulated_2d(args, deadline):
    """AutoSP's 2-D plan at SP=8 on one GPU (one simulated rank): U x R in 8x1, 4x2, 2x4 at 32K
    tokens of llama-3.2-1b in bf16 (communication excluded: what each factorisation costs in
    compute and memory per rank)."""
    smoke = args.smoke
    if not smoke and not torch.cuda.is_available():
        yield Row("simulated_2d", "--autosp U x R", "skipped", "no CUDA device")
        return
    world = 4 if smoke else 8
    degrees = (2,) if smoke else (8, 4, 2)  # smoke: 2 x 2, both the all-to-all and the ring
    cells = [(f"autosp {U}x{world // U}",
              dict(strategy="autosp", world=world, ulysses_degree=U,
                   model="llama-tiny" if smoke else "llama-3.2-1b",
                   device="cpu" if smoke else "cuda", bf16=True,
                   backend="aot_eager" if smoke else "inductor",
                   lengths=[256] if smoke else [32768], steps=1 if smoke else 3,
                   max_search=0, granularity=8192,
                   est_s=20.0 if smoke else COMPILED_WARMUP_EST + 20)) for U in degrees]
    for name, res in run_cells("simulated_2d", cells, deadline, slack=10.0):
        row = unfinished_row("simulated_2d", name, res)
        yield row if row is not None else dict(length_row("simulated_2d", name,
                                                          res["results"][0]),
                                               cell_s=res["cell_s"])


#: ``peak_memory``: the strategies compared, most decisive first: the benchmark's recipes
#: (bench/names.py: as users run them, the ALST recipe eagerly with its block inputs in host
#: memory), the max-context mode with and without its offload against the strongest hand-written
#: recipes, then AutoSP's default plan, its offload, plain Ulysses and AutoSP without SAC. A name
#: this tree does not have (one added on another branch) is skipped as "not in this tree".
PEAK_STRATEGIES = ("autosp-max-offload", "ulysses+alst", "ulysses+upipe", "autosp-max",
                   "ulysses+ac", "autosp", "autosp-offload", "ulysses", "autosp-nosac")
#: the hand-written recipes the ratios are taken against (the strongest one that ran)
PEAK_BASELINES = ("ulysses", "ulysses+ac", "ulysses+alst", "ulysses+upipe")


def section_peak_memory(args, deadline):
    """Peak memory and the longest context per GPU of :data:`PEAK_STRATEGIES`, as one rank of an
    8-way SP job (fake process group) on ``llama-3.2-1b`` in bf16 at 16K tokens:
    ``max_memory_allocated`` (weights and states included), the step's live peak above them, and
    the longest sequence that fits (doubling, then bisecting), with each one's max context
    relative to the strongest hand-written recipe that ran. ``--smoke``: llama-tiny, 2 ranks,
    Ulysses and AutoSP with offload at 256 tokens, no search."""
    from ..names import known, strategy_spec
    smoke = args.smoke
    if not smoke and not torch.cuda.is_available():
        yield Row("peak_memory", "peak memory and max context", "skipped", "no CUDA device")
        return
    chosen = ("ulysses", "autosp-offload") if smoke else PEAK_STRATEGIES
    cells = []
    for label in chosen:
        if not known(label):
            yield Row("peak_memory", label, "skipped",
                      f"not in this tree: bench/names.py has no {label!r} yet (it runs once the "
                      f"strategy is merged)")
            continue
        reg, options = strategy_spec(label)
        cells.append((label, dict(strategy=reg, options=dict(options), live_peak=True,
                                  world=2 if smoke else 8,
                                  model="llama-tiny" if smoke else "llama-3.2-1b",
                                  device="cpu" if smoke else "cuda", bf16=True,
                                  backend="aot_eager" if smoke else "inductor",
                                  lengths=[256] if smoke else [16384], steps=1,
                                  max_search=256 if smoke else 1 << 21,
                                  granularity=128 if smoke else 8192,
                                  est_s=20.0 if smoke else COMPILED_WARMUP_EST + 120)))
    fits = {}
    for label, res in run_cells("peak_memory", cells, deadline):
        row = unfinished_row("peak_memory", label, res)
        if row is not None:
            yield row
            continue
        for r in res["results"]:
            yield dict(length_row("peak_memory", label, r,
                                  keep=("peak_mem_gib", "peak_live_gib", "tokens_per_s",
                                        "step_s")), cell_s=res["cell_s"])
        fits[label] = res["max_fit"]
        if not smoke:
            yield Row("peak_memory", f"{label} longest sequence that fits", "ok",
                      "" if res["search_done"] else "search stopped by the time limit",
                      max_fit=res["max_fit"], first_oom=res["first_oom"])
    baselines = [k for k in PEAK_BASELINES if fits.get(k)]
    if baselines and not smoke:  # against the strongest hand-written recipe that ran
        ref = max(baselines, key=fits.get)
        best = max((v, k) for k, v in fits.items())
        yield Row("peak_memory", f"max context vs {ref} (the strongest baseline run)", "ok",
                  ", ".join(f"{k} {v / max(1, fits[ref]):.2f}x" for k, v in fits.items())
                  + f"; longest: {best[1]}")
