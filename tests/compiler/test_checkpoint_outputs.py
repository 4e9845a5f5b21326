"""Compiled checkpoint regions keep the output that the forward reads after them, as eager
checkpointing does (compiler/passes/checkpoint_outputs.py): without it the partitioner
recomputes the last checkpointed block first thing in the backward, for the final norm, and
holds all its intermediates (every MLP tile at once) until the block's own backward."""
from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from autosp_lm.planner.capture import capture_backend
from autosp_lm.planner.liveness import simulate_step
from autosp_lm.compiler.passes import checkpoint_outputs
from autosp_lm.compiler.passes.checkpoint_outputs import checkpointed_backend


class TiledFF(nn.Module):
    """A feed-forward net run over row tiles, each tile checkpointed (ALST's tiled MLP in the
    style of a research script: functional weights, an explicit loop)."""

    def __init__(self, d, f, tiles):
        super().__init__()
        self.w_gate = nn.Parameter(torch.randn(f, d) / d ** 0.5)
        self.w_in = nn.Parameter(torch.randn(f, d) / d ** 0.5)
        self.w_out = nn.Parameter(torch.randn(d, f) / f ** 0.5)
        self.tiles = tiles

    def tile(self, x):
        return (torch.nn.functional.silu(x @ self.w_gate.t()) * (x @ self.w_in.t())) @ self.w_out.t()

    def forward(self, x):
        return torch.cat([checkpoint(self.tile, t, use_reentrant=False)
                          for t in x.chunk(self.tiles, dim=0)])


class Net(nn.Module):
    def __init__(self, d=16, f=64, depth=2, tiles=4):
        super().__init__()
        self.ffs = nn.ModuleList(TiledFF(d, f, tiles) for _ in range(depth))
        self.norm = nn.LayerNorm(d)

    def block(self, i, x):
        return x + self.ffs[i](torch.tanh(x))

    def forward(self, x):
        for i in range(len(self.ffs)):
            x = checkpoint(self.block, i, x, use_reentrant=False)
        return self.norm(x).square().mean()


def _captured(model, x, *, with_pass: bool, monkeypatch):
    torch._dynamo.reset()
    if not with_pass:
        monkeypatch.setattr(checkpoint_outputs, "save_region_outputs", lambda joint: 0)
    store: list = []
    loss = torch.compile(model, backend=capture_backend(store))(x)
    loss.backward()
    monkeypatch.undo()
    torch._dynamo.reset()
    return loss, store


def test_the_last_block_output_is_saved_and_the_backward_peak_falls(monkeypatch):
    torch.manual_seed(0)
    model = Net()
    x = torch.randn(512, 16)
    ref = model(x)
    ref.backward()
    grads = [p.grad.clone() for p in model.parameters()]
    peaks = {}
    for with_pass in (False, True):
        model.zero_grad()
        loss, store = _captured(model, x, with_pass=with_pass, monkeypatch=monkeypatch)
        torch.testing.assert_close(loss, ref)
        for g, p in zip(grads, model.parameters()):
            torch.testing.assert_close(p.grad, g)  # what is saved changes, not the values
        (part,) = store
        peaks[with_pass] = simulate_step(part.fw, part.bw, part.num_fwd_outputs).backward_peak
    # without the pass the backward recomputes the whole last block (all 4 tiles' [128, 64]
    # intermediates) before the norm's backward; with it, one tile at a time
    tile = 128 * 64 * 4
    assert peaks[False] - peaks[True] >= 4 * tile, peaks


def test_only_outputs_read_by_the_forward_outside_a_region_are_tagged(monkeypatch):
    from torch.utils.checkpoint import CheckpointPolicy
    seen = []
    real = checkpoint_outputs.save_region_outputs

    def spy(joint):
        def saved():
            return [x for x in joint.graph.nodes
                    if x.meta.get("recompute") == CheckpointPolicy.MUST_SAVE]
        before = saved()
        n = real(joint)
        seen.append([x for x in saved() if x not in before])
        assert n == len(seen[-1])
        return n

    monkeypatch.setattr(checkpoint_outputs, "save_region_outputs", spy)
    torch._dynamo.reset()
    model = Net(depth=3)
    torch.compile(model, backend=capture_backend([]))(torch.randn(64, 16)).backward()
    torch._dynamo.reset()
    (tagged,) = seen
    # the last block's residual add (read by the norm); the boundaries between blocks are
    # PyTorch's own MUST_SAVE (cleanup_recompute_tags runs later, in the partitioner)
    assert [n.target for n in tagged] == [torch.ops.aten.add.Tensor], tagged


# Inductor: -m slow, as are the compiled recipes of tests/training/test_bf16.py's matrix on
# Inductor (ulysses+alst-inductor, ring+ac-inductor; on aot_eager by default) that run this
# backend with their parity.
@pytest.mark.parametrize("backend", ["aot_eager", pytest.param("inductor", marks=pytest.mark.slow)])
def test_checkpointed_backend_matches_eager(backend):
    torch.manual_seed(1)
    model = Net(tiles=2)
    x = torch.randn(64, 16)
    ref = model(x)
    ref.backward()
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    torch._dynamo.reset()
    loss = torch.compile(model, backend=checkpointed_backend(backend))(x)
    loss.backward()
    torch._dynamo.reset()
    torch.testing.assert_close(loss, ref, rtol=1e-5, atol=1e-6)
    for g, p in zip(grads, model.parameters()):
        torch.testing.assert_close(p.grad, g, rtol=1e-4, atol=1e-6)

