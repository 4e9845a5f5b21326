"""Rules: short-range mixing along the sequence — a halo exchange with the neighbouring ranks.

Expects ops that combine position ``t`` of a sharded value with positions ``t-k..t+k`` for a
small ``k``: ``F.conv1d`` along the sequence (the short causal depthwise convolutions of
Mamba/Hyena-style blocks, with ``padding=k-1`` and a cut, or after ``F.pad``), token shifts
written as ``F.pad``/``torch.roll``/``cat`` of slices, and operands of one op whose layouts differ
by a shift (``x[:, 1:] + g * x[:, :-1]``).

Rewrites: the rows a rank needs from its neighbours travel by ``autosp_lm::seq_window`` (the
halo exchange; its backward sends the halo gradient back and adds it to the owner's rows).

* :func:`shift_local` moves a sharded value by ``delta`` virtual positions (one window of
  ``|delta|`` rows, or of ``|delta| mod S`` cyclic for ``roll``);
* :func:`realign` moves an operand into another layout with the same logical length, so that
  differently shifted operands of one op meet position by position;
* ``F.conv1d`` over the sequence: the input with ``d*(k-1)`` halo rows (fewer or more for
  non-causal padding) is convolved without padding; the output layout keeps the causal
  alignment (output ``t`` where its receptive field ends);
* ``F.pad`` along the sequence fills the pad rows in place (an overhang when the result is longer
  than the input sequence: the pad rows outside it are zeros that no rank stores);
* ``cat`` along the sequence: every piece is placed by position (a mask per piece): sharded pieces
  shifted into place, short replicated pieces (``x[:, :1]``, a start token) by index.

Afterwards: no gather; per op at most one window per operand forward and one backward. Strided
convolutions, non-constant padding modes, a ``roll`` of a padded layout and pieces whose offset is
not a constant fall back.
"""
from __future__ import annotations

import operator

import sympy
import torch
import torch.fx as fx
import torch.nn.functional as F

from ..graph import Shard, example, integer, is_distributed, is_shard, static_int, torch_ops
from .common import (bcast, canon_value, dim_arg, in_range, layout_refusal, logical_mask, ndim, norm_dim,
                     requires_grad, rows_origin, seq_slice_layout, shift_local, window)
from .registry import rule



# ============================================================================ conv1d
_CONV_PARAMS = ["input", "weight", "bias", "stride", "padding", "dilation", "groups"]


def _one(v, what):
    if isinstance(v, (list, tuple)):
        if len(v) != 1:
            return None
        v = v[0]
    return v if isinstance(v, int) else None


def _crops_back(rw, n, out: Shard) -> bool:
    """Every user of ``n`` slices the sequence back inside the virtual sequence."""
    for u in n.users:
        new = seq_slice_layout(rw, u, n, out)
        if new is None or new.overhang:
            return False
    return True


@rule(*torch_ops("conv1d"), accepts=("overhang",))
def conv1d(rw, n):
    b = dict(zip(_CONV_PARAMS, n.args))
    b.update(n.kwargs)
    x, w, bias = b["input"], b["weight"], b.get("bias")
    s = rw.state(x)
    nd = ndim(x)
    if (not is_shard(s) or s.merged or s.dim != nd - 1 or any(
            isinstance(t, fx.Node) and (is_distributed(rw.state(t)) or rw.is_full(t))
            for t in (w, bias))):
        return rw.fallback(n, "convolution over other dims than the sequence")
    refused = layout_refusal(rw, n, "a convolution along the sequence")
    if refused is not None:
        return refused
    stride, dil = _one(b.get("stride", 1), "stride"), _one(b.get("dilation", 1), "dilation")
    if stride != 1 or dil is None:
        return rw.fallback(n, "strided convolution along the sequence")
    k = static_int(example(w).shape[-1], "kernel size")
    span = dil * (k - 1)
    padding = b.get("padding", 0)
    if padding == "valid":
        pleft = pright = 0
    elif padding == "same":
        pleft, pright = span // 2, span - span // 2
    else:
        p = _one(padding, "padding")
        if p is None:
            return rw.fallback(n, "convolution padding")
        pleft = pright = p
    # output layout: keep the causal alignment (output t where its receptive field ends)
    K = s.pad_left + s.pad_right - pleft - pright + span  # S - output length
    PL = s.pad_left - pleft + span
    if K >= 0 and not 0 <= PL <= K:
        PL = min(max(PL, 0), K)
    out = Shard(s.dim, 1, 1, PL, K - PL)
    if out.overhang and not _crops_back(rw, n, out):
        return rw.fallback(n, "convolution output longer than the sequence, used uncut")
    xl = rw.value(x)
    if s.pad_left > 0 or s.pad_right > 0:  # padding rows hold garbage: the conv reads zeros
        xl = rw.call(torch.where, bcast(rw, logical_mask(rw, s), s.dim, nd), xl, 0)
    left = PL - s.pad_left + pleft
    right = s.pad_left - PL - pleft + span
    win = window(rw, xl, s.dim, max(left, 0), max(right, 0), requires_grad(x))
    if left < 0 or right < 0:
        win = rw.call(torch.narrow, win, s.dim, max(left, 0) - left,
                      rw.call(operator.add, rw.chunk_len(), span))
    kwargs = {key: rw.map(v) for key, v in b.items() if key not in ("input", "padding")}
    rw.bind(n, rw.emit(n, (win,), dict(kwargs, padding=0)))
    rw.report.rewrite("short-range mixing", n,
                      f"conv1d over the sequence (kernel {k}, dilation {dil}): halo of "
                      f"{max(left, 0)} rows before, {max(right, 0)} after (seq_window)")
    return out


# ============================================================================ pad / roll / cat
def _constant(rw, v):
    """``v`` as an int when it is one or a symbolic size that is a constant, else ``v``."""
    if isinstance(v, fx.Node):
        e = integer(canon_value(rw, v))
        return v if e is None else e
    return v


@rule(*torch_ops("pad"), accepts=("overhang",))
def pad(rw, n):
    x = n.args[0]
    s = rw.state(x)
    p = dim_arg(n, 1, key="pad")
    nd = ndim(x)
    mode = dim_arg(n, 2, "constant", key="mode")
    value = dim_arg(n, 3, None, key="value")
    value = 0 if value is None else value
    if isinstance(p, (list, tuple)):  # symbolic amounts that are constants (a pad to a multiple)
        p = [_constant(rw, v) for v in p]
    if not is_shard(s) or not isinstance(p, (list, tuple)) or not all(
            isinstance(v, int) for v in p):
        return rw.fallback(n, "pad of the sequence")
    pairs = {nd - 1 - i // 2: (p[i], p[i + 1]) for i in range(0, len(p), 2)}
    a, b = pairs.pop(s.dim, (0, 0))
    if not a and not b:
        if s.overhang:
            return rw.fallback(n, "pad of an overhanging sequence")
        rw.emit_local(n)
        return s
    if mode != "constant" or s.merged or not isinstance(value, (int, float)):
        return rw.fallback(n, "pad along the sequence (non-constant mode)")
    refused = layout_refusal(rw, n, "a pad along the sequence")
    if refused is not None:
        return refused
    xl = rw.value(x)
    if any(v for pr in pairs.values() for v in pr):  # the other dims first, locally
        rest = [v for i in range(0, len(p), 2) for v in
                ((0, 0) if nd - 1 - i // 2 == s.dim else (p[i], p[i + 1]))]
        xl = rw.call(F.pad, xl, rest, value=value)
    PL, PR = s.pad_left - a, s.pad_right - b  # x stays in place
    total = PL + PR
    if PL < 0 or PR < 0:
        if total >= 0:  # fits in the sequence: move it in
            PL2 = min(max(PL, 0), total)
            xl, PL, PR = shift_local(rw, x, xl, s, PL2 - PL), PL2, total - PL2
        elif value != 0 or s.overhang:
            return rw.fallback(n, "pad making the sequence longer, with a non-zero value")
    # output rows that hold x's logical rows; the rest of the output's logical range is `value`
    lo = PL + a + max(-a, 0)
    hi = rw.info.symbol - PR - b - max(-b, 0)
    keep = bcast(rw, in_range(rw, sympy.Integer(lo), hi), s.dim, nd)
    rw.bind(n, rw.call(torch.where, keep, xl, value))
    rw.report.rewrite("short-range mixing", n,
                      f"pad of the sequence by ({a}, {b}): in place"
                      + (" with a halo shift" if PL != s.pad_left - a else ""))
    return Shard(s.dim, 1, 1, PL, PR)


@rule(*torch_ops("roll"))
def roll(rw, n):
    x = n.args[0]
    s = rw.state(x)
    shifts = dim_arg(n, 1, key="shifts")
    dims = dim_arg(n, 2, None, key="dims")
    if not is_shard(s) or dims is None:
        return rw.fallback(n, "roll over the sequence (no dims)")
    refused = layout_refusal(rw, n, "a roll along the sequence")
    if refused is not None:
        return refused
    dims = [dims] if isinstance(dims, int) else list(dims)
    shifts = [shifts] if isinstance(shifts, int) else list(shifts)
    dims = [norm_dim(d, ndim(x)) for d in dims]
    if s.dim not in dims:  # a roll along other dims only: local
        rw.emit_local(n)
        return s
    i = dims.index(s.dim)
    k = shifts[i] if len(shifts) == len(dims) else None
    if not isinstance(k, int) or s.padded or s.merged:
        return rw.fallback(n, "roll of a shifted or merged sequence")
    xl = rw.value(x)
    others = [(sh, d) for j, (sh, d) in enumerate(zip(shifts, dims)) if j != i]
    if others:
        xl = rw.call(torch.roll, xl, [o[0] for o in others], [o[1] for o in others])
    rw.bind(n, shift_local(rw, x, xl, s, k, cyclic=True))
    rw.report.rewrite("short-range mixing", n, f"roll of the sequence by {k}: cyclic halo "
                                               f"(seq_window)")
    return s


def _length(rw, t, dim):
    return rw.info.shape(t)[dim]


def assemble(rw, n, tensors, dim: int):
    """``cat(tensors, dim)`` along the sequence: each piece placed at its positions."""
    refused = layout_refusal(rw, n, "a cat along the sequence")
    if refused is not None:
        return refused
    info = rw.info
    nd = len(info.shape(n))
    lengths = [_length(rw, t, dim) for t in tensors]
    offsets, acc = [], sympy.Integer(0)
    for L in lengths:
        offsets.append(acc)
        acc = acc + L
    K = integer(info.symbol - acc)
    if K is None or K < 0:
        return rw.fallback(n, "cat making a sequence longer than the input")
    shards = [(i, rw.state(t)) for i, t in enumerate(tensors) if is_shard(rw.state(t))]
    if any(s.merged or s.dim != dim for _, s in shards):
        return rw.fallback(n, "cat of merged sequences")
    cands = [0] + [s.pad_left - integer(offsets[i]) for i, s in shards
                   if integer(offsets[i]) is not None]
    best = None
    for PL in cands:
        if not 0 <= PL <= K:
            continue
        deltas = [integer(PL + offsets[i] - s.pad_left) for i, s in shards]
        if any(d is None for d in deltas):
            continue
        moves = sum(1 for d in deltas if d)
        if best is None or moves < best[1]:
            best = (PL, moves)
    if best is None:
        return rw.fallback(n, "cat of sequence pieces at non-constant offsets")
    PL = best[0]
    dtype = example(n).dtype
    out = None
    for i, t in enumerate(tensors):
        lo, L = PL + offsets[i], lengths[i]
        if integer(L) == 0:
            continue
        s = rw.state(t)
        if is_shard(s):
            v = shift_local(rw, t, rw.value(t), s, integer(lo - s.pad_left))
        elif info.has_seq(L):
            tgt = Shard(dim, 1, 1, integer(lo), integer(info.symbol - lo - L))
            if tgt.pad_left is None or tgt.pad_right is None:
                return rw.fallback(n, "cat of a full piece at a non-constant offset")
            v = rw.localize(t, tgt)
        else:
            length = static_int(L, f"length of a piece of {n.name}")
            origin = rows_origin(rw, t)
            delta = None if origin is None else integer(lo - origin[1])
            if delta is not None:  # the piece is rows of a sharded x: shift x into place
                src, src_shard = origin[0], rw.state(origin[0])
                v = shift_local(rw, src, rw.value(src), src_shard, delta)
            else:
                rel = rw.call(operator.sub, rw.positions(), rw.sym(lo))
                idx = rw.method("clamp", rel, 0, length - 1)
                v = rw.call(torch.index_select, rw.value(t), dim, idx)
        if example(t).dtype != dtype:
            v = rw.method("to", v, dtype)
        if out is None:
            out = v
        else:
            mask = bcast(rw, in_range(rw, lo, lo + L), dim, nd)
            out = rw.call(torch.where, mask, v, out)
    rw.bind(n, out)
    rw.report.rewrite("short-range mixing", n,
                      f"cat of {len(tensors)} pieces along the sequence: placed by position, "
                      f"{best[1]} halo shift(s)")
    return Shard(dim, 1, 1, PL, K - PL)
