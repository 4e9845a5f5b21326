"""The GPU check's harness without its sections (autosp_lm/bench/gpu/common.py, report.py,
worker.py): rows, the table, the time shares of the workers, the JSON and Markdown written."""
import argparse
import json
import time

import torch

from autosp_lm.bench.gpu import common, report, worker
from autosp_lm.bench.gpu.common import Row


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


def test_run_cells_shares_the_time_left(monkeypatch):
    budgets = []

    def fake_worker(cell, timeout):
        budgets.append((cell["budget_s"], timeout))
        return {"error": "x" * 400} if cell["n"] == 1 else {"ok": cell["n"]}

    monkeypatch.setattr(common, "run_worker", fake_worker)
    rows = []
    stop = time.time() + 300
    cells = [(f"c{n}", {"n": n}) for n in range(3)]
    done = list(common.run_cells("s", cells, stop, rows, slack=10))
    assert [c for c, _ in done] == ["c0", "c2"]
    assert rows[0]["status"] == "FAIL" and len(rows[0]["note"]) == 300
    assert 85 < budgets[0][0] <= 90 and 285 < budgets[0][1] <= 295  # a third of 300 s, 10 less
    rows = []
    assert list(common.run_cells("s", cells, time.time() + 20, rows)) == []
    assert [r["status"] for r in rows] == ["skipped"] * 3 and rows[0]["note"] == "time limit"


def test_run_writes_json_and_markdown(tmp_path, monkeypatch, capsys):
    def good(args, deadline):
        return [Row("good", "a check", "ok", max_err=0.5)]

    def broken(args, deadline):
        raise ValueError("bad shape")

    monkeypatch.setattr(report, "SECTIONS", [("good", good), ("broken", broken),
                                             ("unwanted", broken)])
    args = argparse.Namespace(output=str(tmp_path), time_limit=60, smoke=True,
                              sections="good,broken")
    res = report.run(args)
    assert [(r["section"], r["status"]) for r in res["rows"]] == [
        ("env", "ok"), ("good", "ok"), ("broken", "FAIL")]
    assert res["rows"][2]["note"] == "ValueError: bad shape"
    data = json.loads((tmp_path / "gpu_check.json").read_text())
    assert data["smoke"] is True and data["rows"] == res["rows"]
    assert data["environment"]["torch"] == torch.__version__ and "apex" in data["environment"]
    md = (tmp_path / "gpu_check.md").read_text()
    assert md.startswith("GPU check, ") and "(smoke run: no GPU figures)" in md
    assert report.table(res["rows"]) in md and report.table(res["rows"]) in capsys.readouterr().out


def test_worker_runs_the_named_worker(tmp_path, monkeypatch):
    monkeypatch.setitem(worker.WORKERS, "echo", lambda cell: {"got": cell["x"]})
    out = tmp_path / "out.json"
    worker.main([json.dumps({"worker": "echo", "x": 3}), str(out)])
    assert json.loads(out.read_text()) == {"got": 3}
    assert set(worker.WORKERS) == {"fsdp", "plan", "echo"}
