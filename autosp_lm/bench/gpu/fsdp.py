"""The ``fsdp`` section of the GPU check: sharded model state on one GPU.

* ``simulated``: one rank of an 8-way job (a fake process group: collectives return correctly
  shaped, meaningless tensors, so memory and compute are one rank's and communication is
  excluded) training ``llama-3.2-1b`` in bf16 at 8K tokens per step with ``--ulysses`` and
  ``--autosp``, each unsharded, with ``--use-torch-fsdp2`` (native FSDP2 / graph FSDP) and with
  ``--use-distributed-optimizer``: peak ``torch.cuda.max_memory_allocated`` of a training step,
  the rank's parameter + gradient + optimizer bytes, step time (communication excluded).
* then, with a 1-rank NCCL group: torch's fused AdamW on DTensor parameters (the sharded modes'
  optimizer on CUDA) against the plain fp32 AdamW of the same model, and a ``dcp.async_save`` of
  CUDA state through the gloo side group, loaded back exactly.

``--smoke``: the same code on CPU (llama-tiny, 2-way, only ``--ulysses`` with native FSDP2,
eager, gloo; no memory figures).
"""
from __future__ import annotations

import gc
import time

import torch

from ..steps import mock_batch, train_step
from .common import Row, init_fake_world, run_worker, skip_note
from .simulated import compiled_options


def _cells(smoke: bool) -> list:
    cells = [("ulysses", "none"), ("ulysses", "fsdp2"), ("autosp", "none"),
             ("autosp", "graph_fsdp"), ("autosp", "distributed_optimizer")]
    return [("ulysses", "fsdp2")] if smoke else cells  # smoke: the harness, in CI time


def simulated_worker(cell: dict) -> dict:
    import torch.distributed as dist

    from autosp_lm.models import build_model, preset_config
    from autosp_lm.parallel.sharding_kinds import build_sharding
    from autosp_lm.parallel.state import init_parallel
    from autosp_lm.strategies import build_strategy
    from autosp_lm.training.optimizer import build_optimizer

    world = cell["world"]
    init_fake_world(world)
    ps = init_parallel(world, device=cell["device"], shard_mesh=True)
    cfg = preset_config(cell["model"], max_position_embeddings=1 << 20)
    batch = mock_batch(cfg.vocab_size, cell["seq"], 1, 0, ps.device)
    out = []
    for strategy_name, kind in cell["cells"]:
        torch._dynamo.reset()
        torch.manual_seed(0)
        model = build_model(cfg).to(ps.device)
        options = dict(compiled_options(strategy_name, cell["backend"]),
                       **({"compile": cell["compile"]} if strategy_name == "ulysses" else {}))
        strategy = build_strategy(strategy_name, ps, **options)
        sharding = build_sharding(kind, ps, bf16=True)
        sharding.wrap(model)
        strategy.setup(model)
        optimizer = build_optimizer(sharding.optimizer_module(), lr=1e-5, weight_decay=0.0,
                                    device=ps.device, sharded=sharding.sharded)

        def step():
            train_step(strategy, model, optimizer, batch, bf16=True, device=ps.device,
                       sharding=sharding)

        row = {"strategy": strategy_name, "sharding": kind}
        try:
            step()  # compiles
            if ps.device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(ps.device)
            t = time.perf_counter()
            step()
            row["step_s"] = time.perf_counter() - t
            if ps.device.type == "cuda":
                row["peak_mem_gib"] = torch.cuda.max_memory_allocated(ps.device) / 2**30
            b = sharding.memory_bytes(optimizer)
            row["state_gib"] = sum(b.values()) / 2**30
        except Exception as e:  # noqa: BLE001 - report the cell, go on with the next
            row["error"] = f"{type(e).__name__}: {e}"[:300]
        out.append(row)
        del model, strategy, sharding, optimizer
        gc.collect()
        if ps.device.type == "cuda":
            torch.cuda.empty_cache()
    dist.destroy_process_group()
    return {"cells": out, **real_checks(cell)}


def real_checks(cell: dict) -> dict:
    """1-rank process group: fused AdamW on DTensor parameters, async DCP save of device state."""
    import tempfile

    import torch.distributed as dist

    from autosp_lm.models import build_model, preset_config
    from autosp_lm.parallel.sharding_kinds import build_sharding
    from autosp_lm.parallel.state import init_parallel
    from autosp_lm.training import checkpoint_dist
    from autosp_lm.training.optimizer import build_optimizer

    ps = init_parallel(1, device=cell["device"], shard_mesh=True)
    cfg = preset_config("llama-tiny")
    res = {}

    def trained(kind):
        torch.manual_seed(0)
        model = build_model(cfg).to(ps.device)
        sharding = build_sharding(kind, ps)
        sharding.wrap(model)
        opt = build_optimizer(sharding.optimizer_module(), lr=1e-2, weight_decay=0.1,
                              device=ps.device, sharded=sharding.sharded)
        ids = torch.randint(0, cfg.vocab_size, (1, 64), generator=torch.Generator().manual_seed(1))
        ids = ids.to(ps.device)
        for _ in range(2):
            sharding.zero_grad(opt)
            model(ids, labels=ids).backward()
            sharding.reduce_gradients()
            opt.step()
            sharding.after_optimizer_step()
        params = {n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().double().cpu()
                  for n, p in sharding.optimizer_module().named_parameters()}
        return sharding, opt, params

    _, _, ref = trained("none")
    sharding, opt, got = trained("fsdp2")
    res["adamw_max_err"] = max(float((got[n] - ref[n]).abs().max() / ref[n].abs().max())
                               for n in ref)
    res["adamw"] = type(opt).__name__ + (" fused" if opt.defaults.get("fused") else "")
    group = checkpoint_dist.checkpoint_group(ps.backend)
    with tempfile.TemporaryDirectory() as d:
        module = sharding.state_dict_module()
        saved = {n: p.full_tensor().detach().double().cpu() for n, p in module.named_parameters()}
        fut = checkpoint_dist.save(d, module, opt, async_save=True, process_group=group)
        with torch.no_grad():  # training goes on while the checkpoint is written
            for p in module.parameters():
                p.add_(1.0)
        fut.result()
        with torch.no_grad():
            for p in module.parameters():
                p.zero_()
        checkpoint_dist.load(d, module, opt)
        back = {n: p.full_tensor().detach().double().cpu() for n, p in module.named_parameters()}
    res["async_save_max_err"] = max(float((back[n] - saved[n]).abs().max()) for n in saved)
    dist.destroy_process_group()
    return res


def section_fsdp(args, deadline) -> list:
    smoke = args.smoke
    if not smoke and not torch.cuda.is_available():
        return [Row("fsdp", "sharded model state", "skipped", "no CUDA device")]
    rows = []
    left = deadline - time.time()
    # one worker runs every cell (compiled, one after the other): about 150 s each on one H100
    # (decisive.py's docstring), 60 s for the real-group checks; skipped whole if that does not fit
    est = 20.0 if smoke else 60.0 + 150.0 * len(_cells(smoke))
    if left < est:
        return [Row("fsdp", "sharded model state", "skipped", skip_note(est, left))]
    cell = dict(worker="fsdp", world=2 if smoke else 8,
                model="llama-tiny" if smoke else "llama-3.2-1b",
                device="cpu" if smoke else "cuda", seq=128 if smoke else 8192,
                backend="aot_eager" if smoke else "inductor", compile=not smoke,
                cells=_cells(smoke))
    res = run_worker(cell, timeout=max(30.0, left - 5))
    if "error" in res:
        return [Row("fsdp", "sharded model state", "FAIL", res["error"][-300:])]
    for c in res["cells"]:
        name = f"{c['strategy']} {c['sharding']} ({cell['world']}-way simulated)"
        if "error" in c:
            rows.append(Row("fsdp", name, "FAIL", c["error"]))
        else:
            rows.append(Row("fsdp", name, "ok", f"model state {c['state_gib']:.3f} GiB/rank",
                            **{k: v for k, v in c.items() if k in ("step_s", "peak_mem_gib")}))
    rows.append(Row("fsdp", f"{res['adamw']} on DTensor shards vs unsharded",
                    "ok" if res["adamw_max_err"] < 1e-5 else "FAIL", max_err=res["adamw_max_err"]))
    rows.append(Row("fsdp", "dcp.async_save (gloo side group) + load",
                    "ok" if res["async_save_max_err"] == 0 else "FAIL",
                    max_err=res["async_save_max_err"]))
    return rows


WORKERS = {"fsdp": simulated_worker}
