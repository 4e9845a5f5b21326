"""The attention kernels' own workspace (autosp_lm/planner/workspace.py): the CPU formulas equal
the CPU allocator's count of the real kernels, and with them the simulated step of a model whose
peak is inside the attention backward equals the measured peak to the byte (without them it is
below it)."""
from __future__ import annotations

import contextlib

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from autosp_lm.planner.capture import capture_backend, simulate_captured
from autosp_lm.planner.workspace import TensorSpec, kernel_workspace, reference_kernels
from autosp_lm.training.memory import LivePeak

aten = torch.ops.aten
FWD = aten._scaled_dot_product_flash_attention_for_cpu.default
BWD = aten._scaled_dot_product_flash_attention_for_cpu_backward.default
CPU = torch.device("cpu")


@contextlib.contextmanager
def threads(n):
    old = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(old)


def _qkv(b, h, s, d, dtype, heads_last):
    def one():
        if heads_last:  # [B, S, H, D] storage viewed as [B, H, S, D] (what a model's transpose gives)
            return torch.randn(b, s, h, d, dtype=dtype).transpose(1, 2)
        return torch.randn(b, h, s, d, dtype=dtype)
    return one


def _bytes(ts):
    return sum(t.numel() * t.element_size() for t in ts)


# lengths on each side of the kernel's block-size thresholds (192 and 768 queries, 512 keys);
# 1024 tokens: several whole query and key blocks, as at any longer length
SHAPES = [(1, 4, 1024, 64, False), (1, 4, 1024, 64, True), (1, 3, 150, 64, False),
          (2, 2, 500, 32, True), (1, 2, 800, 16, False)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", SHAPES)
def test_cpu_flash_workspace_matches_the_allocator(shape, dtype):
    b, h, s, d, heads_last = shape
    mk = _qkv(b, h, s, d, dtype, heads_last)
    q, k, v = mk(), mk(), mk()
    # the kernel's own path, as the planner's CPU validation runs it: oneDNN off (with it on, a
    # host with AMX or AVX512-BF16 packs K/V and adds gemm scratch; see workspace.py)
    with threads(1), reference_kernels():
        ws = kernel_workspace("cpu")
        with LivePeak(CPU) as fwd_peak:
            out, lse = FWD(q, k, v, 0.0, True)[:2]
        assert fwd_peak.peak - _bytes([out, lse]) == ws(FWD, [TensorSpec.of(q), TensorSpec.of(k)])
        go = mk()
        with LivePeak(CPU) as bwd_peak:
            grads = BWD(go, q, k, v, out, lse, 0.0, True)
        measured = bwd_peak.peak - _bytes(grads)
        predicted = ws(BWD, [TensorSpec.of(go), TensorSpec.of(q), TensorSpec.of(k)])
    assert measured == predicted
    # the contiguous copy of the output's gradient is part of it exactly when the kernel needs it
    copy = 0 if heads_last else _bytes([go])
    assert predicted >= copy


def test_cpu_flash_workspace_with_a_mask():
    """An additive mask (packed documents) takes the kernel's masked path: the same scratch."""
    b, h, s, d = 1, 2, 1024, 32
    mk = _qkv(b, h, s, d, torch.float32, True)
    q, k, v = mk(), mk(), mk()
    mask = torch.zeros(1, 1, s, s).masked_fill(torch.ones(s, s, dtype=torch.bool).triu(1),
                                               float("-inf"))
    with threads(1):
        ws = kernel_workspace("cpu")
        with LivePeak(CPU) as fwd_peak:
            out, lse = FWD(q, k, v, 0.0, False, attn_mask=mask)[:2]
        assert fwd_peak.peak - _bytes([out, lse]) == ws(FWD, [TensorSpec.of(q), TensorSpec.of(k)])
        go = mk()
        with LivePeak(CPU) as bwd_peak:
            grads = BWD(go, q, k, v, out, lse, 0.0, False, attn_mask=mask)
        assert bwd_peak.peak - _bytes(grads) == ws(BWD, [TensorSpec.of(go), TensorSpec.of(q),
                                                          TensorSpec.of(k)])


def test_cuda_flash_backward_workspace_terms():
    """FlashAttention-2's backward: fp32 dq accumulator [B, Sq rounded to 128, H, D rounded to
    32], fp32 softmax_d [B, H, Sq'], and dk/dv expanded to the query heads under GQA."""
    ws = kernel_workspace("cuda")
    spec = lambda b, h, s, d, dt=torch.bfloat16: TensorSpec(  # noqa: E731 - contiguous [B,H,S,D]
        (b, h, s, d), (h * s * d, s * d, d, 1), dt)
    q, k = spec(1, 8, 1000, 80), spec(1, 8, 1000, 80)
    plain = ws(BWD, [q, q, k])
    assert plain == 1 * 1024 * 8 * 96 * 4 + 1 * 8 * 1024 * 4
    gqa = ws(BWD, [q, q, spec(1, 2, 1000, 80)])
    assert gqa - plain == 2 * 1 * 1000 * 8 * 80 * 2
    assert ws(BWD, [spec(1, 8, 1000, 80, torch.float32)] * 3) == 0  # fp32: not the flash kernel
    assert ws(FWD, [q, k]) == 0
    with pytest.raises(ValueError, match="unknown target"):
        kernel_workspace("tpu")


class _AttentionOnly(nn.Module):
    """Attention over a long sequence with a tiny projection: the step's peak is inside the
    attention backward (its scratch and the copy of the output's gradient)."""

    def __init__(self, dim=64, heads=4):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim, bias=False)

    def forward(self, x):
        b, s, _ = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return y.float().square().mean()


def test_simulated_step_with_workspace_equals_measured():
    torch.manual_seed(0)
    model = _AttentionOnly()
    store: list = []
    fn = torch.compile(model, backend=capture_backend(store), dynamic=False)
    x = torch.randn(1, 2048, 64)
    with threads(1):
        fn(x).backward()  # compile
        model.zero_grad(set_to_none=True)
        with LivePeak(CPU) as lp:
            fn(x).backward()
        with_ws = simulate_captured(store, 2048, workspace=kernel_workspace("cpu"))
        without = simulate_captured(store, 2048)
    # to the byte but for the 4-byte gradient of the scalar loss that autograd makes (outside
    # the graphs); without the kernel's scratch the simulation misses half a MB (and puts the
    # peak elsewhere)
    assert 0 <= lp.peak - with_ws.peak <= 4, (with_ws, lp.peak)
    assert lp.peak - without.peak > 500_000 and without.peak_at != with_ws.peak_at, without
    assert "flash_attention_for_cpu_backward" in with_ws.peak_at
