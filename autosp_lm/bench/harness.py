"""A benchmark run's cells, one job each: the strategy table, the interleaved timing jobs
(``--interleave``), the first-step loss check, the longest context within a budget and the
points of ``--curve``. Every job goes through :func:`launch.launch_cell`."""
from __future__ import annotations

from . import launch
from .fit import fit_all, search_max_context


def tqdm_write(msg: str) -> None:
    from tqdm import tqdm
    tqdm.write(msg)


def run_cells(cells: list[dict], timeout: float) -> list[dict]:
    """Each cell as its own job, in order, with a progress bar and one line per cell."""
    from tqdm import tqdm
    results = []
    for cell in tqdm(cells, desc="cells", unit="cell"):
        r = launch.launch_cell(cell, timeout)
        results.append(r)
        status = r["status"] if r["status"] != "ok" else (
            f"{r['step_time_s']:.3f} s/step" if r.get("step_time_s") is not None
            else f"memory only ({r['peak_live_bytes'] / 2**20:.1f} MiB peak live)")
        tqdm_write(f"{cell['strategy']:>14} @ {cell['seq_length']:>7}: {status}")
    return results


#: What an interleaved timing job replaces in a cell's result.
TIMING_FIELDS = ("step_time_s", "step_times_s", "tokens_per_s", "tflops_per_device",
                 "paired_ratio", "paired_ratios", "cpu_step_time_s", "cpu_step_times_s",
                 "cpu_paired_ratio")


def time_interleaved(base: dict, seq: int, rows: list, entries: list, timeout: float) -> None:
    """``--interleave``: the step times of ``rows`` (measured cells at one length, their memory
    figures kept) from jobs that run their ``entries`` (the cells' strategy and options)
    interleaved (:func:`cell.run_interleaved`), one job per process count; the first entry of each
    job is the reference of its ``paired_ratio``. A failed job leaves its rows untimed, with the
    error under ``timing_error``."""
    groups: dict = {}
    for row, entry in zip(rows, entries):
        if row.get("status") == "ok":
            groups.setdefault(launch.cell_nproc(dict(base, **entry)), []).append((row, entry))
    for members in groups.values():
        cell = dict(base, seq_length=seq, strategy=members[0][1]["strategy"],
                    entries=[e for _, e in members])
        res = launch.launch_cell(cell, timeout * len(members))
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




def interleave_table(base: dict, lengths: list[int], strategies: list[str], results: list[dict],
                     timeout: float) -> None:
    """``--interleave``: the step times of the table's (memory-only) ``results``, one timing
    job per length, ``autosp-nosac`` first where it is measured (the ratios' reference)."""
    ref_first = sorted(strategies, key=lambda s: s != "autosp-nosac")  # the ratios' reference
    for L in lengths:
        rows = sorted((r for r in results if r["seq_length"] == L),
                      key=lambda r: ref_first.index(r["strategy"]))
        time_interleaved(base, L, rows, [{"strategy": r["strategy"]} for r in rows], timeout)
        for r in rows:
            if r.get("status") == "ok":
                tqdm_write(f"{r['strategy']:>14} @ {L:>7}: " + (
                    f"{r['step_time_s']:.3f} s/step (interleaved"
                    + (f", x{r['paired_ratio']:.3f} of {r['paired_ref']} per round)"
                       if r.get("paired_ref") else ")")
                    if r.get("step_time_s") is not None
                    else f"not timed: {r.get('timing_error')}"))


def flag_loss_mismatch(results: list[dict], lengths: list[int]) -> None:
    """First-step losses must agree between strategies at each length: ``loss_mismatch`` on
    every ok cell, against the ``none`` cell (else the first) of its length."""
    for L in lengths:
        row = [r for r in results if r["seq_length"] == L and r.get("status") == "ok"]
        if row:
            ref = next((r for r in row if r["strategy"].startswith("none")), row[0])
            for r in row:
                r["loss_mismatch"] = abs(r["loss"] - ref["loss"]) > 1e-4 * max(1.0, abs(ref["loss"]))


def max_context(base: dict, strategies: list[str], lengths: list[int], results: list[dict],
                budget_gb: float, timeout: float) -> dict:
    """``--memory-budget-gb``: per strategy the longest sequence within the budget, by a search
    on CUDA (from the shortest length, in steps of ``2 * nproc * 128``), by a fit of
    ``results`` on CPU."""
    max_ctx = {}
    for s in strategies:
        if base["device"] == "cuda":
            gran = 2 * base["nproc"] * 128
            max_ctx[s] = search_max_context(dict(base, strategy=s), budget_gb, lengths[0],
                                            timeout, gran)
        else:
            max_ctx[s] = fit_all(results, [s], budget_gb * 2**30)[s]
    return max_ctx


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
        r = launch.launch_cell(dict(cell_base, seq_length=seq, **entry), timeout)
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
