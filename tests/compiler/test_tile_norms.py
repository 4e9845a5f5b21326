"""Sequence tiling of mixed-precision norms: ``x.float() ... .type_as(x)``.

With bf16 parameters (Megatron-style mixed precision) an RMSNorm written the usual way upcasts
its input, computes a per-token statistic (``mean -> + eps -> rsqrt``) and casts back. Its fp32
intermediates are twice as wide as its input, and the statistic's path leaves the wide values
and joins them again. Each norm must end up inside a tiled region (on its own before attention,
with its MLP before an MLP, with the loss head's input after the last block), so that its fp32
values never exist for the whole sequence at once: at Llama-3.1-8B's shapes the final norm's
backward alone held six ``[tokens, hidden]`` bf16 units of fp32 values while the loss head's
backward ran.

The model is written as a research script would: functions over a dict of bf16 parameters,
projections as ``x @ W``, no ``nn.Module`` per layer; compared with the same model run eagerly.
"""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from autosp_lm.compiler import autosp_compile, tiling

U = 2.0 ** -8
GRAD_TOL_BF16, LOSS_TOL_BF16 = 4 * U, 1e-4  # as in tests/training/test_bf16.py
DIM, HEADS, FFN, VOCAB, LAYERS = 64, 4, 192, 256, 2


def rmsnorm(x, w, eps=1e-6):
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return xf.type_as(x) * w


def block(x, p, i):
    b, s, _ = x.shape
    h = rmsnorm(x, p[f"an{i}"])
    q, k, v = ((h @ p[f"w{c}{i}"]).view(b, s, HEADS, -1).transpose(1, 2) for c in "qkv")
    a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    x = x + a.transpose(1, 2).reshape(b, s, DIM) @ p[f"wo{i}"]
    h = rmsnorm(x, p[f"mn{i}"])
    return x + (F.silu(h @ p[f"wg{i}"]) * (h @ p[f"wu{i}"])) @ p[f"wd{i}"]


class Script(torch.nn.Module):
    def __init__(self):
        super().__init__()
        g = torch.Generator().manual_seed(0)

        def mat(i, o):
            return torch.nn.Parameter(torch.randn(i, o, generator=g) / math.sqrt(i))
        p = {"emb": torch.nn.Parameter(torch.randn(VOCAB, DIM, generator=g)),
             "fn": torch.nn.Parameter(torch.ones(DIM)), "head": mat(DIM, VOCAB)}
        for i in range(LAYERS):
            p.update({f"an{i}": torch.nn.Parameter(torch.ones(DIM)),
                      f"mn{i}": torch.nn.Parameter(torch.ones(DIM)),
                      f"wq{i}": mat(DIM, DIM), f"wk{i}": mat(DIM, DIM), f"wv{i}": mat(DIM, DIM),
                      f"wo{i}": mat(DIM, DIM), f"wg{i}": mat(DIM, FFN), f"wu{i}": mat(DIM, FFN),
                      f"wd{i}": mat(FFN, DIM)})
        self.p = torch.nn.ParameterDict(p).to(torch.bfloat16)

    def forward(self, input_ids, labels):
        x = F.embedding(input_ids, self.p["emb"])
        for i in range(LAYERS):
            x = block(x, self.p, i)
        logits = rmsnorm(x, self.p["fn"]) @ self.p["head"]
        return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten())


def _step(model, fn, ids):
    model.zero_grad(set_to_none=True)
    loss = fn(input_ids=ids, labels=torch.roll(ids, -1, 1))
    loss.backward()
    return loss.detach().float(), {n: p.grad.detach().float().clone()
                                   for n, p in model.named_parameters()}


# Inductor: -m slow. The default suite runs the pass on aot_eager (the tiling decision does not
# depend on the backend) and a tiled region's chunks Inductor-compiled in
# tests/compiler/test_memory_passes.py::test_tiled_chunk_compilations_are_bounded (the whole
# step on Inductor in bf16, test_tiling_inductor_bf16 there: -m slow too).
@pytest.mark.parametrize("backend", ["aot_eager", pytest.param("inductor", marks=pytest.mark.slow)])
def test_every_bf16_norm_is_tiled_and_exact(backend):
    torch._dynamo.reset()
    tiling.REGIONS.clear()
    model = Script()
    ids = torch.randint(0, VOCAB, (1, 2048), generator=torch.Generator().manual_seed(1))
    ref = _step(model, model, ids)
    run = autosp_compile(model, backend=backend, verbose=False)
    loss, grads = _step(model, run, ids)
    assert abs(loss - ref[0]) <= LOSS_TOL_BF16 * abs(ref[0])
    for n, g in ref[1].items():
        err = ((grads[n] - g).norm() / g.norm().clamp_min(1e-30)).item()
        assert err <= GRAD_TOL_BF16, f"{n}: relative error {err:.3g}"
    # Every norm's statistic (one rsqrt per norm) and its fp32 upcast run inside a tiled region.
    tiled = [name for r in tiling.REGIONS.values() for name in r.nodes]
    norms = 2 * LAYERS + 1
    assert sum(name.startswith("rsqrt") for name in tiled) == norms, run.report.tiled_regions
    assert sum(name.startswith("type_as") for name in tiled) == norms, run.report.tiled_regions
    torch._dynamo.reset()
