"""Rules: scans over the sequence — a local scan plus an exclusive scan of the per-rank totals.

Expects ``cumsum``/``cumprod``/``logcumsumexp``/``cummax``/``cummin`` (function, method or ATen
form) of a value sharded along the scanned dimension (not merged with another dimension).

Rewrites: this rank scans its own rows; the last row of that local scan is its total, and
``autosp_lm::exclusive_scan`` (one all-gather of the totals forward, one backward) gives every
rank the combination of the totals of the ranks before it, which is folded into every local row
(``+``, ``*``, ``logaddexp``, max/min). ``cummax``/``cummin`` also return global indices: the
local index plus the chunk start, or the index of the earlier rank's winner (two more all-gathers
of the totals and their indices, without gradient). Padding rows of a shifted layout are filled
with the identity before the scan. Ties go to the later position, as in PyTorch.

Afterwards: the scan is exact and stays sharded; scans along other dims are local. Scans of a
merged sequence (``x.reshape(-1).cumsum(0)`` over batch x sequence) fall back.
"""
from __future__ import annotations

import operator

import torch

from ..graph import example, is_shard, op_name, torch_ops
from .common import bcast, dim_arg, layout_refusal, logical_mask, ndim, norm_dim
from .features import along_dim
from .registry import rule

KIND = {"cumsum": "sum", "cumprod": "prod", "logcumsumexp": "logsumexp", "cummax": "max",
        "cummin": "min"}


def _identity(kind, dtype):
    if kind == "sum":
        return 0
    if kind == "prod":
        return 1
    if dtype.is_floating_point:
        return float("-inf") if kind in ("max", "logsumexp") else float("inf")
    if dtype == torch.bool:
        return kind == "min"
    info = torch.iinfo(dtype)
    return info.min if kind == "max" else info.max


@rule(*torch_ops(*KIND), accepts=("blocks",))
def scan(rw, n):
    x = n.args[0]
    s = rw.state(x)
    name = op_name(n)
    dim = dim_arg(n, 1)
    if not is_shard(s) or not isinstance(dim, int) or norm_dim(dim, ndim(x)) != s.dim:
        return along_dim(rw, n)
    if s.outer != 1 or s.inner != 1:  # blocks scan like positions: whole blocks per rank
        return rw.fallback(n, f"{name} over a sequence merged with other dims")
    refused = layout_refusal(rw, n, f"{name} over the sequence")
    if refused is not None:
        return refused
    kind, d, nd = KIND[name], s.dim, ndim(x)
    xl = rw.value(x)
    dtype = n.kwargs.get("dtype")
    if dtype is not None:
        xl = rw.method("to", xl, dtype)
    out_dtype = example(n)[0].dtype if kind in ("max", "min") else example(n).dtype
    if s.padded:  # rows outside the logical sequence must not contribute
        xl = rw.call(torch.where, bcast(rw, logical_mask(rw, s), d, nd), xl,
                     _identity(kind, out_dtype))
    grad = bool(getattr(example(x), "requires_grad", False))
    if kind in ("max", "min"):
        if s.block != 1:  # its global indices count positions, not blocks
            return rw.fallback(n, f"{name} over a sequence cut into blocks")
        return _cummax(rw, n, xl, s, kind, grad)
    local = rw.call(n.target if n.op == "call_function" else getattr(torch, name), xl, d)
    total = rw.method("contiguous", rw.call(torch.select, local, d, -1))
    before = rw.method("unsqueeze", rw.collective("exclusive_scan", total, kind,
                                                  requires_grad=grad), d)
    if kind == "sum":
        out = rw.call(operator.add, local, before)
    elif kind == "prod":
        out = rw.call(operator.mul, local, before)
    else:  # logaddexp without a NaN gradient where the local scan is still -inf
        empty = rw.call(operator.eq, local, float("-inf"))
        safe = rw.call(torch.where, empty, 0.0, local)
        out = rw.call(torch.where, empty, rw.method("expand_as", before, local),
                      rw.call(torch.logaddexp, safe, before))
    rw.bind(n, out)
    rw.report.rewrite("scans", n, f"{name} over the sequence: local scan + exclusive scan of "
                                  f"the per-rank totals ({kind})")
    return s


def _cummax(rw, n, xl, s, kind, grad):
    d = s.dim
    fn = torch.cummax if kind == "max" else torch.cummin
    local = rw.call(fn, xl, d)
    vals, idx = rw.call(operator.getitem, local, 0), rw.call(operator.getitem, local, 1)
    idx = rw.call(operator.add, idx, rw.call(operator.sub, rw.chunk_start(), s.pad_left))
    tv = rw.method("contiguous", rw.call(torch.select, vals, d, -1))
    ti = rw.method("contiguous", rw.call(torch.select, idx, d, -1))
    before = rw.collective("exclusive_scan", tv, kind, requires_grad=grad)
    # the index of the earlier ranks' winner: the last rank whose total is the best
    all_v = rw.collective("all_gather", rw.method("unsqueeze", rw.method("detach", tv), 0), 0,
                          requires_grad=False)
    all_i = rw.collective("all_gather", rw.method("unsqueeze", ti, 0), 0, requires_grad=False)
    # (the same graph on every rank, so that no rank drops a collective as dead code)
    P, sign = rw.info.world, 1 if kind == "max" else -1
    shape = [-1] + [1] * (ndim(n.args[0]) - 1)
    ranks = rw.method("reshape", rw.call(torch.arange, P, device=rw.device), shape)
    earlier = rw.call(operator.lt, ranks, rw.info.rank)
    vs = rw.call(torch.where, earlier, rw.call(operator.mul, all_v, sign), float("-inf"))
    best = rw.method("amax", vs, 0, True)
    hit = rw.call(operator.and_, rw.call(operator.eq, vs, best), earlier)
    win = rw.method("clamp", rw.method("amax", rw.call(torch.where, hit, ranks, -1), 0, True), 0)
    before_i = rw.method("squeeze", rw.call(torch.gather, all_i, 0, win), 0)
    cmp = operator.ge if kind == "max" else operator.le
    keep_local = rw.call(cmp, vals, rw.method("unsqueeze", before, d))
    bv = rw.method("unsqueeze", before, d)
    out_v = rw.call(torch.where, keep_local, vals, bv)
    out_i = rw.call(torch.where, keep_local, idx, rw.method("unsqueeze", before_i, d))
    rw.bind(n, rw.call(_pair, out_v, out_i))
    rw.report.rewrite("scans", n, f"cum{kind} over the sequence: local scan + exclusive scan of "
                                  f"the per-rank totals, global indices")
    return (s, s)


def _pair(values, indices):
    """``(values, indices)`` of a cummax/cummin, as the graph's tuple (getitem-able)."""
    return values, indices
