"""Token-local regions run in sequence chunks: the ``autosp_lm::tiled_region`` custom op.

A *region* is a piece of a model's graph that treats every token independently (the MLP of a
transformer layer with its norm: linears over the feature dimension, pointwise ops, norms over
features) and whose intermediates are wider than its inputs (the ``[tokens, ffn]`` activations).
:mod:`.passes.tile_sequence` finds such regions and replaces each with one call of
:func:`run_tiled`, which runs the region's graph on one chunk of the sequence at a time:

* forward, per chunk, under ``no_grad``: the region's outputs for the chunk, written into the full
  outputs; nothing of the region is kept for the backward except its inputs;
* backward, per chunk: the region again for the chunk, with autograd, and its gradients
  (``torch.autograd.grad``, :func:`_chunk_grads`); the chunk's input gradients are written
  into the full gradients, the gradients of non-sequence inputs (weights) are summed over the
  chunks in fp32.

So the region's working set in both passes is one chunk of its intermediates, not the whole
sequence. Both run inside one opaque op with the autocast state the region was traced under.
Under the Inductor backend both are compiled by Inductor itself, once per chunk shape and
autocast state, and shared by regions whose graphs are the same (the MLPs of a model's layers):
the forward's chunk as an inference program, the backward's chunk as one joint program (the
region's forward and backward traced together into one aten graph with ``make_fx``), so a chunk
runs fused code and no autograd graph is built per chunk at run time. Under ``aot_eager``, on
fake tensors (the memory planner) or under a dispatch mode, both run eagerly.

Numerics: every token's values are computed by the same ops as without tiling (under Inductor,
by generated code whose reductions over features may round differently, as any compilation's);
only the weight gradients change summation order (a sum over chunks of per-chunk sums instead
of one sum over all tokens; in bf16 each chunk's weight-gradient matmul is rounded to bf16
before the fp32 sum).
"""
from __future__ import annotations

import copy
import itertools
import math
from dataclasses import dataclass, field
from typing import List, Optional

import torch
import torch.fx as fx
from torch.library import custom_op

from .chunking import ranges


@dataclass
class Region:
    """One outlined token-local region: its graph and where the sequence is in its values."""

    gm: fx.GraphModule  # inputs in order; returns a tuple of outputs
    in_dims: list  # the sequence dimension of each input, None for non-sequence inputs
    out_dims: list  # the sequence dimension of each output
    out_shapes: list  # each output's shape with None at the sequence dimension
    out_dtypes: list
    description: str = ""
    flops_per_token: float = 0.0  # forward FLOPs per token (for the cost model)
    nodes: list = field(default_factory=list)  # names of the original nodes
    compiled: bool = False  # chunks run Inductor-compiled code (the Inductor backend)
    structure: Optional[tuple] = None  # the graph without its names (see _structure)


REGIONS: dict = {}
_ids = itertools.count()


def register_region(region: Region) -> str:
    key = f"region{next(_ids)}"
    REGIONS[key] = region
    return key


def chunk_ranges(n: int, chunks: int):
    """The ``chunks`` even chunks of ``n`` tokens (:func:`.chunking.ranges`: under the
    planner's probing, one of each size)."""
    return ranges(n, math.ceil(n / max(1, chunks)))


_DK = torch._C.DispatchKey
_REENABLE = [getattr(_DK, k) for k in ("AutogradFunctionality", "AutogradOther",
                                        "AutogradNestedTensor", "AutocastCPU", "AutocastCUDA")
             if hasattr(_DK, k)]


def _eager_dispatch():
    """Inside a custom op's kernel autograd and autocast are excluded from dispatch; the region
    needs both (its backward differentiates it; it runs under the autocast it was traced with)."""
    ex = torch._C._dispatch_tls_local_exclude_set()
    for k in _REENABLE:
        ex = ex.remove(k)
    return torch._C._ForceDispatchKeyGuard(torch._C._dispatch_tls_local_include_set(), ex)


def _autocast(autocast: str, device: torch.device):
    dtype = getattr(torch, autocast) if autocast else None
    return torch.autocast(device.type, dtype=dtype or torch.bfloat16, enabled=bool(autocast))


_COMPILED: dict = {}  # (graph, input metadata, autocast) -> what runs a chunk (Inductor's)
#: compiled programs per region graph at most (a forward and a backward per chunk shape): a
#: region that meets more chunk shapes (sequence lengths that vary from step to step) runs the
#: shapes beyond them eagerly instead of compiling without bound
MAX_COMPILED_PER_GRAPH = 16
_PER_GRAPH: dict = {}  # region graph -> programs compiled for it


def _may_compile(structure) -> bool:
    if _PER_GRAPH.get(structure, 0) >= MAX_COMPILED_PER_GRAPH:
        return False
    _PER_GRAPH[structure] = _PER_GRAPH.get(structure, 0) + 1
    return True


def _runs_compiled(args) -> bool:
    from torch._subclasses.fake_tensor import FakeTensor
    return (torch._C._len_torch_dispatch_stack() == 0
            and not any(isinstance(a, FakeTensor) for a in args))


def _structure(region: Region):
    """The region's graph with its node names replaced by positions: equal for regions that
    compute the same thing (the MLPs of a model's layers), which then share their compilations.
    A graph that reads module attributes (constants, submodules) is its own."""
    if region.structure is None:
        nodes = list(region.gm.graph.nodes)
        if any(n.op in ("get_attr", "call_module") for n in nodes):
            region.structure = ("region", id(region))
        else:
            pos = {n: i for i, n in enumerate(nodes)}
            arg = lambda a: fx.node.map_arg(a, lambda n: ("node", pos[n]))  # noqa: E731
            region.structure = tuple((n.op, str(n.target) if n.op != "placeholder" else "",
                                      repr(arg(n.args)), repr(arg(n.kwargs))) for n in nodes)
    return region.structure


def _runner(region: Region, args, autocast: str):
    """What runs one forward chunk (under ``no_grad``): the region's graph, or its Inductor
    compilation for these inputs."""
    if not region.compiled or not _runs_compiled(args):
        return region.gm
    key = (_structure(region), tuple((tuple(a.shape), a.stride(), a.dtype, a.device)
                                     for a in args), autocast)
    fn = _COMPILED.get(key)
    if fn is None:
        if not _may_compile(key[0]):
            return region.gm
        from torch._inductor.compile_fx import compile_fx
        fn = _COMPILED[key] = _or_eager(region, lambda: compile_fx(copy.deepcopy(region.gm),
                                                                   list(args)), region.gm)
    return fn


def _or_eager(region: Region, compile_chunk, eager):
    """``compile_chunk()``, or ``eager`` (kept for these shapes, with a warning) where Inductor
    cannot compile the region: a slower chunk, never a failed step."""
    try:
        return compile_chunk()
    except Exception as e:  # noqa: BLE001 - any lowering failure: the eager graph is exact
        import warnings
        warnings.warn(f"AutoSP: a sequence-tiled region ({region.description or 'region'}) "
                      f"could not be compiled by Inductor and runs eagerly, chunk by chunk "
                      f"(slower, same results): {type(e).__name__}: {str(e)[:300]}")
        return eager


def _chunk_grads(region: Region, args, outgrads, needs_grad, autocast: str) -> list:
    """One chunk's backward: the region again on ``args`` with autograd, and the gradients of
    the inputs that need them (None for those the outputs do not depend on)."""
    dev = args[next(i for i, d in enumerate(region.in_dims) if d is not None)].device
    want = [i for i, need in enumerate(needs_grad) if need]
    with torch.enable_grad(), _autocast(autocast, dev):
        xs = [a.detach().requires_grad_(need) for a, need in zip(args, needs_grad)]
        res = region.gm(*xs)
        pairs = [(r, g) for r, g in zip(res, outgrads) if r.requires_grad]
        if not pairs:
            return [None] * len(want)
        return list(torch.autograd.grad([r for r, _ in pairs], [xs[i] for i in want],
                                        [g for _, g in pairs], allow_unused=True))


def _chunk_grads_fn(region: Region, args, outgrads, needs_grad, autocast: str):
    """``f(args, outgrads) -> gradients`` for one chunk: :func:`_chunk_grads` eagerly, or under
    Inductor its joint graph (the region's forward and backward traced together into one aten
    graph, autocast's casts included) compiled as one inference program: a chunk's recompute
    and gradients run as fused code with no autograd graph built at run time."""
    if not region.compiled or not _runs_compiled(list(args) + list(outgrads)):
        return lambda a, g: _chunk_grads(region, a, g, needs_grad, autocast)
    meta = tuple((tuple(a.shape), a.stride(), a.dtype, a.device) for a in list(args) + list(outgrads))
    key = ("backward", _structure(region), meta, tuple(needs_grad), autocast)
    fn = _COMPILED.get(key)
    if fn is None:
        if not _may_compile(key[1]):
            return lambda a, g: _chunk_grads(region, a, g, needs_grad, autocast)
        from torch._inductor.compile_fx import compile_fx
        from torch.fx.experimental.proxy_tensor import make_fx
        k, present = len(args), []

        def joint(*flat):
            got = _chunk_grads(region, flat[:k], flat[k:], needs_grad, autocast)
            present[:] = [g is not None for g in got]
            return [g for g in got if g is not None]

        def compile_joint():
            flat = list(args) + list(outgrads)
            gm = make_fx(joint, tracing_mode="fake")(*flat)
            with torch.no_grad(), torch.autocast(flat[0].device.type, enabled=False):
                compiled = compile_fx(gm, flat)

            def run(a, g, present=tuple(present)):
                with torch.no_grad(), torch.autocast(a[0].device.type, enabled=False):
                    out = iter(compiled(*a, *g))
                return [next(out) if p else None for p in present]
            return run

        fn = _or_eager(region, compile_joint,
                       lambda a, g: _chunk_grads(region, a, g, needs_grad, autocast))
        _COMPILED[key] = fn
    return fn


def _seq_len(region: Region, inputs) -> int:
    i = next(i for i, d in enumerate(region.in_dims) if d is not None)
    return inputs[i].shape[region.in_dims[i]]


def _chunk_args(region: Region, inputs, s: int, e: int):
    return [x.narrow(d, s, e - s) if d is not None else x for x, d in zip(inputs, region.in_dims)]


def forward_chunks(region: Region, inputs, chunks: int, autocast: str) -> list:
    n = _seq_len(region, inputs)
    dev = inputs[next(i for i, d in enumerate(region.in_dims) if d is not None)].device
    outs = [torch.empty([n if s is None else s for s in shape], dtype=dt, device=dev)
            for shape, dt in zip(region.out_shapes, region.out_dtypes)]
    with _eager_dispatch(), torch.no_grad(), _autocast(autocast, dev):
        for s, e in chunk_ranges(n, chunks):
            args = _chunk_args(region, inputs, s, e)
            res = _runner(region, args, autocast)(*args)
            for o, r, d in zip(outs, res, region.out_dims):
                o.narrow(d, s, e - s).copy_(r)
    return outs


def backward_chunks(region: Region, grads, inputs, chunks: int, needs_grad,
                    autocast: str) -> list:
    n = _seq_len(region, inputs)
    gin = []
    for x, d, need in zip(inputs, region.in_dims, needs_grad):
        if not need:
            gin.append(None)
        elif d is not None:
            gin.append(torch.empty_like(x))
        else:
            gin.append(torch.zeros(x.shape, dtype=torch.float32, device=x.device))
    want = [i for i, need in enumerate(needs_grad) if need]
    with _eager_dispatch():
        for s, e in chunk_ranges(n, chunks):
            args = _chunk_args(region, inputs, s, e)
            outgrads = [g.narrow(d, s, e - s) for g, d in zip(grads, region.out_dims)]
            got = _chunk_grads_fn(region, args, outgrads, needs_grad, autocast)(args, outgrads)
            for i, g in zip(want, got):
                d = region.in_dims[i]
                if d is not None:
                    dst = gin[i].narrow(d, s, e - s)
                    dst.copy_(g) if g is not None else dst.zero_()
                elif g is not None:
                    gin[i].add_(g.float())
    return [g if g is None or region.in_dims[i] is not None else g.to(inputs[i].dtype)
            for i, g in enumerate(gin)]


@custom_op("autosp_lm::tiled_region", mutates_args=())
def _tiled(inputs: List[torch.Tensor], key: str, chunks: int, needs_grad: List[bool],
           autocast: str) -> List[torch.Tensor]:
    return forward_chunks(REGIONS[key], inputs, chunks, autocast)


@_tiled.register_fake
def _(inputs, key, chunks, needs_grad, autocast):
    r = REGIONS[key]
    i = next(i for i, d in enumerate(r.in_dims) if d is not None)
    n = inputs[i].shape[r.in_dims[i]]
    return [inputs[i].new_empty([n if s is None else s for s in shape], dtype=dt)
            for shape, dt in zip(r.out_shapes, r.out_dtypes)]


@custom_op("autosp_lm::tiled_region_backward", mutates_args=())
def _tiled_backward(grads: List[torch.Tensor], inputs: List[torch.Tensor], key: str,
                    chunks: int, needs_grad: List[bool], autocast: str) -> List[torch.Tensor]:
    out = backward_chunks(REGIONS[key], grads, inputs, chunks, needs_grad, autocast)
    return [g if g is not None else x.new_empty(0) for g, x in zip(out, inputs)]


@_tiled_backward.register_fake
def _(grads, inputs, key, chunks, needs_grad, autocast):
    return [torch.empty_like(x) if need else x.new_empty(0)
            for x, need in zip(inputs, needs_grad)]


def _setup(ctx, inputs, output):
    xs, key, chunks, needs_grad, autocast = inputs
    ctx.save_for_backward(*xs)
    ctx.key, ctx.chunks, ctx.needs_grad, ctx.autocast = key, chunks, needs_grad, autocast
    ctx.out_like = [(o.shape, o.dtype) for o in output]


def _backward(ctx, grads):
    xs = list(ctx.saved_tensors)
    gs = [g if g is not None else xs[0].new_zeros(shape, dtype=dt)
          for g, (shape, dt) in zip(grads, ctx.out_like)]
    out = _tiled_backward(gs, xs, ctx.key, ctx.chunks, ctx.needs_grad, ctx.autocast)
    return [g if need else None for g, need in zip(out, ctx.needs_grad)], None, None, None, None


_tiled.register_autograd(_backward, setup_context=_setup)


def run_tiled(key: str, chunks: int, *inputs: torch.Tensor) -> tuple:
    """The call the tiling pass puts into a Dynamo graph: region ``key`` on ``inputs`` in
    ``chunks`` sequence chunks. Records, at trace time, which inputs need gradients and the
    autocast state, so that both passes run the region exactly as it was traced."""
    i = next(i for i, d in enumerate(REGIONS[key].in_dims) if d is not None)
    dev = inputs[i].device.type
    autocast = ""
    if torch.is_autocast_enabled(dev):
        autocast = str(torch.get_autocast_dtype(dev)).replace("torch.", "")
    needs = [bool(x.requires_grad and (x.is_floating_point() or x.is_complex())) for x in inputs]
    chunks = chunks if isinstance(chunks, torch.SymInt) else int(chunks)  # (a size of the graph)
    return tuple(torch.ops.autosp_lm.tiled_region(list(inputs), key, chunks, needs, autocast))


def region_of(node: fx.Node) -> Optional[Region]:
    """The region a ``tiled_region`` joint-graph node runs (None for other nodes)."""
    if node.op == "call_function" and node.target in (torch.ops.autosp_lm.tiled_region.default,
                                                       torch.ops.autosp_lm.tiled_region_backward.default):
        key = node.args[1] if node.target is torch.ops.autosp_lm.tiled_region.default \
            else node.args[2]
        return REGIONS.get(key)
    return None
