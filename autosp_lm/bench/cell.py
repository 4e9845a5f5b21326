"""One benchmark cell measured inside this process group (launched by torchrun, or one process
on its own), and the worker entry point the launcher runs: ``python -m autosp_lm.bench.cell
CELL_JSON`` (under torchrun when the cell has several processes)."""
from __future__ import annotations

import json
import statistics
import sys
import time

from .job import Job, init_process, measure_live_peak, measure_peak


def run_cell(cell: dict) -> dict:
    """Measure one cell inside this process group (torchrun's, or one process)."""
    import torch.distributed as dist

    init_process(cell)
    job = Job(cell)
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
        **collectives(job.strategy),
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
    init_process(cell)
    import torch
    limit = max(8, 2 * len(cell["entries"]) + 4)  # one compiled entry per strategy's backend
    name = dynamo_limit_name()
    setattr(torch._dynamo.config, name, max(getattr(torch._dynamo.config, name), limit))
    jobs = []
    for entry in cell["entries"]:
        job = Job(dict(cell, **entry))
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


def collectives(strategy) -> dict:
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



if __name__ == "__main__":
    worker_main(sys.argv[1:])
