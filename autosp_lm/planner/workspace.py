"""Kernels' own workspace: memory an attention kernel allocates while it runs, beyond its outputs.

The liveness simulation (:mod:`.liveness`) counts every op's outputs. A few kernels also
allocate scratch memory of their own for as long as they run; where the rest of the step's live
set is small (AutoSP with sequence tiling: per layer only the layer's input, the attention output
and its logsumexp are live in the backward) that moment can be the step's peak. The attention
kernels are the ones that matter: their scratch grows with the head count and the sequence (a
copy of the output's gradient, the query gradient's accumulator) or with the thread count.

:func:`kernel_workspace` returns a function ``(op, args) -> bytes`` for a *target* device: the
traced graphs hold the CPU kernels (the planner traces on CPU), so for ``cuda`` a CPU attention
op is priced as the CUDA kernel that the same step calls there. The formulas follow the
kernels' allocations (sizes only; checked against the CPU allocator's own count in
``tests/compiler/test_workspace.py``):

``cpu`` (``aten._scaled_dot_product_flash_attention_for_cpu`` and its ``_backward``; ATen's
``cpu_flash_attention``): queries in blocks of ``qs`` (256 rows from 768 queries on, 64 from
192, else 32; at most the query length) against keys in blocks of ``kvs`` (512, at most the
key length); one block of scratch per thread of the intra-op pool, allocated up front:

* forward: ``qs x kvs + 2 qs + qs x D`` values of the accumulation type (fp32; fp64 for fp64),
  plus ``qs x kvs`` in the input dtype for bf16/fp16;
* backward: ``2 qs x kvs`` accumulation values (the attention block and its gradient), plus
  as many in the input dtype for bf16/fp16, plus ``qs`` accumulation values per working thread
  (``rowsum(dO * O)`` of a block), plus a contiguous copy of the output's gradient when its
  ``[B, S, H, D]`` view is not contiguous (the kernel works in that layout).

  These are the buffers of the kernel's reference path, which every x86_64 CPU takes with
  oneDNN off (:func:`reference_kernels`): there the formulas equal the allocator's count to the
  byte in fp32 and bf16 alike, on AMX, AVX512 and AVX2 hosts. With oneDNN on
  (``torch.backends.mkldnn.enabled``, the default) a host that oneDNN deems bf16-capable takes
  other bf16 paths whose buffers come from the library, not from the kernel's code: on an AMX
  host (torch 2.13, one thread) the forward packs K and V (``2 B H S D`` bf16 values more,
  plus about ``qs x D`` fp32 values a thread) and the backward's products allocate oneDNN
  scratch (0.17 MiB at one thread, 0.64 MiB at two); on an AVX512-BF16 host without AMX the
  backward's scratch only (0.18 MiB at one thread, 0.36-0.51 MiB at two, depending on whether
  the threads' scratch overlaps). Those are library workspaces, as cuBLAS's is on CUDA: not
  modelled (the reserve stands for them), and the planner's CPU validation measures with oneDNN
  off (``planner.check.measure_step``), so that it checks the same thing on every host.

``cuda`` (FlashAttention-2 in ``aten._scaled_dot_product_flash_attention_backward``, what the
CPU ops become on a GPU in bf16/fp16): the query gradient's fp32 accumulator ``[B, Sq', H,
D']`` and ``softmax_d`` ``[B, H, Sq']`` (fp32), with ``Sq'`` the query length rounded up to 128
and ``D'`` the head size rounded up to 32 (to 256 above 192); with fewer key/value heads than
query heads (GQA), ``dk`` and ``dv`` expanded to every query head ``[B, Sk, H, D]`` before
they are summed; a contiguous copy of the output's gradient when its last dimension is strided.
The forward allocates nothing but its outputs. Figures from the kernel's allocation calls
(flash_api.cpp, ``mha_bwd``); not measured here (no GPU). fp32 on CUDA runs the
memory-efficient kernel, whose workspace is not modelled (the planner's reserve covers it).
"""
from __future__ import annotations

import contextlib
import math
from typing import Callable, NamedTuple, Optional, Sequence

import torch

__all__ = ["TensorSpec", "kernel_workspace", "reference_kernels", "TARGETS"]

TARGETS = ("cpu", "cuda")

aten = torch.ops.aten


class TensorSpec(NamedTuple):
    """What a workspace formula needs of a tensor: concrete sizes, strides and dtype."""

    shape: tuple
    stride: tuple
    dtype: torch.dtype

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def itemsize(self) -> int:
        return self.dtype.itemsize

    @classmethod
    def of(cls, t: torch.Tensor, value: Callable = int) -> "TensorSpec":
        """From a tensor (real or fake); ``value`` turns a (symbolic) size into an int."""
        return cls(tuple(value(s) for s in t.shape), tuple(value(s) for s in t.stride()), t.dtype)


def _contiguous(shape: Sequence[int], stride: Sequence[int]) -> bool:
    expected = 1
    for n, s in zip(reversed(shape), reversed(stride)):
        if n != 1 and s != expected:
            return False
        expected *= n
    return True


def _transposed_1_2(t: TensorSpec) -> tuple:
    sh, st = list(t.shape), list(t.stride)
    sh[1], sh[2], st[1], st[2] = sh[2], sh[1], st[2], st[1]
    return sh, st


def _acc_bytes(dtype: torch.dtype) -> int:
    return 8 if dtype == torch.float64 else 4


def _reduced(dtype: torch.dtype) -> bool:
    return dtype in (torch.bfloat16, torch.float16)


def _cpu_blocks(q: TensorSpec, k: TensorSpec) -> tuple:
    sq, skv = q.shape[2], k.shape[2]
    split = 256 if sq >= 768 else 64 if sq >= 192 else 32
    return min(split, sq), min(512, skv)


def cpu_flash_forward(q: TensorSpec, k: TensorSpec, threads: int) -> int:
    qs, kvs = _cpu_blocks(q, k)
    d = q.shape[3]
    ws = threads * (qs * kvs + 2 * qs + qs * d) * _acc_bytes(q.dtype)
    if _reduced(q.dtype):
        ws += threads * qs * kvs * q.itemsize
    return ws


def cpu_flash_backward(grad_out: TensorSpec, q: TensorSpec, k: TensorSpec, threads: int) -> int:
    qs, kvs = _cpu_blocks(q, k)
    acc = _acc_bytes(q.dtype)
    ws = threads * 2 * qs * kvs * acc
    if _reduced(q.dtype):
        ws += threads * 2 * qs * kvs * q.itemsize
    ws += min(threads, q.shape[0] * q.shape[1]) * qs * acc
    if not _contiguous(*_transposed_1_2(grad_out)):
        ws += grad_out.numel * grad_out.itemsize
    return ws


def cuda_flash_backward(grad_out: TensorSpec, q: TensorSpec, k: TensorSpec) -> int:
    b, h, sq, d = q.shape
    hk, sk = k.shape[1], k.shape[2]
    sq_r = -(-sq // 128) * 128
    d_r = 256 if d > 192 else -(-d // 32) * 32
    ws = b * sq_r * h * d_r * 4 + b * h * sq_r * 4
    if hk != h:
        ws += 2 * b * sk * h * d * q.itemsize
    if grad_out.stride[-1] != 1:
        ws += grad_out.numel * grad_out.itemsize
    return ws


@contextlib.contextmanager
def reference_kernels(enabled: bool = True):
    """The block's CPU kernels on their reference path: oneDNN off (``torch.backends.mkldnn``;
    restored after), so that the attention kernels and the matrix products allocate only what
    the formulas of this module count, whatever the host's instruction set (AMX, AVX512, AVX2).
    fp32 products do not use oneDNN by default, so fp32 work is unchanged; bf16 products run in
    MKL or ATen's own gemm, whose scratch torch's allocator does not see. ``enabled=False``: a
    no-op (a CUDA step)."""
    if not enabled:
        yield
        return
    with torch.backends.mkldnn.flags(enabled=False):
        yield


def kernel_workspace(target: str = "cpu", *, threads: Optional[int] = None) -> Callable:
    """``workspace(op, args) -> bytes`` (0 for an op without scratch) for a step that runs on
    ``target`` (``cpu`` or ``cuda``); ``args`` are the op's positional arguments with every
    tensor given as a :class:`TensorSpec`. ``threads``: the CPU kernels' intra-op threads
    (default ``torch.get_num_threads()`` now)."""
    if target not in TARGETS:
        raise ValueError(f"kernel workspace: unknown target {target!r}; one of {TARGETS}")
    n_threads = threads if threads is not None else torch.get_num_threads()
    fwd = aten._scaled_dot_product_flash_attention_for_cpu.default
    bwd = aten._scaled_dot_product_flash_attention_for_cpu_backward.default

    def workspace(op, args: Sequence) -> int:
        if op is fwd:
            q, k = args[0], args[1]
            if target == "cpu":
                return cpu_flash_forward(q, k, n_threads)
            return 0
        if op is bwd:
            grad_out, q, k = args[0], args[1], args[2]
            if target == "cpu":
                return cpu_flash_backward(grad_out, q, k, n_threads)
            if _reduced(q.dtype):
                return cuda_flash_backward(grad_out, q, k)
            return 0
        return 0

    workspace.ops = (fwd, bwd)
    workspace.target = target
    return workspace
