"""The benchmark's jobs, with stand-in cells (autosp_lm/bench/fit.py, harness.py, launch.py):
the longest-context search, the interleaved timing jobs, the loss check, failed-job errors."""
import pytest

from autosp_lm.bench import fit, harness, launch


def test_longest_fit_doubles_then_bisects():
    tried = []

    def fits(seq):
        tried.append(seq)
        return seq <= 5000

    lo, hi, seq = fit.longest_fit(fits, 0, 1024, 1 << 20, 256)
    assert (lo, hi) == (4864, 5120) and seq == 8192
    assert tried[:4] == [1024, 2048, 4096, 8192]  # doubling, then bisecting in steps of 256
    assert tried[4:] == [6144, 5120, 4608, 4864]
    # everything fits up to the limit: no first failure, the next length past the limit
    assert fit.longest_fit(lambda s: True, 128, 256, 1024, 128) == (1024, None, 2048)
    # a deadline stops the search where it is
    assert fit.longest_fit(fits, 512, 1024, 1 << 20, 256, more=lambda: False) == (512, None, 1024)


def test_search_max_context_launches_one_step_trials(monkeypatch):
    asked = []

    def fake_cell(cell, timeout):
        asked.append(cell)
        if cell["seq_length"] > 3000:
            return {"status": "oom"}
        return {"status": "ok", "peak_mem_bytes": cell["seq_length"] * 2**20}

    monkeypatch.setattr(launch, "launch_cell", fake_cell)
    res = fit.search_max_context({"strategy": "autosp", "steps": 5}, 2.0, 512, 60, 512)
    assert res["method"] == "search" and res["max_seq_length"] == 2048
    assert all(c["steps"] == 1 and c["strategy"] == "autosp" for c in asked)
    assert [t["seq_length"] for t in res["trials"]] == [512, 1024, 2048, 4096, 3072, 2560]
    assert res["trials"][3]["status"] == "oom"
    assert res["trials"][-1]["peak_mem_bytes"] == 2560 * 2**20  # ok, but over the 2 GiB budget
    monkeypatch.setattr(launch, "launch_cell", lambda cell, timeout: {"status": "failed"})
    assert fit.search_max_context({"strategy": "x"}, 1.0, 512, 60, 512)["max_seq_length"] is None


def test_fit_all_says_why():
    def cell(s, seq, live):
        return {"strategy": s, "seq_length": seq, "status": "ok", "peak_live_bytes": live}
    results = [cell("a", 100, 2e6), cell("a", 200, 3e6), cell("flat", 100, 1e6),
               cell("flat", 200, 1e6), cell("big", 100, 5e9), cell("big", 200, 6e9),
               {"strategy": "gone", "seq_length": 100, "status": "oom"}]
    out = fit.fit_all(results, ["a", "flat", "big", "gone"], 4e6)
    assert out["a"]["max_seq_length"] == 300 and out["a"]["reason"] is None
    assert out["flat"]["reason"] == "peak memory did not grow with the sequence length"
    assert out["big"]["reason"] == "the measured peaks already exceed the budget"
    assert out["gone"]["reason"] == "no successful cell"
    # the resident-set peak where a cell lacks the live one
    assert fit.fit_peak({"peak_mem_bytes": 5}) == 5
    assert fit.fit_peak({"peak_mem_bytes": 5, "peak_live_bytes": 3}) == 3


def test_max_context_fits_on_cpu(monkeypatch):
    monkeypatch.setattr(launch, "launch_cell", lambda *a: pytest.fail("no job on CPU"))
    results = [{"strategy": "a", "seq_length": L, "status": "ok", "peak_live_bytes": L * 2**20}
               for L in (64, 128)]
    out = harness.max_context({"device": "cpu", "nproc": 2}, ["a"], [64, 128], results, 1.0, 60)
    assert out["a"]["method"] == "fit" and out["a"]["max_seq_length"] == 1024


def test_time_interleaved_one_job_per_process_count(monkeypatch):
    """Rows of the same process count share one timing job, whose first entry is the ratios'
    reference; a failed job leaves its rows untimed with the reason."""
    jobs = []

    def fake_job(cell, timeout):
        jobs.append(cell)
        if cell["strategy"] == "ring":
            return {"status": "failed", "error": "boom"}
        return {"status": "ok", "entries": [
            {k: (1.0 + i if k == "step_time_s" else None) for k in harness.TIMING_FIELDS}
            for i, _ in enumerate(cell["entries"])]}

    monkeypatch.setattr(launch, "launch_cell", fake_job)
    base = {"nproc": 2, "steps": 3}
    rows = [{"strategy": s, "status": "ok", "first_step_s": 5.0}
            for s in ("autosp-nosac", "none", "autosp")]
    rows.append({"strategy": "ulysses", "status": "oom"})  # not timed: its cell failed
    harness.time_interleaved(base, 64, rows, [{"strategy": r["strategy"]} for r in rows], 10)
    assert [[e["strategy"] for e in j["entries"]] for j in jobs] == [["autosp-nosac", "autosp"],
                                                                    ["none"]]
    assert all(j["seq_length"] == 64 for j in jobs)
    nosac, none, autosp, uly = rows
    assert nosac["paired_ref"] is None and autosp["paired_ref"] == "autosp-nosac"
    assert autosp["step_time_s"] == 2.0 and autosp["compile_time_s"] == 3.0
    assert none["timing"] == "interleaved" and "step_time_s" not in uly
    jobs.clear()
    rows = [{"strategy": "ring", "status": "ok", "step_time_s": 9.0}]
    harness.time_interleaved(base, 64, rows, [{"strategy": "ring"}], 10)
    assert rows[0]["step_time_s"] is None and rows[0]["timing_error"] == "boom"


def test_loss_mismatch_against_the_single_device_row():
    results = [{"strategy": "ulysses", "seq_length": 64, "status": "ok", "loss": 6.0},
               {"strategy": "none-eager", "seq_length": 64, "status": "ok", "loss": 6.0001},
               {"strategy": "ring", "seq_length": 64, "status": "ok", "loss": 6.01},
               {"strategy": "autosp", "seq_length": 128, "status": "ok", "loss": 1.0},
               {"strategy": "none", "seq_length": 128, "status": "failed"}]
    harness.flag_loss_mismatch(results, [64, 128])
    assert [r.get("loss_mismatch") for r in results] == [False, False, True, False, None]


def test_last_error_and_process_counts():
    out = "noise\n[rank1]: torch.OutOfMemoryError: CUDA out of memory\nexit 1\n"
    assert launch.last_error(out) == "[rank1]: torch.OutOfMemoryError: CUDA out of memory"
    assert launch.last_error("a\nsome rror here\nb") == "some rror here"
    assert launch.last_error("") == "no output"
    assert launch.cell_nproc({"strategy": "none-eager", "nproc": 4}) == 1
    assert launch.cell_nproc({"strategy": "ulysses", "nproc": 4}) == 4
    assert launch.cell_nproc({"strategy": "ulysses", "nproc": 4, "simulate_world_size": 8}) == 1
