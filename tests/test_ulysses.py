"""Ulysses baseline: loss and every gradient equal a single-device fp32 run (gloo, 2 and 4 ranks).

The parity worker here is shared with ``test_ring.py``: one process launch runs several
configurations (spawning is the slow part on CPU).
"""
import copy

import pytest
import torch

from autosp_lm.models import build_model, preset_config
from autosp_lm.parallel import ParallelState, init_parallel, reduce_gradients, slicing
from autosp_lm.parallel.strategy import build_strategy
from autosp_lm.parallel.ulysses import REPLICATE, SPLIT, UlyssesStrategy, kv_head_mode
from tests.dist_utils import run_distributed

TOL = 1e-5  # relative, fp32 against fp32


# --------------------------------------------------------------------------------------------
# shared parity machinery (also used by test_ring.py)
# --------------------------------------------------------------------------------------------
def make_batch(seed: int, batch: int, seq: int, vocab: int, ignore_ranks: tuple, sp: int,
               layout: str, positions: bool) -> dict:
    """A batch with aligned labels, some random ignored targets and every target of the shards
    of ``ignore_ranks`` ignored (so token counts differ across ranks; a rank may have none)."""
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, vocab, (batch, seq + 1), generator=g)
    labels = tokens[:, 1:].clone()
    labels[torch.rand(batch, seq, generator=g) < 0.15] = -100
    for r in ignore_ranks:
        labels[:, slicing.shard_positions(seq, sp, r, layout)] = -100
    out = {"input_ids": tokens[:, :-1].contiguous(), "labels": labels}
    if positions:  # documents restart their positions (position ids are sliced like tokens)
        pos = torch.arange(seq).repeat(batch, 1)
        pos[:, seq // 3:] -= seq // 3
        out["position_ids"] = pos
    return out


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


def parity_worker(rank, world, strategy_name, configs):
    """Run each config: the strategy on this rank's share vs the single-device fp32 reference."""
    results = []
    for cfg in configs:
        sp = cfg["sp"]
        ps = init_parallel(sp_size=sp)
        layout = slicing.ZIGZAG if strategy_name == "ring" else slicing.CONTIGUOUS
        torch.manual_seed(1234)
        model = build_model(preset_config(cfg["model"]))
        ref_model = copy.deepcopy(model)
        seq, vocab = cfg.get("seq", 32), model.config.vocab_size
        batches = [make_batch(100 + d, 2, seq, vocab, cfg.get("ignore_ranks", (0,)), sp, layout,
                              cfg.get("positions", False)) for d in range(ps.dp_size)]
        strategy = build_strategy(strategy_name, ps, compile=cfg.get("compile", False),
                                  backend=cfg.get("backend", "aot_eager"), fullgraph=True,
                                  **cfg.get("options", {}))
        strategy.setup(model)
        steps = cfg.get("steps", 1)
        for _ in range(steps):  # >1: the compiled graph is reused (no recompilation, same values)
            model.zero_grad(set_to_none=True)
            loss, reported = strategy.forward_loss(batches[ps.dp_rank])
            loss.backward()
        reduce_gradients(model.parameters(), ps.dp_size)

        ref_losses = [ref_model(b["input_ids"], position_ids=b.get("position_ids"), labels=b["labels"])
                      for b in batches]
        (sum(ref_losses) / len(ref_losses)).backward()
        grad_errs = {name: rel_err(p.grad, q.grad)
                     for (name, p), (_, q) in zip(model.named_parameters(), ref_model.named_parameters())}
        worst = max(grad_errs, key=grad_errs.get)
        results.append(dict(name=cfg["name"], reported=reported.item(),
                            loss_err=rel_err(reported, ref_losses[ps.dp_rank].detach()),
                            local_finite=bool(torch.isfinite(loss).item()),
                            grad_err=grad_errs[worst], worst=worst, sp_group=ps.rank // sp,
                            report=strategy.report()))
    return results


def check_parity(per_rank: list, world: int):
    by_name = {}
    for rank_results in per_rank:
        for r in rank_results:
            by_name.setdefault(r["name"], []).append(r)
    for name, rs in by_name.items():
        assert len(rs) == world
        for r in rs:
            assert r["local_finite"], name
            assert r["loss_err"] < TOL, f"{name}: loss rel err {r['loss_err']:.2e}"
            assert r["grad_err"] < TOL, f"{name}: grad rel err {r['grad_err']:.2e} ({r['worst']})"
        # the reported loss is identical on every rank of one SP group
        for g in {r["sp_group"] for r in rs}:
            assert len({r["reported"] for r in rs if r["sp_group"] == g}) == 1, name
    return by_name


# --------------------------------------------------------------------------------------------
# tests
# --------------------------------------------------------------------------------------------
def test_kv_head_modes_and_errors():
    assert kv_head_mode(4, 4, 2) == SPLIT
    assert kv_head_mode(4, 2, 2) == SPLIT
    assert kv_head_mode(4, 2, 4) == REPLICATE
    assert kv_head_mode(32, 8, 16) == REPLICATE
    assert kv_head_mode(32, 8, 4) == SPLIT
    with pytest.raises(ValueError, match=r"4 attention heads are not divisible by the "
                                         r"sequence-parallel size 3.*--ring"):
        kv_head_mode(4, 2, 3)
    with pytest.raises(ValueError, match=r"6 key/value heads cannot be split over "
                                         r"sequence-parallel size 4"):
        kv_head_mode(12, 6, 4)
    # the strategy checks the model's head counts at setup
    model = build_model(preset_config("llama-tiny"))
    with pytest.raises(ValueError, match="4 attention heads are not divisible by the "
                                         "sequence-parallel size 8"):
        UlyssesStrategy(ParallelState(sp_size=8, world_size=8)).setup(model)
    strategy = UlyssesStrategy(ParallelState(sp_size=4, world_size=4))
    strategy.setup(model)  # 2 kv heads at P=4: replicated
    assert strategy.head_mode == REPLICATE
    batch = {"input_ids": torch.zeros(1, 30, dtype=torch.long), "labels": torch.zeros(1, 30, dtype=torch.long)}
    with pytest.raises(ValueError, match=r"--ulysses: sequence length 30 is not divisible by the "
                                         r"sequence-parallel size 4.*--seq-length 28 or 32"):
        strategy.forward_loss(batch)
    with pytest.raises(ValueError, match="--sac"):
        UlyssesStrategy(ParallelState(), sac=True)


def test_replicated_kv_heads_follow_sdpa_grouping():
    """What rank r computes in REPLICATE mode equals SDPA enable_gqa's heads of rank r."""
    torch.manual_seed(0)
    h, hkv, p = 8, 2, 4
    q, k = torch.randn(1, h, 6, 4), torch.randn(1, hkv, 6, 4)
    v = torch.randn(1, hkv, 6, 4)
    ref = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    kr, vr = k.repeat_interleave(p // hkv, 1), v.repeat_interleave(p // hkv, 1)
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


def test_ulysses_parity_2_ranks():
    configs = [
        dict(name="gpt sp2", model="gpt-tiny", sp=2),
        dict(name="llama sp2 (kv split)", model="llama-tiny", sp=2, positions=True),
        dict(name="llama sp2 compiled aot_eager", model="llama-tiny", sp=2, compile=True, steps=2),
    ]
    check_parity(run_distributed(parity_worker, 2, "ulysses", configs), 2)


@pytest.mark.slow  # Inductor code generation on 2 ranks (~40 s); test_ring.py runs Inductor by default
def test_ulysses_parity_inductor():
    configs = [dict(name="gpt sp2 compiled inductor", model="gpt-tiny", sp=2, compile=True,
                    backend="inductor", ignore_ranks=(1,), steps=2)]
    check_parity(run_distributed(parity_worker, 2, "ulysses", configs), 2)


def test_ulysses_parity_4_ranks():
    configs = [
        dict(name="gpt sp4", model="gpt-tiny", sp=4),
        dict(name="llama sp4 (kv replicated)", model="llama-tiny", sp=4, ignore_ranks=(0, 3)),
        dict(name="llama dp2 x sp2", model="llama-tiny", sp=2),
        dict(name="gpt dp2 x sp2", model="gpt-tiny", sp=2, positions=True),
    ]
    check_parity(run_distributed(parity_worker, 4, "ulysses", configs), 4)
