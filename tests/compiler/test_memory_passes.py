"""Exactness of the memory passes (activation offload, sequence tiling) and the choices of the
communication-aware SAC cost model, on one CPU process.

AutoSP compiled without a process group runs the whole pass stack at SP size 1 (its
all-to-alls are identities, the graph has the same structure as at SP > 1), which makes these
checks cheap; parity at SP = 2 runs in test_autosp.py. Parity: the loss and every gradient
against the single-device eager model (1e-5 relative in fp32; the bf16 tolerances of
tests/training/test_bf16.py in bf16).
"""
from __future__ import annotations

import pytest
import torch

from autosp_lm.compiler import autosp_compile
from autosp_lm.compiler import offload as offload_ops
from autosp_lm.compiler.cost_model import (DEVICES, auto_device, collective_wire_bytes,
                                           device_params)
from autosp_lm.models import build_model, preset_config
from autosp_lm.strategies import extract_loss

TOL = 1e-5
U = 2.0 ** -8
GRAD_TOL_BF16, LOSS_TOL_BF16 = 4 * U, 1e-4  # as in tests/training/test_bf16.py


@pytest.fixture(autouse=True)
def _fresh():
    torch._dynamo.reset()
    offload_ops.reset()
    yield
    torch._dynamo.reset()
    offload_ops.reset()


def _setup(name, seq, layers=1):
    torch.manual_seed(0)
    model = build_model(preset_config(name, num_layers=layers))
    ids = torch.randint(0, model.config.vocab_size, (1, seq),
                        generator=torch.Generator().manual_seed(1))
    return model, ids


def _step(model, fn, ids, bf16=False):
    model.zero_grad(set_to_none=True)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
        loss = extract_loss(fn(input_ids=ids, labels=ids))
    loss.backward()
    return loss.detach().float(), {n: p.grad.detach().float().clone()
                                   for n, p in model.named_parameters()}


def _assert_parity(got, ref, grad_tol=TOL, loss_tol=TOL):
    (loss, grads), (ref_loss, ref_grads) = got, ref
    assert abs(loss - ref_loss) <= loss_tol * abs(ref_loss), (loss.item(), ref_loss.item())
    for n, g in ref_grads.items():
        err = ((grads[n] - g).norm() / g.norm().clamp_min(1e-30)).item()
        assert err <= grad_tol, f"{n}: relative error {err:.3g}"


def _compiled(model, **options):
    return autosp_compile(model, backend="aot_eager", verbose=False, **options)


def test_offload_and_tiling_exact_fp32():
    """Offload (every saved tensor of >= 16 KiB to host memory) and tiling (4 chunks) together:
    exact over two steps (the second reloads with prefetching from the first's order)."""
    model, ids = _setup("llama-tiny", 1024)
    ref = _step(model, model, ids)
    run = _compiled(model, offload_activations=True, offload_threshold=1 << 14,
                    tile_chunk_tokens=256)
    for _ in range(2):
        _assert_parity(_step(model, run, ids), ref)
    sac = run.report.sac
    assert sac.offloaded_bytes > 0 and "offloaded to host memory" in run.report.text()
    assert run.report.tiled_regions and all("in 4 chunks" in r for r in run.report.tiled_regions)
    assert run.sac_stats[-1]["partition_offloaded_bytes"] > 0  # host copies in the partition
    assert not offload_ops._host and not offload_ops._ready  # every copy was taken back


def test_tiling_exact_gpt_and_bf16():
    """Tiled MLP/norm regions of the GPT preset in fp32, and offload + tiling under bf16
    autocast (against the eager bf16 model)."""
    model, ids = _setup("gpt-tiny", 1024)
    ref = _step(model, model, ids)
    run = _compiled(model, tile_chunk_tokens=256)
    _assert_parity(_step(model, run, ids), ref)
    assert run.report.tiled_regions
    torch._dynamo.reset()
    model, ids = _setup("llama-tiny", 1024)
    ref = _step(model, model, ids, bf16=True)
    run = _compiled(model, offload_activations=True, offload_threshold=1 << 14,
                    tile_chunk_tokens=256)
    _assert_parity(_step(model, run, ids, bf16=True), ref, GRAD_TOL_BF16, LOSS_TOL_BF16)
    assert run.report.sac.offloaded_bytes > 0 and run.report.tiled_regions


def _tiled_inductor(name, bf16):
    from autosp_lm.compiler import tiling
    tiling._COMPILED.clear()
    model, ids = _setup(name, 1000, layers=2)
    ref = _step(model, model, ids, bf16=bf16)
    run = autosp_compile(model, verbose=False, tile_chunk_tokens=256)
    tols = (GRAD_TOL_BF16, LOSS_TOL_BF16) if bf16 else (TOL, TOL)
    for _ in range(2):
        _assert_parity(_step(model, run, ids, bf16=bf16), ref, *tols)
    assert len(run.report.tiled_regions) == 2  # one per layer
    # Both layers' regions ran Inductor code, compiled once for both (250-token chunks): the
    # no-grad forward, and the backward's joint program (recompute + gradients), under the
    # autocast state of the step.
    autocast = "bfloat16" if bf16 else ""
    (fwd,) = [k for k in tiling._COMPILED if k[0] != "backward"]
    (bwd,) = [k for k in tiling._COMPILED if k[0] == "backward"]
    assert fwd[1][0][0] == (1, 250, 64) and fwd[2] == autocast
    assert bwd[2][0][0] == (1, 250, 64) and bwd[4] == autocast


# An Inductor compile of the whole step (~1 CPU min with an empty Inductor cache): -m slow. The
# default suite compiles a region's chunks with Inductor in
# test_tiled_chunk_compilations_are_bounded, AutoSP on Inductor in bf16 in
# tests/training/test_bf16.py and --compile --sac on Inductor in tests/compiler/test_sac.py.
@pytest.mark.slow
def test_tiling_inductor_bf16():
    """Under the default backend (Inductor) a tiled region's chunks run Inductor-compiled code,
    shared by the layers' regions, exact under bf16 autocast (1000 tokens in 256-token chunks:
    the chunks are 250 tokens)."""
    _tiled_inductor("llama-tiny", True)


def test_tiled_chunk_compilations_are_bounded(monkeypatch):
    """A region graph gets at most MAX_COMPILED_PER_GRAPH compiled programs; chunk shapes beyond
    them (sequence lengths varying from step to step) run the region's graph eagerly; a region
    Inductor cannot compile runs eagerly with a warning instead of failing the step."""
    import torch.fx as fx
    from torch._inductor import compile_fx as inductor
    from autosp_lm.compiler import tiling

    def mlp(x, w):
        return (torch.nn.functional.gelu(x @ w),)
    region = tiling.Region(fx.symbolic_trace(mlp), [0, None], [0], [[None, 8]], [torch.float32],
                           compiled=True)
    monkeypatch.setattr(tiling, "_COMPILED", {})
    monkeypatch.setattr(tiling, "_PER_GRAPH", {})
    monkeypatch.setattr(tiling, "MAX_COMPILED_PER_GRAPH", 2)
    w = torch.randn(4, 8)
    with torch.no_grad():
        first = tiling._runner(region, [torch.randn(3, 4), w], "")
        again = tiling._runner(region, [torch.randn(3, 4), w], "")
        x = torch.randn(5, 4)
        torch.testing.assert_close(first(x[:3], w)[0], mlp(x[:3], w)[0])

        def broken(*a, **k):
            raise RuntimeError("no lowering")
        monkeypatch.setattr(inductor, "compile_fx", broken)
        with pytest.warns(UserWarning, match="could not be compiled by Inductor.*no lowering"):
            failed = tiling._runner(region, [torch.randn(4, 4), w], "")
        other = tiling._runner(region, [torch.randn(5, 4), w], "")  # over the bound: no compile
    assert first is not region.gm and again is first
    assert failed is region.gm and other is region.gm


@pytest.mark.slow  # another Inductor compile: pytest -m slow
def test_tiling_inductor_fp32():
    _tiled_inductor("gpt-tiny", False)


@pytest.mark.slow  # four compiles (about a minute on 2 cores): pytest -m slow
def test_cost_model_choices():
    """The default policy re-runs the q/k/v all-to-alls in the backward where that frees bytes
    cheaply; the never-communicate-twice flag and a link whose latency dwarfs the step keep
    every collective; a memory target of 0 recomputes beyond the budget. All exact."""
    model, ids = _setup("llama-tiny", 1024)
    ref = _step(model, model, ids)
    runs = {}
    for key, opts in {"default": {}, "never": {"sac_recommunicate": False},
                      "slow-link": {"sac_device": "cpu,link_latency=10"},
                      "target-0": {"sac_memory_target": 0}}.items():
        torch._dynamo.reset()
        runs[key] = _compiled(model, sequence_tiling=False, **opts)
        _assert_parity(_step(model, runs[key], ids), ref)
    s = {k: r.report.sac for k, r in runs.items()}
    assert s["default"].policy == "recommunicate" and s["default"].recommunicated
    assert set(s["default"].recommunicated) == {"all_to_all"}
    assert "re-communicated in the backward: all_to_all" in runs["default"].report.text()
    bwd = runs["default"].report.collectives_bwd["all_to_all"]
    assert bwd == runs["never"].report.collectives_bwd["all_to_all"] + len(s["default"].recommunicated)
    assert s["never"].policy == "never-recommunicate" and not s["never"].recommunicated
    assert "never re-communicated" in runs["never"].report.text()
    assert not s["slow-link"].recommunicated
    assert s["default"].saved_bytes < s["never"].saved_bytes
    assert s["target-0"].memory_target == 0
    assert s["target-0"].saved_bytes <= s["default"].saved_bytes
    assert s["target-0"].nodes_recomputed >= s["default"].nodes_recomputed


def test_device_parameters(monkeypatch):
    h100 = device_params("h100-nvlink")
    assert device_params("h100-nvlink,link_bw=2e11").link_bw == 2e11
    assert device_params(h100, host_bw=1.0).host_bw == 1.0
    assert device_params(None) is DEVICES["cpu"] and auto_device("cpu") is DEVICES["cpu"]
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")  # an SP group of 16 spans two nodes
    assert auto_device(torch.device("cuda", 0), world=16).name == "h100-cross-node"
    with pytest.raises(ValueError, match="presets: cpu"):
        device_params("a100")
    with pytest.raises(ValueError, match="unknown device parameter"):
        device_params("cpu,flops=1")
    with pytest.raises(ValueError, match="key=value"):
        device_params("cpu,link_bw")
    # one rank sends (P-1)/P of an all-to-all's output, twice that of an all-reduce's input
    assert collective_wire_bytes("all_to_all", 8, 8, 2) == 4
    assert collective_wire_bytes("all_reduce", 8, 8, 4) == 12
    assert collective_wire_bytes("all_to_all", 8, 8, 1) == 0


# budget 0.1: -m slow (0.05 puts the peak where the frees after last use decide it)
@pytest.mark.parametrize("budget", [0.05, pytest.param(0.1, marks=pytest.mark.slow)])
def test_liveness_simulation_equals_measured_peak(budget):
    """simulate_step on the partitioned graphs predicts the measured live-tensor peak of the
    step they run (aot_eager: op by op) to within a few bytes (the scalar loss's rounding). At
    budget 0.05 the peak sits in the last MLP's backward, after the loss head's saved
    log-softmax was last read: it is only met if the backward frees its inputs after their last
    use (a compiler that ran ``gm(*args)`` kept them all, 672516 B over)."""
    from torch._dynamo.backends.common import aot_autograd

    from autosp_lm.planner.liveness import simulate_step
    from autosp_lm.compiler.passes.sac import sac_partition_fn
    from autosp_lm.compiler.aot import boxed_nop
    from autosp_lm.training.memory import LivePeak
    model, ids = _setup("llama-tiny", 512, layers=2)
    captured = {}
    inner = sac_partition_fn(budget)

    def partition(joint, inputs, *, num_fwd_outputs, **kw):
        fw, bw = inner(joint, inputs, num_fwd_outputs=num_fwd_outputs, **kw)
        captured.update(fw=fw, bw=bw, n=num_fwd_outputs)
        return fw, bw

    f = torch.compile(model, backend=aot_autograd(fw_compiler=boxed_nop, bw_compiler=boxed_nop,
                                                  partition_fn=partition))
    f(ids, labels=ids).backward()
    model.zero_grad(set_to_none=True)
    with LivePeak() as measured:
        f(ids, labels=ids).backward()
    sim = simulate_step(captured["fw"], captured["bw"], captured["n"])
    assert abs(sim.peak - measured.peak) <= 64, (sim, measured.peak)
    assert 0 < sim.saved < sim.peak and sim.peak_phase in ("forward", "backward")


def test_liveness_frees_each_output_of_a_multi_output_op_on_its_own():
    """The outputs of one op (attention's output and its logsumexp; here sort's values and
    indices) are separate storages with separate lifetimes: the values die at their last read
    while the indices live on. Simulating them as one block over-predicted AutoSP's step by the
    head-layout attention outputs it no longer keeps (1 MiB per 4K tokens on llama-tiny)."""
    from torch.fx.experimental.proxy_tensor import make_fx

    from autosp_lm.planner.liveness import simulate_graph
    from autosp_lm.training.memory import LivePeak

    def f(x):
        values, indices = torch.ops.aten.sort.default(x, 1)
        total = values.sum()  # the last read of the values
        shifted = indices * 3  # allocated while the indices live, the values already freed
        return total, shifted

    x = torch.randn(64, 1024)
    gm = make_fx(f, tracing_mode="fake")(x)
    peak, at, _, _ = simulate_graph(gm)
    n = x.numel()
    assert peak == 8 * n + 8 * n + 4, (peak, at)  # indices + shifted + total, not the values
    with LivePeak() as measured:
        torch.fx.Interpreter(gm).boxed_run([x])
    assert abs(measured.peak - peak) <= 64, (measured.peak, peak)


def test_liveness_counts_split_pieces_as_views_of_their_input():
    """``split``'s outputs are views of its input, not storages of their own: the input lives
    until the last piece is read. Taking the pieces for storages freed the input at the split and
    each piece again at its last use (1.5 MiB too little live in AutoSP's backward at 8K tokens
    on llama-tiny, where the rotary halves of q and k are split)."""
    from torch.fx.experimental.proxy_tensor import make_fx

    from autosp_lm.planner.liveness import simulate_graph
    from autosp_lm.training.memory import LivePeak

    def f(x):
        y = x * 2  # the split's input: 4 n bytes, live until `late` is computed
        first, second = torch.ops.aten.split.Tensor(y, x.shape[1] // 2, 1)
        early = first.sum()  # the first piece's last read
        wide = x * 3  # allocated while the second piece (so all of y) is still live
        late = (second * wide[:, : x.shape[1] // 2]).sum()
        return early + late

    x = torch.randn(64, 1024)
    gm = make_fx(f, tracing_mode="fake")(x)
    peak, at, _, _ = simulate_graph(gm)
    n = x.numel()
    assert peak >= 4 * n + 4 * n + 4 * n // 2, (peak, at)  # y, wide and the product, all live
    with LivePeak() as measured:
        torch.fx.Interpreter(gm).boxed_run([x])
    assert abs(measured.peak - peak) <= 64, (measured.peak, peak)


def test_liveness_counts_a_collectives_wait_as_its_output():
    """``wait_tensor`` of a functional collective returns the collective's output itself (its
    schema declares no alias): one storage, not two. Counting the wait as an allocation put a
    second copy of every gathered parameter (graph FSDP) or all-to-all output live at the wait."""
    from torch.fx.experimental.proxy_tensor import make_fx

    from autosp_lm.planner.liveness import simulate_graph

    def f(x, big):
        a = big * 2  # live across the gather
        g = torch.ops._c10d_functional.all_gather_into_tensor(x, 2, "0")
        w = torch.ops._c10d_functional.wait_tensor(g)
        return a.sum() + w.sum()

    x, big = torch.randn(64, 1024), torch.randn(256, 1024)
    gm = make_fx(f, tracing_mode="fake")(x, big)
    peak, at, _, _ = simulate_graph(gm)
    gathered = 2 * x.numel() * 4
    assert big.numel() * 4 + gathered <= peak <= big.numel() * 4 + gathered + 64, (peak, at)
