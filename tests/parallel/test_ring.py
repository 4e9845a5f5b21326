"""Ring attention baseline: exact against one device at function level (float64, autograd of plain
attention) and at model level (loss and every gradient vs a single-device fp32 run), gloo 2/4 ranks."""
import math

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from autosp_lm.models import build_model, preset_config
from autosp_lm.parallel import ParallelState, slicing
from autosp_lm.parallel import ring
from autosp_lm.parallel.ring import RingAttention, ring_attention, ring_blocks
from autosp_lm.strategies.ring import RingStrategy
from tests.helpers.launch import Job
from tests.helpers.baseline_parity import check_parity, make_batch, parity_worker


# --------------------------------------------------------------------------------------------
# function level: ring attention (forward and its custom backward) vs autograd of SDPA
# --------------------------------------------------------------------------------------------
def function_check(rank, world, heads, kv_heads, causal, zigzag, kernel, compiled=False):
    torch.manual_seed(7)
    b, s, d = 2, 8 * world, 8
    dt = torch.float64
    q = torch.randn(b, heads, s, d, dtype=dt, requires_grad=True)
    k = torch.randn(b, kv_heads, s, d, dtype=dt, requires_grad=True)
    v = torch.randn(b, kv_heads, s, d, dtype=dt, requires_grad=True)
    grad = torch.randn(b, heads, s, d, dtype=dt)
    ref = F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=kv_heads != heads)
    (ref * grad).sum().backward()

    layout = slicing.ZIGZAG if zigzag else slicing.CONTIGUOUS
    local = lambda t: slicing.slice_sequence(t.detach(), world, rank, layout, dim=2)  # noqa: E731
    ql, kl, vl = (local(t).clone().requires_grad_(True) for t in (q, k, v))
    fn = ring_attention
    if compiled:
        fn = torch.compile(ring_attention, backend="aot_eager", fullgraph=True)
    out = fn(ql, kl, vl, causal=causal, group=dist.group.WORLD, zigzag=zigzag, kernel=kernel)
    (out * local(grad)).sum().backward()
    errs = [(a - local(e)).abs().max().item() / local(e).abs().max().item()
            for a, e in ((out, ref), (ql.grad, q.grad), (kl.grad, k.grad), (vl.grad, v.grad))]
    return max(errs)


FN_CONFIGS = [  # heads, kv heads, causal, zigzag, kernel
    (4, 4, True, True, "auto"),
    (4, 2, True, True, "auto"),
    (4, 1, True, True, "math"),
    (4, 2, False, True, "auto"),
    (4, 2, True, False, "auto"),
]


def ring_worker(rank, world, fn_configs, model_configs):
    errs = {str(c): function_check(rank, world, *c) for c in fn_configs}
    return errs, parity_worker(rank, world, "ring", model_configs)


P2 = Job("tests.parallel.test_ring:ring_worker", (FN_CONFIGS + [(4, 2, True, True, "auto", True)], [
    dict(name="gpt sp2", model="gpt-tiny", sp=2),
    dict(name="llama sp2", model="llama-tiny", sp=2, positions=True, ignore_ranks=(1,)),
    dict(name="llama sp2 compiled aot_eager", model="llama-tiny", sp=2, compile=True, steps=2,
         layers=1),
    dict(name="gpt sp2 math kernel", model="gpt-tiny", sp=2, options={"kernel": "math"}),
]))
P4 = Job("tests.parallel.test_ring:ring_worker", (FN_CONFIGS, [
    dict(name="gpt sp4", model="gpt-tiny", sp=4),
    dict(name="llama sp4", model="llama-tiny", sp=4, ignore_ranks=(0, 2)),
    dict(name="llama dp2 x sp2", model="llama-tiny", sp=2, positions=True),
]))
# -m slow: compiled at DP 2 x SP 2 (compiled at SP 2: P2; eager at DP 2 x SP 2: P4)
P4_COMPILED = [dict(name="gpt dp2 x sp2 compiled aot_eager", model="gpt-tiny", sp=2, compile=True,
                    layers=1)]
# the default suite's launches are the session's shared ones (tests/helpers/launch.py)
LAUNCH = {2: [P2], 4: [P4]}


def _check(results, world):
    for errs, _ in results:
        for cfg, err in errs.items():
            assert err < 1e-12, f"ring attention {cfg} on {world} ranks: rel err {err:.2e}"
    check_parity([r for _, r in results], world)


def test_ring_2_ranks(launch2):
    _check(launch2(P2), 2)


def test_ring_4_ranks(launch4):
    _check(launch4(P4), 4)


@pytest.mark.slow  # the ring on Inductor in fp32, a launch of its own; the default suite compiles
# it on aot_eager (P2 above and tests/parallel/test_baseline_recipes.py; in bf16, -m slow:
# tests/training/test_bf16.py's "ring+ac")
def test_ring_parity_inductor():
    from tests.helpers.dist import run_distributed
    configs = [dict(name="llama sp2 compiled inductor", model="llama-tiny", sp=2, compile=True,
                    backend="inductor", layers=1)]
    check_parity(run_distributed(parity_worker, 2, "ring", configs), 2)


@pytest.mark.slow  # a 4-rank launch of its own for one compile on aot_eager (see P4_COMPILED)
def test_ring_compiled_dp_x_sp_4_ranks():
    from tests.helpers.dist import run_distributed
    check_parity(run_distributed(parity_worker, 4, "ring", P4_COMPILED), 4)


# --------------------------------------------------------------------------------------------
# in-process checks
# --------------------------------------------------------------------------------------------
def test_zigzag_block_schedule():
    n = 8  # local tokens: two chunks of 4
    every, first, second = slice(0, 8), slice(0, 4), slice(4, 8)
    assert ring_blocks(1, 1, n, True, True) == [(every, every, True)]  # diagonal: causal
    assert ring_blocks(2, 0, n, True, True) == [(every, first, False)]  # earlier rank: kv chunk j
    assert ring_blocks(1, 3, n, True, True) == [(second, every, False)]  # later rank: q chunk 2P-1-r
    assert ring_blocks(0, 1, n, True, False) == []  # contiguous: later block fully masked
    assert ring_blocks(1, 0, n, True, False) == [(every, every, False)]
    assert ring_blocks(0, 3, n, False, True) == [(every, every, False)]
    # balanced: every rank computes the same number of score entries (P=4)
    work = []
    for r in range(4):
        w = 0
        for j in range(4):
            for qs, ks, causal in ring_blocks(r, j, n, True, True):
                lq, lk = qs.stop - qs.start, ks.stop - ks.start
                w += lq * (lq + 1) // 2 if causal else lq * lk
        work.append(w)
    assert len(set(work)) == 1


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_block_kernels_match_math(dtype):
    torch.manual_seed(0)
    assert ring.select_kernel(torch.device("cpu"), dtype, 16) == "cpu_flash"
    q, k, v, g = (torch.randn(2, 3, n, 16, dtype=dtype) for n in (12, 20, 20, 12))
    scale = 1 / math.sqrt(16)
    tol = dict(atol=2e-2, rtol=2e-2) if dtype == torch.bfloat16 else dict(atol=1e-5, rtol=1e-5)
    for causal, kk, vv in ((False, k, v), (True, k[:, :, :12], v[:, :, :12])):
        out, lse = ring.block_forward("cpu_flash", q, kk, vv, causal, scale)
        mout, mlse = ring.block_forward("math", q, kk, vv, causal, scale)
        torch.testing.assert_close(out, mout, **tol)
        torch.testing.assert_close(lse, mlse, **tol)
        assert lse.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
        for a, b in zip(ring.block_backward("cpu_flash", g, q, kk, vv, out, lse, causal, scale),
                        ring.block_backward("math", g, q, kk, vv, out, lse, causal, scale)):
            torch.testing.assert_close(a, b, **tol)


def test_single_rank_ring_equals_sdpa():
    torch.manual_seed(0)
    q = torch.randn(1, 4, 10, 8, requires_grad=True)
    k = torch.randn(1, 2, 10, 8, requires_grad=True)
    v = torch.randn(1, 2, 10, 8, requires_grad=True)
    out = ring_attention(q, k, v, causal=True)
    ref = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    torch.testing.assert_close(out, ref, atol=1e-6, rtol=1e-5)
    g1 = torch.autograd.grad(out.sum(), (q, k, v))
    g2 = torch.autograd.grad(ref.sum(), (q, k, v))
    for a, b in zip(g1, g2):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)


def test_ring_errors():
    model = build_model(preset_config("llama-tiny"))
    strategy = RingStrategy(ParallelState(sp_size=4, world_size=4))
    strategy.setup(model)
    batch = {"input_ids": torch.zeros(1, 36, dtype=torch.long), "labels": torch.zeros(1, 36, dtype=torch.long)}
    with pytest.raises(ValueError, match=r"--ring: sequence length 36 is not divisible by 2 x "
                                         r"sequence-parallel size = 2 x 4 = 8"):
        strategy.forward_loss(batch)
    with pytest.raises(ValueError, match="unknown kernel"):
        RingStrategy(ParallelState(), kernel="flash3")
    with pytest.raises(ValueError, match=r"attention dropout \(0.1\).*--hidden-dropout 0"):
        RingStrategy.check(preset_config("gpt-tiny", dropout=0.1), 2, 64, None)
    with pytest.raises(ValueError, match=r"--ring: sequence length 36 is not divisible by 2 x"):
        RingStrategy.check(preset_config("gpt-tiny"), 4, 36, None)
    with pytest.raises(ValueError, match="attention dropout"):
        RingAttention(None)(torch.zeros(1, 2, 4, 8), torch.zeros(1, 2, 4, 8),
                            torch.zeros(1, 2, 4, 8), dropout_p=0.1)
    with pytest.raises(ValueError, match="3 query heads are not a multiple of 2"):
        ring_attention(torch.zeros(1, 3, 4, 8), torch.zeros(1, 2, 4, 8), torch.zeros(1, 2, 4, 8))


def test_single_rank_strategy_loss():
    torch.manual_seed(0)
    model = build_model(preset_config("gpt-tiny"))
    strategy = RingStrategy(ParallelState())
    strategy.setup(model)
    batch = make_batch(3, 2, 16, 512, (), 1, slicing.ZIGZAG, False)
    loss, reported = strategy.forward_loss(batch)
    ref = model(batch["input_ids"], labels=batch["labels"])
    torch.testing.assert_close(loss, ref, rtol=1e-6, atol=0)
    assert "cpu_flash" in strategy.report()
