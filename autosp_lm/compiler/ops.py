"""Custom ops the AutoSP passes insert (``torch.library``, traceable, with autograd).

* ``autosp_lm::grad_scale`` — identity forward, gradient times ``scale`` backward (a replicated
  value that meets each rank's loss share).
* ``autosp_lm::linear_cross_entropy`` (+ ``_backward``) — the loss head recomputed in sequence
  chunks, :func:`linear_cross_entropy`. The pass that puts it into a model's graph is
  :mod:`autosp_lm.compiler.passes.fuse_loss_head`.

The loss head, recomputed in sequence chunks: output projection + cross entropy as one op.

A language model's last step, ``logits = h @ W.T (+ b)`` then ``cross_entropy(logits.float(),
labels)``, materializes ``[tokens, vocab]`` fp32 logits, their log-softmax and, in the backward,
their gradient: 0.5 MB per token each at a 128K vocabulary, more than all the activations SAC
keeps for a whole 8B model. With SAC those logits are recomputed in the backward anyway, so
nothing is lost by recomputing them chunk by chunk instead:

* forward, per chunk of tokens: the logits, their log-sum-exp and the loss of the chunk; only the
  per-token log-sum-exp (4 bytes per token) is kept;
* backward, per chunk: the logits again, ``softmax - one_hot`` scaled by the incoming gradient,
  then ``dh = dlogits @ W`` and ``dW += dlogits.T @ h`` (accumulated in fp32).

At most one chunk's ``[chunk, vocab]`` fp32 logits exist at a time, worked on in place (plus
their copy in the compute dtype for the gradient matmuls under bf16). The chunk count is
``ceil(vocab / hidden)`` (at least 1024 tokens per chunk), so a chunk's fp32 logits are about
the size of one fp32 ``[tokens, hidden]`` activation: 8 chunks for the tiny presets, 32 for
Llama 3 8B (2048 tokens each at 64K tokens per rank); and at long context a chunk's fp32 logits
stay within 1 GiB (2093 tokens at Llama 3's 128K vocabulary), however many tokens a rank holds.

Numerics: the loss and gradients equal the unfused ops to fp32 rounding (the sums
run in a different order); under autocast the projection runs in the autocast dtype as
``F.linear`` would.
"""
from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn.functional as F
from torch.library import custom_op

from .chunking import ranges

MIN_CHUNK_TOKENS = 1024
#: the most bytes one chunk's fp32 ``[chunk, vocab]`` logits may take (above MIN_CHUNK_TOKENS)
MAX_CHUNK_LOGITS_BYTES = 1 << 30


def chunk_tokens_for(tokens: int, hidden: int, vocab: int) -> int:
    """Tokens per chunk: ``ceil(vocab / hidden)`` chunks, at least 1024 tokens each, and no
    more tokens than keep one chunk's fp32 logits within :data:`MAX_CHUNK_LOGITS_BYTES`.

    Without the cap the chunk grows with the sequence: at 500K tokens per rank, Llama 3 8B's
    32 chunks held 7.6 GiB of fp32 logits each (plus their bf16 copy in the backward), more
    than a layer's activations. A GEMM of 1K-2K rows by a 32K+ vocabulary is still a large,
    efficient one, so more chunks cost launches, not throughput."""
    if not tokens:
        return MIN_CHUNK_TOKENS
    chunks = max(1, math.ceil(vocab / hidden))
    cap = max(MIN_CHUNK_TOKENS, MAX_CHUNK_LOGITS_BYTES // (4 * max(1, vocab)))
    return max(MIN_CHUNK_TOKENS, min(cap, math.ceil(tokens / chunks)))


def _chunks(n: int, chunk: int):
    """Chunks of ``chunk`` tokens (:func:`.chunking.ranges`: under the planner's probing, one of
    each size)."""
    return ranges(n, chunk)


def forward_chunks(h, w, b, target, ignore_index: int, chunk: int):
    """``(loss sum, per-token log-sum-exp)``, one ``[chunk, vocab]`` block of logits at a time
    (worked on in place: one fp32 block is the whole transient)."""
    n = h.shape[0]
    lse = torch.empty(n, dtype=torch.float32, device=h.device)
    total = torch.zeros((), dtype=torch.float32, device=h.device)
    for s, e in _chunks(n, chunk):
        logits = F.linear(h[s:e], w, b).float()
        t = target[s:e]
        valid = t != ignore_index
        picked = logits.gather(1, torch.where(valid, t, 0).unsqueeze(1)).squeeze(1)
        top = logits.amax(dim=1, keepdim=True)
        lse_c = logits.sub_(top).exp_().sum(dim=1).log_().add_(top.squeeze(1))
        total += torch.where(valid, lse_c - picked, 0.0).sum()
        lse[s:e] = lse_c
        del logits  # before the next chunk's block is made: one fp32 block live, not two
    return total, lse


def vocab_block_rows(tokens: int, hidden: int, vocab: int, itemsize: int = 2) -> int:
    """Rows of ``dW`` per product in the backward: each ``[rows, hidden]`` partial product (in
    the compute dtype, ``itemsize`` bytes) is at most an eighth of the chunk's fp32
    ``[tokens, vocab]`` logits block, the op's designated transient."""
    if vocab <= 0 or hidden <= 0:
        return max(1, vocab)
    return max(1, min(vocab, (tokens * vocab * 4) // (8 * hidden * itemsize)))


def backward_chunks(grad, h, w, b, target, lse, ignore_index: int, chunk: int):
    """``(dh, dW, db)`` for the loss sum scaled by ``grad``, recomputing the logits per chunk
    (``db`` is empty without a bias).

    Transients beyond the outputs and the fp32 ``dW`` accumulator: one chunk's fp32 logits
    (worked on in place), their copy in the compute dtype, and a ``[rows, hidden]`` block of the
    ``dW`` product (:func:`vocab_block_rows`; the compute-dtype product is added to the fp32
    accumulator as it is, upcast element by element, exactly what ``.float()`` then ``add_``
    gives without the fp32 copy). At Llama 3 8B's shapes (2048-token chunks, vocabulary 128K,
    bf16) that is 1.1 + 0.55 + 0.13 GiB where a whole ``[vocab, hidden]`` product in bf16 and its
    fp32 copy (1 + 2 GiB) were live before, with the fp32 logits still held."""
    n = h.shape[0]
    vocab = w.shape[0]
    gh = torch.empty_like(h)
    gw = torch.zeros(w.shape, dtype=torch.float32, device=w.device)
    gb = torch.zeros(vocab if b is not None else 0, dtype=torch.float32, device=w.device)
    g = grad.float()
    rows = vocab_block_rows(min(chunk, n), w.shape[1], vocab, h.element_size())
    for s, e in _chunks(n, chunk):
        logits = F.linear(h[s:e], w, b).float()
        t = target[s:e]
        valid = t != ignore_index
        p = logits.sub_(lse[s:e].unsqueeze(1)).exp_()  # softmax, in place
        p.scatter_add_(1, torch.where(valid, t, 0).unsqueeze(1),
                       -valid.to(p.dtype).unsqueeze(1))  # - one_hot(target)
        p.mul_((valid.to(p.dtype) * g).unsqueeze(1))
        if b is not None:
            gb += p.sum(0)
        dlogits = p.to(h.dtype)
        del logits, p  # the fp32 block dies here under bf16 (fp32: dlogits is the same storage)
        torch.mm(dlogits, w, out=gh[s:e])
        hc = h[s:e]
        for v0, v1 in _chunks(vocab, rows):
            gw[v0:v1].add_(dlogits[:, v0:v1].t() @ hc)
        del dlogits
    return gh, gw.to(w.dtype), gb.to(b.dtype) if b is not None else gb


@custom_op("autosp_lm::linear_cross_entropy", mutates_args=())
def _lce(h: torch.Tensor, w: torch.Tensor, b: Optional[torch.Tensor], target: torch.Tensor,
         ignore_index: int, chunk: int) -> tuple[torch.Tensor, torch.Tensor]:
    return forward_chunks(h, w, b, target, ignore_index, chunk)


@_lce.register_fake
def _(h, w, b, target, ignore_index, chunk):
    return h.new_empty((), dtype=torch.float32), h.new_empty(h.shape[0], dtype=torch.float32)


@custom_op("autosp_lm::linear_cross_entropy_backward", mutates_args=())
def _lce_backward(grad: torch.Tensor, h: torch.Tensor, w: torch.Tensor, b: Optional[torch.Tensor],
                  target: torch.Tensor, lse: torch.Tensor, ignore_index: int,
                  chunk: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return backward_chunks(grad, h, w, b, target, lse, ignore_index, chunk)


@_lce_backward.register_fake
def _(grad, h, w, b, target, lse, ignore_index, chunk):
    nb = w.shape[0] if b is not None else 0
    return (torch.empty_like(h), torch.empty_like(w),
            w.new_empty(nb, dtype=b.dtype if b is not None else torch.float32))


def _setup(ctx, inputs, output):
    h, w, b, target, ignore_index, chunk = inputs
    ctx.save_for_backward(h, w, b, target, output[1])
    ctx.ignore_index, ctx.chunk, ctx.has_bias = ignore_index, chunk, b is not None


def _backward(ctx, grad_total, grad_lse):
    h, w, b, target, lse = ctx.saved_tensors
    gh, gw, gb = _lce_backward(grad_total, h, w, b, target, lse, ctx.ignore_index, ctx.chunk)
    return gh, gw, (gb if ctx.has_bias else None), None, None, None


_lce.register_autograd(_backward, setup_context=_setup)


def linear_cross_entropy(input: torch.Tensor, target: torch.Tensor, lm_weight: torch.Tensor,
                         lm_bias: Optional[torch.Tensor] = None, ignore_index: int = -100,
                         reduction: str = "mean", chunk_tokens: Optional[int] = None
                         ) -> torch.Tensor:
    """``F.cross_entropy(F.linear(input, lm_weight, lm_bias).float(), target, ...)`` without the
    ``[tokens, vocab]`` logits: ``input`` is ``[tokens, hidden]``, ``target`` ``[tokens]``.

    ``reduction`` is ``"mean"`` (over targets other than ``ignore_index``; NaN when there are
    none, as ``F.cross_entropy``) or ``"sum"``. Under autocast the projection runs in the
    autocast dtype, as ``F.linear`` would.
    """
    if reduction not in ("mean", "sum"):
        raise ValueError(f"linear_cross_entropy: reduction must be 'mean' or 'sum', got {reduction!r}")
    h, w, b = input, lm_weight, lm_bias
    dev = h.device.type
    if torch.is_autocast_enabled(dev):
        dt = torch.get_autocast_dtype(dev)
        h, w = h.to(dt), w.to(dt)
        b = b.to(dt) if b is not None else None
    elif w.dtype != h.dtype:
        w = w.to(h.dtype)
        b = b.to(h.dtype) if b is not None else None
    chunk = chunk_tokens or chunk_tokens_for(h.shape[0], h.shape[1], w.shape[0])
    total, _ = _lce(h, w, b, target, ignore_index, int(chunk))
    if reduction == "sum":
        return total
    return total / (target != ignore_index).sum().to(torch.float32)


# F.cross_entropy's parameters in positional order (the loss rule and the fusion bind them alike)
CROSS_ENTROPY_PARAMS = ["input", "target", "weight", "size_average", "ignore_index", "reduce",
                        "reduction", "label_smoothing"]


# --------------------------------------------------------------------------------------------
# grad_scale
# --------------------------------------------------------------------------------------------

@custom_op("autosp_lm::grad_scale", mutates_args=())
def grad_scale(x: torch.Tensor, scale: float) -> torch.Tensor:
    """Identity in the forward; multiplies the gradient by ``scale`` in the backward.

    Used where a replicated value that requires grad meets the per-rank loss share: every rank
    back-propagates it fully, so its gradient is scaled by ``1/P`` to keep the sum over the SP
    group exact.
    """
    return x.clone()


@grad_scale.register_fake
def _(x, scale):
    return torch.empty_like(x)


def _grad_scale_setup(ctx, inputs, output):
    ctx.scale = inputs[1]


def _grad_scale_backward(ctx, grad):
    return grad * ctx.scale, None


grad_scale.register_autograd(_grad_scale_backward, setup_context=_grad_scale_setup)
