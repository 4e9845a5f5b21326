"""tools/long_context_goals.py: the goals table from benchmark JSON files (stand-in runs, in the
shapes tools/benchmark_sp.py writes them)."""
import json
import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "tools"))
import long_context_goals as goals  # noqa: E402

MiB = 2 ** 20


def row(strategy, saved, peaks, ratios=None, simulated=False, point=None, seq=8192):
    r = dict(strategy=strategy, seq_length=seq, status="ok", saved_bytes_per_token=saved,
             saved_device_bytes_per_token=saved, peak_live_bytes_ranks=peaks,
             simulated=simulated)
    if point:
        r["point"] = point
    if ratios is not None:
        r.update(timing="interleaved", paired_ref="autosp-nosac", paired_ratios=ratios)
    return r


def write(tmp_path, name, obj):
    path = tmp_path / name
    path.write_text(json.dumps(obj))
    return str(path)


def run_rows(specs):
    cells = goals.Cells()
    for s in specs:
        cells.load(s)
    return {(r["shape"], r["dtype"], r["seq"], r["point"]): r for r in goals.rows(cells)}


def env(bf16=False, **flags):
    return {"model": "llama-tiny", "flags": dict(model="llama-tiny", bf16=bf16, **flags)}


def test_ratios_verdicts_and_peaks_from_real_ranks(tmp_path):
    results = [row("autosp-nosac", 11000, [40 * MiB, 40 * MiB], [1.0] * 4),
               row("ulysses", 11000, [40 * MiB, 44 * MiB], [1.0, 1.01, 0.99, 1.0]),
               row("autosp-keepcomm", 2000, [30 * MiB, 30 * MiB], [1.02] * 4),
               # mean 1.045, s.e. 0.005: mean + s.e. = 1.05 -> met
               row("autosp", 900, [10 * MiB, 11 * MiB], [1.04, 1.05, 1.04, 1.05])]
    got = run_rows([write(tmp_path, "a.json", {"results": results, "environment": env()})])
    assert set(got) == {("llama-tiny", "fp32", 8192, "autosp")}  # references are not points
    r = got[("llama-tiny", "fp32", 8192, "autosp")]
    assert r["saved_ratio"] == pytest.approx(0.45)
    assert r["peak_ratio"] == pytest.approx(11 / 44)  # the larger rank of each
    med, mean, se, n = r["step"]
    assert (mean, n) == (pytest.approx(1.045), 4) and se == pytest.approx(0.0028868, rel=1e-4)
    assert (r["saved_verdict"], r["peak_verdict"], r["step_verdict"]) == ("met", "met", "met")
    assert r["keepcomm_step"][1] == pytest.approx(1.02)  # today's SAC's step, for comparison


def test_bound_missed_simulated_peaks_and_later_inputs_win(tmp_path):
    old = [row("autosp-nosac", 11000, [40 * MiB], simulated=True),
           row("ulysses", 11000, [40 * MiB], simulated=True),
           row("autosp-keepcomm", 2000, [30 * MiB], simulated=True),
           row("autosp", 1200, [21 * MiB], simulated=True)]
    a = write(tmp_path, "old.json", {"sim_x": {"results": old, "flags": dict(
        model="llama-tiny", bf16=True, model_overrides="hidden_size=512")}})
    got = run_rows([f"{a}#sim_x@label=wide"])
    r = got[("wide", "bf16", 8192, "autosp")]
    assert r["peak_tag"] == " sim" and r["peak_ratio"] == pytest.approx(21 / 40)
    assert (r["saved_verdict"], r["peak_verdict"], r["step"]) == ("missed", "missed", None)
    # a later interleaved run of the same cell: its step ratios and bytes replace nothing it
    # lacks (the simulated peaks stay usable), its own figures win
    new = [row("autosp-nosac", 11000, [40 * MiB], [1.0] * 3),
           row("autosp", 900, [12 * MiB], [1.06, 1.05, 1.04], point="autosp")]
    b = write(tmp_path, "new.json", {"results": new, "environment": env(
        bf16=True, model_overrides="hidden_size=512")})
    r = run_rows([f"{a}#sim_x@label=wide", f"{b}@label=wide"])[("wide", "bf16", 8192, "autosp")]
    assert r["saved_ratio"] == pytest.approx(0.45) and r["step_verdict"] == "at the bound"
    assert r["peak_tag"] == " sim"  # Ulysses ran simulated only: compare like with like


def test_curves_and_refusals(tmp_path):
    curve = [row("autosp-nosac", 11000, [40 * MiB], [1.0] * 2, point="autosp-nosac"),
             row("autosp", 1000, [12 * MiB], [1.2, 1.1], point="target 0.1"),
             row("autosp", 500, [12 * MiB], [1.0, 1.01], point="offload, target 0.05")]
    c = write(tmp_path, "c.json", {"curves": {"8192": curve}, "environment": env()})
    r = run_rows([c])[("llama-tiny", "fp32", 8192, "target 0.1")]
    assert r["step_verdict"] == "missed" and r["saved_ratio"] is None  # no keepcomm: no ratio
    assert run_rows([c])[("llama-tiny", "fp32", 8192, "offload, target 0.05")]["step_verdict"] \
        == "met"  # --curve-offload-fractions' points are points too
    bare = write(tmp_path, "bare.json", {"results": curve, "environment": {"model": "gpt-tiny"}})
    with pytest.raises(SystemExit, match="dtype"):
        run_rows([bare])
    assert ("gpt-tiny", "bf16", 8192, "target 0.1") in run_rows([f"{bare}@bf16=1"])
    with pytest.raises(SystemExit, match="no entry"):
        run_rows([f"{c}#nope"])
    with pytest.raises(SystemExit, match="annotation"):
        run_rows([f"{c}@colour=red"])
    out = tmp_path / "goals.md"
    assert goals.main([c, "--output", str(out)]) == 0
    assert "| llama-tiny | fp32 | 8192 | target 0.1 |" in out.read_text()
