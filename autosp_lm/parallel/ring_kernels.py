"""The block kernels of ring attention: attention of one query block to one key/value block
with its log-sum-exp, forward and backward, per device and dtype.

CPU ``aten._scaled_dot_product_flash_attention_for_cpu`` (+ ``_backward``); CUDA
``aten._scaled_dot_product_flash_attention`` for fp16/bf16, ``_scaled_dot_product_efficient_attention``
otherwise; an explicit math implementation as the fallback (``kernel="math"``). ``select_kernel``
picks one per (device, dtype, head dim) and verifies it once against the math path on small
random blocks (causal and rectangular) before first use.
"""
from __future__ import annotations

import math

import torch

aten = torch.ops.aten

KERNELS = ("auto", "cpu_flash", "cuda_flash", "cuda_efficient", "math")

_HALF = (torch.float16, torch.bfloat16)


def acc_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


# --------------------------------------------------------------------------------------------
# one block: attention of a query block to a key/value block, with log-sum-exp
# --------------------------------------------------------------------------------------------
def _causal_mask(sq: int, sk: int, device) -> torch.Tensor:
    """True where query ``i`` may not see key ``j`` (top-left aligned, as the SDPA kernels)."""
    return torch.ones(sq, sk, dtype=torch.bool, device=device).triu(1)


def _math_fwd(q, k, v, causal: bool, scale: float, mask=None):
    acc = acc_dtype(q.dtype)
    s = torch.matmul(q.to(acc), k.to(acc).transpose(-1, -2)) * scale
    if causal:
        s = s.masked_fill(_causal_mask(s.size(-2), s.size(-1), s.device), float("-inf"))
    if mask is not None:
        s = s.masked_fill(~mask, float("-inf"))
    lse = torch.logsumexp(s, dim=-1)
    p = torch.exp(s - lse.unsqueeze(-1)).nan_to_num(0.0)  # rows that see nothing: 0
    return torch.matmul(p, v.to(acc)).to(q.dtype), lse


def _math_bwd(dout, q, k, v, out, lse, causal: bool, scale: float, mask=None):
    acc = acc_dtype(q.dtype)
    qa, ka, va, da = q.to(acc), k.to(acc), v.to(acc), dout.to(acc)
    s = torch.matmul(qa, ka.transpose(-1, -2)) * scale
    if causal:
        s = s.masked_fill(_causal_mask(s.size(-2), s.size(-1), s.device), float("-inf"))
    if mask is not None:
        s = s.masked_fill(~mask, float("-inf"))
    p = torch.exp(s - lse.to(acc).unsqueeze(-1)).nan_to_num(0.0)
    dv = torch.matmul(p.transpose(-1, -2), da)
    dp = torch.matmul(da, va.transpose(-1, -2))
    delta = (da * out.to(acc)).sum(-1, keepdim=True)
    ds = p * (dp - delta)
    dq = torch.matmul(ds, ka) * scale
    dk = torch.matmul(ds.transpose(-1, -2), qa) * scale
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


_LSE_ALIGN = 32  # the memory-efficient CUDA kernel pads its log-sum-exp to a multiple of 32


def cuda_aux(kernel: str, q, k, v):
    """The auxiliary outputs (rng state, cumulative lengths) the CUDA backward ops expect, taken
    from a one-row forward call so their types match this PyTorch build (dropout is 0: unused)."""
    q1, k1, v1 = q[:, :, :1].contiguous(), k[:, :, :1].contiguous(), v[:, :, :1].contiguous()
    if kernel == "cuda_flash":
        res = aten._scaled_dot_product_flash_attention(q1, k1, v1, 0.0, False, False)
        return res[2], res[3], res[6], res[7]
    res = aten._scaled_dot_product_efficient_attention(q1, k1, v1, None, True, 0.0, False)
    return res[2], res[3]


#: kernels that take a mask (a block of document-masked or model-masked attention)
MASKED_KERNELS = ("cpu_flash", "cuda_efficient", "math")


def _bias(mask, dtype):
    """Additive bias of a boolean mask (True: visible) in the kernel's dtype."""
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill(~mask, float("-inf"))


def block_forward(kernel: str, q, k, v, causal: bool, scale: float, mask=None):
    """``(out [B,H,Sq,D] in q's dtype, lse [B,H,Sq] in float32/float64)`` of one block (equal
    head counts). ``mask``: bool ``[B|1, H|1, Sq, Sk]``, True where query may see key (with
    ``causal`` False; a kernel of :data:`MASKED_KERNELS`). A query row that sees no key of the
    block gets ``out = 0`` and ``lse = -inf``."""
    if mask is not None and kernel not in MASKED_KERNELS:
        raise ValueError(f"ring attention kernel {kernel!r} takes no mask; use one of "
                         f"{MASKED_KERNELS}")
    if kernel == "cpu_flash":
        out, lse = aten._scaled_dot_product_flash_attention_for_cpu(
            q, k, v, 0.0, causal, attn_mask=None if mask is None else _bias(mask, q.dtype),
            scale=scale)
    elif kernel == "cuda_flash":
        res = aten._scaled_dot_product_flash_attention(q, k, v, 0.0, causal, False, scale=scale)
        out, lse = res[0], res[1]
    elif kernel == "cuda_efficient":
        bias = None if mask is None else _bias(mask, q.dtype).expand(
            q.size(0), q.size(1), q.size(2), k.size(2))
        res = aten._scaled_dot_product_efficient_attention(q, k, v, bias, True, 0.0, causal,
                                                           scale=scale)
        out, lse = res[0], res[1][:, :, :q.size(2)]
    elif kernel == "math":
        out, lse = _math_fwd(q, k, v, causal, scale, mask)
    else:
        raise ValueError(f"unknown ring attention kernel {kernel!r}; choose one of {KERNELS}")
    lse = lse.to(acc_dtype(q.dtype))
    if mask is not None:  # rows without a visible key: the kernels' lse is not -inf for them
        seen = mask.any(-1).expand(lse.shape)
        lse = lse.masked_fill(~seen, float("-inf"))
        out = out.masked_fill(~seen.unsqueeze(-1), 0)
    return out, lse


def block_backward(kernel: str, dout, q, k, v, out, lse, causal: bool, scale: float, aux=None,
                   mask=None):
    """``(dq, dk, dv)`` of one block given the *global* ``out``/``lse`` of the query rows."""
    if kernel == "cpu_flash":
        return aten._scaled_dot_product_flash_attention_for_cpu_backward(
            dout, q, k, v, out, lse, 0.0, causal,
            attn_mask=None if mask is None else _bias(mask, q.dtype), scale=scale)
    if kernel == "cuda_flash":
        cum_q, cum_k, seed, offset = aux
        return aten._scaled_dot_product_flash_attention_backward(
            dout, q, k, v, out, lse.float().contiguous(), cum_q, cum_k, q.size(2), k.size(2), 0.0,
            causal, seed, offset, scale=scale)
    if kernel == "cuda_efficient":
        seed, offset = aux
        sq = q.size(2)
        pad = (-sq) % _LSE_ALIGN
        lse_p = torch.nn.functional.pad(lse.float(), (0, pad)).contiguous()
        bias = None if mask is None else _bias(mask, q.dtype).expand(
            q.size(0), q.size(1), q.size(2), k.size(2))
        dq, dk, dv, _ = aten._scaled_dot_product_efficient_attention_backward(
            dout, q, k, v, bias, out, lse_p, seed, offset, 0.0, [True, True, True, False], causal,
            scale=scale)
        return dq, dk, dv
    if kernel == "math":
        return _math_bwd(dout, q, k, v, out, lse, causal, scale, mask)
    raise ValueError(f"unknown ring attention kernel {kernel!r}; choose one of {KERNELS}")


# --------------------------------------------------------------------------------------------
# kernel selection: candidates by device/dtype, each verified once against the math path
# --------------------------------------------------------------------------------------------
_SELECTED: dict = {}  # (device type, dtype, head_dim) -> kernel


def _probe(kernel: str, device, dtype, head_dim: int) -> bool:
    """Run ``kernel`` on small random blocks (causal and rectangular full) forward and backward
    and compare with float64 math; any error or mismatch rejects it."""
    tol = {torch.float16: 2e-2, torch.bfloat16: 1e-1}.get(dtype, 1e-3)
    gen = torch.Generator(device="cpu").manual_seed(0)
    try:
        for sq, sk, causal in ((40, 40, True), (24, 40, False)):
            q, k, v, do = (torch.randn(1, 2, n, head_dim, generator=gen).to(device=device, dtype=dtype)
                           for n in (sq, sk, sk, sq))
            scale = 1.0 / math.sqrt(head_dim)
            aux = cuda_aux(kernel, q, k, v) if kernel.startswith("cuda") else None
            out, lse = block_forward(kernel, q, k, v, causal, scale)
            ref_out, ref_lse = _math_fwd(q.double(), k.double(), v.double(), causal, scale)
            grads = block_backward(kernel, do, q, k, v, out, lse, causal, scale, aux)
            ref = _math_bwd(do.double(), q.double(), k.double(), v.double(), ref_out, ref_lse,
                            causal, scale)
            pairs = [(out, ref_out), (lse, ref_lse)] + list(zip(grads, ref))
            for a, b in pairs:
                if a.shape != b.shape or not torch.allclose(a.double(), b, atol=tol, rtol=tol):
                    return False
        return True
    except (RuntimeError, ValueError, TypeError, NotImplementedError):
        return False


def select_kernel(device: torch.device, dtype: torch.dtype, head_dim: int,
                  requested: str = "auto", masked: bool = False) -> str:
    """The block kernel for tensors on ``device`` of ``dtype``: ``requested`` unless ``"auto"``;
    ``masked``: one that takes a mask (:data:`MASKED_KERNELS`)."""
    if requested not in KERNELS:
        raise ValueError(f"unknown ring attention kernel {requested!r}; choose one of {KERNELS}")
    if requested != "auto":
        if masked and requested not in MASKED_KERNELS:
            raise ValueError(f"ring attention kernel {requested!r} takes no mask (document or "
                             f"model masks need one of {MASKED_KERNELS})")
        return requested
    key = (device.type, dtype, head_dim, masked)
    if key not in _SELECTED:
        if device.type == "cpu":
            candidates = ["cpu_flash"]
        elif device.type == "cuda":
            candidates = []
            if dtype in _HALF and head_dim % 8 == 0 and head_dim <= 256 and not masked:
                candidates.append("cuda_flash")
            if dtype in _HALF + (torch.float32,):
                candidates.append("cuda_efficient")
        else:
            candidates = []
        # the probe asks the real device: never an ambient fake-tensor or dispatch mode (the
        # memory planner runs this op's body on fake tensors)
        from torch.utils._python_dispatch import _disable_current_modes
        with _disable_current_modes():
            _SELECTED[key] = next((c for c in candidates if _probe(c, device, dtype, head_dim)),
                                  "math")
    return _SELECTED[key]


def selected_kernels() -> dict:
    """The kernels chosen so far, ``{"cpu/torch.float32/16": "cpu_flash", ...}`` (for reports)."""
    return {f"{d}/{t}/{h}" + ("/masked" if m else ""): k for (d, t, h, m), k in _SELECTED.items()}
