"""Parity machinery of the hand-written baselines (Ulysses, Ring): each config runs the strategy
on this rank's share and compares loss and every gradient with a single-device fp32 run."""
import copy

import torch

from autosp_lm.models import build_model, preset_config
from autosp_lm.parallel import init_parallel, reduce_gradients, slicing
from autosp_lm.strategies import build_strategy

TOL = 1e-5  # relative, fp32 against fp32


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
        model = build_model(preset_config(cfg["model"], **({"num_layers": cfg["layers"]}
                                                           if "layers" in cfg else {}),
                                          **cfg.get("overrides", {})))
        ref_model = copy.deepcopy(model)
        seq, vocab = cfg.get("seq", 32), model.config.vocab_size
        batches = [make_batch(100 + d, 2, seq, vocab, cfg.get("ignore_ranks", (0,)), sp, layout,
                              cfg.get("positions", False)) for d in range(ps.dp_size)]
        graph = {} if strategy_name == "none" else {"fullgraph": True}
        strategy = build_strategy(strategy_name, ps, compile=cfg.get("compile", False),
                                  backend=cfg.get("backend", "aot_eager"), **graph,
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


