"""The planner's calibration table (autosp_lm/planner/calibrate.py, tools/calibrate_planner.py):
each record's hardware reaches the planner, a failing record is its own row, and the table says
what each peer runs that the planner does not model."""
from __future__ import annotations

import dataclasses

import pytest

from autosp_lm.planner import calibrate as C


def test_records_name_their_sources_and_differences():
    keys = [r.key for r in C.RECORDS]
    assert len(set(keys)) == len(keys) and {"alst-8", "alst-32", "upipe-8", "alst-1"} <= set(keys)
    for r in C.RECORDS:
        assert r.source and r.published > 0 and r.recipe
        assert r.differences or r.gap, r.key  # a ratio off 1 must be explained, not fitted
    with pytest.raises(KeyError, match="choose from"):
        C.record("zero-infinity")


def test_the_peers_host_memory_is_shared_by_the_gpus_of_a_node():
    layout = C.layout_of(C.record("alst-8"))  # ALST's nodes: about 1.9 TB of host memory
    assert layout.world == 8 and layout.fsdp2 and layout.bf16 and layout.device == "cuda"
    assert abs(layout.host_bytes - 1.9e12 / 8) < 1e3
    assert C.layout_of(C.record("alst-32")).host_bytes == layout.host_bytes  # per GPU, 4 nodes


def test_a_failing_record_is_its_own_row_and_the_table_says_so():
    bad = dataclasses.replace(C.record("alst-8"), key="bad", recipe="no-such-recipe")
    lines = []
    row = C.calibrate_one(bad, reserve_gb=4, log=lines.append)
    assert row.predicted == 0 and row.ratio is None and "no-such-recipe" in row.error
    assert lines and lines[0].startswith("bad: predicted 0 tokens")
    ok = C.Row(C.record("alst-8"), predicted=2_775_000, seconds=1.0)
    assert ok.ratio == pytest.approx(0.75)
    md = C.markdown([ok, row], {"command": "calibrate", "date": "today", "torch": "x",
                                "cpu_count": 2, "reserve_gb": 4})
    assert "| alst-8 (ALST) | llama-3.1-8b, 8 x H100 | `ulysses+alst` | 3,700,000 | 2,775,000 " \
           "| 0.750 |" in md
    assert "| bad (ALST) |" in md and "| error |" in md and "The planner failed" in md
    assert md.count("The peer runs, the planner does not model:") >= 4
