#!/usr/bin/env python
"""Side-by-side benchmark of the sequence-parallel strategies.

    python tools/benchmark_sp.py --model llama-tiny --strategies none,ulysses,ring,autosp,autosp-nosac \
        --seq-lengths 2048,4096 --nproc 2 --output bench_out

Each (strategy, sequence length) cell runs as its own ``torchrun`` job (a crash or OOM of one cell
is recorded as a failed cell, the others go on), on the same model, seed and batch. Per cell:
median step time after warm-up, tokens/s, TFLOP/s per device, bytes saved for backward per local
token (deterministic), peak memory of one steady-state step, the first step's loss (all strategies
must agree; disagreements are flagged) and compile time: the first step's time minus the median
step's (Dynamo tracing, the passes, AOTAutograd and code generation), measured with empty compile
caches (each cell gets fresh Inductor/Triton cache directories), i.e. what the first iteration of a
first run costs (``--warm-compile-cache`` reuses your caches instead). ``none`` is one rank holding
the whole sequence: the reference row.

Writes ``DIR/results.json``, ``DIR/results.md`` and PNG plots; logs to W&B with --wandb-project.
``--memory-budget-gb B`` finds the longest trainable sequence per strategy within B per rank: by a
real search on CUDA (double, then bisect; each trial a fresh process; an OOM is a result), by a
fit of the exact peak live tensor memory of a step (above weights and optimizer state) against
sequence length on CPU (labelled as a fit everywhere; it needs two or more --seq-lengths, and says
so otherwise). Plots need matplotlib (the ``bench`` extra:
``pip install -e ".[bench]"``).
``--curve`` prints and writes the memory vs step-time curve of the SAC memory target (AutoSP
without SAC, Ulysses, the default policy, the never-communicate-twice flag, offload, and memory
targets at ``--curve-fractions`` of the no-SAC saved bytes; ``--curve-offload-fractions``: targets
with ``--offload-activations``; saved bytes are those kept on the device, offload's host copies
apart). Peak live memory (exact on CPU:
:class:`~autosp_lm.training.memory.LivePeak`) is reported for every strategy.
``--simulate-world-size P`` runs one rank's share of a P-way job on one device with a fake process
group (collectives return correctly shaped, meaningless tensors): per-rank memory and compute of
large SP jobs on one GPU; communication time is excluded and losses are not comparable.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shutil
import statistics
import signal
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from autosp_lm.cli import HelpFormatter  # noqa: E402
from autosp_lm.planner.trace import HOST_OFFLOAD as _HOST_OFFLOAD  # noqa: E402
from autosp_lm.planner.trace import STRATEGIES as _PLANNED  # noqa: E402

STRATEGIES = {
    # name: (strategy registry name, options): the memory planner's names, and
    **_PLANNED,
    # the never-communicate-twice policy without sequence tiling (SAC before the cost model)
    "autosp-keepcomm": ("autosp", {"sac": True, "sac_recommunicate": False,
                                   "sequence_tiling": False}),
    "autosp-offload": ("autosp", {"sac": True, "offload_activations": True}),
    "ulysses-eager": ("ulysses", {"compile": False}),
    "ring-eager": ("ring", {"compile": False}),
    "none-eager": ("none", {"compile": False}),
    # ALST as users run it: eagerly, with the checkpointed block inputs in host memory
    # (cpu_offloading runs saved-tensor hooks, which torch.compile cannot hold). The planner's
    # entries of the same names trace the compiled recipe without the offload and model the
    # offload on its graphs (planner.trace.HOST_OFFLOAD); "<name>-compiled" is that traced
    # program as it runs (everything on the device)
    **{n: (_PLANNED[n][0], dict(_PLANNED[n][1], compile=False, cpu_offloading=True))
       for n in _HOST_OFFLOAD},
    **{f"{n}-compiled": _PLANNED[n] for n in _HOST_OFFLOAD},
}
FAIL_MARK = "BENCH_CELL_RESULT "


def strategy_spec(name: str):
    """``(registry name, options)`` of a benchmark strategy name: the table above, or
    ``autosp-u<U>`` / ``ulysses-u<U>`` for a 2-D plan with Ulysses degree ``U`` (the rest of the
    SP size is a ring)."""
    if name in STRATEGIES:
        return STRATEGIES[name]
    for base in ("autosp", "ulysses"):
        prefix = f"{base}-u"
        if name.startswith(prefix) and name[len(prefix):].isdigit():
            reg, options = STRATEGIES[base]
            return reg, dict(options, ulysses_degree=int(name[len(prefix):]))
    raise KeyError(name)


# ============================================================================ worker (one cell)
def measure_peak(device, fn):
    """Peak memory of ``fn()``: on CUDA the absolute ``max_memory_allocated`` (weights and
    optimizer state included: what must fit in the budget), on CPU the peak resident set during the
    call minus the resident set before it (``/proc/self/clear_refs``)."""
    import torch
    from autosp_lm.training.memory import peak_rss_delta
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        fn()
        torch.cuda.synchronize(device)
        return torch.cuda.max_memory_allocated(device)
    return peak_rss_delta(fn)[1]


def measure_live_peak(device, fn):
    """Peak of live tensor memory during ``fn()`` above what was live before it
    (:class:`~autosp_lm.training.memory.LivePeak`: exact on CPU from the allocator's profiler
    events, ``max_memory_allocated - memory_allocated`` on CUDA): activations, gradients and
    transients of the step, not the weights and optimizer state that were live before it."""
    from autosp_lm.training.memory import LivePeak
    with LivePeak(device) as lp:
        fn()
    return lp.peak


def _init_simulated(world: int):
    from autosp_lm.parallel.state import init_simulated_world
    init_simulated_world(world)


def _packed_batch(cell: dict):
    """``(batch, padded vocabulary)``: the first micro batch of the built-in corpus (Python
    standard library sources: documents end inside samples) with document ids, positions that
    restart per document and the loss masked after end-of-document tokens."""
    import argparse

    import torch
    from autosp_lm.arguments import pad_vocab
    from autosp_lm.data import build_data
    args = argparse.Namespace(mock_data=False, data_path=None, seq_length=cell["seq_length"],
                              seed=cell["seed"], split=None, data_cache_path=None,
                              tokenizer_model=None, tokenizer_type=None, eod_mask_loss=True,
                              reset_position_ids=True, reset_attention_mask=True)
    n = cell["micro_batch_size"]
    data = build_data(args, (n, 0, 0), mock_vocab_size=0)
    batch = {k: torch.stack([data.train[i][k] for i in range(n)])
             for k in ("input_ids", "labels", "position_ids", "document_ids")}
    return batch, pad_vocab(data.vocab_size, 128)


class _Job:
    """One strategy built for a cell inside this (torchrun-launched) process group: its model,
    optimizer and batch, and :meth:`step` (a training step: forward, backward, optimizer)."""

    def __init__(self, cell: dict):
        import torch
        import torch.distributed as dist
        from autosp_lm.data.mock import MockGPTDataset
        from autosp_lm.models import build_model, preset_config
        from autosp_lm.parallel.sharding_kinds import build_sharding
        from autosp_lm.parallel.state import init_parallel
        from autosp_lm.strategies import build_strategy
        from autosp_lm.training.flops import document_attention_pairs
        from autosp_lm.training.optimizer import build_optimizer

        reg_name, options = strategy_spec(cell["strategy"])
        world = (dist.get_world_size() if dist.is_initialized()
                 else int(os.environ.get("WORLD_SIZE", "1")))
        self.world, self.sp = world, (world if reg_name != "none" else 1)
        self.ps = ps = init_parallel(self.sp, device=cell["device"])
        seq = cell["seq_length"]
        packed = _packed_batch(cell) if cell.get("packed") else None
        over = dict(cell.get("overrides") or {})
        if packed:
            over["vocab_size"] = packed[1]
        cfg = preset_config(cell["model"], **over)
        self.cfg = cfg = preset_config(cell["model"], **dict(
            over, max_position_embeddings=max(seq, cfg.max_position_embeddings)))
        torch.manual_seed(cell["seed"])
        self.model = model = build_model(cfg).to(ps.device)
        backend = cell.get("compile_backend", "inductor")
        if reg_name == "autosp":
            options = dict(options, backend=backend, verbose=False,
                           **({"sac_budget": cell["sac_budget"]} if cell.get("sac_budget") else {}),
                           **({"sac_memory_target": cell["sac_memory_target"]}
                              if cell.get("sac_memory_target") is not None else {}),
                           **({"offload_activations": True} if cell.get("offload") else {}))
        elif options.get("compile"):
            options = dict(options, backend=backend)
        self.strategy = build_strategy(reg_name, ps, **options)
        # --bf16 is Megatron-style (bf16 parameters, fp32 main ones); --fp32-residual-connection
        # keeps fp32 parameters under autocast (autosp_lm/parallel/precision.py)
        self.sharding = build_sharding("none", ps, bf16=cell["bf16"],
                                       fp32_residual=cell.get("fp32_residual", False))
        self.sharding.wrap(model)
        self.strategy.setup(model)
        self.optimizer = build_optimizer(self.sharding.optimizer_module(), lr=1e-4,
                                         weight_decay=0.0, device=ps.device)
        if packed:
            self.batch = {k: v.to(ps.device) for k, v in packed[0].items()}
        else:
            data = MockGPTDataset(cfg.vocab_size, seq, cell["micro_batch_size"], seed=cell["seed"])
            self.batch = {k: torch.stack([data[i][k] for i in range(cell["micro_batch_size"])])
                          .to(ps.device) for k in ("input_ids", "labels", "position_ids")}
        self.pairs = (document_attention_pairs(self.batch["document_ids"])
                      if "document_ids" in self.batch else None)
        self.bf16 = cell["bf16"]

    def step(self, measure_saved=False, zero=True):
        import torch
        from autosp_lm.training.memory import SavedTensorBytes
        from autosp_lm.training.step import finish_step, forward_backward
        if zero:
            self.sharding.zero_grad(self.optimizer)
        counter = SavedTensorBytes(exclude=self.model) if measure_saved else None
        reported = forward_backward(self.strategy, self.batch, bf16=self.bf16,
                                    device=self.ps.device, saved_counter=counter)
        finish_step(self.model, self.optimizer, dp_size=self.ps.dp_size, sharding=self.sharding)
        if self.ps.device.type == "cuda":
            torch.cuda.synchronize(self.ps.device)
        return float(reported), counter


def _init_process(cell: dict) -> None:
    """This process's threads and, for a simulated world, its fake process group."""
    import torch
    torch.set_num_threads(max(1, int(cell.get("threads") or torch.get_num_threads())))
    if cell.get("simulate_world_size"):
        _init_simulated(cell["simulate_world_size"])


def run_cell(cell: dict) -> dict:
    """Measure one cell inside this (torchrun-launched) process group."""
    import torch.distributed as dist

    _init_process(cell)
    job = _Job(cell)
    step, world, sp, seq = job.step, job.world, job.sp, cell["seq_length"]
    t0 = time.perf_counter()
    first_loss, _ = step()
    first_step_s = time.perf_counter() - t0
    step()  # second warm-up (e.g. backward recompilation, allocator warm-up)
    _, counter = step(measure_saved=True)
    saved = counter.bytes
    peaks = [measure_peak(job.ps.device, step) for _ in range(cell.get("peak_repeats", 3))]
    peak = None if (not peaks or any(p is None for p in peaks)) else int(statistics.median(peaks))
    # gradients freed before the block: the peak is that of the step's own tensors (activations,
    # transients, gradients, optimizer temporaries), exact and deterministic on CPU
    job.sharding.zero_grad(job.optimizer)
    live = measure_live_peak(job.ps.device, lambda: step(zero=False))
    # every rank's figure (the table shows rank 0's): ranks of one job can differ, e.g. where a
    # process group's worker threads still hold collective buffers on one rank
    live_ranks = [live]
    if dist.is_initialized() and not cell.get("simulate_world_size") and world > 1:
        live_ranks = [None] * world
        dist.all_gather_object(live_ranks, live)
    times = []
    for _ in range(cell["steps"]):
        t = time.perf_counter()
        step()
        times.append(time.perf_counter() - t)
    batch = job.batch
    tokens = seq * cell["micro_batch_size"]
    local_tokens = tokens // sp
    return {
        "strategy": cell["strategy"], "seq_length": seq, "sp": sp, "world_size": world,
        **step_time_fields(times, job.cfg, tokens, seq, job.pairs, world),
        "documents": (int(batch["document_ids"][:, -1].add(1).sum()) if cell.get("packed")
                      else None),
        "saved_bytes_per_token": saved / local_tokens if saved is not None else None,
        "saved_bytes": saved, "peak_mem_bytes": peak, "peak_live_bytes": live,
        # of the saved bytes, those kept on the device and those activation offload keeps in
        # host memory (on CPU: its copies outside torch's allocator)
        "saved_device_bytes": counter.device_bytes, "saved_host_bytes": counter.host_bytes,
        "saved_device_bytes_per_token": counter.device_bytes / local_tokens,
        "peak_live_bytes_ranks": live_ranks,
        "peak_method": "cuda max_memory_allocated" if job.ps.device.type == "cuda" else "rss",
        "loss": first_loss,
        "compile_time_s": (max(0.0, first_step_s - statistics.median(times)) if times
                           else None),
        "first_step_s": first_step_s,
        "simulated": bool(cell.get("simulate_world_size")), "status": "ok",
        "report": job.strategy.report(),
        **_collectives(job.strategy),
    }


def step_time_fields(times: list, cfg, tokens: int, seq: int, pairs, world: int) -> dict:
    """Step time (median of ``times``), throughput and TFLOP/s per device; ``None`` for each
    without timed steps (``--steps 0``: memory only)."""
    from autosp_lm.training.flops import flops_per_step
    t = statistics.median(times) if times else None
    return {"step_time_s": t, "step_times_s": list(times),
            "tokens_per_s": tokens / t if t else None,
            "tflops_per_device": (flops_per_step(cfg, tokens, seq, attention_pairs=pairs)
                                  / t / world / 1e12) if t else None}


def dynamo_limit_name() -> str:
    """Dynamo's recompile limit's name (``cache_size_limit`` before it was renamed)."""
    import torch
    return ("recompile_limit" if "recompile_limit" in torch._dynamo.config._config
            else "cache_size_limit")


def run_interleaved(cell: dict) -> dict:
    """Time several strategies in one job (``--interleave``): each entry of ``cell["entries"]``
    (cell fields: strategy, memory target, offload) is built on its own copy of the model (same
    seed, same weights and batch) and warmed up by two steps; then ``cell["steps"]`` rounds run
    one step of every entry each, the order rotated by one per round. Drift in the machine's
    speed (other tenants, clocks) then hits every entry alike, where cells run one after the
    other see it as a difference between strategies. -> per entry its step times, and per
    round the ratio of each entry's step to the first entry's."""
    _init_process(cell)
    import torch
    limit = max(8, 2 * len(cell["entries"]) + 4)  # one compiled entry per strategy's backend
    name = dynamo_limit_name()
    setattr(torch._dynamo.config, name, max(getattr(torch._dynamo.config, name), limit))
    jobs = []
    for entry in cell["entries"]:
        job = _Job(dict(cell, **entry))
        job.step()
        job.step()
        jobs.append(job)
    n = len(jobs)
    times = [[] for _ in jobs]
    cpu = [[] for _ in jobs]  # the calling thread's CPU time of each step
    for r in range(cell["steps"]):
        for i in [(r + k) % n for k in range(n)]:
            t, c = time.perf_counter(), time.thread_time()
            jobs[i].step()
            cpu[i].append(time.thread_time() - c)
            times[i].append(time.perf_counter() - t)
    tokens = cell["seq_length"] * cell["micro_batch_size"]
    out = []
    for job, ts, cs in zip(jobs, times, cpu):
        ratios = [t / t0 for t, t0 in zip(ts, times[0])]
        cpu_ratios = [c / c0 for c, c0 in zip(cs, cpu[0])]
        out.append(dict(step_time_fields(ts, job.cfg, tokens, cell["seq_length"], job.pairs,
                                         job.world),
                        paired_ratio=statistics.median(ratios) if ratios else None,
                        paired_ratios=ratios, cpu_step_times_s=cs,
                        cpu_step_time_s=statistics.median(cs) if cs else None,
                        cpu_paired_ratio=statistics.median(cpu_ratios) if cpu_ratios else None))
    return {"status": "ok", "entries": out}


def _collectives(strategy) -> dict:
    """AutoSP's collectives per step and plan from its structured report (empty otherwise)."""
    rep = getattr(getattr(strategy, "runner", None), "report", None)
    if rep is None or not hasattr(rep, "as_dict"):
        return {}
    d = rep.as_dict()
    return {"collectives_forward": d["collectives_forward"],
            "collectives_backward": d["collectives_backward"], "plan": d.get("plan")}


def worker_main(argv):
    cell = json.loads(argv[0])
    import torch.distributed as dist
    result = run_interleaved(cell) if "entries" in cell else run_cell(cell)
    rank = dist.get_rank() if dist.is_initialized() else 0
    if rank == 0:
        with open(cell["result_file"], "w") as f:
            json.dump(result, f)
    if dist.is_initialized():
        dist.destroy_process_group()


# ============================================================================ harness
def launch_cell(cell: dict, timeout: float) -> dict:
    """Run one cell as a fresh torchrun job; failures become a failed-cell record."""
    nproc = cell_nproc(cell)
    fd, result_file = tempfile.mkstemp(prefix="bench_cell_", suffix=".json")
    os.close(fd)
    os.unlink(result_file)
    cell = dict(cell, result_file=result_file)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
           os.path.abspath(__file__), "--worker", json.dumps(cell)]
    env = dict(os.environ, OMP_NUM_THREADS=str(cell.get("threads") or 1), PYTHONPATH=ROOT)
    caches = None
    if not cell.get("warm_compile_cache"):  # compile time of a first run: nothing cached
        caches = tempfile.mkdtemp(prefix="bench_cell_caches_")
        env.update(TORCHINDUCTOR_CACHE_DIR=os.path.join(caches, "inductor"),
                   TRITON_CACHE_DIR=os.path.join(caches, "triton"))
    base = {"strategy": cell["strategy"], "seq_length": cell["seq_length"],
            "sp": nproc if not cell["strategy"].startswith("none") else 1}
    t0 = time.time()
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, cwd=ROOT)
    try:
        out, err = proc.communicate(timeout=timeout)
        proc = subprocess.CompletedProcess(cmd, proc.returncode, out, err)
    except subprocess.TimeoutExpired:
        _stop_job(proc)
        return dict(base, status="failed", error=f"timed out after {timeout:.0f} s")
    finally:
        if caches:
            shutil.rmtree(caches, ignore_errors=True)
    if proc.returncode != 0 or not os.path.exists(result_file):
        tail = (proc.stderr or "")[-3000:] + (proc.stdout or "")[-1000:]
        oom = "out of memory" in tail.lower() or "OutOfMemoryError" in tail or proc.returncode in (-9, 137)
        return dict(base, status="oom" if oom else "failed", returncode=proc.returncode,
                    error=_last_error(tail), wall_s=time.time() - t0)
    with open(result_file) as f:
        result = json.load(f)
    os.unlink(result_file)
    result["wall_s"] = time.time() - t0
    return result


def cell_nproc(cell: dict) -> int:
    """Processes of a cell's job: one for the single-device strategies and simulated worlds."""
    return 1 if (cell["strategy"].startswith("none") or cell.get("simulate_world_size")) \
        else cell["nproc"]


#: What an interleaved timing job replaces in a cell's result.
TIMING_FIELDS = ("step_time_s", "step_times_s", "tokens_per_s", "tflops_per_device",
                 "paired_ratio", "paired_ratios", "cpu_step_time_s", "cpu_step_times_s",
                 "cpu_paired_ratio")


def time_interleaved(base: dict, seq: int, rows: list, entries: list, timeout: float) -> None:
    """``--interleave``: the step times of ``rows`` (measured cells at one length, their memory
    figures kept) from jobs that run their ``entries`` (the cells' strategy and options)
    interleaved (:func:`run_interleaved`), one job per process count; the first entry of each
    job is the reference of its ``paired_ratio``. A failed job leaves its rows untimed, with the
    error under ``timing_error``."""
    groups: dict = {}
    for row, entry in zip(rows, entries):
        if row.get("status") == "ok":
            groups.setdefault(cell_nproc(dict(base, **entry)), []).append((row, entry))
    for members in groups.values():
        cell = dict(base, seq_length=seq, strategy=members[0][1]["strategy"],
                    entries=[e for _, e in members])
        res = launch_cell(cell, timeout * len(members))
        for i, (row, _) in enumerate(members):
            if res.get("status") != "ok":
                row.update({k: None for k in TIMING_FIELDS},
                           timing_error=res.get("error") or res.get("status"))
                continue
            timed = res["entries"][i]
            row.update({k: timed[k] for k in TIMING_FIELDS}, timing="interleaved",
                       paired_ref=members[0][1]["strategy"] if i else None)
            if row.get("first_step_s") is not None and timed["step_time_s"]:
                row["compile_time_s"] = max(0.0, row["first_step_s"] - timed["step_time_s"])


def _descendants(pid: int) -> list:
    """Process ids below ``pid`` (Linux ``/proc``; empty elsewhere)."""
    children: dict = {}
    for d in os.listdir("/proc") if os.path.isdir("/proc") else ():
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        children.setdefault(ppid, []).append(int(d))
    out, todo = [], [pid]
    while todo:
        for c in children.get(todo.pop(), ()):
            out.append(c)
            todo.append(c)
    return out


def _stop_job(proc: subprocess.Popen) -> None:
    """End a timed-out cell: SIGTERM to torchrun, which stops its workers (they run in sessions
    of their own, so killing torchrun alone, as ``subprocess.run``'s timeout does, left them
    running); SIGKILL to whatever is left after 30 s."""
    below = _descendants(proc.pid)
    proc.terminate()
    try:
        proc.communicate(timeout=30)
    except subprocess.TimeoutExpired:
        for pid in [proc.pid] + below:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        proc.communicate()


def _last_error(text: str) -> str:
    """The last exception line (``SomeError: message``) of a failed job's output."""
    lines = [l.strip() for l in text.strip().splitlines() if l.strip()]
    pattern = re.compile(r"^(\[rank\d+\]:\s*)?([\w.]*(Error|Exception|Unsupported)): ")
    for line in reversed(lines):
        if pattern.match(line):
            return line[:500]
    for line in reversed(lines):
        if "rror" in line:
            return line[:500]
    return (lines[-1] if lines else "no output")[:500]


def fit_max_context(points: list[tuple[int, float]], budget_bytes: float):
    """Fit peak = a + b*S by least squares (memory is linear in S: flash attention keeps no
    S x S matrix) and solve a + b*S = budget. Returns (max_seq, [b, a]), or (None, coefficients)
    when there are fewer than two points or the fit does not grow with S."""
    import numpy as np
    pts = [(s, m) for s, m in points if m is not None and m > 0]
    if len(pts) < 2 or len({s for s, _ in pts}) < 2:
        return None, None
    s = np.array([p[0] for p in pts], dtype=float)
    m = np.array([p[1] for p in pts], dtype=float)
    slope, intercept = np.polyfit(s, m, 1)
    # a flat series fits a slope of rounding noise (~1e-12, either sign): growth over the
    # measured range below a millionth of the peak is no growth
    if slope * (s.max() - s.min()) <= 1e-6 * float(np.abs(m).max()):
        return None, [float(slope), float(intercept)]
    return int((budget_bytes - intercept) / slope), [float(slope), float(intercept)]


def fit_peak(r: dict):
    """The peak a CPU fit uses for one cell: the exact live-tensor peak of a step
    (``peak_live_bytes``, deterministic) where the cell has it, else the resident-set peak (coarse:
    malloc keeps freed memory, so it can stay flat or shrink between two lengths)."""
    live = r.get("peak_live_bytes")
    return live if live is not None else r.get("peak_mem_bytes")


def fit_all(results: list[dict], strategies: list[str], budget_bytes: float) -> dict:
    """CPU: per strategy, the fitted longest sequence within the budget, or None with the reason
    (fitted to :func:`fit_peak`: the exact live-tensor peak of a step, i.e. the step's
    activations, transients and gradients above the weights and optimizer state)."""
    out = {}
    for s in strategies:
        pts = [(r["seq_length"], fit_peak(r)) for r in results
               if r["strategy"] == s and r.get("status") == "ok"]
        best, coef = fit_max_context(pts, budget_bytes)
        lengths = {L for L, m in pts if m}
        reason = None
        if best is None:
            reason = ("no successful cell" if not pts else
                      f"a fit needs two or more sequence lengths, got {len(lengths)}" if len(lengths) < 2
                      else "peak memory did not grow with the sequence length")
        elif best <= 0:
            best, reason = None, "the measured peaks already exceed the budget"
        out[s] = {"max_seq_length": best, "method": "fit", "coefficients": coef, "points": pts,
                  "reason": reason}
    return out


def search_max_context(cell: dict, budget_gb: float, start: int, timeout: float, granularity: int,
                       limit: int = 1 << 24) -> dict:
    """CUDA: double the sequence until a trial exceeds the budget or OOMs, then bisect."""
    budget = budget_gb * 2**30

    def fits(seq):
        r = launch_cell(dict(cell, seq_length=seq, steps=1), timeout)
        ok = r.get("status") == "ok" and r.get("peak_mem_bytes") is not None and r["peak_mem_bytes"] <= budget
        return ok, r

    lo, hi, trials = 0, None, []
    seq = start
    while seq <= limit:
        ok, r = fits(seq)
        trials.append({"seq_length": seq, "status": r.get("status"), "peak_mem_bytes": r.get("peak_mem_bytes")})
        if not ok:
            hi = seq
            break
        lo, seq = seq, seq * 2
    while hi is not None and hi - lo > granularity:
        mid = (lo + hi) // 2 // granularity * granularity
        if mid <= lo:
            break
        ok, r = fits(mid)
        trials.append({"seq_length": mid, "status": r.get("status"), "peak_mem_bytes": r.get("peak_mem_bytes")})
        lo, hi = (mid, hi) if ok else (lo, mid)
    return {"max_seq_length": lo or None, "method": "search", "trials": trials}


def fmt(v, spec: str) -> str:
    """A table value, ``-`` where it was not measured."""
    return "-" if v is None else format(v, spec)


def write_markdown(path: str, results: list[dict], env: dict, max_ctx: dict) -> None:
    ref_name = "ulysses" if any(r["strategy"] == "ulysses" for r in results) else "ulysses-eager"
    ref = {r["seq_length"]: r for r in results if r["strategy"] == ref_name and r.get("status") == "ok"}
    lines = [f"# Strategy comparison: {env['model']}, {env['device']}, {env['nproc']} ranks", "",
             f"torch {env['torch']}, {env['cpu_count']} CPU cores, {env['machine']}; "
             f"median of {env['steps']} steps after warm-up; peak memory: median of 3 steps "
             "(CPU: resident set, coarse; CUDA: max_memory_allocated, weights included); peak live: "
             "one step's live tensor bytes above the weights and optimizer state (exact on CPU: "
             "the allocator's profiler events; CUDA: max_memory_allocated - memory_allocated); "
             f"compile: first step minus the median step, "
             f"{'warm compile caches' if env.get('warm_compile_cache') else 'empty compile caches'}."
             + (" Step times interleaved (--interleave): one job per length runs one step of "
                "every strategy in turn, the order rotated each round."
                if env.get("flags", {}).get("interleave") else "")
             + (" Simulated world size: communication excluded, losses not comparable."
                if env.get("simulate_world_size") else ""), "",
             "| strategy | seq | sp | step (s) | tokens/s | TFLOP/s/dev | saved B/token | peak mem (MiB) "
             f"| peak live (MiB) | loss | compile (s) | time vs {ref_name} | saved B/token vs {ref_name} "
             f"| peak live vs {ref_name} |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        if r.get("status") != "ok":
            lines.append(f"| {r['strategy']} | {r['seq_length']} | {r.get('sp', '-')} | {r['status']}: "
                         f"{r.get('error', '')[:80]} |  |  |  |  |  |  |  |  |  |  |")
            continue
        u = ref.get(r["seq_length"])
        t_ratio = (r["step_time_s"] / u["step_time_s"]
                   if u and u.get("step_time_s") and r.get("step_time_s") is not None else None)
        b_ratio = (r["saved_bytes_per_token"] / u["saved_bytes_per_token"]
                   if u and u.get("saved_bytes_per_token") and r.get("saved_bytes_per_token") is not None else None)
        l_ratio = (r["peak_live_bytes"] / u["peak_live_bytes"]
                   if u and u.get("peak_live_bytes") and r.get("peak_live_bytes") is not None else None)
        flag = " (!)" if r.get("loss_mismatch") else ""
        lines.append(
            f"| {r['strategy']} | {r['seq_length']} | {r['sp']} | {fmt(r['step_time_s'], '.4f')} | "
            f"{fmt(r['tokens_per_s'], '.0f')} | {fmt(r['tflops_per_device'], '.4f')} | "
            f"{fmt(r.get('saved_bytes_per_token'), '.0f')} | "
            f"{fmt(r['peak_mem_bytes'] / 2**20 if r.get('peak_mem_bytes') is not None else None, '.1f')} | "
            f"{fmt(r['peak_live_bytes'] / 2**20 if r.get('peak_live_bytes') is not None else None, '.1f')} | "
            f"{r['loss']:.6f}{flag} | {fmt(r['compile_time_s'], '.1f')} | {fmt(t_ratio, '.3f')} | {fmt(b_ratio, '.3f')} "
            f"| {fmt(l_ratio, '.3f')} |")
    if max_ctx:
        lines += ["", "## Longest trainable sequence within the memory budget", "",
                  "| strategy | max seq | method |", "|---|---|---|"]
        for name, m in max_ctx.items():
            value = m.get("max_seq_length") or f"- ({m.get('reason') or 'not found'})"
            lines.append(f"| {name} | {value} | {m['method']} |")
        if any(m["method"] == "fit" for m in max_ctx.values()):
            lines += ["", "CPU figures are a **fit** of the peak live tensor memory of a step (exact; "
                          "the resident-set peak where a cell lacks it) against sequence length "
                          "(a + b*S, least squares over the measured lengths) solved for the budget, "
                          "not a measured run."]
    paired = [r for r in results if r.get("paired_ratio") is not None and r.get("paired_ref")]
    if paired:
        lines += ["", "Per-round step-time ratios (median over the interleaved rounds of this "
                      "strategy's step over the reference's step of the same round): "
                  + ", ".join(f"{r['strategy']}@{r['seq_length']} x{r['paired_ratio']:.3f} of "
                              f"{r['paired_ref']}" for r in paired) + ". The same for the step's "
                  "thread CPU time (the calling thread's compute, without the time it waits "
                  "blocked in collectives or for the other ranks; with one intra-op thread): "
                  + ", ".join(f"{r['strategy']}@{r['seq_length']} x{r['cpu_paired_ratio']:.3f}"
                              for r in paired if r.get("cpu_paired_ratio") is not None)]
    untimed = [r for r in results if r.get("timing_error")]
    if untimed:
        lines += ["", "Not timed (the interleaved job failed): " + "; ".join(
            f"{r['strategy']}@{r['seq_length']}: {r['timing_error'][:120]}" for r in untimed)]
    mism = [r for r in results if r.get("loss_mismatch")]
    if mism:
        lines += ["", "**Loss mismatch** (first-step loss differs from the reference by more than 1e-4 "
                      "relative): " + ", ".join(f"{r['strategy']}@{r['seq_length']}" for r in mism)]
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")


def make_plots(out: str, results: list[dict], max_ctx: dict) -> list[str]:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: skipping plots (pip install -e \".[bench]\")", file=sys.stderr)
        return []
    files = []
    ok = [r for r in results if r.get("status") == "ok"]
    order = list(STRATEGIES)  # the table's order; 2-D names (autosp-u2 ...) after it, by name
    names = sorted({r["strategy"] for r in ok},
                   key=lambda n: (order.index(n) if n in order else len(order), n))
    for key, label, fname in (("saved_bytes_per_token", "activation bytes saved per local token", "saved_bytes_per_token.png"),
                              ("tokens_per_s", "tokens/s", "tokens_per_s.png")):
        if not any(r.get(key) is not None for r in ok):  # e.g. no step timed (--steps 0)
            continue
        fig, ax = plt.subplots(figsize=(6, 4))
        for n in names:
            pts = sorted((r["seq_length"], r[key]) for r in ok if r["strategy"] == n and r.get(key) is not None)
            if pts:
                ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=n)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("sequence length")
        ax.set_ylabel(label)
        ax.set_title(label + " vs sequence length")
        ax.grid(alpha=0.3)
        ax.legend()
        fig.tight_layout()
        path = os.path.join(out, fname)
        fig.savefig(path, dpi=110)
        plt.close(fig)
        files.append(path)
    found = {n: m["max_seq_length"] for n, m in max_ctx.items() if m.get("max_seq_length")}
    if max_ctx and not found:
        print("no max-context plot: " + "; ".join(f"{n}: {m.get('reason') or 'not found'}"
                                                  for n, m in max_ctx.items()), file=sys.stderr)
    if found:
        fig, ax = plt.subplots(figsize=(6, 4))
        ax.bar(list(found), list(found.values()))
        method = "CPU fit" if any(m["method"] == "fit" for m in max_ctx.values()) else "measured"
        ax.set_ylabel("max trainable sequence length")
        ax.set_title(f"max context per rank within the budget, {method}")
        fig.tight_layout()
        path = os.path.join(out, "max_context.png")
        fig.savefig(path, dpi=110)
        plt.close(fig)
        files.append(path)
    return files


CURVE_FRACTIONS = "0.5,0.3,0.2,0.1,0.05,0"


def run_curve(base: dict, seq: int, fractions: list[float], timeout: float,
              offload_fractions: tuple = (), interleave: bool = False) -> list[dict]:
    """The memory vs step-time curve of the ``--sac-memory-target`` knob at one length: the
    no-SAC and hand-written Ulysses references, the default policy (the budget), the
    never-communicate-twice flag, offload, and a memory target at each fraction of the bytes
    AutoSP without SAC saves for the backward per rank (``offload_fractions``: targets with
    ``--offload-activations``, which the policy meets by offload first). ``interleave``: the
    step times of all points from one job (:func:`time_interleaved`)."""
    rows, entries = [], []
    cell_base = dict(base, steps=0) if interleave else base

    def point(entry, **fields):
        r = launch_cell(dict(cell_base, seq_length=seq, **entry), timeout)
        rows.append(dict(r, **fields))
        entries.append(entry)
        tqdm_write(f"curve {fields['point']:>20} @ {seq}: {r['status']}")
        return r

    for name in ("autosp-nosac", "ulysses", "autosp-keepcomm", "autosp", "autosp-offload"):
        point({"strategy": name}, point=name)
    ref = rows[0]
    if ref.get("status") != "ok" or not ref.get("saved_bytes"):
        return rows
    for f in fractions:
        target = f * ref["saved_bytes"]
        point({"strategy": "autosp", "sac_memory_target": target}, point=f"target {f:g}",
              target_fraction=f, target_bytes=target)
    for f in offload_fractions:
        target = f * ref["saved_bytes"]
        point({"strategy": "autosp", "sac_memory_target": target, "offload": True},
              point=f"offload, target {f:g}", target_fraction=f, target_bytes=target,
              offload=True)
    if interleave:
        time_interleaved(base, seq, rows, entries, timeout)
    for r in rows:
        if r.get("status") == "ok" and r.get("step_time_s") and ref.get("step_time_s"):
            r["time_vs_nosac"] = r["step_time_s"] / ref["step_time_s"]
    return rows


def tqdm_write(msg: str) -> None:
    from tqdm import tqdm
    tqdm.write(msg)


def write_curve(out: str, curves: dict, env: dict) -> list[str]:
    """``curve.md`` (and ``curve.png`` with matplotlib): saved bytes and peak live memory
    against step time for each point of :func:`run_curve`."""
    sim = env["flags"].get("simulate_world_size")
    lines = [f"# SAC memory vs step time: {env['model']}, {env['device']}, {env['nproc']} ranks"
             + (f" (simulated: one rank of {sim} in one process)" if sim else "")
             + (", bf16" if env["flags"].get("bf16") else ", fp32"), "",
             f"torch {env['torch']}, {env['cpu_count']} CPU cores; {env['date']}. Step time: "
             f"median of {env['steps']} steps"
             + (" (interleaved: one job per length, one step of every point in turn)"
                if env["flags"].get("interleave") else "")
             + "; peak live: one step (see results.md). Saved: the "
             "bytes kept on the device for the backward per rank (activation offload's host "
             "copies, listed below the table, not counted).", ""]
    for seq, rows in curves.items():
        lines += [f"## {seq} tokens", "", "| point | saved MiB/rank | saved B/token | peak live MiB | "
                  "step (s) | time vs autosp-nosac |", "|---|---|---|---|---|---|"]
        for r in rows:
            if r.get("status") != "ok":
                lines.append(f"| {r['point']} | {r['status']} | | | | |")
                continue
            dev = r.get("saved_device_bytes", r["saved_bytes"])
            per_token = r.get("saved_device_bytes_per_token", r["saved_bytes_per_token"])
            lines.append(f"| {r['point']} | {dev / 2**20:.1f} | "
                         f"{per_token:.0f} | {r['peak_live_bytes'] / 2**20:.1f} | "
                         f"{fmt(r['step_time_s'], '.3f')} | {fmt(r.get('time_vs_nosac'), '.3f')} |")
        lines.append("")
        host = [r for r in rows if r.get("status") == "ok" and r.get("saved_host_bytes")]
        if host:
            lines += ["In host memory (offloaded): " + "; ".join(
                f"{r['point']} {r['saved_host_bytes'] / 2**20:.1f} MiB" for r in host) + ".", ""]
    with open(os.path.join(out, "curve.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return []
    fig, ax = plt.subplots(figsize=(6.5, 4.2))
    for seq, rows in curves.items():
        ok = [r for r in rows if r.get("status") == "ok"]
        tgt = sorted((r for r in ok if "target_fraction" in r), key=lambda r: -r["target_fraction"])
        line, = ax.plot([r["time_vs_nosac"] for r in tgt], [r["peak_live_bytes"] / 2**20 for r in tgt],
                        marker="o", label=f"{seq} tokens: memory target (fraction of no-SAC saved bytes)")
        for r in ok:
            if "target_fraction" in r:
                ax.annotate(f"{r['target_fraction']:g}", (r["time_vs_nosac"], r["peak_live_bytes"] / 2**20),
                            fontsize=7, xytext=(3, -9), textcoords="offset points")
            else:
                ax.scatter([r["time_vs_nosac"]], [r["peak_live_bytes"] / 2**20], marker="s",
                           color=line.get_color())
                ax.annotate(r["point"], (r["time_vs_nosac"], r["peak_live_bytes"] / 2**20),
                            fontsize=7, xytext=(3, 3), textcoords="offset points")
    ax.set_xlabel("step time / AutoSP without SAC")
    ax.set_ylabel("peak live tensor memory per rank (MiB)")
    ax.set_title("memory target knob: peak memory vs step time")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    path = os.path.join(out, "curve.png")
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return [path]


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=HelpFormatter)
    p.add_argument("--model", default="llama-tiny", help="model preset")
    p.add_argument("--model-overrides", default="",
                   help="shape overrides of the preset, e.g. hidden_size=512,num_layers=4,vocab_size=8192")
    p.add_argument("--strategies", default="none,ulysses,ring,autosp,autosp-nosac",
                   help=f"comma-separated, from: {','.join(STRATEGIES)}")
    p.add_argument("--seq-lengths", default="2048,4096", help="comma-separated sequence lengths")
    p.add_argument("--nproc", type=int, default=2, help="ranks per sequence-parallel job")
    p.add_argument("--output", default="bench_out", help="output directory")
    p.add_argument("--steps", type=int, default=5,
                   help="timed steps per cell (median reported; 0: memory only, for cells too "
                        "slow to time: saved bytes and peak live, no step time)")
    p.add_argument("--peak-repeats", type=int, default=3,
                   help="steps measured for the resident-set / max_memory_allocated peak (median; "
                        "0: none, for slow cells; the exact live peak is always measured)")
    p.add_argument("--micro-batch-size", type=int, default=1, help="samples per step")
    p.add_argument("--bf16", action="store_true",
                   help="Megatron-style bf16 (bf16 parameters for compute, fp32 main weights)")
    p.add_argument("--fp32-residual-connection", action="store_true",
                   help="with --bf16: fp32 parameters and residual, bf16 inside autocast only")
    p.add_argument("--packed", action="store_true",
                   help="train on packed samples of the built-in corpus with document masking "
                        "(--reset-attention-mask --reset-position-ids --eod-mask-loss); TFLOP/s "
                        "count the attention the masks leave")
    p.add_argument("--device", choices=["cpu", "cuda"], default=None, help="device of every cell (default: cuda when available)")
    p.add_argument("--memory-budget-gb", type=float, help="find the longest sequence per strategy within this per-rank budget")
    p.add_argument("--simulate-world-size", type=int, help="one rank's share of a P-way SP job on one device (fake process group)")
    p.add_argument("--seed", type=int, default=1234, help="model and data seed")
    p.add_argument("--threads", type=int, default=0, help="CPU threads per rank (0: cores / ranks)")
    p.add_argument("--cell-timeout", type=float, default=1200, help="seconds before a cell is recorded as failed")
    p.add_argument("--compile-backend", "--autosp-backend", dest="compile_backend",
                   choices=["inductor", "aot_eager"], default="inductor",
                   help="code generation of the compiled strategies")
    p.add_argument("--warm-compile-cache", action="store_true",
                   help="reuse the on-disk Inductor/Triton caches (the compile column then measures a "
                        "cache hit where there is one; default: fresh caches per cell)")
    p.add_argument("--curve", action="store_true",
                   help="instead of the strategy table: the memory vs step-time curve of the SAC "
                        "memory target at each --seq-lengths (curve.md, curve.json, curve.png)")
    p.add_argument("--curve-fractions", default=CURVE_FRACTIONS,
                   help="--curve: memory targets as fractions of the bytes AutoSP without SAC saves")
    p.add_argument("--curve-offload-fractions", default="",
                   help="--curve: memory targets (same fractions) with --offload-activations, "
                        "met by offload first (empty: none)")
    p.add_argument("--interleave", action="store_true",
                   help="time the strategies (or --curve's points) of each length in one job, "
                        "one step of each in turn (the order rotated every round), instead of one "
                        "job after the other: on a machine whose speed drifts (shared hosts, "
                        "clocks) the ratios then compare like with like; memory is still "
                        "measured one job per cell; the table also gives the per-round ratio of "
                        "each step's thread CPU time (compute without waiting in collectives); "
                        "the timing job holds every strategy's model and optimizer state at once")
    p.add_argument("--wandb-project", help="log the table and plots to W&B (offline unless configured)")
    return p.parse_args(argv)


def main(argv=None):
    if argv is None:
        argv = sys.argv[1:]
    if argv and argv[0] == "--worker":
        return worker_main(argv[1:])
    args = parse_args(argv)
    import torch
    from tqdm import tqdm
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    strategies = [s.strip() for s in args.strategies.split(",") if s.strip()]
    def known(name):
        try:
            strategy_spec(name)
            return True
        except KeyError:
            return False
    unknown = [s for s in strategies if not known(s)]
    if unknown:
        sys.exit(f"benchmark_sp.py: unknown strategy {unknown}; choose from {', '.join(STRATEGIES)}"
                 f", or autosp-u<U> / ulysses-u<U> (a 2-D plan with Ulysses degree U)")
    try:
        seqs = sorted(int(s) for s in args.seq_lengths.split(","))
    except ValueError:
        sys.exit(f"benchmark_sp.py: --seq-lengths {args.seq_lengths!r} must be comma-separated integers")
    if args.steps < 0:
        sys.exit(f"benchmark_sp.py: --steps {args.steps}: give a number of timed steps, or 0 for "
                 "memory only")
    if args.steps == 0 and (args.curve or args.memory_budget_gb or args.interleave):
        sys.exit("benchmark_sp.py: --steps 0 measures memory only; --curve, --interleave and "
                 "--memory-budget-gb need step times: give --steps 1 or more")
    if args.simulate_world_size and device != "cuda":
        print("note: --simulate-world-size on CPU: figures are per-rank compute only", file=sys.stderr)
    overrides = {}
    for kv in filter(None, (x.strip() for x in args.model_overrides.split(","))):
        key, sep, value = kv.partition("=")
        if not sep:
            sys.exit(f"benchmark_sp.py: --model-overrides {kv!r} must be key=value")
        try:
            overrides[key] = int(value)
        except ValueError:
            try:
                overrides[key] = float(value)
            except ValueError:
                overrides[key] = value
    os.makedirs(args.output, exist_ok=True)
    threads = args.threads or max(1, (os.cpu_count() or 1) // max(1, args.nproc))
    base = {"model": args.model, "nproc": args.nproc, "steps": args.steps, "bf16": args.bf16,
            "fp32_residual": args.fp32_residual_connection,
            "device": device, "seed": args.seed, "micro_batch_size": args.micro_batch_size,
            "simulate_world_size": args.simulate_world_size, "threads": threads,
            "compile_backend": args.compile_backend, "packed": args.packed,
            "warm_compile_cache": args.warm_compile_cache, "overrides": overrides,
            "peak_repeats": max(0, args.peak_repeats)}
    if args.curve:
        fractions = [float(x) for x in args.curve_fractions.split(",") if x.strip()]
        off = [float(x) for x in args.curve_offload_fractions.split(",") if x.strip()]
        curves = {L: run_curve(base, L, fractions, args.cell_timeout, off, args.interleave)
                  for L in seqs}
        env = {"torch": torch.__version__, "device": device if device == "cpu" else torch.cuda.get_device_name(),
               "cpu_count": os.cpu_count(), "model": args.model, "nproc": args.nproc,
               "steps": args.steps, "flags": vars(args), "date": time.strftime("%Y-%m-%d %H:%M:%S")}
        with open(os.path.join(args.output, "curve.json"), "w") as f:
            json.dump({"curves": {str(k): v for k, v in curves.items()}, "environment": env}, f, indent=1)
        plots = write_curve(args.output, curves, env)
        print(open(os.path.join(args.output, "curve.md")).read())
        print(f"wrote {args.output}/curve.json, curve.md" + "".join(f", {os.path.basename(p)}" for p in plots))
        return curves
    # --interleave: the cells measure memory only, the step times come from one job per length
    cell_base = dict(base, steps=0) if args.interleave else base
    cells = [dict(cell_base, strategy=s, seq_length=L) for L in seqs for s in strategies]
    results = []
    for cell in tqdm(cells, desc="cells", unit="cell"):
        r = launch_cell(cell, args.cell_timeout)
        results.append(r)
        status = r["status"] if r["status"] != "ok" else (
            f"{r['step_time_s']:.3f} s/step" if r.get("step_time_s") is not None
            else f"memory only ({r['peak_live_bytes'] / 2**20:.1f} MiB peak live)")
        tqdm.write(f"{cell['strategy']:>14} @ {cell['seq_length']:>7}: {status}")
    if args.interleave:
        ref_first = sorted(strategies, key=lambda s: s != "autosp-nosac")  # the ratios' reference
        for L in seqs:
            rows = sorted((r for r in results if r["seq_length"] == L),
                          key=lambda r: ref_first.index(r["strategy"]))
            time_interleaved(base, L, rows, [{"strategy": r["strategy"]} for r in rows],
                             args.cell_timeout)
            for r in rows:
                if r.get("status") == "ok":
                    tqdm.write(f"{r['strategy']:>14} @ {L:>7}: " + (
                        f"{r['step_time_s']:.3f} s/step (interleaved"
                        + (f", x{r['paired_ratio']:.3f} of {r['paired_ref']} per round)"
                           if r.get("paired_ref") else ")")
                        if r.get("step_time_s") is not None
                        else f"not timed: {r.get('timing_error')}"))
    # first-step losses must agree between strategies at each length
    for L in seqs:
        row = [r for r in results if r["seq_length"] == L and r.get("status") == "ok"]
        if row and not args.simulate_world_size:
            ref = next((r for r in row if r["strategy"].startswith("none")), row[0])
            for r in row:
                r["loss_mismatch"] = abs(r["loss"] - ref["loss"]) > 1e-4 * max(1.0, abs(ref["loss"]))
    max_ctx = {}
    if args.memory_budget_gb:
        for s in strategies:
            if device == "cuda":
                gran = 2 * args.nproc * 128
                max_ctx[s] = search_max_context(dict(base, strategy=s), args.memory_budget_gb, seqs[0],
                                                args.cell_timeout, gran)
            else:
                max_ctx[s] = fit_all(results, [s], args.memory_budget_gb * 2**30)[s]
    env = {"torch": torch.__version__, "device": device if device == "cpu" else torch.cuda.get_device_name(),
           "cpu_count": os.cpu_count(), "machine": f"{platform.machine()} {platform.processor() or ''}".strip(),
           "python": platform.python_version(), "model": args.model, "nproc": args.nproc,
           "steps": args.steps, "simulate_world_size": args.simulate_world_size,
           "warm_compile_cache": args.warm_compile_cache,
           "flags": vars(args), "date": time.strftime("%Y-%m-%d %H:%M:%S")}
    with open(os.path.join(args.output, "results.json"), "w") as f:
        json.dump({"results": results, "environment": env, "max_context": max_ctx}, f, indent=1)
    write_markdown(os.path.join(args.output, "results.md"), results, env, max_ctx)
    plots = make_plots(args.output, results, max_ctx)
    if args.wandb_project:
        from autosp_lm.training.metrics import wandb_mode
        import wandb
        run = wandb.init(project=args.wandb_project, dir=args.output, mode=wandb_mode(), config=env)
        cols = ["strategy", "seq_length", "sp", "status", "step_time_s", "tokens_per_s",
                "tflops_per_device", "saved_bytes_per_token", "peak_mem_bytes", "loss", "compile_time_s"]
        run.log({"results": wandb.Table(columns=cols, data=[[r.get(c) for c in cols] for r in results]),
                 **{os.path.basename(p)[:-4]: wandb.Image(p) for p in plots}})
        run.finish()
    print(open(os.path.join(args.output, "results.md")).read())
    print(f"wrote {args.output}/results.json, results.md" + "".join(f", {os.path.basename(p)}" for p in plots))
    return results


if __name__ == "__main__":
    main()
