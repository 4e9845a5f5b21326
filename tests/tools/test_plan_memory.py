"""The memory planner (tools/plan_memory.py, autosp_lm/planner/): it allocates no parameter
memory, its prediction equals the measured live-memory peak of the same real step, and the
longest length it finds grows with the GPU memory. The full CPU validation table is
``tools/plan_memory.py --validate`` (docs/bench/plan_memory_cpu.md)."""
from __future__ import annotations

import pytest
import torch

from autosp_lm.planner.check import TOLERANCE, measure_step
from autosp_lm.planner.plan import GiB, Layout, predict, search_max, trace_step
from autosp_lm.planner.trace import model_config, sac_device_for
from autosp_lm.training.memory import peak_rss_delta


@pytest.fixture(scope="module")
def tiny():
    """The ``none`` strategy's trace (its graphs have no custom op whose body must run at every
    length: cheap to evaluate at many lengths), shared by the default-suite tests."""
    cfg = model_config("llama-tiny", {"num_layers": 1})
    return cfg, trace_step("none", cfg, 2, 2048)


@pytest.mark.slow  # ~35 s: the biggest single part of this file (pytest -m slow)
def test_8b_preset_allocates_no_parameters():
    """Llama-3.1-8B's vocabulary matrices and one block hold 1.3 G parameters (5 GB in fp32):
    the planner traces them on fake tensors, its resident set grows far less."""
    cfg = model_config("llama-3.1-8b", {"num_layers": 1})
    traced, grown = peak_rss_delta(trace_step, "ulysses", cfg, 2, 4096)
    r = predict(traced, 4096, Layout(world=2))
    assert r["breakdown"]["parameters"] > 5e9  # what it would have allocated
    if grown is not None:
        assert grown < 1.5e9, f"the planner grew by {grown / 1e9:.2f} GB"
    assert r["step_live_peak_bytes"] > 0 and r["peak_bytes"] > r["static_bytes"]


@pytest.mark.slow  # the default suite measures the same simulation against real steps of the
# ALST recipe, graph FSDP, AutoSP in bf16 and the offloads (below and test_plan_memory_*.py)
@pytest.mark.parametrize("name", ["none", "autosp"])
def test_prediction_equals_measured_peak(tiny, name):
    """Predicted (fake trace, no memory) vs measured (the same compiled step run for real on
    CPU, LivePeak around forward, backward, all-reduce and AdamW step), one rank of SP=2.
    AutoSP: its own trace and compile (~1 min); every strategy is in the CPU validation table
    (docs/bench/plan_memory_cpu.md)."""
    cfg, traced = tiny
    if name != "none":
        traced = trace_step(name, cfg, 2, 2048)
    pred = predict(traced, 2048, Layout(world=2, device="cpu"))
    meas = measure_step(name, cfg, 2, 2048)
    step = pred["peak_bytes"] - pred["static_bytes"]
    assert abs(step / meas["measured_step_peak_bytes"] - 1) <= TOLERANCE, (pred, meas)
    assert abs(pred["peak_bytes"] / meas["measured_peak_bytes"] - 1) <= TOLERANCE


@pytest.mark.slow  # FSDP2 compiles one graph per unit: not timed on an idle machine yet
def test_fsdp2_prediction_equals_measured_peak(tiny):
    """``--use-torch-fsdp2``: the unsharded trace plus the analytic FSDP term against a real step
    with the model state sharded by PyTorch FSDP2 over the 2 ranks (its all-gathers and
    reduce-scatters on the fake group), one rank measured with LivePeak."""
    cfg, traced = tiny
    pred = predict(traced, 2048, Layout(world=2, fsdp2=True, device="cpu"))
    meas = measure_step("none", cfg, 2, 2048, fsdp2=True)
    # the sharded state (parameters and AdamW's moments, 1/W each; FSDP2 pads its shards)
    assert abs(pred["static_bytes"] / meas["measured_start_bytes"] - 1) <= 0.02, (pred, meas)
    assert abs(pred["peak_bytes"] / meas["measured_peak_bytes"] - 1) <= TOLERANCE, (pred, meas)
    step = pred["peak_bytes"] - pred["static_bytes"]
    assert abs(step / meas["measured_step_peak_bytes"] - 1) <= TOLERANCE, (pred, meas)


# world 2: -m slow (world 4 shards over the dp x sp mesh with SP a sub-group: the general case)
@pytest.mark.parametrize("world", [pytest.param(2, marks=pytest.mark.slow), 4])
def test_graph_fsdp_prediction_equals_measured_peak(world):
    """AutoSP under ``--use-torch-fsdp2`` (graph FSDP) is traced with its parameters sharded over
    the job's ranks, so its gathers, the backward's re-gathers and the reduce-scatters are nodes
    of the captured graphs: the prediction is the measured step's peak (the analytic FSDP term,
    an upper bound kept for native FSDP2's hooks, over-predicted it by 6-10% on llama-tiny).
    World 4 with SP 2: the state sharded over the dp x sp mesh, the SP group a sub-group."""
    cfg = model_config("llama-tiny", {"num_layers": 1})
    layout = Layout(world=world, fsdp2=True, device="cpu")
    traced = trace_step("autosp", cfg, 2, 2048, layout=layout)
    assert traced.graph_fsdp_world == world
    assert traced.plan["sac_device"] == "cpu"  # priced as the measured CPU step runs
    gathers = [n for p in traced.partitions for g in (p.fw, p.bw) for n in g.graph.nodes
               if n.target is torch.ops._c10d_functional.all_gather_into_tensor.default]
    assert gathers, "the trace holds no parameter gather"
    pred = predict(traced, 2048, layout)
    assert "FSDP gathered parameters / gradient buffers" not in pred["breakdown"]
    meas = measure_step("autosp", cfg, 2, 2048, world=world, fsdp2=True)
    assert abs(pred["static_bytes"] / meas["measured_start_bytes"] - 1) <= 0.02, (pred, meas)
    step = pred["peak_bytes"] - pred["static_bytes"]
    assert abs(step / meas["measured_step_peak_bytes"] - 1) <= 0.005, (pred, meas)
    # a trace sharded over W ranks is not a plan for another layout
    with pytest.raises(ValueError, match="trace it again with this layout"):
        predict(traced, 2048, Layout(world=2 * world, fsdp2=True, device="cpu"))
    with pytest.raises(ValueError, match="trace it again with this layout"):
        predict(traced, 2048, Layout(world=world, device="cpu"))


def test_sac_is_priced_on_the_planned_device():
    """A plan for GPUs is SAC's plan on the GPU cost model, not the CPU's it is traced on: the
    preset follows the layout's device (H100 within a node, its cross-node link beyond 8 ranks),
    and ``sac_device`` overrides it."""
    assert sac_device_for("cuda", 8) == "h100-nvlink"
    assert sac_device_for("cuda", 16) == "h100-cross-node"
    assert sac_device_for("cpu", 16) == "cpu"
    cfg = model_config("llama-tiny", {"num_layers": 1})
    traced = trace_step("autosp", cfg, 2, 256, layout=Layout(world=2, device="cuda"),
                        depth=False)
    assert traced.plan["sac_device"] == "h100-nvlink"


@pytest.fixture(scope="module")
def recipes():
    """Traces (made on first use, shared) of plain ``ulysses`` and its memory recipes on a
    llama-tiny of 2 blocks (the fewest where one checkpoint's offload is prefetched while another
    runs; 3 blocks cost ~20 CPU s more, the planner is exact at either) with a wide MLP (ffn 512:
    the tiled MLP's saving shows), 512 tokens, SP 2: 256 local tokens, so the tiled MLP runs 4
    chunks of 64 (the hidden size)."""
    cfg = model_config("llama-tiny", {"num_layers": 2, "ffn_hidden_size": 512}, seq=512)
    layout = Layout(world=2, device="cpu")
    cache: dict = {}

    def get(name):
        if name not in cache:
            cache[name] = trace_step(name, cfg, 2, 512, layout=layout)
        return cache[name]
    return cfg, layout, get


# +ac: -m slow (as its bf16 check in tests/tools/test_plan_memory_bf16.py). +alst is +ac with the
# tiled MLP and the offload.
@pytest.mark.parametrize("name", [pytest.param("ulysses+ac", marks=pytest.mark.slow), "ulysses+alst"])
def test_recipe_prediction_equals_measured_peak(recipes, name):
    """Full recomputation + chunked loss (+ tiled MLP + the checkpoints' inputs in host memory):
    the prediction against the measured step. +alst is traced without its offload (it cannot be
    compiled) and the offload modelled; the measured program is the same compiled step with the
    checkpoints' saved inputs offloaded by AutoSP's offload ops (host buffers outside torch's
    allocator), one checkpoint prefetched. Exact to ~1 KB when written (the CPU flash kernel's
    row-sum block counted twice); the two simulation bugs the checkpointed graphs had (attention
    recomputed under an RNG wrapper counted as 0 bytes, saved tensors' bytes sent to the wrong
    backward inputs) were each ~3% of the step, so the tolerance is 1% of the step."""
    cfg, layout, get = recipes
    pred = predict(get(name), 512, layout)
    meas = measure_step(name, cfg, 2, 512)
    step = pred["peak_bytes"] - pred["static_bytes"]
    assert abs(step / meas["measured_step_peak_bytes"] - 1) <= 0.01, (pred, meas)
    assert abs(pred["peak_bytes"] / meas["measured_peak_bytes"] - 1) <= 0.05


def test_alst_host_bytes_are_the_checkpointed_inputs(recipes):
    """+alst's host bytes are exactly the checkpointed blocks' inputs (2 blocks x [256 tokens,
    64] fp32), and a host budget one byte under them does not fit. (+alst against plain Ulysses
    and +ac, two more traces: the next test, -m slow.)"""
    cfg, layout, get = recipes
    alst = predict(get("ulysses+alst"), 512, layout)
    assert alst["host_bytes"] == 2 * 256 * 64 * 4
    assert alst["fits_host"] and not predict(get("ulysses+alst"), 512, Layout(
        world=2, device="cpu", host_bytes=alst["host_bytes"] - 1))["fits_host"]


@pytest.mark.slow  # traces plain Ulysses and +ac (~25 CPU s); +alst alone: the test above
def test_recipes_lower_device_memory_alst_uses_host(recipes):
    """+ac predicts less device memory than plain Ulysses; +alst less than +ac, with its host
    bytes exactly the checkpointed blocks' inputs (2 blocks x [256 tokens, 64] fp32), which are
    no longer saved on the device."""
    cfg, layout, get = recipes
    plain, ac, alst = (predict(get(n), 512, layout) for n in ("ulysses", "ulysses+ac",
                                                             "ulysses+alst"))
    assert ac["peak_bytes"] < plain["peak_bytes"], (ac, plain)
    assert alst["peak_bytes"] < ac["peak_bytes"], (alst, ac)
    assert plain["host_bytes"] == ac["host_bytes"] == 0
    assert alst["host_bytes"] == 2 * 256 * 64 * 4
    assert alst["saved_activations_bytes"] < ac["saved_activations_bytes"]
    assert alst["fits_host"] and not predict(get("ulysses+alst"), 512, Layout(
        world=2, device="cpu", host_bytes=alst["host_bytes"] - 1))["fits_host"]


@pytest.mark.slow  # the traces of plain Ulysses and +ac (~25 CPU s), as the test above
def test_step_time_prices_recomputation(recipes):
    """The predicted step time (planner/timing.py) prices what each plan runs: full recomputation
    runs every block's forward again, attention included (under an RNG wrapper in the graphs),
    so +ac is slower than plain Ulysses, and its attention part is 4.5 / 3.5 of plain's (forward
    1 + recomputed 1 + backward 2.5, against 1 + 2.5). The attention part grows with the square
    of the length: from 512 to 4096 tokens the step grows more than 8x."""
    from autosp_lm.planner.plan import time_device
    cfg, layout, get = recipes
    plain, ac = get("ulysses"), get("ulysses+ac")
    dev = time_device(layout, 2)
    for L in (512, 4096):
        assert ac.step_time(L, dev) > plain.step_time(L, dev)
    quadratic = ac.times[dev.name].quadratic, plain.times[dev.name].quadratic
    assert quadratic[0] == pytest.approx(quadratic[1] * 4.5 / 3.5, rel=1e-6)
    assert plain.step_time(4096, dev) > 8 * plain.step_time(512, dev)
    assert predict(plain, 512, layout)["predicted_step_s"] == pytest.approx(
        plain.step_time(512, dev))


def test_longest_within_takes_the_longest_plan_inside_the_margin():
    """`--within-percent`: at each plan's longest length, the plans' predicted step times are
    compared with the fastest's; the answer is the longest length whose plan is inside."""
    from autosp_lm.planner.plan import longest_within

    class Plan:  # a trace's step time: seconds per token
        sp = 2

        def __init__(self, per_token):
            self.per_token = per_token

        def step_time(self, L, device):
            return self.per_token * L
    traces = {"fast": Plan(1.0), "mid": Plan(1.05), "slow": Plan(1.3)}
    results = [dict(strategy="fast", max_seq_length=100), dict(strategy="mid", max_seq_length=200),
               dict(strategy="slow", max_seq_length=300), dict(strategy="none", max_seq_length=0)]
    layout = Layout(world=2, device="cpu")
    w = longest_within(results, traces, layout, 10)
    assert (w["answer"]["strategy"], w["answer"]["seq_length"]) == ("mid", 200)
    assert w["answer"]["fastest"] == "fast" and w["answer"]["ratio"] == pytest.approx(1.05)
    assert longest_within(results, traces, layout, 40)["answer"]["strategy"] == "slow"
    assert longest_within(results[:1], traces, layout, 0)["answer"]["strategy"] == "fast"


def test_search_refuses_plans_over_the_host_budget(monkeypatch):
    """The longest length found respects the host budget as well as the device budget (on a
    stand-in prediction: device 1000 + L bytes, host 10 L bytes)."""
    import types

    from autosp_lm.planner import plan

    def fake_predict(traced, L, layout):
        host = 10 * L
        return {"peak_bytes": 1000 + L, "host_bytes": host,
                "fits_host": not layout.host_bytes or host <= layout.host_bytes}

    monkeypatch.setattr(plan, "predict", fake_predict)
    traced = types.SimpleNamespace(sp=2, zigzag=False, traced_seq=4096)
    free = search_max(traced, Layout(world=2), 1000 + 100_000)
    assert free == 99_968  # the device budget alone (multiples of 128)
    capped = search_max(traced, Layout(world=2, host_bytes=10 * 50_000), 1000 + 100_000)
    assert capped == 49_920 and 10 * (capped + 128) > 10 * 50_000


def test_max_seq_length_monotone_in_memory(tiny):
    """More memory never shortens the longest length found; lengths are multiples of 128 and
    of the SP size; a budget below the model state fits nothing. (On the ``none`` strategy's
    graphs, which have no custom op whose body must run at every length: cheap.)"""
    cfg, traced = tiny
    layout = Layout(world=2, device="cpu")
    found = [search_max(traced, layout, int(gb * GiB)) for gb in (0.0001, 0.05, 0.1, 0.2, 0.4)]
    assert found == sorted(found) and found[0] == 0 and found[-1] > found[1] > 0, found
    assert all(f % 128 == 0 and f % 2 == 0 for f in found)
    for f, gb in zip(found[1:], (0.05, 0.1, 0.2, 0.4)):
        assert predict(traced, f, layout)["peak_bytes"] <= gb * GiB
        assert predict(traced, f + 128, layout)["peak_bytes"] > gb * GiB


def test_tool_refuses_bad_flags():
    import os
    import sys
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    sys.path.insert(0, os.path.join(root, "tools"))
    try:
        import plan_memory
    finally:
        sys.path.remove(os.path.join(root, "tools"))
    with pytest.raises(SystemExit, match="choose a comma list of"):
        plan_memory.main(["--strategy", "zero3"])
    with pytest.raises(SystemExit, match="multiple of"):
        plan_memory.main(["--world-size", "6", "--sequence-parallel-size", "4"])
    torch._dynamo.reset()


@pytest.mark.parametrize("each", [False, True])
def test_validate_traces_once_or_at_every_length(monkeypatch, each):
    """``--validate-trace-each-length`` traces at every length (as the search's confirmation
    does); without it one trace at the shortest length serves the others. Stand-ins for the
    trace, the prediction and the measurement: what is checked is which trace each row uses."""
    import types

    from autosp_lm.planner import check
    traced_at = []

    def fake_trace(name, cfg, sp, seq, bf16=False, layout=None):
        traced_at.append(seq)
        return types.SimpleNamespace(traced_seq=seq)

    def fake_predict(traced, seq, layout):
        return {"peak_bytes": 100 + traced.traced_seq, "static_bytes": 10, "peak_phase": "bw"}

    monkeypatch.setattr(check, "trace_step", fake_trace)
    monkeypatch.setattr(check, "predict", fake_predict)
    monkeypatch.setattr(check, "measure_step", lambda *a, **k: {
        "measured_peak_bytes": 100 + a[3], "measured_step_peak_bytes": 90 + a[3]})
    rows = check.validate({"s": ("llama-tiny", {})}, ["autosp"], {"s": [512, 256]},
                          trace_each_length=each, log=lambda *a: None)
    assert traced_at == ([256, 512] if each else [256])
    assert [r["traced_seq"] for r in rows] == ([256, 512] if each else [256, 256])
    assert [r["error"] == 0 for r in rows] == [True, each]
    assert ("one trace per shape, strategy and length" in check.markdown(rows, {
        "command": "x", "date": "d", "torch": "t", "cpu_count": 2})) == each
