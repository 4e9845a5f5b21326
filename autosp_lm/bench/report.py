"""The benchmark's written results: ``results.json`` / ``results.md`` of the strategy table,
``curve.json`` / ``curve.md`` of ``--curve``, and the W&B log."""
from __future__ import annotations

import json
import os

from .plots import plot_curve


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
    return plot_curve(out, curves)


def write_json(path: str, **content) -> None:
    """``content`` as indented JSON (``results.json``, ``curve.json``)."""
    with open(path, "w") as f:
        json.dump(content, f, indent=1)


#: the W&B table's columns
WANDB_COLUMNS = ["strategy", "seq_length", "sp", "status", "step_time_s", "tokens_per_s",
                 "tflops_per_device", "saved_bytes_per_token", "peak_mem_bytes", "loss",
                 "compile_time_s"]


def log_wandb(project: str, out: str, env: dict, results: list[dict], plots: list[str]) -> None:
    """The table and the plots as one W&B run (offline unless an account is configured)."""
    from autosp_lm.training.metrics import wandb_mode
    import wandb
    run = wandb.init(project=project, dir=out, mode=wandb_mode(), config=env)
    cols = WANDB_COLUMNS
    run.log({"results": wandb.Table(columns=cols, data=[[r.get(c) for c in cols] for r in results]),
             **{os.path.basename(p)[:-4]: wandb.Image(p) for p in plots}})
    run.finish()
