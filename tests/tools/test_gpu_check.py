"""tools/gpu_check.py on CPU (--smoke): every section runs its real code on tiny shapes and the
table and JSON are written. GPU figures come only from a GPU (docs/bench/)."""
import json
import os
import sys

import pytest
import torch

from autosp_lm.bench.gpu.report import table

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "tools"))
import gpu_check  # noqa: E402


@pytest.mark.slow  # every section's real code on CPU: 4-6 minutes on 2 cores (pytest -m slow)
def test_smoke_run_writes_the_table(tmp_path):
    res = gpu_check.main(["--smoke", "--output", str(tmp_path), "--time-limit", "900"])
    rows = res["rows"]
    assert not [r for r in rows if r["status"] == "FAIL"], table(rows)
    sections = {r["section"] for r in rows if r["status"] == "ok"}
    assert {"env", "attention_output_once", "attention_workspace", "ring_kernels", "optimizer",
            "plan_vs_measured", "peak_memory", "simulated_sp"} <= sections, table(rows)
    peaks = [r for r in rows if r["section"] == "peak_memory" and r["status"] == "ok"]
    assert len(peaks) == 2 and all(r["peak_live_gib"] > 0 for r in peaks), table(rows)
    plan = [r for r in rows if r["section"] == "plan_vs_measured"]
    assert len(plan) == 2 and all(r["status"] == "ok" and r["predicted_gib"] > 0 for r in plan), \
        table(rows)  # the planner vs the measured peak (CPU: LivePeak, exact)
    assert any("FSDP2" in r["check"] for r in plan), table(rows)  # graph FSDP traced
    fits = [r for r in rows if r["check"].endswith("longest sequence that fits")]
    assert len(fits) == 2 and all(r["max_fit"] >= 256 for r in fits)
    data = json.loads((tmp_path / "gpu_check.json").read_text())
    assert data["smoke"] is True and data["environment"]["torch"] == torch.__version__
    assert "smoke run: no GPU figures" in (tmp_path / "gpu_check.md").read_text()


def test_recipes_section_smoke(tmp_path):
    """The hand-written strategies' memory techniques on the device path's harness (CPU here):
    offload without the tiled MLP equals full recomputation bit for bit, and reports host bytes."""
    res = gpu_check.main(["--smoke", "--sections", "recipes", "--output", str(tmp_path)])
    rows = [r for r in res["rows"] if r["section"] == "recipes"]
    assert len(rows) == 4 and all(r["status"] == "ok" for r in rows), table(rows)
    host = {r["check"].split(",")[0]: r["host_mib"] for r in rows}
    assert host["keep everything"] == host["ac"] == 0 < host["ac + offload"] == host["alst"]
