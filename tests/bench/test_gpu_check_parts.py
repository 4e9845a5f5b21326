"""The GPU check's harness without its sections (autosp_lm/bench/gpu/common.py, report.py,
worker.py): rows, the table, the time shares of the workers, the JSON and Markdown written."""
import argparse
import json
import os
import signal
import subprocess
import time

import pytest

import torch

from autosp_lm.bench.gpu import common, report, worker
from autosp_lm.bench.gpu.common import Row

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_rows_and_the_table():
    r = Row("ring_kernels", "math float32", "ok", "picks math", max_err=1.5e-7)
    assert r == {"section": "ring_kernels", "check": "math float32", "status": "ok",
                 "note": "picks math", "max_err": 1.5e-7}
    rows = [r, Row("fsdp", "x", "FAIL", step_s=0.25, max_fit=4096), Row("env", "e", "skipped")]
    text = report.table(rows).splitlines()
    # the figure columns some row has, in the fixed order; floats to 3 significant digits
    assert text[0] == "| section | check | status | max_err | step_s | max_fit | note |"
    assert text[1] == "|---|---|---|---|---|---|---|"
    assert text[2] == "| ring_kernels | math float32 | ok | 1.5e-07 |  |  | picks math |"
    assert text[3] == "| fsdp | x | FAIL |  | 0.25 | 4096 |  |"
    assert report.table([Row("env", "e", "ok")]).splitlines()[0] == \
        "| section | check | status |  | note |"


def test_errors_and_names():
    a = torch.tensor([1.0, 2.0, 2.0], dtype=torch.float64)
    assert common.rel(a, a) == 0.0
    assert abs(common.rel(a * 1.01, a) - 0.01) < 1e-12
    assert common.rel(torch.zeros(2), torch.zeros(2)) == 0.0  # no division by zero
    assert common.dtype_name(torch.bfloat16) == "bfloat16"
    assert common.first_line(RuntimeError("  no kernel\nmore\n")) == "no kernel"
    r = common.length_row("peak_memory", "ulysses", {"seq_length": 256, "status": "oom",
                                                      "step_s": 1.0, "mfu": 0.1}, keep=("step_s",))
    assert r["check"] == "ulysses S=256" and r["status"] == "oom" and "mfu" not in r


class FakePending:
    """A stand-in worker process: its result is ``answer(cell)`` (instantly), and it says it is
    warm at once (run_together's ready file)."""
    answer = staticmethod(lambda cell: {"ok": cell.get("n")})
    started: list = []

    def __init__(self, cell):
        self.cell, self.t0 = cell, time.time()
        FakePending.started.append(cell)
        if cell.get("sync_dir"):
            open(os.path.join(cell["sync_dir"], f"ready_{cell['index']}"), "w").close()

    def done(self):
        return True

    def result(self, timeout):
        return dict(self.answer(self.cell), cell_s=0.5)

    def kill(self):
        pass


@pytest.fixture
def fake_workers(monkeypatch):
    FakePending.started = []
    monkeypatch.setattr(common, "Pending", FakePending)
    return FakePending


def test_run_cells_skips_what_does_not_fit_and_goes_on(fake_workers, monkeypatch):
    """Cells run in order; one that fails is an error result and the next still runs; one whose
    estimate does not fit the time left is skipped with its estimate while a later, cheaper one
    runs; a cell marked to skip keeps its place; budgets share the time left."""
    monkeypatch.setattr(FakePending, "answer", staticmethod(
        lambda cell: {"error": "x" * 400} if cell["n"] == 1 else {"ok": cell["n"]}))
    stop = time.time() + 300
    cells = [(f"c{n}", {"n": n, "est_s": 10}) for n in range(3)]
    cells.insert(2, ("big", {"n": 9, "est_s": 1000}))
    cells.insert(1, ("absent", {"skip": "not in this tree"}))
    done = list(common.run_cells("s", cells, stop, slack=10))
    assert [c for c, _ in done] == ["c0", "absent", "c1", "big", "c2"]
    res = dict(done)
    assert res["c0"] == {"ok": 0, "cell_s": 0.5} and res["c2"]["ok"] == 2
    assert res["absent"] == {"skipped": "not in this tree"}
    assert res["big"]["skipped"].startswith("time limit: needs about 1000 s")
    row = common.unfinished_row("s", "c1", res["c1"])
    assert row["status"] == "FAIL" and len(row["note"]) == 300 and row["cell_s"] == 0.5
    assert common.unfinished_row("s", "c0", res["c0"]) is None
    assert 64 < fake_workers.started[0]["budget_s"] <= 65  # a quarter of 300 s, less 10 s
    assert [c["n"] for c in fake_workers.started] == [0, 1, 2]


def test_run_cells_side_by_side_within_memory(monkeypatch):
    """``parallel`` cells run at once while their memory fits; results come back in order."""
    live, most = [], []

    class Slow(FakePending):
        def __init__(self, cell):
            super().__init__(cell)
            live.append(cell["n"])
            most.append(sorted(live))

        def result(self, timeout):
            live.remove(self.cell["n"])
            return {"ok": self.cell["n"]}
    monkeypatch.setattr(common, "Pending", Slow)
    mem = [10, 10, 10, 30, 10, 50]
    cells = [(f"c{n}", {"n": n, "mem_gib": m}) for n, m in enumerate(mem)]
    done = list(common.run_cells("s", cells, time.time() + 300, parallel=3, memory_gib=40))
    assert [r["ok"] for _, r in done] == [0, 1, 2, 3, 4, 5]
    assert most == [[0], [0, 1], [0, 1, 2], [2, 3], [3, 4], [5]]  # 50 GiB: alone


def test_run_together_times_each_cell_alone(fake_workers, tmp_path):
    """Every timed cell starts (compiles) at once; each gets its turn (go_<i>) in order, only
    when every started worker is warm."""
    cells = [(f"c{n}", {"n": n, "est_s": 5}) for n in range(3)]
    cells.append(("absent", {"skip": "not in this tree"}))
    out = list(common.run_together("s", cells, time.time() + 60, str(tmp_path)))
    assert [c for c, _ in out] == ["c0", "c1", "c2", "absent"]
    assert len(fake_workers.started) == 3 and out[3][1] == {"skipped": "not in this tree"}
    assert sorted(os.listdir(tmp_path)) == ["go_0", "go_1", "go_2", "ready_0", "ready_1",
                                            "ready_2"]


def test_run_writes_json_and_markdown_after_every_row(tmp_path, monkeypatch, capsys):
    """Each row is on disk (JSON and Markdown, written atomically) before the next is made; a
    section that raises is a FAIL row and the run goes on; the files say when a run is
    incomplete."""
    seen = []

    def on_disk():
        data = json.loads((tmp_path / "gpu_check.json").read_text())
        return [r["check"] for r in data["rows"]], data["complete"], data["running"]

    def good(args, deadline):
        yield Row("good", "first", "ok", max_err=0.5)
        seen.append(on_disk())
        yield Row("good", "second", "ok")
        seen.append(on_disk())

    def broken(args, deadline):
        yield Row("broken", "before", "ok")
        raise ValueError("bad shape")

    monkeypatch.setattr(report, "SECTIONS", [("good", good), ("broken", broken),
                                             ("unwanted", broken)])
    args = argparse.Namespace(output=str(tmp_path), time_limit=60, smoke=True,
                              sections="good,broken")
    res = report.run(args)
    assert seen == [(["torch / device", "first"], False, "good"),
                    (["torch / device", "first", "second"], False, "good")]
    assert [(r["section"], r["check"], r["status"]) for r in res["rows"]] == [
        ("env", "torch / device", "ok"), ("good", "first", "ok"), ("good", "second", "ok"),
        ("broken", "before", "ok"), ("broken", "section", "FAIL")]
    assert res["rows"][4]["note"] == "ValueError: bad shape"
    data = json.loads((tmp_path / "gpu_check.json").read_text())
    assert data["smoke"] is True and data["complete"] is True and data["rows"] == res["rows"]
    assert data["sections"] == ["good", "broken"]
    assert data["environment"]["torch"] == torch.__version__ and "apex" in data["environment"]
    md = (tmp_path / "gpu_check.md").read_text()
    assert md.startswith("GPU check, ") and "(smoke run: no GPU figures)" in md
    assert "Incomplete" not in md and not [f for f in os.listdir(tmp_path) if ".tmp" in f]
    assert report.table(res["rows"]) in md and report.table(res["rows"]) in capsys.readouterr().out


def test_a_stopped_run_keeps_its_rows(tmp_path, monkeypatch):
    """A run stopped mid-section (SIGTERM: a timeout) ends with the rows it made on disk,
    marked incomplete, naming the section it was in and those it did not reach."""
    def first(args, deadline):
        yield Row("first", "done", "ok")

    def stopped(args, deadline):
        yield Row("stopped", "a cell", "ok")
        os.kill(os.getpid(), signal.SIGTERM)
        yield Row("stopped", "never", "ok")

    monkeypatch.setattr(report, "SECTIONS", [("first", first), ("stopped", stopped),
                                             ("later", first)])
    args = argparse.Namespace(output=str(tmp_path), time_limit=60, smoke=True,
                              sections="first,stopped,later")
    res = report.run(args)
    assert [r["check"] for r in res["rows"]] == ["torch / device", "done", "a cell"]
    data = json.loads((tmp_path / "gpu_check.json").read_text())
    assert data["complete"] is False and data["stopped"] == "stopped by signal SIGTERM"
    assert data["running"] == "stopped"
    md = (tmp_path / "gpu_check.md").read_text()
    assert "**Incomplete**: stopped by signal SIGTERM; last section started: stopped; not " \
           "reached: later." in md


def test_decisive_cells_first_and_on_disk_after_each(tmp_path, fake_workers, monkeypatch):
    """The smoke run's harness with stand-in workers: the first rows are the planner against the
    measurement for each decisive recipe in DECISIVE's order (one not in this tree skipped in
    its place), then their tokens/s; each row is on disk before the next cell's result is
    taken; a cell that fails is a FAIL row with its error and the others still run."""
    from autosp_lm.bench.gpu import decisive
    on_disk = []

    def answer(cell):
        on_disk.append([r["check"] for r in json.loads(
            (tmp_path / "gpu_check.json").read_text())["rows"]])
        if cell["strategy"] == "autosp-max":
            return {"error": "exit 1: RuntimeError: boom"}
        if cell["worker"] == "plan":
            return dict(predicted_gib=1.0, measured_gib=1.0, peak_error=0.0, step_error=0.0,
                        host_error=0.0, predicted_host_gib=0.0, measured_host_gib=0.0,
                        predicted_phase="step", custom_ops_not_counted={}, depth={})
        return dict(tokens_per_s=100.0, tflops_per_device=1.0, mfu=None, step_s=1.0,
                    first_step_s=2.0, peak_mem_gib=None, sharding="fsdp2")
    monkeypatch.setattr(FakePending, "answer", staticmethod(answer))
    monkeypatch.setattr(decisive, "DECISIVE", ("autosp", "autosp-max", "not-a-recipe",
                                               "ulysses+alst"))
    gpu_args = argparse.Namespace(output=str(tmp_path), time_limit=120, smoke=True,
                                  sections="plan_vs_measured,throughput,optimizer")
    rows = report.run(gpu_args)["rows"]
    got = [(r["section"], r["check"].split()[0], r["status"]) for r in rows]
    assert got == [("env", "torch", "ok"),
                   ("plan_vs_measured", "autosp", "ok"),
                   ("plan_vs_measured", "autosp-max", "FAIL"),
                   ("plan_vs_measured", "not-a-recipe", "skipped"),
                   ("plan_vs_measured", "ulysses+alst", "ok"),
                   ("throughput", "autosp", "ok"),
                   ("throughput", "autosp-max", "FAIL"),
                   ("throughput", "not-a-recipe", "skipped"),
                   ("throughput", "ulysses+alst", "ok"),
                   ("optimizer", "build_optimizer", "ok")], got
    assert "not in this tree" in rows[3]["note"] and "boom" in rows[2]["note"]
    assert "FSDP2" in rows[1]["check"] and "FSDP2" not in rows[4]["check"]  # exact layouts
    # the plan cells run one at a time on 2 cores; each result is taken with the rows before
    # it on disk (the throughput workers all start before any result is taken)
    assert on_disk[1] == ["torch / device", "autosp S=256 SP=2 FSDP2"]
    assert on_disk[2][1:] == ["autosp S=256 SP=2 FSDP2", "autosp-max S=256 SP=2 FSDP2",
                              "not-a-recipe S=256 SP=2"]


def test_without_a_device_it_says_not_run(tmp_path, monkeypatch, capsys):
    """No CUDA device and no --smoke: nothing runs, the files say "not run", the exit status is
    2; a directory holding a GPU run's results is left as it is."""
    import sys
    sys.path.insert(0, os.path.join(ROOT, "tools"))
    try:
        import gpu_check
    finally:
        sys.path.remove(os.path.join(ROOT, "tools"))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    res = gpu_check.main(["--output", str(tmp_path)])
    assert res["not_run"].startswith("not run: no CUDA device") and res["rows"] == []
    assert "gpu_check.py: not run: no CUDA device" in capsys.readouterr().out
    assert json.loads((tmp_path / "gpu_check.json").read_text())["not_run"] == res["not_run"]
    assert "There are no GPU figures" in (tmp_path / "gpu_check.md").read_text()
    gpu_run = {"environment": {"cuda_available": True}, "rows": [{"check": "x"}]}
    (tmp_path / "gpu_check.json").write_text(json.dumps(gpu_run))
    gpu_check.main(["--output", str(tmp_path)])
    assert json.loads((tmp_path / "gpu_check.json").read_text()) == gpu_run
    with pytest.raises(SystemExit):
        gpu_check.main(["--sections", "plan_vs_measured,nope"])
    p = subprocess.run([sys.executable, os.path.join(ROOT, "tools", "gpu_check.py"), "--output",
                        str(tmp_path / "x"), "--time-limit", "1"], capture_output=True,
                       text=True, env=dict(os.environ, CUDA_VISIBLE_DEVICES=""), cwd=ROOT)
    assert p.returncode == 2 and "not run" in p.stdout, p.stderr[-2000:]


def test_worker_runs_the_named_worker(tmp_path, monkeypatch):
    monkeypatch.setitem(worker.WORKERS, "echo", lambda cell: {"got": cell["x"]})
    out = tmp_path / "out.json"
    worker.main([json.dumps({"worker": "echo", "x": 3}), str(out)])
    assert json.loads(out.read_text()) == {"got": 3}
    assert set(worker.WORKERS) == {"fsdp", "plan", "throughput", "autosp_kernels", "memory_plan",
                                   "echo"}


@pytest.mark.slow  # a worker process (imports torch): ~4 s
def test_a_real_worker_failure_is_its_error(tmp_path):
    """A worker process that raises: its error's last lines, one cell's FAIL."""
    res = common.run_worker({"worker": "no-such-worker-field", "world": "x"}, timeout=120)
    assert res["error"].startswith("exit 1: ") and "cell_s" in res, res
