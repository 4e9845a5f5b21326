"""Activation offload under a memory target in bf16: the policy meets a target below what the
default policy keeps by moving the fp32 residual-stream value (the largest saved tensor) to host
memory, unrounded, and the step is bitwise the step without offload (a copy out and back).

One CPU process, AutoSP at SP size 1 (see test_memory_passes.py), aot_eager.
"""
from __future__ import annotations

import torch

from autosp_lm.compiler import autosp_compile
from autosp_lm.compiler import offload as offload_ops
from autosp_lm.models import build_model, preset_config
from autosp_lm.strategies import extract_loss
from autosp_lm.training.memory import SavedTensorBytes
from tests.compiler.test_memory_passes import _fresh  # noqa: F401 - the same autouse reset


def _step(model, fn, ids):
    model.zero_grad(set_to_none=True)
    with SavedTensorBytes(exclude=model) as counter:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = extract_loss(fn(input_ids=ids, labels=ids))
    loss.backward()
    return loss.detach(), {n: p.grad.detach().clone() for n, p in model.named_parameters()}, counter


def test_bf16_offload_under_target_moves_the_fp32_residual_exactly():
    torch.manual_seed(0)
    model = build_model(preset_config("llama-tiny"))  # 2 layers: layer 1 keeps its fp32 input
    ids = torch.randint(0, model.config.vocab_size, (1, 1024),
                        generator=torch.Generator().manual_seed(1))
    base = autosp_compile(model, backend="aot_eager", verbose=False, sequence_tiling=False)
    loss0, grads0, _ = _step(model, base, ids)
    stats0 = base.sac_stats[-1]
    residual = [s for s in stats0["saved"] if s["dtype"] == "float32" and s["shape"][-1] ==
                model.config.hidden_size and s["shape"][-2] == ids.shape[1]]
    assert residual, stats0["saved"]  # the default policy keeps the fp32 residual
    torch._dynamo.reset()
    target = stats0["saved_bytes"] - 1  # just below the default: offload has to step in
    run = autosp_compile(model, backend="aot_eager", verbose=False, sequence_tiling=False,
                         sac_memory_target=target, offload_activations=True,
                         offload_threshold=1 << 14)
    for _ in range(2):  # the second step reloads with prefetching from the first's order
        loss, grads, counter = _step(model, run, ids)
        assert torch.equal(loss, loss0)
        for n, g in grads0.items():
            assert torch.equal(grads[n], g), n
    stats = run.sac_stats[-1]
    assert stats["target_met"] and stats["saved_bytes"] <= target
    assert stats["nodes_recomputed"] == stats0["nodes_recomputed"]  # met by offload alone
    moved = [s for s in stats["saved"] if s["offload"]]
    # the largest saved tensor is the fp32 residual: it goes to the host as it is (not rounded)
    assert moved and moved[0]["dtype"] == "float32" and moved[0]["bytes"] == residual[0]["bytes"]
    assert stats["offloaded_bytes"] == sum(s["bytes"] for s in moved)
    # measured: the host copies are the offloaded bytes, the device keeps the rest
    assert counter.host_bytes == stats["offloaded_bytes"] == stats["partition_offloaded_bytes"]
    assert counter.device_bytes < counter.bytes
    assert not offload_ops._host and not offload_ops._ready
