"""Stand-ins for the GPU kernels real runs call, as opaque ``torch.library`` custom ops with
reference implementations on CPU (tests/compiler/test_kernels.py).

* ``flash_attn::_flash_attn_forward`` and ``flash_attn::_flash_attn_varlen_forward`` with
  FlashAttention 2's schemas (flash_attn_interface.py), defined only when the real package is
  not importable: AutoSP's built-in registrations key on these names.
* ``standin::decay_scan`` — a per-head gated linear recurrence over the sequence (the shape of
  fla's gated delta rule / mamba_ssm's chunk scan: whole sequence per head).
* ``standin::grouped_mm`` — rows grouped by expert times each expert's weight (the schema of
  transformers' ``grouped_mm_fallback``).
* ``standin::swiglu`` — a fused token-local activation on ``[B, S, 2F]``.
* ``standin::linear_cross_entropy`` — a fused linear + cross-entropy loss (Liger-style), with
  ``reduction`` and ``ignore_index`` arguments.

Each forward op's backward is a second custom op that recomputes the reference with autograd
(as the real packages keep their backward kernels opaque too).
"""
from __future__ import annotations

import importlib.util
import math

import torch
import torch.nn.functional as F

# ---------------------------------------------------------------------------- references


def _attention(q, k, v, scale, causal, left, right, softcap):
    """``[B, S, H, D]`` attention with FlashAttention's conventions (GQA, window, softcap):
    the output and the log-sum-exp ``[B, H, S]``."""
    b, s, h, d = q.shape
    rep = h // k.shape[2]
    qh, kh, vh = (t.transpose(1, 2).float() for t in (q, k, v))
    kh, vh = kh.repeat_interleave(rep, 1), vh.repeat_interleave(rep, 1)
    scores = qh @ kh.transpose(-1, -2) * (scale if scale else 1.0 / math.sqrt(d))
    if softcap:
        scores = softcap * torch.tanh(scores / softcap)
    i = torch.arange(s)[:, None]
    j = torch.arange(k.shape[1])[None, :]
    allowed = torch.ones(s, k.shape[1], dtype=torch.bool)
    if causal:
        allowed &= j <= i
    if left >= 0:
        allowed &= j >= i - left
    if right >= 0:
        allowed &= j <= i + right
    scores = scores.masked_fill(~allowed, float("-inf"))
    lse = torch.logsumexp(scores, -1)
    out = (scores - lse[..., None]).exp() @ vh
    return out.transpose(1, 2).to(q.dtype), lse


def _varlen(q, k, v, cu_q, cu_k, scale, causal, left, right, softcap):
    outs, lses = [], []
    for a, b, c, e in zip(cu_q[:-1].tolist(), cu_q[1:].tolist(), cu_k[:-1].tolist(),
                          cu_k[1:].tolist()):
        o, lse = _attention(q[None, a:b], k[None, c:e], v[None, c:e], scale, causal, left,
                            right, softcap)
        outs.append(o[0])
        lses.append(lse[0])
    return torch.cat(outs), torch.cat(lses, -1)


def _decay_scan(x, decay, a):
    """``h_t = decay_t * h_{t-1} + A * x_t`` per (batch, head), over the sequence (dim 1)."""
    h = torch.zeros_like(x[:, 0], dtype=torch.float32)
    out = []
    for t in range(x.shape[1]):
        h = decay[:, t, :, None].float() * h + a[None, :, None].float() * x[:, t].float()
        out.append(h)
    return torch.stack(out, 1).to(x.dtype)


def _swiglu(x):
    g, u = x.float().chunk(2, -1)
    return (F.silu(g) * u).to(x.dtype)


def _grouped_mm(x, w, offs):
    """Rows ``[start, end)`` of group ``e`` times ``w[e]`` (``offs``: cumulative row counts)."""
    out, start = [], 0
    for e, end in enumerate(offs.tolist()):
        out.append(x[start:end] @ w[e])
        start = end
    return torch.cat(out + [x.new_zeros(x.shape[0] - start, w.shape[-1])])


def _linear_ce(inp, weight, target, ignore_index=-100, reduction="mean"):
    return F.cross_entropy(inp.float() @ weight.float().t(), target, ignore_index=ignore_index,
                           reduction=reduction)


# ---------------------------------------------------------------------------- op factory
def _define(name, schema, ref, fake, grads):
    """A custom op ``name`` running ``ref`` and, for its backward, ``name``_backward (the
    forward's arguments after the output gradients): the reference's vector-Jacobian product
    for the tensor inputs at positions ``grads``."""
    lib_name, op = name.split("::")
    lib = torch.library.Library(lib_name, "FRAGMENT")
    lib.define(f"{op}{schema}")
    args_text = schema[1:schema.index(") ->")]
    lib.define(f"{op}_backward(Tensor?[] grads_out, {args_text}) -> Tensor[]")

    def fwd(*args):
        with torch.no_grad():
            out = ref(*args)
        return tuple(t.contiguous() for t in out) if isinstance(out, tuple) else out.contiguous()

    def bwd(grads_out, *args):
        with torch.enable_grad():
            full = [t.detach().requires_grad_(i in grads) if isinstance(t, torch.Tensor) else t
                    for i, t in enumerate(args)]
            out = ref(*full)
            outs = out if isinstance(out, tuple) else (out,)
            pairs = [(o, g) for o, g in zip(outs, grads_out) if g is not None and o.requires_grad]
            got = torch.autograd.grad([o for o, _ in pairs], [full[i] for i in grads],
                                      [g for _, g in pairs], allow_unused=True)
        return [torch.zeros(full[i].shape, dtype=full[i].dtype) if g is None else g.contiguous()
                for i, g in zip(grads, got)]

    def bwd_fake(grads_out, *args):
        return [args[i].new_empty(args[i].shape) for i in grads]

    lib.impl(op, fwd, "CompositeExplicitAutograd")
    lib.impl(f"{op}_backward", bwd, "CompositeExplicitAutograd")
    torch.library.register_fake(name, fake, lib=lib)
    torch.library.register_fake(f"{name}_backward", bwd_fake, lib=lib)

    def setup(ctx, inputs, output):
        ctx.tensors = [i for i, a in enumerate(inputs) if isinstance(a, torch.Tensor)]
        ctx.save_for_backward(*[inputs[i] for i in ctx.tensors])
        ctx.rest = {i: a for i, a in enumerate(inputs) if not isinstance(a, torch.Tensor)}
        ctx.n = len(inputs)

    def backward(ctx, *grads_out):
        saved = dict(zip(ctx.tensors, ctx.saved_tensors))
        args = [saved[i] if i in saved else ctx.rest[i] for i in range(ctx.n)]
        got = getattr(getattr(torch.ops, lib_name), f"{op}_backward")(list(grads_out), *args)
        out = [None] * ctx.n
        for i, g in zip(grads, got):
            out[i] = g
        return tuple(out)

    torch.library.register_autograd(name, backward, setup_context=setup, lib=lib)
    _LIBS.append(lib)  # a custom op lives as long as its Library object


_LIBS: list = []
_DEFINED: list = []


def flash_attn_installed() -> bool:
    return importlib.util.find_spec("flash_attn") is not None


def define_all() -> None:
    """Define the stand-in ops once per process."""
    if _DEFINED:
        return
    _DEFINED.append(True)
    if not flash_attn_installed():
        def fa_ref(q, k, v, p, scale, causal, left=-1, right=-1, softcap=0.0, alibi=None,
                   ret=False):
            out, lse = _attention(q, k, v, scale, causal, left, right, softcap)
            return out, lse, q.new_empty(0), torch.zeros(2, dtype=torch.int64)

        def fa_fake(q, k, v, *rest):
            b, s, h, _ = q.shape
            return (q.new_empty(q.shape), q.new_empty(b, h, s, dtype=torch.float32),
                    q.new_empty(0), q.new_empty(2, dtype=torch.int64))
        _define("flash_attn::_flash_attn_forward",
                "(Tensor q, Tensor k, Tensor v, float dropout_p, float softmax_scale, bool causal, "
                "SymInt window_size_left=-1, SymInt window_size_right=-1, float softcap=0.0, "
                "Tensor? alibi_slopes=None, bool return_softmax=False) "
                "-> (Tensor, Tensor, Tensor, Tensor)", fa_ref, fa_fake, (0, 1, 2))

        def vl_ref(q, k, v, cu_q, cu_k, mq, mk, p, scale, causal, left=-1, right=-1,
                   softcap=0.0, *rest):
            out, lse = _varlen(q, k, v, cu_q, cu_k, scale, causal, left, right, softcap)
            return out, lse, q.new_empty(0), torch.zeros(2, dtype=torch.int64)

        def vl_fake(q, k, v, cu_q, cu_k, *rest):
            t, h, _ = q.shape
            return (q.new_empty(q.shape), q.new_empty(h, t, dtype=torch.float32),
                    q.new_empty(0), q.new_empty(2, dtype=torch.int64))
        _define("flash_attn::_flash_attn_varlen_forward",
                "(Tensor q, Tensor k, Tensor v, Tensor cu_seqlens_q, Tensor cu_seqlens_k, "
                "SymInt max_seqlen_q, SymInt max_seqlen_k, float dropout_p, float softmax_scale, "
                "bool causal, SymInt window_size_left=-1, SymInt window_size_right=-1, "
                "float softcap=0.0, Tensor? alibi_slopes=None, bool return_softmax=False, "
                "Tensor? block_table=None, Tensor? leftpad_k=None, Tensor? seqused_k=None, "
                "bool zero_tensors=False) -> (Tensor, Tensor, Tensor, Tensor)",
                vl_ref, vl_fake, (0, 1, 2))
    _define("standin::decay_scan", "(Tensor x, Tensor decay, Tensor A) -> Tensor", _decay_scan,
            lambda x, decay, a: x.new_empty(x.shape), (0, 1, 2))
    _define("standin::grouped_mm", "(Tensor input, Tensor weight, Tensor offs) -> Tensor",
            _grouped_mm, lambda x, w, o: x.new_empty(x.shape[0], w.shape[-1]), (0, 1))
    _define("standin::swiglu", "(Tensor x) -> Tensor", _swiglu,
            lambda x: x.new_empty(*x.shape[:-1], x.shape[-1] // 2), (0,))
    _define("standin::linear_cross_entropy",
            "(Tensor input, Tensor weight, Tensor target, int ignore_index=-100, "
            "str reduction='mean') -> Tensor", _linear_ce,
            lambda inp, w, t, i=-100, r="mean": inp.new_empty((), dtype=torch.float32)
            if r != "none" else inp.new_empty(t.shape, dtype=torch.float32), (0, 1))
