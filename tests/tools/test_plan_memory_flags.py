"""tools/plan_memory.py's flags: every combination works or ends in one line naming the problem
and the fix, before any trace (the table), an error inside the planner is one line too, the
progress lines, and the JSON written before the plot (which needs matplotlib, an extra)."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "tools"))
try:
    import plan_memory  # noqa: E402
finally:
    sys.path.remove(os.path.join(ROOT, "tools"))

TINY = ["--model", "llama-tiny", "--world-size", "2", "--sequence-parallel-size", "2"]

#: (argv, the error's text): each refused before any trace or measurement
REFUSED = [
    (["--strategy", "zero3"], "unknown strategy 'zero3'; choose a comma list of"),
    (["--strategy", ","], "unknown strategy"),
    (["--strategy", "autosp,ulysses,autosp"], "names autosp more than once"),
    (["--world-size", "6", "--sequence-parallel-size", "4"],
     "multiple of --sequence-parallel-size 4"),
    (TINY[:2] + ["--strategy", "ulysses+ac", "--seq-length", "1024"],
     "--ulysses: 4 query heads and 2 key/value heads cannot be split over sequence-parallel "
     "size 8"),
    (TINY[:2] + ["--find-max-seq-length", "--strategy", "ulysses", "--sp-sizes", "2,8"],
     "--strategy ulysses at SP 8"),
    (["--world-size", "0"], "--world-size 0 must be a positive integer"),
    # the flags shared with pretrain.py refuse in its words (config/shared_flags.py)
    (["--sequence-parallel-size", "-2"], "--sequence-parallel-size/--context-parallel-size: "
                                         "must be a positive integer, got -2"),
    (["--seq-length", "-5"], "argument --seq-length: must be a positive integer, got -5"),
    (["--seq-length", "1004"], "--seq-length 1004 must be a multiple of 8"),
    (["--strategy", "ring+ac", "--seq-length", "8200"], "multiple of 16"),
    (["--gpu-memory-gb", "0"], "--gpu-memory-gb 0 must be a positive number"),
    (["--gpu-memory-gb", "-80"], "--gpu-memory-gb -80 must be a positive"),
    (["--gpu-memory-gb", "nan"], "--gpu-memory-gb nan must be a positive"),
    (["--gpu-memory-gb", "3"], "--reserve-gb 4 leaves nothing of --gpu-memory-gb 3"),
    (["--reserve-gb", "-1"], "--reserve-gb -1 must be a non-negative"),
    (["--host-memory-gb", "-1"], "--host-memory-gb -1 must be a non-negative"),
    (["--find-max-seq-length", "--within-percent", "-5"], "--within-percent -5"),
    (["--within-percent", "5"], "only apply to --find-max-seq-length"),
    (["--sp-sizes", "2,4"], "only apply to --find-max-seq-length"),
    (["--no-confirm"], "only apply to --find-max-seq-length"),
    (["--find-max-seq-length", "--sp-sizes", "3"], "positive divisor of --world-size 8"),
    (["--find-max-seq-length", "--sp-sizes", "2,16"], "16 is not"),
    (["--find-max-seq-length", "--sp-sizes", "0"], "0 is not"),
    (["--find-max-seq-length", "--sp-sizes", "two"], "comma list of integers"),
    (["--validate", "--find-max-seq-length"], "choose one"),
    (["--validate", "--model", "llama-3.2-1b"], "does not read --model"),
    (["--validate", "--offload-activations", "--seq-length", "4096"],
     "does not read --seq-length, --offload-activations"),
    (["--validate", "--gpu-memory-gb", "40", "--device", "cpu"],
     "does not read --gpu-memory-gb, --device"),
    (["--validate", "--check-depth"], "does not read --check-depth"),
    (["--validate", "--validate-shapes", "llama-huge"], "unknown shape llama-huge"),
    (["--validate", "--validate-shapes", "llama-tiny", "--validate-lengths", "llama-wide=4096"],
     "no length for llama-tiny"),
    (["--validate", "--validate-lengths", "llama-tiny=4k"], "shape=L1:L2"),
    (["--validate", "--validate-lengths", "llama-tiny"], "shape=L1:L2"),
    (["--validate-shapes", "llama-tiny"], "only apply to --validate"),
    (["--validate-trace-each-length"], "only apply to --validate"),
    (["--no-depth-extrapolation", "--check-depth"], "drop one"),
    (["--offload-activations", "--strategy", "autosp,ulysses+ac"],
     "ulysses+ac has none"),
    (["--offload-activations", "--strategy", "ulysses+alst"],
     "ulysses+alst has none: drop the flag, or plan ring+alst, ulysses+alst"),
    (["--offload-activations", "--strategy", "autosp-nosac"], "plan autosp or autosp-max-offload"),
    (["--sac-device", "tpu-v9"], "--sac-device"),
    (["--model", "llama-99b"], "argument --model: invalid choice: 'llama-99b'"),
    (["--model-overrides", "num_layers"], "must be key=value"),
    (["--model-overrides", "num_layer=2"], "unknown key num_layer"),
    (["--model-overrides", "hidden_size=100,num_attention_heads=3"], "not divisible"),
    (["--model-overrides", "num_layers=0"], "--num-layers must be positive"),
    (["--output", "/"], "is a directory"),
    (["--seq-length", "4k"], "argument --seq-length: expected an integer, got '4k'"),
    (["--device", "tpu"], "invalid choice: 'tpu'"),
    (["--no-such-flag"], "unrecognized arguments: --no-such-flag"),
]


@pytest.fixture
def no_trace(monkeypatch):
    """Any trace, search or measurement fails the test: the errors must come first."""
    from autosp_lm.planner import check, plan

    def traced(*a, **k):
        raise AssertionError("the tool traced before refusing its flags")
    for mod, name in ((plan, "trace_step"), (plan, "find_max_seq_length"), (check, "validate")):
        monkeypatch.setattr(mod, name, traced)


@pytest.mark.parametrize("argv,text", REFUSED, ids=[" ".join(a) for a, _ in REFUSED])
def test_refused_in_one_line(no_trace, argv, text):
    with pytest.raises(SystemExit) as e:
        plan_memory.main(argv)
    msg = str(e.value.code)
    assert msg.startswith("plan_memory.py: ") and "\n" not in msg, msg
    assert text in msg, msg


#: (argv, what the planner is then called with): combinations that work
ACCEPTED = [
    (["--validate", "--use-torch-fsdp2", "--bf16", "--validate-shapes", "llama-tiny",
      "--validate-lengths", "llama-tiny=512"], {"fsdp2": True, "bf16": True}),
    (TINY + ["--device", "cpu", "--gpu-memory-gb", "8", "--seq-length", "512"],
     {"device": "cpu"}),
    (TINY + ["--strategy", "autosp-max-offload", "--offload-activations", "--seq-length", "512"],
     {"offload": True}),
    (TINY + ["--strategy", "autosp-max-offload", "--seq-length", "512", "--check-depth",
             "--sac-device", "h100-nvlink"], {"check_depth": True, "sac_device": "h100-nvlink"}),
    (["--model", "llama-tiny", "--world-size", "8", "--sequence-parallel-size", "4",
      "--find-max-seq-length", "--strategy", "autosp", "--within-percent", "0", "--no-confirm"],
     {"sp_sizes": [1, 2, 4]}),
]


@pytest.mark.parametrize("argv,expect", ACCEPTED, ids=[" ".join(a) for a, _ in ACCEPTED])
def test_accepted_combinations_reach_the_planner(monkeypatch, argv, expect):
    """Combinations that work pass the checks and reach the planner with their settings (the
    planner stands in: it records its arguments and stops the run)."""
    from autosp_lm.planner import check, plan
    calls = []

    class Reached(Exception):
        pass

    def record(*a, **k):
        calls.append(k)
        if "layout" in k:
            calls.append({"device": k["layout"].device})
        raise Reached()
    for mod, name in ((plan, "trace_step"), (check, "validate")):
        monkeypatch.setattr(mod, name, record)
    monkeypatch.setattr(plan_memory, "_sp_sizes", lambda args, fail, real=plan_memory._sp_sizes:
                        calls.append({"sp_sizes": real(args, fail)}) or real(args, fail))
    with pytest.raises(SystemExit, match="Reached"):
        plan_memory.main(argv + ["--quiet"])
    got = {k: v for c in calls for k, v in c.items()}
    assert {k: got.get(k) for k in expect} == expect, calls


def test_planner_errors_are_one_line(monkeypatch, capsys):
    """An error the checks do not foresee (here a stand-in trace that raises) is one line naming
    it; --debug gives the traceback."""
    from autosp_lm.planner import plan

    def broken(*a, **k):
        raise RuntimeError("memory plan: the graph\nhas two dynamic sizes")
    monkeypatch.setattr(plan, "trace_step", broken)
    argv = TINY + ["--seq-length", "512", "--quiet"]
    with pytest.raises(SystemExit, match=r"^plan_memory.py: RuntimeError: memory plan: the "
                                         r"graph has two dynamic sizes \(--debug prints the "
                                         r"traceback\)$"):
        plan_memory.main(argv)
    with pytest.raises(RuntimeError, match="two dynamic sizes"):
        plan_memory.main(argv + ["--debug"])


def test_search_writes_json_then_skips_the_plot_without_matplotlib(monkeypatch, tmp_path, capsys):
    """The search's JSON is complete before any plot, and without matplotlib (an extra) the tool
    says it skipped the plot instead of failing (stand-ins for the trace and the search); the
    progress lines name the strategy and SP size, on stderr."""
    from autosp_lm.planner import plan
    written = []

    def fake_search(name, cfg, sp, layout, budget, **kw):
        kw["progress"](f"{name} SP {sp}: a length tried")
        kw["keep"][name] = None
        return {"strategy": name, "sp": sp, "max_seq_length": 1024 * sp, "confirmed": True,
                "traces": []}
    monkeypatch.setattr(plan, "trace_step", lambda *a, **k: None)
    monkeypatch.setattr(plan, "find_max_seq_length", fake_search)
    monkeypatch.setattr(plan, "longest_within", lambda results, traces, layout, pct: {
        "percent": pct, "answer": None, "candidates": []})
    real_plot = plan_memory.plot

    def plot(path, results, title):
        written.append(json.loads((tmp_path / "max.json").read_text()))
        return real_plot(path, results, title)
    monkeypatch.setattr(plan_memory, "plot", plot)
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib: ImportError
    out = tmp_path / "max.json"
    plan_memory.main(TINY + ["--strategy", "autosp,ulysses+ac", "--find-max-seq-length",
                             "--output", str(out)])
    assert written and written[0]["complete"] is True
    assert [r["max_seq_length"] for r in written[0]["max_seq_length"]] == [1024, 1024, 2048, 2048]
    assert not (tmp_path / "max.png").exists()
    io = capsys.readouterr()
    assert "skipped the plot" in io.out and "matplotlib is not installed" in io.out
    assert "strategy 2 of 2: ulysses+ac, SP 2 (SP size 2 of 2)" in io.err
    assert all(line.startswith("[plan_memory ") for line in io.err.splitlines()), io.err
    plan_memory.main(TINY + ["--strategy", "autosp", "--find-max-seq-length", "--quiet",
                             "--output", str(out)])
    assert capsys.readouterr().err == ""


@pytest.mark.slow  # a real search on llama-tiny in a fresh process: 30 CPU-s (4 min at load 7)
def test_tiny_search_end_to_end_without_matplotlib(tmp_path):
    """A real run as a plain install has it (matplotlib absent): it plans, writes its JSON, says
    it skipped the plot, and its progress lines name each trace, the lengths tried and the time."""
    out = tmp_path / "max.json"
    code = ("import runpy, sys; sys.modules['matplotlib'] = None; sys.argv = sys.argv[1:]; "
            "runpy.run_path(sys.argv[0], run_name='__main__')")
    argv = [os.path.join(ROOT, "tools", "plan_memory.py"), *TINY, "--model-overrides",
            "num_layers=1", "--seq-length", "512", "--strategy", "autosp-max-offload",
            "--offload-activations", "--find-max-seq-length", "--gpu-memory-gb", "4.05",
            "--device", "cpu", "--sp-sizes", "2", "--output", str(out)]
    p = subprocess.run([sys.executable, "-c", code, *argv], capture_output=True, text=True,
                       cwd=ROOT, env=dict(os.environ, PYTHONPATH=ROOT), timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    assert "Traceback" not in p.stderr
    data = json.loads(out.read_text())
    assert data["complete"] and data["max_seq_length"][0]["max_seq_length"] > 0
    assert "skipped the plot" in p.stdout and not (tmp_path / "max.png").exists()
    assert "autosp-max-offload SP 2: trace 1 of 1 (all 1 blocks) at 512 tokens" in p.stderr
    assert " tokens: peak " in p.stderr and "fits" in p.stderr


@pytest.mark.parametrize("offload", [False, True])
def test_max_offload_with_offload_flag_builds(offload):
    """`--strategy autosp-max-offload --offload-activations` builds the strategy (it passed the
    offload option twice: a TypeError, fixed in planner/trace.py build_strategy_for), and the
    offload is on either way."""
    from autosp_lm.planner.trace import build_strategy_for, simulated_world
    with simulated_world(2):
        strategy, _ = build_strategy_for("autosp-max-offload", 2, store=[], offload=offload)
    opts = strategy.options
    assert opts.offload_activations is True and opts.max_context is True, opts
