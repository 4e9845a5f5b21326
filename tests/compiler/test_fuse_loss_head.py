"""The fused, sequence-chunked loss head (``autosp_lm.compiler.ops.linear_cross_entropy`` and
the pass ``autosp_lm.compiler.passes.fuse_loss_head``)."""
import math

import pytest
import torch
import torch.nn.functional as F
from torch._dynamo.backends.common import aot_autograd
from torch.utils._python_dispatch import TorchDispatchMode

from autosp_lm.compiler.ops import (MAX_CHUNK_LOGITS_BYTES, backward_chunks, chunk_tokens_for,
                                    forward_chunks, linear_cross_entropy)
from autosp_lm.compiler.passes.fuse_loss_head import fuse_loss_heads
from autosp_lm.compiler.aot import boxed_nop
from autosp_lm.training.memory import SavedTensorBytes


def _rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-300)).item()


def _data(n=300, hidden=16, vocab=50, bias=False, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(n, hidden, generator=g, dtype=dtype).requires_grad_()
    w = torch.randn(vocab, hidden, generator=g, dtype=dtype).requires_grad_()
    b = torch.randn(vocab, generator=g, dtype=dtype).requires_grad_() if bias else None
    t = torch.randint(0, vocab, (n,), generator=g)
    t[::7] = -100
    return h, w, b, t


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("chunk", [1, 37, 300, 1000])
def test_equals_linear_then_cross_entropy(bias, reduction, chunk):
    h, w, b, t = _data(bias=bias)
    params = [h, w] + ([b] if bias else [])
    ref = F.cross_entropy(F.linear(h, w, b).float(), t, reduction=reduction)
    ref_grads = torch.autograd.grad(ref, params)
    got = linear_cross_entropy(h, t, w, b, reduction=reduction, chunk_tokens=chunk)
    grads = torch.autograd.grad(got, params)
    assert _rel(got, ref) <= 1e-6
    for a, r in zip(grads, ref_grads):
        assert _rel(a, r) <= 1e-6


def test_all_targets_ignored_matches_cross_entropy():
    h, w, _, t = _data()
    t[:] = -100
    assert math.isnan(linear_cross_entropy(h, t, w).item())
    assert math.isnan(F.cross_entropy(F.linear(h, w), t).item())
    s = linear_cross_entropy(h, t, w, reduction="sum")
    assert s.item() == 0.0
    s.backward()
    assert torch.count_nonzero(h.grad) == 0 and torch.count_nonzero(w.grad) == 0


def test_bad_reduction():
    h, w, _, t = _data()
    with pytest.raises(ValueError, match="reduction"):
        linear_cross_entropy(h, t, w, reduction="none")


def test_bf16_autocast_error_is_that_of_the_unfused_ops():
    h, w, _, t = _data(n=512, hidden=64, vocab=300)
    exact = F.cross_entropy(F.linear(h.double(), w.double()), t)
    exact_grads = torch.autograd.grad(exact, [h, w])
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ref = F.cross_entropy(F.linear(h, w).float(), t)
    ref_grads = torch.autograd.grad(ref, [h, w])
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = linear_cross_entropy(h, t, w, chunk_tokens=100)
    grads = torch.autograd.grad(got, [h, w])
    assert got.dtype == torch.float32
    assert abs(got.item() - exact.item()) <= 2 * abs(ref.item() - exact.item()) + 1e-3
    for a, r, e in zip(grads, ref_grads, exact_grads):
        assert a.dtype == torch.float32  # gradients reach the fp32 master weights
        assert _rel(a, e) <= 1.5 * _rel(r, e) + 1e-3


class _Largest(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.numel = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for o in (out if isinstance(out, (tuple, list)) else [out]):
            if isinstance(o, torch.Tensor):
                self.numel = max(self.numel, o.numel())
        return out


def test_never_materializes_more_than_one_chunk_of_logits():
    n, hidden, vocab, chunk = 1024, 8, 512, 128
    h, w, _, t = _data(n=n, hidden=hidden, vocab=vocab)
    with torch.no_grad(), _Largest() as m:
        total, lse = forward_chunks(h, w, None, t, -100, chunk)
        backward_chunks(torch.ones(()), h, w, None, t, lse, -100, chunk)
    assert m.numel == chunk * vocab  # one chunk's logits, never n * vocab
    # and only the per-token log-sum-exp is kept for the backward (weights excluded)
    with SavedTensorBytes(exclude=[w]) as saved:
        loss = linear_cross_entropy(h, t, w, chunk_tokens=chunk)
    loss.backward()
    # h, targets, lse, and the mean's fp32 token count
    assert saved.bytes == n * hidden * 4 + n * 8 + n * 4 + 4


def test_chunk_sizing():
    assert chunk_tokens_for(16384, 64, 512) == 2048         # tiny presets: 8 chunks
    assert chunk_tokens_for(65536, 4096, 128256) == 2048    # Llama 3 8B: 32 chunks
    assert chunk_tokens_for(4096, 64, 512) == 1024          # never below 1024 tokens
    # long context: one chunk's fp32 logits stay within 1 GiB, however many tokens a rank holds
    # (at 500K tokens, 32 chunks would be 15,625 tokens: 7.5 GiB of fp32 logits each)
    for tokens in (500_000, 4_000_000):
        chunk = chunk_tokens_for(tokens, 4096, 128256)
        assert chunk * 128256 * 4 <= MAX_CHUNK_LOGITS_BYTES and chunk >= 2048
    # a vocabulary so large that 1024 rows exceed the cap keeps the 1024-token floor
    assert chunk_tokens_for(1 << 20, 8192, 1 << 20) == 1024


# -- the graph pass ---------------------------------------------------------------------------


def _compile(fn, fused):
    def backend(gm, example_inputs):
        fused.extend(fuse_loss_heads(gm, chunk_tokens=50))
        return aot_autograd(fw_compiler=boxed_nop, bw_compiler=boxed_nop)(gm, example_inputs)
    torch._dynamo.reset()
    return torch.compile(fn, backend=backend, fullgraph=True)


class Head(torch.nn.Module):
    def __init__(self, bias=False):
        super().__init__()
        torch.manual_seed(0)
        self.norm = torch.nn.LayerNorm(16)
        self.lm_head = torch.nn.Linear(16, 40, bias=bias)

    def forward(self, x, labels, mode="plain"):
        logits = self.lm_head(self.norm(x))
        if mode == "plain":
            return F.cross_entropy(logits.float().reshape(-1, logits.size(-1)), labels.reshape(-1))
        if mode == "shifted":  # HF/Llama style: drop the last position, shift the labels
            shift = logits[..., :-1, :].contiguous()
            return F.cross_entropy(shift.view(-1, 40), labels[:, 1:].reshape(-1),
                                   ignore_index=3, reduction="sum")
        if mode == "nofloat":
            return F.cross_entropy(logits.reshape(-1, 40), labels.reshape(-1))
        if mode == "returns_logits":
            return F.cross_entropy(logits.reshape(-1, 40), labels.reshape(-1)), logits
        if mode == "smoothing":
            return F.cross_entropy(logits.reshape(-1, 40), labels.reshape(-1), label_smoothing=0.1)
        if mode == "class_weights":
            return F.cross_entropy(logits.reshape(-1, 40), labels.reshape(-1),
                                   weight=torch.linspace(0.5, 1.5, 40))
        raise KeyError(mode)


@pytest.mark.parametrize("mode,bias", [("plain", False), ("plain", True), ("shifted", False)])
def test_pass_fuses_and_keeps_results(mode, bias):
    model = Head(bias)
    x = torch.randn(2, 64, 16)
    labels = torch.randint(0, 40, (2, 64))
    ref = model(x, labels, mode)
    ref_grads = torch.autograd.grad(ref, list(model.parameters()))
    fused = []
    got = _compile(model, fused)(x, labels, mode)
    grads = torch.autograd.grad(got, list(model.parameters()))
    assert len(fused) == 1 and "linear + cross_entropy fused" in fused[0]
    assert _rel(got, ref) <= 1e-6
    for a, r in zip(grads, ref_grads):
        assert _rel(a, r) <= 1e-5


@pytest.mark.parametrize("mode", ["returns_logits", "smoothing", "class_weights"])
def test_pass_leaves_other_losses_alone(mode):
    model = Head()
    x = torch.randn(2, 8, 16)
    labels = torch.randint(0, 40, (2, 8))
    fused = []
    out = _compile(model, fused)(x, labels, mode)
    ref = model(x, labels, mode)
    assert fused == []
    torch.testing.assert_close(out, ref)


def test_pass_leaves_a_bf16_loss_alone():
    """A loss computed in bf16 (no autocast, no .float()) is not turned into an fp32 one."""
    model = Head().to(torch.bfloat16)
    x = torch.randn(2, 8, 16, dtype=torch.bfloat16)
    labels = torch.randint(0, 40, (2, 8))
    fused = []
    out = _compile(model, fused)(x, labels, "nofloat")
    assert fused == [] and out.dtype == torch.bfloat16
    _compile(Head(), fused)(x.float(), labels, "nofloat")  # the same head in fp32 is fused
    assert len(fused) == 1


def test_backward_transient_is_one_logits_block_and_the_fp32_accumulator():
    """bf16: beyond its outputs the backward holds the fp32 ``dW`` accumulator and one chunk's
    logits (fp32, with their bf16 copy), never a whole ``[vocab, hidden]`` product or its fp32
    copy (which, with the fp32 logits still held, had been 3 GiB more than this at Llama 3 8B's
    shapes). Here hidden is wide against the chunk, as at 8B: the old code held 9.5 MiB more
    (17.5 MiB beyond the outputs, against a bound of 10.5 MiB). 256 tokens: the bf16 matmuls of
    1024 cost 4x the CPU time for the same check."""
    from autosp_lm.training.memory import LivePeak
    torch.manual_seed(0)
    n, hidden, vocab = 256, 2048, 1024
    h = torch.randn(n, hidden, dtype=torch.bfloat16) * 0.1
    w = torch.randn(vocab, hidden, dtype=torch.bfloat16) * 0.02
    t = torch.randint(0, vocab, (n,))
    total, lse = forward_chunks(h, w, None, t, -100, n)
    with LivePeak() as lp:
        gh, gw, _ = backward_chunks(torch.ones(()), h, w, None, t, lse, -100, n)
    outputs = gh.numel() * 2 + gw.numel() * 2
    logits = n * vocab * (4 + 2)  # the fp32 block and its bf16 copy (or the linear's bf16 output)
    accumulator = vocab * hidden * 4
    assert lp.peak - outputs <= accumulator + logits + (1 << 20), lp.peak - outputs
    # the gradients of the unfused ops in fp32, to bf16 rounding
    hf, wf = h.float().requires_grad_(), w.float().requires_grad_()
    F.cross_entropy(F.linear(hf, wf), t, reduction="sum").backward()
    assert torch.allclose(gw.float(), wf.grad, rtol=0.05, atol=2e-3)
    assert torch.allclose(gh.float(), hf.grad, rtol=0.05, atol=2e-3)
