"""The joint-graph pass that keeps each attention output once (sequence layout only).

Single process: the all-to-alls run with a group of size 1 (a copy), which leaves the graph
structure of the Ulysses rewrite intact; the 2-rank runs in ``test_autosp.py`` cover the real
collectives. Checked here: gradients equal the stock backward, the head-layout output is no
longer handed to the backward, the stand-in is exact for zero gradient rows and tiny or huge
gradients, and graphs without the all-to-all pair are left alone.
"""
import pytest
import torch
import torch.nn.functional as F
from torch._dynamo.backends.common import aot_autograd
from torch._functorch.partitioners import min_cut_rematerialization_partition

import autosp_lm.parallel.collectives  # noqa: F401  (registers torch.ops.autosp_lm.*)
from autosp_lm.compiler.attention_out import keep_attention_output_once
from autosp_lm.compiler.sac import _partition_saved_bytes, apply_sac
from autosp_lm.compiler.sac_compile import _boxed_nop

a2a = torch.ops.autosp_lm.all_to_all




class Attn(torch.nn.Module):
    """[B, S, C] -> Ulysses-style attention (world 1 all-to-alls) -> o_proj, like the rewrite."""

    def __init__(self, dim=32, heads=4, ulysses=True, dtype=torch.float32):
        super().__init__()
        self.heads, self.ulysses = heads, ulysses
        self.qkv = torch.nn.Linear(dim, 3 * dim, dtype=dtype)
        self.proj = torch.nn.Linear(dim, dim, dtype=dtype)

    def forward(self, x):
        B, S, C = x.shape
        q, k, v = self.qkv(x).view(B, S, 3, self.heads, C // self.heads).permute(2, 0, 3, 1, 4)
        if self.ulysses:
            q, k, v = (a2a(t.contiguous(), 1, 2, "unused", 1) for t in (q, k, v))
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        if self.ulysses:
            o = a2a(o.contiguous(), 2, 1, "unused", 1)
        return self.proj(o.transpose(1, 2).reshape(B, S, C))


def _run(model, x, grad, rewrite):
    seen = {}

    def partition(joint, inputs, **kw):
        seen["rewritten"] = keep_attention_output_once(joint) if rewrite else 0
        # as in the AutoSP backend: the pass runs with SAC, which recomputes the o_proj input
        # copy from the sequence-layout output instead of saving the copy as well
        apply_sac(joint, budget=10.0, num_fwd_outputs=kw["num_fwd_outputs"])
        fw, bw = min_cut_rematerialization_partition(joint, inputs, **kw)
        seen["saved"] = _partition_saved_bytes(fw, kw["num_fwd_outputs"])
        return fw, bw

    torch._dynamo.reset()
    model.zero_grad(set_to_none=True)
    x = x.detach().requires_grad_()
    fn = torch.compile(model, backend=aot_autograd(fw_compiler=_boxed_nop,
                                                   bw_compiler=_boxed_nop,
                                                   partition_fn=partition))
    fn(x).backward(grad)
    grads = [x.grad] + [p.grad for p in model.parameters()]
    return [g.detach().clone() for g in grads], seen


def _rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-300)).item()


@pytest.mark.parametrize("scale", [1.0, 1e-30, 1e25])
def test_gradients_equal_the_stock_backward(scale):
    torch.manual_seed(0)
    model = Attn()
    x = torch.randn(2, 64, 32)
    grad = torch.randn(2, 64, 32) * scale
    grad[0, 7] = 0  # a zero gradient row: delta = 0, the stand-in must be 0, not NaN
    ref, stock = _run(model, x, grad, rewrite=False)
    got, seen = _run(model, x, grad, rewrite=True)
    assert seen["rewritten"] == 1 and stock["rewritten"] == 0
    for a, b in zip(got, ref):
        assert torch.isfinite(a).all()
        assert _rel(a, b) <= 1e-5


def test_head_layout_output_is_not_saved():
    torch.manual_seed(0)
    model = Attn()
    x, grad = torch.randn(2, 64, 32), torch.randn(2, 64, 32)
    _, stock = _run(model, x, grad, rewrite=False)
    _, seen = _run(model, x, grad, rewrite=True)
    out_bytes = 2 * 64 * 32 * 4  # the [B, H, S, D] fp32 attention output
    (b0, n0), (b1, n1) = stock["saved"], seen["saved"]
    assert n1 == n0 - 1, (stock["saved"], seen["saved"])
    assert b0 - b1 == out_bytes, (stock["saved"], seen["saved"])


def test_bf16_error_is_that_of_the_stock_kernel():
    """bf16: one extra rounding of the stand-in; the error against fp64 stays within 10% of the
    stock bf16 backward's own error."""
    torch.manual_seed(0)
    model = Attn(dtype=torch.bfloat16)
    x = torch.randn(2, 128, 32, dtype=torch.bfloat16)
    grad = torch.randn(2, 128, 32, dtype=torch.bfloat16)
    ref, _ = _run(model, x, grad, rewrite=False)
    got, _ = _run(model, x, grad, rewrite=True)
    exact_model = Attn(ulysses=False, dtype=torch.float64)
    exact_model.load_state_dict({k: v.double() for k, v in model.state_dict().items()})
    xe = x.double().requires_grad_()
    exact_model(xe).backward(grad.double())
    exact = [xe.grad] + [p.grad for p in exact_model.parameters()]
    for a, b, e in zip(got, ref, exact):
        assert _rel(a, e) <= 1.1 * _rel(b, e) + 1e-3, (_rel(a, e), _rel(b, e))


def test_graphs_without_the_all_to_all_pair_are_untouched():
    torch.manual_seed(0)
    model = Attn(ulysses=False)
    x, grad = torch.randn(2, 64, 32), torch.randn(2, 64, 32)
    _, seen = _run(model, x, grad, rewrite=True)
    assert seen["rewritten"] == 0


_CUDA_KERNELS = ["FLASH_ATTENTION", "EFFICIENT_ATTENTION", "CUDNN_ATTENTION"]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("kernel", _CUDA_KERNELS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_cuda_kernels(kernel, dtype):
    """The CUDA SDPA backward kernels read ``out`` only through rowsum(dO * out): with the
    stand-in, the error against fp64 stays that of the stock kernel."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    torch.manual_seed(0)
    model = Attn(dim=256, heads=4, dtype=dtype).cuda()
    x = torch.randn(2, 512, 256, dtype=dtype, device="cuda")
    grad = torch.randn(2, 512, 256, dtype=dtype, device="cuda")
    try:
        with sdpa_kernel(getattr(SDPBackend, kernel)):
            ref, _ = _run(model, x, grad, rewrite=False)
            got, seen = _run(model, x, grad, rewrite=True)
    except RuntimeError as e:  # kernel not built / not supported on this GPU
        pytest.skip(f"{kernel}: {str(e).splitlines()[0]}")
    assert seen["rewritten"] == 1
    exact_model = Attn(dim=256, heads=4, ulysses=False, dtype=torch.float64).cuda()
    exact_model.load_state_dict({k: v.double() for k, v in model.state_dict().items()})
    xe = x.double().requires_grad_()
    exact_model(xe).backward(grad.double())
    exact = [xe.grad] + [p.grad for p in exact_model.parameters()]
    for a, b, e in zip(got, ref, exact):
        assert _rel(a, e) <= 1.1 * _rel(b, e) + 1e-3, (kernel, _rel(a, e), _rel(b, e))
