"""tools/benchmark_sp.py --curve with --curve-offload-fractions: the cells it asks for and the
table it writes (saved bytes on the device, offload's host copies apart). The cells themselves
are the harness of test_benchmark_tool.py; here they are stand-ins."""
from autosp_lm.bench import harness, launch, report

MiB = 2 ** 20


def test_curve_offload_points_and_device_bytes(tmp_path, monkeypatch):
    asked = []

    def fake_cell(cell, timeout):
        asked.append(cell)
        off = bool(cell.get("offload")) or cell["strategy"] == "autosp-offload"
        saved, host = (44 * MiB, 0) if cell["strategy"] == "autosp-nosac" else (3 * MiB, MiB if off else 0)
        return dict(status="ok", step_time_s=1.0, peak_live_bytes=13 * MiB, saved_bytes=saved,
                    saved_bytes_per_token=saved / 4096, saved_host_bytes=host,
                    saved_device_bytes=saved - host, saved_device_bytes_per_token=(saved - host) / 4096)

    monkeypatch.setattr(launch, "launch_cell", fake_cell)
    monkeypatch.setattr(harness, "tqdm_write", lambda msg: None)
    rows = harness.run_curve({"model": "llama-tiny"}, 8192, [0.1], 60, (0.05,))
    assert [r["point"] for r in rows] == ["autosp-nosac", "ulysses", "autosp-keepcomm", "autosp",
                                         "autosp-offload", "target 0.1", "offload, target 0.05"]
    last = asked[-1]
    assert last["strategy"] == "autosp" and last["offload"] is True
    assert last["sac_memory_target"] == 0.05 * 44 * MiB
    assert "offload" not in asked[-2] and asked[-2]["sac_memory_target"] == 0.1 * 44 * MiB
    env = {"model": "llama-tiny", "device": "cpu", "nproc": 2, "flags": {"bf16": True},
           "torch": "x", "cpu_count": 2, "date": "today", "steps": 1}
    report.write_curve(str(tmp_path), {8192: rows}, env)
    md = (tmp_path / "curve.md").read_text()
    assert "llama-tiny, cpu, 2 ranks, bf16" in md
    # the device column excludes the host copies: 3 MiB saved, 1 MiB of it offloaded
    assert "| offload, target 0.05 | 2.0 | 512 | 13.0 | 1.000 | 1.000 |" in md
    assert "| autosp | 3.0 | 768 |" in md
    assert "In host memory (offloaded): autosp-offload 1.0 MiB; offload, target 0.05 1.0 MiB." in md
