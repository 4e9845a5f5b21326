"""``--tiled-mlp`` (the ALST recipe's tiled MLP): a block's MLP over chunks of tokens, one op a
block.

:class:`TiledMLP` traces the MLP once (``make_fx``, the token count symbolic) into a token-local
region of the compiler's tiling (:mod:`autosp_lm.compiler.tiling`) and runs it chunk by chunk:
one chunk's ``[chunk, ffn]`` intermediates are live at a time, only the MLP's input is kept for
the backward, and each chunk is recomputed there. :func:`_tiled_checkpoints`, ALST's loop of
checkpointed chunks as written, is the fallback for an input dtype the region was not prepared
for. Installed on the blocks' MLPs by :class:`.memory.MemoryRecipe`.
"""
from __future__ import annotations

import math
from typing import Callable

import torch
import torch.nn as nn
from torch.utils.checkpoint import checkpoint


def _tiled_checkpoints(forward: Callable, x, chunk: int):
    """``forward`` over even chunks of ``x``'s tokens, each chunk checkpointed (ALST's loop as
    written: the fallback of :class:`TiledMLP` for a dtype it was not prepared for)."""
    hidden = x.shape[-1]
    flat = x.reshape(1, -1, hidden)
    n = flat.shape[1]
    chunk = math.ceil(n / math.ceil(n / chunk))  # even chunks
    outs = [checkpoint(forward, piece, use_reentrant=False) for piece in flat.split(chunk, dim=1)]
    out = torch.cat(outs, dim=1)
    return out.reshape(*x.shape[:-1], out.shape[-1])


class TiledMLP:
    """``--tiled-mlp``: a block's MLP over chunks of tokens, one chunk's ``[chunk, ffn]``
    intermediates live at a time (ALST's chunk: the hidden size; ``chunk_tokens`` overrides).

    The MLP is one token-local region of the compiler's tiling (:mod:`autosp_lm.compiler.
    tiling`): its forward traced once into an aten graph (``make_fx``, the token count
    symbolic, the parameters as inputs), run chunk by chunk inside one op, under ``no_grad`` in
    the forward (only the MLP's input and parameters are kept) and again with autograd, chunk by
    chunk, in the backward (the weight gradients summed over the chunks in fp32). What it
    computes per token is the MLP's own forward. In a compiled graph it is one node a block
    with the chunk count as a size of the graph, where checkpointing each chunk made a region
    per chunk (128 a block at 4M tokens on 8 GPUs): the trace grew with the sequence, and a trace
    evaluated at another length kept its chunk count, so its chunks had the wrong size.

    The region is prepared when the recipe is installed, for inputs of the parameters' dtype
    with and without bf16 autocast on their device (the two ways a step runs: fp32, and
    Megatron-style bf16); inputs of another dtype take the checkpointed loop."""

    def __init__(self, mlp: nn.Module, chunk_tokens: int, compiled: bool):
        self.forward = mlp.forward  # the module's own (patched over by :meth:`__call__`)
        self.mlp, self.chunk_tokens = mlp, chunk_tokens
        self.params = [p for _, p in mlp.named_parameters()]
        self.keys: dict = {}  # (input dtype, autocast dtype name or "") -> region key
        try:
            for autocast in ("", "bfloat16"):
                self.keys[(self.params[0].dtype, autocast)] = self._region(autocast, compiled)
        except Exception:  # noqa: BLE001 - an MLP make_fx cannot trace: the checkpointed loop
            self.keys = {}

    def _region(self, autocast: str, compiled: bool) -> str:
        from torch.fx.experimental.proxy_tensor import make_fx
        from torch.nn.utils.stateless import _reparametrize_module

        from ..compiler.tiling import Region, register_region
        names = [n for n, _ in self.mlp.named_parameters()]
        hidden = self._in_features()
        dtype = self.params[0].dtype

        def body(x, *ps):
            with _reparametrize_module(self.mlp, dict(zip(names, ps))):
                return (self.forward(x),)

        meta = [torch.empty(p.shape, dtype=p.dtype, device="meta") for p in self.params]
        x = torch.empty(1, 4 * hidden, hidden, dtype=dtype, device="meta")
        gm = make_fx(body, tracing_mode="symbolic")(x, *meta)
        (out,) = body(x, *meta)
        out_dtype = out.dtype
        if autocast and _made_by_matmul(gm):  # the last op of the MLP is its down projection
            out_dtype = getattr(torch, autocast)
        flops = sum(2.0 * p.numel() for p in self.params if p.dim() == 2)
        return register_region(Region(gm, [1] + [None] * len(meta), [1],
                                      [[1, None, out.shape[-1]]], [out_dtype],
                                      f"tiled MLP ({type(self.mlp).__name__})",
                                      flops_per_token=flops, compiled=compiled))

    def _in_features(self) -> int:
        first = next((m for m in self.mlp.modules() if isinstance(m, nn.Linear)), None)
        if first is None:
            raise ValueError("no linear layer")
        return first.in_features

    def __call__(self, x, *args, **kwargs):
        if args or kwargs or x.dim() < 2:
            raise ValueError("--tiled-mlp: the MLP takes more than the hidden states; tiling "
                             "needs a module of one [.., tokens, hidden] input (drop --tiled-mlp)")
        hidden = x.shape[-1]
        n = x.numel() // hidden
        chunk = self.chunk_tokens or hidden
        if n <= chunk or not torch.is_grad_enabled():
            return self.forward(x)
        dev = x.device.type
        autocast = str(torch.get_autocast_dtype(dev)).replace("torch.", "") \
            if torch.is_autocast_enabled(dev) else ""
        key = self.keys.get((x.dtype, autocast))
        if key is None:
            return _tiled_checkpoints(self.forward, x, chunk)
        from ..compiler.tiling import run_tiled
        params = [p for _, p in self.mlp.named_parameters()]  # (FSDP2: the gathered ones now)
        (out,) = run_tiled(key, (n + chunk - 1) // chunk, x.reshape(1, n, hidden), *params)
        return out.reshape(*x.shape[:-1], out.shape[-1])


def _made_by_matmul(gm) -> bool:
    """The graph's first output is a matrix product's result (through views)."""
    from ..compiler.graph import is_alias_op
    out = next(n for n in gm.graph.nodes if n.op == "output").args[0][0]
    while is_alias_op(out) and out.args:
        out = out.args[0]
    return getattr(out.target, "overloadpacket", None) in (
        torch.ops.aten.mm, torch.ops.aten.addmm, torch.ops.aten.bmm, torch.ops.aten.linear)
