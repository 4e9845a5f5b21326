"""Ulysses baseline: loss and every gradient equal a single-device fp32 run (gloo, 2 and 4 ranks).

The parity worker (tests/helpers/baseline_parity.py) is shared with ``test_ring.py``: one
process launch runs several configurations (spawning is the slow part on CPU).
"""
import pytest
import torch

from autosp_lm.models import build_model, preset_config
from autosp_lm.parallel import ParallelState, slicing
from autosp_lm.parallel.heads import kv_replication
from autosp_lm.strategies.ulysses import UlyssesStrategy
from tests.helpers.baseline_parity import check_parity, make_batch, parity_worker
from tests.helpers.dist import run_distributed
from tests.helpers.launch import Job

PARITY = "tests.helpers.baseline_parity:parity_worker"
P2 = Job(PARITY, ("ulysses", [
    dict(name="gpt sp2", model="gpt-tiny", sp=2),
    dict(name="llama sp2 (kv split)", model="llama-tiny", sp=2, positions=True),
    # compiled on aot_eager (on Inductor: test_ulysses_parity_inductor, -m slow)
    dict(name="llama sp2 compiled aot_eager", model="llama-tiny", sp=2, compile=True, steps=2,
         layers=1),
]))
P4 = Job(PARITY, ("ulysses", [
    dict(name="gpt sp4", model="gpt-tiny", sp=4),
    dict(name="llama sp4 (kv replicated)", model="llama-tiny", sp=4, ignore_ranks=(0, 3)),
    dict(name="llama dp2 x sp2", model="llama-tiny", sp=2),
    dict(name="gpt dp2 x sp2", model="gpt-tiny", sp=2, positions=True),
    # the hand-written 2-D hybrid: all-to-all over 2 ranks x ring over 2, zigzag layout
    dict(name="llama 2x2 hybrid", model="llama-tiny", sp=4, options={"ulysses_degree": 2}),
    dict(name="gpt 1x4 hybrid (ring only)", model="gpt-tiny", sp=4,
         options={"ulysses_degree": 1}, positions=True),
]))
# the default suite's launches are the session's shared ones (tests/helpers/launch.py)
LAUNCH = {2: [P2], 4: [P4]}


# --------------------------------------------------------------------------------------------
# tests
# --------------------------------------------------------------------------------------------
def test_strategy_checks_and_errors():
    cfg = preset_config("llama-tiny")  # 4 query heads, 2 kv heads
    with pytest.raises(ValueError, match=r"--ulysses: 4 query heads and 2 key/value heads cannot "
                                         r"be split over sequence-parallel size 8.*sizes that "
                                         r"work: 2, 4.*--ring"):
        UlyssesStrategy.check(cfg, 8, 64, None)
    UlyssesStrategy.check(cfg, 4, 64, None)  # 2 kv heads at P=4: replicated
    with pytest.raises(ValueError, match=r"--ulysses: sequence length 30 is not divisible by the "
                                         r"sequence-parallel size 4.*--seq-length 28 or 32"):
        UlyssesStrategy.check(cfg, 4, 30, None)
    strategy = UlyssesStrategy(ParallelState(sp_size=4, world_size=4))
    strategy.setup(build_model(cfg))
    batch = {"input_ids": torch.zeros(1, 30, dtype=torch.long),
             "labels": torch.zeros(1, 30, dtype=torch.long)}
    with pytest.raises(ValueError, match=r"--ulysses: sequence length 30 is not divisible by the "
                                         r"sequence-parallel size 4.*--seq-length 28 or 32"):
        strategy.forward_loss(batch)
    with pytest.raises(TypeError, match="sac.*its options are: .*recompute_granularity.*"
                                        "compile, backend, fullgraph"):
        UlyssesStrategy(ParallelState(), sac=True)


def test_replicated_kv_heads_follow_sdpa_grouping():
    """What rank r computes with replicated kv heads equals SDPA enable_gqa's heads of rank r."""
    torch.manual_seed(0)
    h, hkv, p = 8, 2, 4
    q, k = torch.randn(1, h, 6, 4), torch.randn(1, hkv, 6, 4)
    v = torch.randn(1, hkv, 6, 4)
    ref = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    r_ = kv_replication(h, hkv, p)
    assert r_ == 2
    kr, vr = k.repeat_interleave(r_, 1), v.repeat_interleave(r_, 1)
    for r in range(p):  # after the all-to-all rank r holds query heads [2r, 2r+2) and kv head r
        qh = q[:, r * h // p:(r + 1) * h // p]
        out = torch.nn.functional.scaled_dot_product_attention(
            qh, kr[:, r:r + 1], vr[:, r:r + 1], is_causal=True, enable_gqa=True)
        torch.testing.assert_close(out, ref[:, r * h // p:(r + 1) * h // p])


def test_single_rank_is_plain_attention():
    ps = ParallelState()
    torch.manual_seed(0)
    model = build_model(preset_config("llama-tiny"))
    strategy = UlyssesStrategy(ps)
    strategy.setup(model)
    batch = make_batch(0, 2, 16, 512, (), 1, slicing.CONTIGUOUS, False)
    loss, reported = strategy.forward_loss(batch)
    ref = model(batch["input_ids"], labels=batch["labels"])
    torch.testing.assert_close(loss, ref, rtol=1e-6, atol=0)
    assert "ulysses" in strategy.report()


def test_ulysses_parity_2_ranks(launch2):
    check_parity(launch2(P2), 2)


@pytest.mark.slow  # Ulysses on Inductor in fp32; the default suite compiles it on aot_eager (P2,
# and in bf16 tests/training/test_bf16.py's "ulysses+alst-compiled"; on Inductor in bf16 its
# "ulysses+alst-inductor", -m slow)
def test_ulysses_parity_inductor():
    configs = [dict(name="llama sp2 compiled inductor", model="llama-tiny", sp=2, compile=True,
                    steps=2, backend="inductor", layers=1),
               dict(name="gpt sp2 compiled inductor", model="gpt-tiny", sp=2, compile=True,
                    backend="inductor", ignore_ranks=(1,), steps=2)]
    check_parity(run_distributed(parity_worker, 2, "ulysses", configs), 2)


def test_ulysses_parity_4_ranks(launch4):
    results = launch4(P4)
    check_parity(results, 4)
    report = {r["name"]: r["report"] for r in results[0]}
    assert "2-D: all-to-all over 2 ranks x ring over 2" in report["llama 2x2 hybrid"]
