"""The joint-graph pass that keeps each attention output once (sequence layout only).

Single process: the all-to-alls run with a group of size 1 (a copy), which leaves the graph
structure of the Ulysses rewrite intact; the 2-rank runs in ``test_autosp.py`` cover the real
collectives. Checked here: gradients equal the stock backward, the head-layout output is no
longer handed to the backward, the stand-in is exact for zero gradient rows and tiny or huge
gradients, and graphs without the all-to-all pair are left alone.
"""
import pytest
import torch

# the attention block and its runner are shared with the GPU check (tools/gpu_check.py)
from autosp_lm.bench.gpu.attention import AttentionBlock, attention_output_errors, run_attention_block


def Attn(dim=32, heads=4, ulysses=True, dtype=torch.float32):
    return AttentionBlock(dim=dim, heads=heads, ulysses=ulysses, dtype=dtype)


def _run(model, x, grad, rewrite):
    return run_attention_block(model, x, grad, rewrite)


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
    stand-in, the error against fp64 stays that of the stock kernel (tools/gpu_check.py runs
    the same check)."""
    try:
        e = attention_output_errors(torch.device("cuda"), dtype, kernel=kernel)
    except RuntimeError as err:  # kernel not built / not supported on this GPU
        pytest.skip(f"{kernel}: {str(err).splitlines()[0]}")
    assert e["rewritten"] == 1
    for a, b in zip(e["rewritten_err"], e["stock"]):
        assert a <= 1.1 * b + 1e-3, (kernel, a, b)
