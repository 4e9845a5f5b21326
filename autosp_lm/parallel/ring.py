"""Hand-written ring attention (``--ring``), load balanced (zigzag), exact against one device.

Each of the ``P`` ranks keeps its query block; key/value blocks travel around the ring (rank
``r`` sends to ``r+1`` and receives from ``r-1``) with point-to-point ``batch_isend_irecv``
issued *before* the block computation, so the transfer of the next block overlaps the attention
of the current one. The partial results of the blocks are merged exactly with an online softmax:
the attention kernel returns ``(out_b, lse_b)`` (the log-sum-exp of each query row's scores) and

    lse = logaddexp(lse_a, lse_b),   out = exp(lse_a - lse) * out_a + exp(lse_b - lse) * out_b.

**Zigzag split and causal masking.** The sequence is cut into ``2P`` chunks and rank ``r`` holds
chunks ``r`` and ``2P-1-r`` (``q = [q0 | q1]``, likewise the kv blocks). For the kv block of rank
``j`` (chunks ``j`` and ``2P-1-j``):

* ``j == r`` (diagonal): ordinary causal attention over the local ``2c`` tokens (chunk ``r``
  precedes chunk ``2P-1-r``, so the local token order is the global order);
* ``j < r``: both query chunks see kv chunk ``j`` entirely and neither sees ``2P-1-j``
  (``> 2P-1-r``): full attention of all local queries to the first half of the block;
* ``j > r``: ``q0`` (chunk ``r < j``) sees nothing, ``q1`` (chunk ``2P-1-r >= P > j`` and
  ``> 2P-1-j``) sees the whole block: full attention of the second half of the queries.

So every rank computes one causal diagonal plus ``P-1`` half-size full blocks: equal work.

**Backward** is exact and stores only the local ``q, k, v``, the merged ``out`` and ``lse``
(O(S/P) activation memory per rank): with the *global* ``out`` and ``lse`` a flash-attention
backward kernel run on one block returns exactly that block's contribution to ``dq, dk, dv``
(the softmax probabilities ``exp(s - lse)`` and the row terms ``rowsum(dout * out)`` are then the
global ones). K/V travel the ring again; the ``dk/dv`` accumulators travel with them (one step
behind, overlapped with the next block) and a final send returns each block's gradient to its
owner.

**Grouped-query attention**: the ring sends the ``Hkv`` un-repeated kv heads; each block is
expanded to the query heads just before the kernel (query head ``h`` uses kv head
``h // (H/Hkv)``) and the kernel's kv gradients are summed back over each group.

**Kernels** (chosen per device, dtype and head dim, verified once against the math path):
CPU ``aten._scaled_dot_product_flash_attention_for_cpu`` (+ ``_backward``); CUDA
``aten._scaled_dot_product_flash_attention`` for fp16/bf16, ``_scaled_dot_product_efficient_attention``
otherwise; an explicit math implementation as the fallback (``kernel="math"``).

**torch.compile**: forward and backward are ``torch.library`` custom ops
(``autosp_lm::ring_attention`` with a registered autograd formula calling
``autosp_lm::ring_attention_backward``) with fake implementations, so Dynamo/AOTAutograd/Inductor
treat the whole ring as one opaque node in the forward and backward graphs: no graph breaks.
"""
from __future__ import annotations

import math
from typing import Optional

import torch
import torch.distributed as dist
from torch.library import custom_op

from ..models.attention import AttentionFn
from . import collectives
from .slicing import CONTIGUOUS, ZIGZAG, SlicedSPStrategy

aten = torch.ops.aten

KERNELS = ("auto", "cpu_flash", "cuda_flash", "cuda_efficient", "math")

_HALF = (torch.float16, torch.bfloat16)


def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


# --------------------------------------------------------------------------------------------
# one block: attention of a query block to a key/value block, with log-sum-exp
# --------------------------------------------------------------------------------------------
def _causal_mask(sq: int, sk: int, device) -> torch.Tensor:
    """True where query ``i`` may not see key ``j`` (top-left aligned, as the SDPA kernels)."""
    return torch.ones(sq, sk, dtype=torch.bool, device=device).triu(1)


def _math_fwd(q, k, v, causal: bool, scale: float):
    acc = _acc_dtype(q.dtype)
    s = torch.matmul(q.to(acc), k.to(acc).transpose(-1, -2)) * scale
    if causal:
        s = s.masked_fill(_causal_mask(s.size(-2), s.size(-1), s.device), float("-inf"))
    lse = torch.logsumexp(s, dim=-1)
    p = torch.exp(s - lse.unsqueeze(-1))
    return torch.matmul(p, v.to(acc)).to(q.dtype), lse


def _math_bwd(dout, q, k, v, out, lse, causal: bool, scale: float):
    acc = _acc_dtype(q.dtype)
    qa, ka, va, da = q.to(acc), k.to(acc), v.to(acc), dout.to(acc)
    s = torch.matmul(qa, ka.transpose(-1, -2)) * scale
    if causal:
        s = s.masked_fill(_causal_mask(s.size(-2), s.size(-1), s.device), float("-inf"))
    p = torch.exp(s - lse.to(acc).unsqueeze(-1))
    dv = torch.matmul(p.transpose(-1, -2), da)
    dp = torch.matmul(da, va.transpose(-1, -2))
    delta = (da * out.to(acc)).sum(-1, keepdim=True)
    ds = p * (dp - delta)
    dq = torch.matmul(ds, ka) * scale
    dk = torch.matmul(ds.transpose(-1, -2), qa) * scale
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


_LSE_ALIGN = 32  # the memory-efficient CUDA kernel pads its log-sum-exp to a multiple of 32


def _cuda_aux(kernel: str, q, k, v):
    """The auxiliary outputs (rng state, cumulative lengths) the CUDA backward ops expect, taken
    from a one-row forward call so their types match this PyTorch build (dropout is 0: unused)."""
    q1, k1, v1 = q[:, :, :1].contiguous(), k[:, :, :1].contiguous(), v[:, :, :1].contiguous()
    if kernel == "cuda_flash":
        res = aten._scaled_dot_product_flash_attention(q1, k1, v1, 0.0, False, False)
        return res[2], res[3], res[6], res[7]
    res = aten._scaled_dot_product_efficient_attention(q1, k1, v1, None, True, 0.0, False)
    return res[2], res[3]


def block_forward(kernel: str, q, k, v, causal: bool, scale: float):
    """``(out [B,H,Sq,D] in q's dtype, lse [B,H,Sq] in float32/float64)`` of one block (equal
    head counts)."""
    if kernel == "cpu_flash":
        out, lse = aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, scale=scale)
    elif kernel == "cuda_flash":
        res = aten._scaled_dot_product_flash_attention(q, k, v, 0.0, causal, False, scale=scale)
        out, lse = res[0], res[1]
    elif kernel == "cuda_efficient":
        res = aten._scaled_dot_product_efficient_attention(q, k, v, None, True, 0.0, causal, scale=scale)
        out, lse = res[0], res[1][:, :, :q.size(2)]
    elif kernel == "math":
        out, lse = _math_fwd(q, k, v, causal, scale)
    else:
        raise ValueError(f"unknown ring attention kernel {kernel!r}; choose one of {KERNELS}")
    return out, lse.to(_acc_dtype(q.dtype))


def block_backward(kernel: str, dout, q, k, v, out, lse, causal: bool, scale: float, aux=None):
    """``(dq, dk, dv)`` of one block given the *global* ``out``/``lse`` of the query rows."""
    if kernel == "cpu_flash":
        return aten._scaled_dot_product_flash_attention_for_cpu_backward(
            dout, q, k, v, out, lse, 0.0, causal, scale=scale)
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
        dq, dk, dv, _ = aten._scaled_dot_product_efficient_attention_backward(
            dout, q, k, v, None, out, lse_p, seed, offset, 0.0, [True, True, True, False], causal,
            scale=scale)
        return dq, dk, dv
    if kernel == "math":
        return _math_bwd(dout, q, k, v, out, lse, causal, scale)
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
            aux = _cuda_aux(kernel, q, k, v) if kernel.startswith("cuda") else None
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


def select_kernel(device: torch.device, dtype: torch.dtype, head_dim: int, requested: str = "auto") -> str:
    """The block kernel for tensors on ``device`` of ``dtype``: ``requested`` unless ``"auto"``."""
    if requested not in KERNELS:
        raise ValueError(f"unknown ring attention kernel {requested!r}; choose one of {KERNELS}")
    if requested != "auto":
        return requested
    key = (device.type, dtype, head_dim)
    if key not in _SELECTED:
        if device.type == "cpu":
            candidates = ["cpu_flash"]
        elif device.type == "cuda":
            candidates = []
            if dtype in _HALF and head_dim % 8 == 0 and head_dim <= 256:
                candidates.append("cuda_flash")
            if dtype in _HALF + (torch.float32,):
                candidates.append("cuda_efficient")
        else:
            candidates = []
        _SELECTED[key] = next((c for c in candidates if _probe(c, device, dtype, head_dim)), "math")
    return _SELECTED[key]


def selected_kernels() -> dict:
    """The kernels chosen so far, ``{"cpu/torch.float32/16": "cpu_flash", ...}`` (for reports)."""
    return {f"{d}/{t}/{h}": k for (d, t, h), k in _SELECTED.items()}


# --------------------------------------------------------------------------------------------
# the ring
# --------------------------------------------------------------------------------------------
class _Ring:
    """Point-to-point neighbours of this rank in the SP group ``group`` (by registered name)."""

    def __init__(self, group: str):
        if not group:
            self.pg, self.world, self.rank = None, 1, 0
            return
        self.pg = collectives.resolve_group(group)
        self.world = dist.get_world_size(self.pg)
        self.rank = dist.get_rank(self.pg)
        ranks = dist.get_process_group_ranks(self.pg)
        self.next = ranks[(self.rank + 1) % self.world]
        self.prev = ranks[(self.rank - 1) % self.world]

    def shift(self, send: torch.Tensor, tag: int):
        """Start sending ``send`` to the next rank and receiving the previous rank's into a new
        buffer; returns ``(buffer, requests)``."""
        recv = torch.empty_like(send)
        ops = [dist.P2POp(dist.isend, send, self.next, self.pg, tag),
               dist.P2POp(dist.irecv, recv, self.prev, self.pg, tag)]
        return recv, dist.batch_isend_irecv(ops)


def _wait(reqs) -> None:
    for r in reqs:
        r.wait()


def ring_blocks(rank: int, src: int, length: int, causal: bool, zigzag: bool):
    """The (query slice, key slice, causal) pieces rank ``rank`` computes against the kv block of
    rank ``src`` (``length`` local tokens); empty when the block is entirely masked."""
    every = slice(0, length)
    if not causal:
        return [(every, every, False)]
    if src == rank:
        return [(every, every, True)]
    if not zigzag:  # contiguous blocks: earlier ranks fully visible, later ones masked
        return [(every, every, False)] if src < rank else []
    half = length // 2
    if src < rank:
        return [(every, slice(0, half), False)]
    return [(slice(half, length), every, False)]


def _expand(x: torch.Tensor, groups: int) -> torch.Tensor:
    return x if groups == 1 else x.repeat_interleave(groups, dim=1)


def _reduce_groups(dx: torch.Tensor, groups: int) -> torch.Tensor:
    if groups == 1:
        return dx
    b, h, s, d = dx.shape
    return dx.reshape(b, h // groups, groups, s, d).sum(2)


def _ring_forward(q, k, v, causal: bool, zigzag: bool, scale: float, group: str, kernel: str):
    ring = _Ring(group)
    kernel = select_kernel(q.device, q.dtype, q.size(-1), kernel)
    groups = q.size(1) // k.size(1)
    length = q.size(2)
    acc = _acc_dtype(q.dtype)
    out = lse = None
    kv = torch.stack([k, v])  # one message per step: [2, B, Hkv, L, D]
    for step in range(ring.world):
        if step + 1 < ring.world:
            nxt, reqs = ring.shift(kv, tag=0)
        src = (ring.rank - step) % ring.world
        kk, vv = _expand(kv[0], groups), _expand(kv[1], groups)
        for qs, ks, blk_causal in ring_blocks(ring.rank, src, length, causal, zigzag):
            o_b, l_b = block_forward(kernel, q[:, :, qs].contiguous(), kk[:, :, ks].contiguous(),
                                     vv[:, :, ks].contiguous(), blk_causal, scale)
            if out is None:  # step 0, the diagonal block, covers every query row
                out, lse = o_b.to(acc), l_b.clone()
                continue
            l_old = lse[:, :, qs]
            l_new = torch.logaddexp(l_old, l_b)
            out[:, :, qs] = (torch.exp(l_old - l_new).unsqueeze(-1) * out[:, :, qs]
                             + torch.exp(l_b - l_new).unsqueeze(-1) * o_b.to(acc))
            lse[:, :, qs] = l_new
        if step + 1 < ring.world:
            _wait(reqs)
            kv = nxt
    return out.to(q.dtype).contiguous(), lse.contiguous()


def _ring_backward(dout, q, k, v, out, lse, causal: bool, zigzag: bool, scale: float, group: str,
                   kernel: str):
    ring = _Ring(group)
    kernel = select_kernel(q.device, q.dtype, q.size(-1), kernel)
    aux = _cuda_aux(kernel, q, k, v) if kernel.startswith("cuda") else None
    groups = q.size(1) // k.size(1)
    length = q.size(2)
    acc = _acc_dtype(q.dtype)
    dq = torch.zeros(q.shape, dtype=acc, device=q.device)
    kv = torch.stack([k, v])
    dkv_recv = dkv_reqs = dkv_sent = None
    for step in range(ring.world):
        if step + 1 < ring.world:
            nxt, kv_reqs = ring.shift(kv, tag=1)
        src = (ring.rank - step) % ring.world
        kk, vv = _expand(kv[0], groups), _expand(kv[1], groups)
        dkv = torch.zeros(kv.shape, dtype=acc, device=q.device)  # grads for the block of `src`
        for qs, ks, blk_causal in ring_blocks(ring.rank, src, length, causal, zigzag):
            dq_b, dk_b, dv_b = block_backward(
                kernel, dout[:, :, qs].contiguous(), q[:, :, qs].contiguous(),
                kk[:, :, ks].contiguous(), vv[:, :, ks].contiguous(), out[:, :, qs].contiguous(),
                lse[:, :, qs].contiguous(), blk_causal, scale, aux)
            dq[:, :, qs] += dq_b
            dkv[0, :, :, ks] += _reduce_groups(dk_b.to(acc), groups)
            dkv[1, :, :, ks] += _reduce_groups(dv_b.to(acc), groups)
        if ring.world > 1:
            if dkv_reqs is not None:  # the accumulator for `src` from the previous rank
                _wait(dkv_reqs)
                dkv += dkv_recv
            dkv_sent = dkv
            dkv_recv, dkv_reqs = ring.shift(dkv_sent, tag=2)
        if step + 1 < ring.world:
            _wait(kv_reqs)
            kv = nxt
    if ring.world > 1:  # after P steps the accumulator of my own block arrives from rank r-1
        _wait(dkv_reqs)
        dkv = dkv_recv
    del dkv_sent
    # separate storages for dk and dv (outputs of a custom op must not alias each other)
    return dq.to(q.dtype), dkv[0].to(k.dtype, copy=True), dkv[1].to(v.dtype, copy=True)


# --------------------------------------------------------------------------------------------
# custom ops (one opaque node each for torch.compile) and autograd
# --------------------------------------------------------------------------------------------
@custom_op("autosp_lm::ring_attention", mutates_args=())
def _ring_attention_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool,
                       zigzag: bool, scale: float, group: str, kernel: str) -> tuple[torch.Tensor, torch.Tensor]:
    return _ring_forward(q, k, v, causal, zigzag, scale, group, kernel)


@_ring_attention_op.register_fake
def _(q, k, v, causal, zigzag, scale, group, kernel):
    return q.new_empty(q.shape), q.new_empty(q.shape[:3], dtype=_acc_dtype(q.dtype))


@custom_op("autosp_lm::ring_attention_backward", mutates_args=())
def _ring_attention_backward_op(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                                v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor, causal: bool,
                                zigzag: bool, scale: float, group: str,
                                kernel: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return _ring_backward(dout, q, k, v, out, lse, causal, zigzag, scale, group, kernel)


@_ring_attention_backward_op.register_fake
def _(dout, q, k, v, out, lse, causal, zigzag, scale, group, kernel):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def _setup_context(ctx, inputs, output):
    q, k, v, ctx.causal, ctx.zigzag, ctx.scale, ctx.group, ctx.kernel = inputs
    out, lse = output
    ctx.mark_non_differentiable(lse)
    ctx.save_for_backward(q, k, v, out, lse)


def _backward(ctx, dout, _dlse):
    q, k, v, out, lse = ctx.saved_tensors
    dq, dk, dv = _ring_attention_backward_op(dout.contiguous(), q, k, v, out, lse, ctx.causal,
                                             ctx.zigzag, ctx.scale, ctx.group, ctx.kernel)
    return dq, dk, dv, None, None, None, None, None


_ring_attention_op.register_autograd(_backward, setup_context=_setup_context)


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool = True,
                   group: Optional[dist.ProcessGroup] = None, zigzag: bool = True,
                   kernel: str = "auto", scale: Optional[float] = None,
                   sp_size: Optional[int] = None) -> torch.Tensor:
    """Exact attention of this rank's queries to the keys/values of every rank of ``group``.

    ``q [B, H, L, D]``, ``k``/``v`` ``[B, Hkv, L, D]`` hold this rank's ``L`` tokens: with
    ``zigzag`` (the load-balanced split of :mod:`slicing`) chunks ``r`` and ``2P-1-r`` of ``2P``,
    otherwise contiguous block ``r`` of ``P``. Returns ``[B, H, L, D]``. ``group=None`` (or a
    group of one) is plain local attention through the same kernels.
    """
    world = sp_size if sp_size is not None else (1 if group is None else dist.get_world_size(group))
    name = collectives.group_name(group) if world > 1 else ""
    return _ring_attention(q, k, v, causal, zigzag, kernel, name, world, scale)


def _ring_attention(q, k, v, causal: bool, zigzag: bool, kernel: str, group_name: str, world: int,
                    scale: Optional[float] = None) -> torch.Tensor:
    if k.shape != v.shape or q.dim() != 4 or k.dim() != 4:
        raise ValueError(f"ring attention expects q [B, H, L, D] and k, v [B, Hkv, L, D]; got "
                         f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    if q.size(1) % k.size(1):
        raise ValueError(f"ring attention: {q.size(1)} query heads are not a multiple of "
                         f"{k.size(1)} key/value heads")
    if q.size(2) != k.size(2):
        raise ValueError(f"ring attention: local query length {q.size(2)} differs from the local "
                         f"key length {k.size(2)}")
    if causal and zigzag and world > 1 and q.size(2) % 2:
        raise ValueError(f"ring attention: the zigzag split needs an even local length (two "
                         f"chunks per rank), got {q.size(2)}")
    scale = 1.0 / math.sqrt(q.size(-1)) if scale is None else float(scale)
    out, _ = _ring_attention_op(q.contiguous(), k.contiguous(), v.contiguous(), causal, zigzag,
                                scale, group_name, kernel)
    return out


class RingAttention:
    """An attention implementation for :func:`autosp_lm.models.attention.use_attention`:
    :func:`ring_attention` over ``group``. Attention dropout cannot be made exact and is refused."""

    def __init__(self, group: Optional[dist.ProcessGroup], sp_size: Optional[int] = None,
                 zigzag: bool = True, kernel: str = "auto"):
        if kernel not in KERNELS:
            raise ValueError(f"unknown ring attention kernel {kernel!r}; choose one of {KERNELS}")
        self.group = group
        self.sp_size = sp_size if sp_size is not None else (
            1 if group is None else dist.get_world_size(group))
        # resolved now (outside any compiled region) unless there is no group object yet
        self._group_name = ("" if self.sp_size == 1 else
                            collectives.group_name(group) if group is not None else None)
        self.zigzag = zigzag
        self.kernel = kernel

    @property
    def group_name(self) -> str:
        """The registered name of the SP group ("" for a single rank), looked up once."""
        if self._group_name is None:
            self._group_name = collectives.group_name(self.group)
        return self._group_name

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool = True,
                 dropout_p: float = 0.0) -> torch.Tensor:
        if dropout_p:
            raise ValueError(f"--ring: attention dropout ({dropout_p}) is not supported by the ring "
                             f"attention baseline; train with --hidden-dropout 0")
        return _ring_attention(q, k, v, causal, self.zigzag, self.kernel, self.group_name,
                               self.sp_size)


class RingStrategy(SlicedSPStrategy):
    """``--ring``: zigzag (load-balanced) sequence split, attention swapped for :class:`RingAttention`.

    Options (besides ``compile``): ``kernel`` (one of :data:`KERNELS`, default ``"auto"``),
    ``backend`` (torch.compile backend, default inductor), ``fullgraph``.
    """

    name = "ring"
    layout = ZIGZAG

    def __init__(self, ps, *, compile: bool = False, sac: bool = False, kernel: str = "auto",
                 **options):
        super().__init__(ps, compile=compile, sac=sac, **options)
        if kernel not in KERNELS:
            raise ValueError(f"--ring: unknown kernel {kernel!r}; choose one of {KERNELS}")
        self.kernel = kernel

    def make_attention(self, model: torch.nn.Module) -> AttentionFn:
        cfg = getattr(model, "config", None)
        if cfg is not None and getattr(cfg, "dropout", 0.0):
            raise ValueError(f"--ring: attention dropout ({cfg.dropout}) is not supported by the "
                             f"ring attention baseline; train with --hidden-dropout 0")
        return RingAttention(self.ps.sp_group if self.ps.sp_size > 1 else None, self.ps.sp_size,
                             zigzag=self.layout == ZIGZAG, kernel=self.kernel)

    def describe(self) -> str:
        chosen = selected_kernels()
        kern = self.kernel if self.kernel != "auto" else (
            "auto (" + ", ".join(f"{k}: {v}" for k, v in chosen.items()) + ")" if chosen
            else "auto (chosen at the first step)")
        return (f"ring of {self.ps.sp_size} ranks with point-to-point kv exchange overlapped with "
                f"compute, exact log-sum-exp merge, block kernel {kern}")


__all__ = ["ring_attention", "RingAttention", "RingStrategy", "select_kernel", "selected_kernels",
           "block_forward", "block_backward", "ring_blocks", "KERNELS", "CONTIGUOUS", "ZIGZAG"]
