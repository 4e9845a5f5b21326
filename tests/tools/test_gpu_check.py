"""tools/gpu_check.py on CPU (--smoke): every section runs its real code on tiny shapes, the
decisive cells first, and the table and JSON are on disk after every cell. GPU figures come only
from a GPU (docs/bench/)."""
import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from autosp_lm.bench.gpu.decisive import DECISIVE
from autosp_lm.bench.gpu.report import table

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "tools"))
import gpu_check  # noqa: E402


@pytest.mark.slow  # every section's real code on CPU: 23 min on 2 cores at a load of ~7 (-m slow)
def test_smoke_run_writes_the_table(tmp_path):
    res = gpu_check.main(["--smoke", "--output", str(tmp_path), "--time-limit", "1500"])
    rows = res["rows"]
    assert not [r for r in rows if r["status"] == "FAIL"], table(rows)
    sections = [r["section"] for r in rows]
    # the decisive cells first: the planner against the measurement, then tokens/s, each in
    # DECISIVE's order (a recipe not in this tree skipped in its place)
    assert sections[1:2 * len(DECISIVE) + 1] == ["plan_vs_measured"] * len(DECISIVE) \
        + ["throughput"] * len(DECISIVE), table(rows)
    for section in ("plan_vs_measured", "throughput"):
        names = [r["check"].split()[0] for r in rows if r["section"] == section]
        assert names == list(DECISIVE), table(rows)
    plan = [r for r in rows if r["section"] == "plan_vs_measured" and r["status"] == "ok"]
    assert len(plan) >= 5 and all(r["predicted_gib"] > 0 for r in plan), table(rows)
    assert all(abs(r["step_error"]) <= 0.1 for r in plan), table(rows)
    assert {"env", "attention_output_once", "attention_workspace", "ring_kernels",
            "autosp_kernels", "optimizer",
            "recipes", "peak_memory", "simulated_sp", "throughput"} \
        <= {r["section"] for r in rows if r["status"] == "ok"}, table(rows)
    peaks = [r for r in rows if r["section"] == "peak_memory" and r["status"] == "ok"]
    assert len(peaks) == 2 and all(r["peak_live_gib"] > 0 for r in peaks), table(rows)
    data = json.loads((tmp_path / "gpu_check.json").read_text())
    assert data["smoke"] is True and data["complete"] is True
    assert data["environment"]["torch"] == torch.__version__
    assert "smoke run: no GPU figures" in (tmp_path / "gpu_check.md").read_text()


@pytest.mark.slow  # one plan cell on CPU, then the run is stopped: ~1-2 minutes on 2 cores
def test_a_killed_run_keeps_the_cells_it_finished(tmp_path):
    """SIGTERM (a `timeout`) while a cell runs: the files hold the cells finished before, say
    the run is incomplete and where it stopped, and no worker process outlives the run."""
    p = subprocess.Popen([sys.executable, os.path.join(ROOT, "tools", "gpu_check.py"), "--smoke",
                          "--sections", "plan_vs_measured,throughput", "--output",
                          str(tmp_path)], cwd=ROOT, env=dict(os.environ, PYTHONPATH=ROOT),
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    path = tmp_path / "gpu_check.json"
    rows = []
    try:
        t0 = time.time()
        while time.time() - t0 < 600 and p.poll() is None:
            time.sleep(1)
            if path.exists():
                rows = json.loads(path.read_text())["rows"]
                if len(rows) >= 2:  # the environment and the first decisive cell
                    break
        assert len(rows) >= 2, p.communicate()[0][-3000:] if p.poll() is not None else rows
        children = subprocess.run(["pgrep", "-P", str(p.pid)], capture_output=True,
                                  text=True).stdout.split()
        p.send_signal(signal.SIGTERM)
        out = p.communicate(timeout=120)[0]
    finally:
        if p.poll() is None:
            p.kill()
    data = json.loads(path.read_text())
    assert data["complete"] is False and data["stopped"] == "stopped by signal SIGTERM", out
    assert [r["check"] for r in data["rows"][:2]] == [r["check"] for r in rows[:2]]
    assert data["rows"][1]["section"] == "plan_vs_measured"
    assert "**Incomplete**" in (tmp_path / "gpu_check.md").read_text()
    time.sleep(1)
    alive = [c for c in children if os.path.exists(f"/proc/{c}")
             and "autosp_lm.bench.gpu.worker" in open(f"/proc/{c}/cmdline").read()]
    assert not alive, alive


def test_recipes_section_smoke(tmp_path):
    """The hand-written strategies' memory techniques on the device path's harness (CPU here):
    offload without the tiled MLP equals full recomputation bit for bit, and reports host bytes."""
    res = gpu_check.main(["--smoke", "--sections", "recipes", "--output", str(tmp_path)])
    rows = [r for r in res["rows"] if r["section"] == "recipes"]
    assert len(rows) == 4 and all(r["status"] == "ok" for r in rows), table(rows)
    host = {r["check"].split(",")[0]: r["host_mib"] for r in rows}
    assert host["keep everything"] == host["ac"] == 0 < host["ac + offload"] == host["alst"]


@pytest.mark.slow  # the default suite has the choice's own tests (tests/compiler/test_memory_plan.py)
def test_memory_plan_section_smoke(tmp_path):
    """The memory-plan cell's real code on CPU: two budgets, each a plan chosen and its measured
    peak within the budget."""
    res = gpu_check.main(["--smoke", "--sections", "memory_plan", "--output", str(tmp_path)])
    rows = [r for r in res["rows"] if r["section"] == "memory_plan"]
    assert [r["check"] for r in rows] == ["default budget", "a quarter of it"], table(rows)
    assert all(r["status"] == "ok" for r in rows), table(rows)
    assert all(r["measured_gib"] <= r["budget_gib"] for r in rows), table(rows)


@pytest.mark.slow  # ~15-20 s: the default suite has the CPU exactness tests (tests/compiler/test_kernels.py)
def test_autosp_kernels_section_smoke(tmp_path):
    """The kernel cell's real code on CPU (aot_eager, one rank of a 2-rank fake job): our llama
    under AutoSP with no fallback; flash_attn_func skipped without its package."""
    res = gpu_check.main(["--smoke", "--sections", "autosp_kernels", "--output", str(tmp_path)])
    rows = [r for r in res["rows"] if r["section"] == "autosp_kernels"]
    assert [r["check"] for r in rows] == ["llama-tiny (SDPA)", "flash_attn_func"], table(rows)
    assert rows[0]["status"] == "ok" and "fallbacks 0, all_gathers 0" in rows[0]["note"], \
        table(rows)
    assert rows[1]["status"] == ("skipped" if "not installed" in rows[1]["note"] else "ok"), \
        table(rows)
