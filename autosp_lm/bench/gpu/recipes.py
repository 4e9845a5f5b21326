"""The ``recipes`` section of the GPU check: the hand-written strategies' memory techniques
(``autosp_lm/strategies/memory.py``) on one GPU.

One process, no SP (the techniques act per rank the same way under Ulysses and Ring): a
``llama-3.2-1b``-shaped model cut to 4 blocks, bf16 autocast, 16K tokens, one training step of
the ``none`` strategy with

* nothing (every activation kept, whole fp32 logits),
* ``ac``: full recomputation + the chunked loss,
* ``alst``: ``ac`` + tiled MLP + the checkpointed block inputs offloaded to pinned host memory,
  prefetched on a side stream (the CUDA stream code a CPU run cannot exercise).

Per configuration: the step's peak ``max_memory_allocated`` above what was allocated before it,
the pinned host bytes of the offload, and the gradients against ``ac`` (the offload only moves the
block inputs, so ``alst`` without the tiled MLP must equal ``ac`` bit for bit; with it, to bf16
rounding of the chunked MLP products). ``--smoke``: llama-tiny at 512 tokens on CPU (the host
copies are plain copies there; no memory figures).
"""
from __future__ import annotations

import gc
import time

import torch

from .common import Row, skip_note


def _step(cfg, batch, device, bf16: bool, options: dict):
    from autosp_lm.models import build_model
    from autosp_lm.parallel.state import init_parallel
    from autosp_lm.strategies import build_strategy
    torch.manual_seed(0)
    model = build_model(cfg).to(device)
    strategy = build_strategy("none", init_parallel(1, device=device.type), **options)
    strategy.setup(model)
    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
    with torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16):
        loss, _ = strategy.forward_loss(batch)
    loss.backward()
    peak = None
    if device.type == "cuda":
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - before
    offload = getattr(strategy.recipe, "offload", None) if strategy.recipe else None
    grads = [p.grad.detach().float().cpu() for p in model.parameters()]
    del model, strategy
    return dict(loss=loss.item(), peak=peak, grads=grads,
                host=offload.host_bytes if offload is not None else 0)


def section_recipes(args, deadline) -> list:
    from autosp_lm.models import preset_config
    smoke = args.smoke or not torch.cuda.is_available()
    if not args.smoke and not torch.cuda.is_available():
        return [Row("recipes", "section", "skipped", "no CUDA device")]
    device = torch.device("cpu" if smoke else "cuda")
    cfg = (preset_config("llama-tiny", num_layers=2) if smoke
           else preset_config("llama-3.2-1b", num_layers=4))
    seq = 512 if smoke else 16384
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, cfg.vocab_size, (1, seq), generator=g)
    batch = {k: v.to(device) for k, v in {"input_ids": ids, "labels": torch.roll(ids, -1, 1),
                                          "position_ids": torch.arange(seq)[None]}.items()}
    ac = dict(recompute_granularity="full", chunked_loss=True)
    configs = {"keep everything": {}, "ac": ac,
               "ac + offload": dict(ac, cpu_offloading=True),
               "alst": dict(ac, cpu_offloading=True, tiled_mlp=True)}
    results, rows = {}, []
    est = 1.0 if smoke else 15.0  # one eager step of 4 blocks at 16K on one H100, model built
    for name, options in configs.items():
        if deadline - time.time() < est:
            rows.append(Row("recipes", name, "skipped", skip_note(est, deadline - time.time())))
            continue
        try:
            results[name] = _step(cfg, batch, device, not smoke, options)
        except torch.OutOfMemoryError as e:
            rows.append(Row("recipes", name, "skipped", f"out of memory: {str(e)[:120]}"))
    base = results.get("ac")
    u = 2.0 ** -8
    for name, r in results.items():
        ok, note = True, ""
        if base is not None and name != "keep everything":
            err = max(((a - b).norm() / b.norm().clamp_min(1e-30)).item()
                      for a, b in zip(r["grads"], base["grads"]))
            bound = 0.0 if name == "ac + offload" else 4 * u
            ok = err <= bound
            note = f"grads vs ac: max rel {err:.2e} (bound {bound:.1e})"
        rows.append(Row("recipes", f"{name}, {seq} tokens", "ok" if ok else "FAIL", note,
                        measured_mib=None if r["peak"] is None else r["peak"] / 2**20,
                        host_mib=r["host"] / 2**20))
    return rows
