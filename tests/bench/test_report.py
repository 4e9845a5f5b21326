"""The benchmark's written results (autosp_lm/bench/report.py, steps.py): the strategy table's
rows and ratios, the notes under it, the JSON."""
import json

import torch

from autosp_lm.bench import report
from autosp_lm.bench.steps import mock_batch

ENV = {"model": "llama-tiny", "device": "cpu", "nproc": 2, "torch": "x", "cpu_count": 2,
       "machine": "m", "steps": 3, "flags": {"interleave": True}}


def _row(strategy, t, saved, live, loss=6.0, **kw):
    return dict(strategy=strategy, seq_length=64, sp=2, status="ok", step_time_s=t,
                tokens_per_s=64 / t if t else None, tflops_per_device=0.00123,
                saved_bytes_per_token=saved, peak_mem_bytes=3 * 2**20,
                peak_live_bytes=live * 2**20, loss=loss, compile_time_s=1.26, **kw)


def test_strategy_table_rows_and_ratios(tmp_path):
    results = [_row("ulysses", 0.5, 100.0, 8.0),
               _row("autosp", 0.55, 25.0, 2.0, loss=6.1, loss_mismatch=True,
                    paired_ratio=1.1, paired_ref="ulysses", cpu_paired_ratio=1.05),
               _row("ring", None, 50.0, 4.0, timing_error="job died"),
               dict(strategy="none", seq_length=64, status="failed", error="E" * 100)]
    path = tmp_path / "results.md"
    report.write_markdown(str(path), results, ENV,
                          {"autosp": {"max_seq_length": 4096, "method": "search"},
                           "ring": {"max_seq_length": None, "method": "fit", "reason": "why"}})
    lines = path.read_text().splitlines()
    assert lines[0] == "# Strategy comparison: llama-tiny, cpu, 2 ranks"
    assert "Step times interleaved (--interleave)" in lines[2]
    assert lines[4].endswith("| time vs ulysses | saved B/token vs ulysses | peak live vs ulysses |")
    rows = {line.split("|")[1].strip(): line for line in lines
            if line.startswith("| ") and line.split("|")[2].strip() == "64"}
    assert rows["ulysses"] == ("| ulysses | 64 | 2 | 0.5000 | 128 | 0.0012 | 100 | 3.0 | 8.0 | "
                               "6.000000 | 1.3 | 1.000 | 1.000 | 1.000 |")
    assert rows["autosp"] == ("| autosp | 64 | 2 | 0.5500 | 116 | 0.0012 | 25 | 3.0 | 2.0 | "
                              "6.100000 (!) | 1.3 | 1.100 | 0.250 | 0.250 |")
    assert "| ring | 64 | 2 | - | - |" in rows["ring"] and rows["ring"].endswith("| - | 0.500 | 0.500 |")
    assert rows["none"] == "| none | 64 | - | failed: " + "E" * 80 + " |  |  |  |  |  |  |  |  |  |  |"
    text = "\n".join(lines)
    assert "| autosp | 4096 | search |" in text and "| ring | - (why) | fit |" in text
    assert "autosp@64 x1.100 of ulysses" in text and "autosp@64 x1.050" in text
    assert "Not timed (the interleaved job failed): ring@64: job died" in text
    assert "**Loss mismatch**" in text and text.rstrip().endswith(": autosp@64")


def test_json_and_format(tmp_path):
    report.write_json(str(tmp_path / "r.json"), results=[{"a": 1}], environment={}, max_context={})
    text = (tmp_path / "r.json").read_text()
    assert json.loads(text) == {"results": [{"a": 1}], "environment": {}, "max_context": {}}
    assert text.startswith('{\n "results"')  # indent 1, the keys in the order given
    assert report.fmt(None, ".3f") == "-" and report.fmt(0.12345, ".3f") == "0.123"


def test_mock_batch_stacks_the_first_samples():
    from autosp_lm.data.mock import MockGPTDataset
    batch = mock_batch(100, 16, 2, 5, torch.device("cpu"), keys=("input_ids", "position_ids"))
    data = MockGPTDataset(100, 16, 2, seed=5)
    assert set(batch) == {"input_ids", "position_ids"} and batch["input_ids"].shape == (2, 16)
    assert torch.equal(batch["input_ids"][1], data[1]["input_ids"])
    assert set(mock_batch(100, 16, 1, 0, "cpu")) == {"input_ids", "labels"}
