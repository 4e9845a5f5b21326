"""Smoke test of tools/benchmark_sp.py: real cells on the smallest sizes, not a timing test."""
import json
import os
import statistics
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "tools"))
import benchmark_sp  # noqa: E402

from autosp_lm.bench import fit, launch, plots, report  # noqa: E402
from autosp_lm.bench.cell import dynamo_limit_name, run_cell, run_interleaved  # noqa: E402


def test_fit_max_context_solves_the_budget():
    # peak = 1e6 + 3e3*S bytes, measured with +-1% noise
    pts = [(s, (1e6 + 3e3 * s) * (1 + 0.01 * (-1) ** i)) for i, s in enumerate((256, 512, 1024, 2048))]
    best, (slope, intercept) = fit.fit_max_context(pts, 1e6 + 3e3 * 65536)
    assert abs(best - 65536) / 65536 < 0.03 and abs(slope - 3e3) / 3e3 < 0.03
    assert fit.fit_max_context([(256, 1e6)], 1e9) == (None, None)
    best, _ = fit.fit_max_context([(256, 2e6), (512, 2e6)], 1e9)  # flat: no answer
    assert best is None


def test_harness_end_to_end(tmp_path):
    out = tmp_path / "bench"
    results = benchmark_sp.main(["--model", "llama-tiny", "--strategies", "none-eager,ulysses-eager",
                                 "--seq-lengths", "63,64", "--nproc", "2", "--steps", "1",
                                 "--output", str(out), "--memory-budget-gb", "4", "--threads", "1"])
    data = json.loads((out / "results.json").read_text())
    assert {"results", "environment", "max_context"} <= set(data)
    assert data["environment"]["torch"] and data["environment"]["cpu_count"]
    cells = {(r["strategy"], r["seq_length"]): r for r in data["results"]}
    assert len(cells) == 4 and len(results) == 4
    # 63 tokens cannot be split over 2 ranks: a failed cell with the reason (found before a
    # launch), the rest goes on
    bad = cells[("ulysses-eager", 63)]
    assert bad["status"] == "failed" and "63" in bad["error"] and "62 or 64" in bad["error"]
    for key in [("none-eager", 63), ("none-eager", 64), ("ulysses-eager", 64)]:
        r = cells[key]
        assert r["status"] == "ok", r
        for field in ("strategy", "seq_length", "sp", "step_time_s", "tokens_per_s", "tflops_per_device",
                      "saved_bytes_per_token", "peak_mem_bytes", "peak_live_bytes", "loss",
                      "compile_time_s"):
            assert field in r, field
        assert r["step_time_s"] > 0 and r["saved_bytes_per_token"] > 0
        assert r["peak_live_bytes"] > 0  # exact live-tensor peak of one step, every strategy
    assert cells[("ulysses-eager", 64)]["sp"] == 2 and cells[("none-eager", 64)]["sp"] == 1
    ranks = cells[("ulysses-eager", 64)]["peak_live_bytes_ranks"]
    assert len(ranks) == 2 and ranks[0] == cells[("ulysses-eager", 64)]["peak_live_bytes"]
    assert all(r > 0 for r in ranks)
    # same model, seed and batch: the first-step losses agree and nothing is flagged
    assert cells[("ulysses-eager", 64)]["loss"] == pytest.approx(cells[("none-eager", 64)]["loss"], rel=1e-5)
    assert not any(r.get("loss_mismatch") for r in data["results"])
    # the CPU fit uses the exact live peak (deterministic): 64 tokens hold more than 63, so the fit
    # grows with the length and answers a longest sequence for the 4 GB budget
    fit = data["max_context"]["none-eager"]
    assert fit["method"] == "fit" and fit["reason"] is None
    assert fit["points"] == [[63, cells[("none-eager", 63)]["peak_live_bytes"]],
                             [64, cells[("none-eager", 64)]["peak_live_bytes"]]]
    assert cells[("none-eager", 64)]["peak_live_bytes"] > cells[("none-eager", 63)]["peak_live_bytes"]
    assert fit["coefficients"][0] > 0 and fit["max_seq_length"] > 64
    md = (out / "results.md").read_text()
    assert "failed" in md and "fit" in md
    for png in ("saved_bytes_per_token.png", "tokens_per_s.png", "max_context.png"):
        assert (out / png).stat().st_size > 1000


def test_a_cell_its_ranks_cannot_split_is_refused_without_a_launch(monkeypatch):
    def no_launch(*a, **k):
        raise AssertionError("launched")
    monkeypatch.setattr(launch.subprocess, "Popen", no_launch)
    cell = {"strategy": "ulysses-eager", "seq_length": 63, "nproc": 2}
    r = launch.launch_cell(cell, timeout=60)
    assert (r["status"], r["sp"]) == ("failed", 2) and "not divisible" in r["error"], r
    # the simulated world's ranks split the sequence: 64 over 3 simulated ranks is refused too
    r = launch.launch_cell(dict(cell, seq_length=64, simulate_world_size=3), timeout=60)
    assert r["sp"] == 3 and "64" in r["error"], r
    assert launch.split_refusal(dict(cell, strategy="none-eager")) is None  # one device
    assert launch.split_refusal(dict(cell, seq_length=64)) is None


@pytest.mark.parametrize("script,timeout,status,error", [
    ("import sys; print('ValueError: bad cell', file=sys.stderr); sys.exit(3)", 120, "failed",
     "ValueError: bad cell"),
    ("import os, signal; os.kill(os.getpid(), signal.SIGKILL)", 120, "oom", None),
    ("import time; time.sleep(60)", 1, "failed", "timed out after 1 s"),
])
def test_a_job_that_fails_is_a_failed_cell(monkeypatch, script, timeout, status, error):
    """A crash (its last error line), a kill by the kernel's OOM killer (SIGKILL) and a timeout
    of the cell's job each become a failed-cell record (a stand-in job: a bare interpreter)."""
    monkeypatch.setattr(launch, "job_command", lambda cell, nproc: [sys.executable, "-c", script])
    r = launch.launch_cell({"strategy": "ulysses-eager", "seq_length": 64, "nproc": 2},
                           timeout=timeout)
    assert r["status"] == status and r["sp"] == 2, r
    if error:
        assert r["error"] == error, r


def test_one_process_runs_without_a_launcher():
    assert launch.job_command({}, 1)[1:3] == ["-m", "autosp_lm.bench.cell"]
    assert launch.job_command({}, 2)[1:5] == ["-m", "torch.distributed.run", "--standalone",
                                              "--nproc-per-node=2"]


def _cell(strategy, seq, peak):
    return {"strategy": strategy, "seq_length": seq, "sp": 2, "status": "ok", "step_time_s": 0.1,
            "tokens_per_s": seq / 0.1, "tflops_per_device": 0.001, "saved_bytes_per_token": 100.0,
            "peak_mem_bytes": peak, "loss": 6.0, "compile_time_s": 1.0}


def test_one_sequence_length_says_why_there_is_no_max_context(tmp_path, monkeypatch, capsys):
    """A single --seq-lengths value cannot be fitted: the table says so, no empty plot is drawn."""
    pytest.importorskip("matplotlib")
    results = [_cell("ulysses", 512, 2e6), _cell("autosp", 512, 1e6)]
    max_ctx = fit.fit_all(results, ["ulysses", "autosp"], 4 * 2**30)
    assert max_ctx["autosp"]["max_seq_length"] is None
    assert max_ctx["autosp"]["reason"] == "a fit needs two or more sequence lengths, got 1"
    env = {"model": "llama-tiny", "device": "cpu", "nproc": 2, "torch": "x", "cpu_count": 2,
           "machine": "x", "steps": 1}
    report.write_markdown(str(tmp_path / "results.md"), results, env, max_ctx)
    md = (tmp_path / "results.md").read_text()
    assert "| autosp | - (a fit needs two or more sequence lengths, got 1) | fit |" in md
    assert "empty compile caches" in md  # what the compile column measured
    titles = []
    import matplotlib.axes
    real = matplotlib.axes.Axes.set_title
    monkeypatch.setattr(matplotlib.axes.Axes, "set_title",
                        lambda self, label, *a, **k: (titles.append(label), real(self, label, *a, **k))[1])
    files = plots.make_plots(str(tmp_path), results, max_ctx)
    assert [os.path.basename(f) for f in files] == ["saved_bytes_per_token.png", "tokens_per_s.png"]
    assert "no max-context plot: ulysses: a fit needs two" in capsys.readouterr().err
    # two lengths: the plot is drawn, its title balanced
    results += [_cell("ulysses", 1024, 3e6), _cell("autosp", 1024, 1.5e6)]
    max_ctx = fit.fit_all(results, ["ulysses", "autosp"], 4 * 2**30)
    assert max_ctx["autosp"]["max_seq_length"] > max_ctx["ulysses"]["max_seq_length"] > 0
    files = plots.make_plots(str(tmp_path), results, max_ctx)
    assert os.path.basename(files[-1]) == "max_context.png"
    assert titles[-1] == "max context per rank within the budget, CPU fit"
    assert all(t.count("(") == t.count(")") for t in titles)


def test_curve_table(tmp_path):
    """--curve's table and plot from its rows (the cells themselves are the harness above)."""
    def row(point, t, live, saved, **kw):
        return dict(point=point, status="ok", step_time_s=t, peak_live_bytes=live * 2**20,
                    saved_bytes=saved * 2**20, saved_bytes_per_token=saved * 256.0, **kw)
    rows = [row("autosp-nosac", 1.0, 50, 44), row("ulysses", 0.9, 48, 44), row("autosp", 1.02, 13, 3),
            row("target 0.1", 1.01, 20, 4.4, target_fraction=0.1), dict(point="target 0", status="oom")]
    for r in rows:
        if r["status"] == "ok":
            r["time_vs_nosac"] = r["step_time_s"]
    env = {"model": "llama-tiny", "device": "cpu", "nproc": 2, "flags": {"bf16": False},
           "torch": "x", "cpu_count": 2, "date": "today", "steps": 3}
    report.write_curve(str(tmp_path), {8192: rows}, env)
    md = (tmp_path / "curve.md").read_text()
    assert "## 8192 tokens" in md and "| autosp | 3.0 | 768 | 13.0 | 1.020 | 1.020 |" in md
    assert "| target 0 | oom |" in md


def test_steps_0_measures_memory_only(tmp_path, monkeypatch):
    """--steps 0 (cells too slow to time): saved bytes and the live peak, no step time, and the
    table shows '-' where nothing was timed; the modes that need step times refuse it. The cell
    runs in this process (a single-device strategy; the torchrun jobs: the harness test)."""
    import torch
    monkeypatch.setattr(launch, "launch_cell", lambda cell, timeout: run_cell(cell))
    threads = torch.get_num_threads()
    out = tmp_path / "mem"
    try:
        (r,) = benchmark_sp.main(["--model", "llama-tiny", "--strategies", "none-eager",
                                  "--seq-lengths", "64", "--steps", "0", "--peak-repeats", "0",
                                  "--output", str(out), "--threads", "1"])
    finally:
        torch.set_num_threads(threads)
    assert r["status"] == "ok", r
    assert r["step_time_s"] is None and r["tokens_per_s"] is None and r["step_times_s"] == []
    assert r["saved_bytes_per_token"] > 0 and r["peak_live_bytes"] > 0
    row = next(line for line in (out / "results.md").read_text().splitlines()
               if line.startswith("| none-eager"))
    assert row.split("|")[4].strip() == "-"  # step (s)
    for extra in (["--curve"], ["--memory-budget-gb", "1"]):
        with pytest.raises(SystemExit, match="--steps 0 measures memory only"):
            benchmark_sp.main(["--steps", "0", "--output", str(tmp_path / "x"), *extra])
    with pytest.raises(SystemExit, match="--steps -1"):
        benchmark_sp.main(["--steps", "-1", "--output", str(tmp_path / "x")])


def _check_interleaved(results, out, ref_name, other):
    cells = {r["strategy"]: r for r in results}
    for r in cells.values():
        assert r["status"] == "ok" and r["timing"] == "interleaved", r
        assert len(r["step_times_s"]) == 3 and r["step_time_s"] > 0 and r["tokens_per_s"] > 0
        assert r["saved_bytes_per_token"] > 0 and r["peak_live_bytes"] > 0  # the memory cells
        assert r["compile_time_s"] is not None
    ref, sp = cells[ref_name], cells[other]
    assert ref["paired_ref"] is None and sp["paired_ref"] == ref_name
    assert sp["paired_ratios"] == pytest.approx(
        [a / b for a, b in zip(sp["step_times_s"], ref["step_times_s"])])
    # the thread CPU time of each step, and its per-round ratio
    for r in (ref, sp):
        assert len(r["cpu_step_times_s"]) == 3 and all(c > 0 for c in r["cpu_step_times_s"])
    assert sp["cpu_paired_ratio"] == pytest.approx(statistics.median(
        [a / b for a, b in zip(sp["cpu_step_times_s"], ref["cpu_step_times_s"])]))
    md = (out / "results.md").read_text()
    assert "interleaved" in md and f"{other}@64 x" in md


def test_interleave_in_one_process(tmp_path, monkeypatch):
    """--interleave's harness and its timing job, the cells run in this process instead of
    torchrun jobs (single-device strategies): memory cells untimed, then one job of both
    strategies whose rounds give the times and the per-round ratios."""
    import torch
    launched = []

    def in_process(cell, timeout):
        launched.append(cell)
        return (run_interleaved if "entries" in cell else run_cell)(cell)
    monkeypatch.setattr(launch, "launch_cell", in_process)
    limit = dynamo_limit_name()  # raised by the timing job: restored after
    threads = torch.get_num_threads()
    out = tmp_path / "inter"
    try:
        with torch._dynamo.config.patch(**{limit: getattr(torch._dynamo.config, limit)}):
            results = benchmark_sp.main([
                "--model", "llama-tiny", "--strategies", "none,none-eager", "--seq-lengths",
                "64", "--steps", "3", "--interleave", "--compile-backend", "aot_eager",
                "--peak-repeats", "0", "--output", str(out), "--threads", "1"])
    finally:
        torch.set_num_threads(threads)
        torch._dynamo.reset()
    assert [c["steps"] for c in launched] == [0, 0, 3]  # two memory cells, one timing job
    assert [e["strategy"] for e in launched[-1]["entries"]] == ["none", "none-eager"]
    _check_interleaved(results, out, "none", "none-eager")
    with pytest.raises(SystemExit, match="--steps 0 measures memory only"):
        benchmark_sp.main(["--steps", "0", "--interleave", "--output", str(tmp_path / "x")])


@pytest.mark.slow  # three torchrun jobs (~35 s); the harness in one process: the test above
def test_interleave_times_the_strategies_in_one_job(tmp_path):
    """--interleave: memory from one job per cell, step times from one job per length that runs
    one step of each strategy in turn; each round's ratio is of the same round's two steps."""
    out = tmp_path / "inter"
    results = benchmark_sp.main(["--model", "llama-tiny", "--strategies", "none-eager,ulysses-eager",
                                 "--seq-lengths", "64", "--steps", "3", "--interleave",
                                 "--simulate-world-size", "2", "--peak-repeats", "0",
                                 "--output", str(out), "--threads", "1"])
    _check_interleaved(results, out, "none-eager", "ulysses-eager")
