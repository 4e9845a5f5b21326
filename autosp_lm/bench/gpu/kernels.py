"""The ``ring_kernels`` and ``packed_attention`` sections: ring attention's CUDA block kernels
against float64 math, and the models' document-masked attention (FlexAttention) against SDPA
with the dense mask."""
from __future__ import annotations

import math
import time

import torch
import torch.nn.functional as F

from .common import Row, dtype_name, first_line, rel


def section_ring_kernels(args, deadline) -> list:
    from autosp_lm.parallel import ring_kernels as rk
    from autosp_lm.parallel.ring import ring_attention
    if args.smoke:
        device, kernels, dtypes = torch.device("cpu"), ("cpu_flash", "math"), (torch.float32,)
    elif not torch.cuda.is_available():
        return [Row("ring_kernels", "CUDA kernels", "skipped", "no CUDA device")]
    else:
        device = torch.device("cuda")
        kernels, dtypes = ("cuda_flash", "cuda_efficient"), (torch.bfloat16, torch.float16,
                                                              torch.float32)
    rows = []
    tol = {torch.float16: 2e-2, torch.bfloat16: 1e-1, torch.float32: 1e-3}
    for kernel in kernels:
        for dtype in dtypes:
            name = f"{kernel} {dtype_name(dtype)}"
            if time.time() > deadline:
                rows.append(Row("ring_kernels", name, "skipped", "time limit"))
                continue
            gen = torch.Generator(device="cpu").manual_seed(0)
            errs = []
            try:
                for sq, sk, causal in ((256, 256, True), (128, 256, False)):
                    q, k, v, do = (torch.randn(2, 4, n, 64, generator=gen).to(device, dtype)
                                   for n in (sq, sk, sk, sq))
                    scale = 1.0 / math.sqrt(64)
                    aux = rk.cuda_aux(kernel, q, k, v) if kernel.startswith("cuda") else None
                    out, lse = rk.block_forward(kernel, q, k, v, causal, scale)
                    ref_out, ref_lse = rk.block_forward("math", q.double(), k.double(),
                                                        v.double(), causal, scale)
                    grads = rk.block_backward(kernel, do, q, k, v, out, lse, causal, scale, aux)
                    ref = rk.block_backward("math", do.double(), q.double(), k.double(),
                                            v.double(), ref_out, ref_lse, causal, scale)
                    errs += [rel(a, b) for a, b in [(out, ref_out), (lse, ref_lse)]
                             + list(zip(grads, ref))]
            except (RuntimeError, ValueError, NotImplementedError) as err:
                rows.append(Row("ring_kernels", name, "skipped",
                                first_line(err)))
                continue
            chosen = rk.select_kernel(device, dtype, 64)
            ok = max(errs) <= tol[dtype]
            rows.append(Row("ring_kernels", name, "ok" if ok else "FAIL",
                            f"select_kernel picks {chosen}", max_err=max(errs)))
    # the whole ring op on one rank (world 1) against SDPA, through autograd
    if time.time() < deadline:
        dtype = torch.float32 if args.smoke else torch.bfloat16
        q, k, v = (torch.randn(1, 8, 512, 64, device=device, dtype=dtype, requires_grad=True)
                   for _ in range(3))
        out = ring_attention(q, k, v, causal=True)
        ref = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        g1 = torch.autograd.grad(out.float().square().sum(), (q, k, v))
        g2 = torch.autograd.grad(ref.float().square().sum(), (q, k, v))
        err = max([rel(out, ref)] + [rel(a, b) for a, b in zip(g1, g2)])
        rows.append(Row("ring_kernels", "ring_attention world 1 vs SDPA", "ok"
                        if err <= (1e-4 if dtype == torch.float32 else 3e-2) else "FAIL",
                        dtype_name(dtype), max_err=err))
    return rows



def section_packed_attention(args, deadline) -> list:
    """Document-masked attention of the models' entry point on CUDA (FlexAttention with the block
    mask built from document ranges) against SDPA with the dense boolean mask, forward and
    backward; and its time against full causal attention on the same packed batch."""
    from autosp_lm.models.attention import document_mask, sdpa_attention
    if args.smoke:
        device, dtypes, seq, heads, docs = torch.device("cpu"), (torch.float32,), 256, 2, 8
    elif not torch.cuda.is_available():
        return [Row("packed_attention", "FlexAttention document mask", "skipped",
                    "no CUDA device")]
    else:
        device, dtypes, seq, heads, docs = torch.device("cuda"), (torch.bfloat16, torch.float32), \
            16384, 16, 8
    rows = []
    gen = torch.Generator().manual_seed(0)
    cuts = torch.sort(torch.randperm(seq - 1, generator=gen)[:docs - 1] + 1).values
    doc = torch.zeros(1, seq, dtype=torch.long)
    for c in cuts.tolist():
        doc[0, c:] += 1
    doc = doc.to(device)
    for dtype in dtypes:
        name = f"document mask {dtype_name(dtype)} S={seq}"
        if time.time() > deadline:
            rows.append(Row("packed_attention", name, "skipped", "time limit"))
            continue
        q, k, v = (torch.randn(1, heads, seq, 64, generator=gen).to(device, dtype)
                   .requires_grad_() for _ in range(3))
        ref = F.scaled_dot_product_attention(q.double(), k.double(), v.double(),
                                             attn_mask=document_mask(doc)) \
            if seq <= 4096 else None
        grad_out = torch.randn(q.shape, generator=gen).to(device, dtype)

        def timed(fn):
            if device.type == "cuda":
                torch.cuda.synchronize()
            t = time.perf_counter()
            out = fn()
            out.backward(grad_out)
            if device.type == "cuda":
                torch.cuda.synchronize()
            return out, time.perf_counter() - t

        if args.smoke:  # FlexAttention has no CPU backward: the dense-mask path of the entry point
            out, _ = timed(lambda: sdpa_attention(q, k, v, document_ids=doc))
        else:
            timed(lambda: sdpa_attention(q, k, v, document_ids=doc))  # compile
            for t in (q, k, v):
                t.grad = None
            out, masked_s = timed(lambda: sdpa_attention(q, k, v, document_ids=doc))
            for t in (q, k, v):
                t.grad = None
            timed(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True))
            for t in (q, k, v):
                t.grad = None
            _, causal_s = timed(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True))
        if ref is None:  # too long for an fp64 dense reference: a masked SDPA in this dtype
            ref = F.scaled_dot_product_attention(q, k, v, attn_mask=document_mask(doc))
        err = rel(out, ref)
        tol = 1e-4 if dtype == torch.float32 else 2e-2
        fig = {"max_err": err}
        note = "CPU: SDPA with the dense mask (FlexAttention has no CPU backward)" if args.smoke \
            else f"{docs} documents; masked {masked_s * 1e3:.1f} ms vs full causal " \
                 f"{causal_s * 1e3:.1f} ms (x{masked_s / causal_s:.2f})"
        if not args.smoke:
            fig["step_s"] = masked_s
        rows.append(Row("packed_attention", name, "ok" if err <= tol else "FAIL", note, **fig))
    return rows

