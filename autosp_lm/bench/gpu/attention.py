"""The ``attention_output_once`` and ``attention_workspace`` sections: the AutoSP joint-graph
pass on the SDPA backward kernels (its gradients as exact as the stock kernel's), and the
memory planner's formula for the attention backward's scratch against the kernel."""
from __future__ import annotations

import contextlib
import time

import torch
import torch.nn.functional as F

from .common import Row, dtype_name, first_line, rel


class AttentionBlock(torch.nn.Module):
    """``[B, S, C]`` -> Ulysses-style attention (world-1 all-to-alls, the graph structure of the
    AutoSP rewrite) -> output projection."""

    def __init__(self, dim=32, heads=4, ulysses=True, dtype=torch.float32):
        super().__init__()
        self.heads, self.ulysses = heads, ulysses
        self.qkv = torch.nn.Linear(dim, 3 * dim, dtype=dtype)
        self.proj = torch.nn.Linear(dim, dim, dtype=dtype)

    def forward(self, x):
        import autosp_lm.parallel.collectives  # noqa: F401 - registers autosp_lm::all_to_all
        a2a = torch.ops.autosp_lm.all_to_all
        B, S, C = x.shape
        q, k, v = self.qkv(x).view(B, S, 3, self.heads, C // self.heads).permute(2, 0, 3, 1, 4)
        if self.ulysses:
            q, k, v = (a2a(t.contiguous(), 1, 2, "unused", 1) for t in (q, k, v))
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        if self.ulysses:
            o = a2a(o.contiguous(), 2, 1, "unused", 1)
        return self.proj(o.transpose(1, 2).reshape(B, S, C))




def run_attention_block(model, x, grad, rewrite: bool):
    """Forward + backward of ``model`` compiled with aot_eager, with (``rewrite``) or without the
    attention-output-once pass, as the AutoSP backend runs it (with SAC). Returns the gradients
    of ``x`` and the parameters and what the partition saved."""
    from torch._dynamo.backends.common import aot_autograd
    from torch._functorch.partitioners import min_cut_rematerialization_partition

    from autosp_lm.compiler.passes.attention_output_once import keep_attention_output_once
    from autosp_lm.compiler.passes.sac import apply_sac, partition_saved_bytes
    from autosp_lm.compiler.aot import boxed_nop
    seen = {}

    def partition(joint, inputs, **kw):
        seen["rewritten"] = keep_attention_output_once(joint) if rewrite else 0
        apply_sac(joint, budget=10.0, num_fwd_outputs=kw["num_fwd_outputs"])
        fw, bw = min_cut_rematerialization_partition(joint, inputs, **kw)
        seen["saved"] = partition_saved_bytes(fw, kw["num_fwd_outputs"])
        return fw, bw

    torch._dynamo.reset()
    model.zero_grad(set_to_none=True)
    x = x.detach().requires_grad_()
    fn = torch.compile(model, backend=aot_autograd(fw_compiler=boxed_nop,
                                                   bw_compiler=boxed_nop,
                                                   partition_fn=partition))
    fn(x).backward(grad)
    grads = [x.grad] + [p.grad for p in model.parameters()]
    return [g.detach().clone() for g in grads], seen


def attention_output_errors(device, dtype, dim=256, heads=4, seq=512, kernel=None) -> dict:
    """Errors against fp64 of the stock backward and of the rewritten one, per gradient.
    ``kernel``: an ``SDPBackend`` name to force (CUDA)."""
    torch.manual_seed(0)
    model = AttentionBlock(dim=dim, heads=heads, dtype=dtype).to(device)
    x = torch.randn(2, seq, dim, dtype=dtype, device=device)
    grad = torch.randn(2, seq, dim, dtype=dtype, device=device)
    ctx = contextlib.nullcontext()
    if kernel is not None:
        from torch.nn.attention import SDPBackend, sdpa_kernel
        ctx = sdpa_kernel(getattr(SDPBackend, kernel))
    with ctx:
        ref, _ = run_attention_block(model, x, grad, rewrite=False)
        got, seen = run_attention_block(model, x, grad, rewrite=True)
    exact_model = AttentionBlock(dim=dim, heads=heads, ulysses=False, dtype=torch.float64).to(device)
    exact_model.load_state_dict({k: v.double() for k, v in model.state_dict().items()})
    xe = x.double().requires_grad_()
    exact_model(xe).backward(grad.double())
    exact = [xe.grad] + [p.grad for p in exact_model.parameters()]
    return dict(rewritten=seen.get("rewritten", 0),
                stock=[rel(b, e) for b, e in zip(ref, exact)],
                rewritten_err=[rel(a, e) for a, e in zip(got, exact)])


def section_attention_output(args, deadline) -> list:
    rows = []
    if args.smoke:
        cases = [(None, torch.bfloat16)]
        device = torch.device("cpu")
    elif not torch.cuda.is_available():
        return [Row("attention_output_once", "CUDA kernels", "skipped", "no CUDA device")]
    else:
        device = torch.device("cuda")
        cases = [(k, d) for k in ("FLASH_ATTENTION", "EFFICIENT_ATTENTION", "CUDNN_ATTENTION")
                 for d in (torch.bfloat16, torch.float16)]
    for kernel, dtype in cases:
        name = f"{kernel or 'cpu flash'} {dtype_name(dtype)}"
        if time.time() > deadline:
            rows.append(Row("attention_output_once", name, "skipped", "time limit"))
            continue
        try:
            e = attention_output_errors(device, dtype, kernel=kernel,
                                        **({"dim": 32, "seq": 128} if args.smoke else {}))
        except RuntimeError as err:  # kernel not built / not supported on this GPU
            rows.append(Row("attention_output_once", name, "skipped",
                            first_line(err)))
            continue
        ok = e["rewritten"] == 1 and all(a <= 1.1 * b + 1e-3
                                         for a, b in zip(e["rewritten_err"], e["stock"]))
        rows.append(Row("attention_output_once", name, "ok" if ok else "FAIL",
                        f"rewritten {e['rewritten']}",
                        max_err_stock=max(e["stock"]), max_err_rewritten=max(e["rewritten_err"])))
    return rows


def attention_workspace_row(device, dtype, b, h, hk, s, d) -> dict:
    """The SDPA backward's memory beyond its gradients, measured (CUDA: ``max_memory_allocated``;
    CPU: ``LivePeak``) against the planner's formula (``planner/workspace.py``) for the device."""
    from ..plan import TensorSpec, kernel_workspace
    from autosp_lm.training.memory import LivePeak
    torch.manual_seed(0)

    def leaf(heads):  # [B, S, H, D] storage seen as [B, H, S, D], as a model's transpose gives
        return torch.randn(b, s, heads, d, dtype=dtype, device=device).transpose(1, 2) \
            .detach().requires_grad_()
    q, k, v = leaf(h), leaf(hk), leaf(hk)
    ctx = contextlib.nullcontext()
    if device.type == "cuda":
        from torch.nn.attention import SDPBackend, sdpa_kernel
        ctx = sdpa_kernel(SDPBackend.FLASH_ATTENTION)
    with ctx:
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=hk != h)
        go = torch.randn_like(out)
        with LivePeak(device) as lp:
            grads = torch.autograd.grad(out, (q, k, v), go)
    grad_bytes = sum(g.numel() * g.element_size() for g in grads)
    measured = lp.peak - grad_bytes
    op = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward.default
    predicted = kernel_workspace(device.type)(op, [TensorSpec.of(go), TensorSpec.of(q),
                                                    TensorSpec.of(k)])
    return dict(measured=measured, predicted=predicted)


def section_attention_workspace(args, deadline) -> list:
    """The planner's attention-backward workspace formula against the kernel on this device:
    CUDA FlashAttention-2 in bf16 (the fp32 dq accumulator, softmax_d, GQA's expanded dk/dv;
    not measured anywhere before a GPU run), CPU flash in fp32 under ``--smoke`` (exact)."""
    if args.smoke:
        device, dtype = torch.device("cpu"), torch.float32
        cases = [(1, 4, 2, 1024, 32), (1, 2, 2, 300, 16)]
    elif not torch.cuda.is_available():
        return [Row("attention_workspace", "CUDA flash backward", "skipped", "no CUDA device")]
    else:
        device, dtype = torch.device("cuda"), torch.bfloat16
        cases = [(1, 8, 8, 8192, 128), (1, 32, 8, 16384, 128), (2, 16, 4, 3000, 64)]
    rows = []
    for b, h, hk, s, d in cases:
        name = f"B{b} H{h}/{hk} S{s} D{d} {dtype_name(dtype)}"
        if time.time() > deadline:
            rows.append(Row("attention_workspace", name, "skipped", "time limit"))
            continue
        try:
            r = attention_workspace_row(device, dtype, b, h, hk, s, d)
        except RuntimeError as err:  # kernel not built / not supported on this GPU
            rows.append(Row("attention_workspace", name, "skipped",
                            first_line(err)))
            continue
        # the caching allocator rounds blocks up (512 B; 2 MiB segments for large ones): allow
        # that much, and 5% of the formula on CUDA (a kernel version may differ); CPU: exact
        # but for the row sums of the threads that ran at once (qs fp32 values each)
        slack = 0.05 * r["predicted"] + (4 << 20) if device.type == "cuda" else 4096
        ok = abs(r["measured"] - r["predicted"]) <= slack
        rows.append(Row("attention_workspace", name, "ok" if ok else "FAIL",
                        "beyond the gradients", measured_mib=r["measured"] / 2**20,
                        predicted_mib=r["predicted"] / 2**20))
    return rows

