"""Graph pass — run token-local regions with wide intermediates in sequence chunks.

Expects
    The Dynamo graph of the whole model (torch-function level, ``example_value`` fake values on
    every node, computed under the ambient autocast) and the
    :class:`~autosp_lm.compiler.graph.SequenceInfo` of :mod:`.find_sequence`: the sequence is the
    symbol ``S`` in the values' shapes. Runs before the sharding pass (it shards the tiled call
    like any token-local op: ``rules/tiled.py``).

Rewrites
    Finds *regions*: connected sets of token-local ops (pointwise ops and casts, ``linear`` or
    ``x @ W`` over the feature dimension, ``layer_norm``/``rms_norm`` and reductions or softmax
    over feature dimensions; every tensor either carries ``S`` at the region's sequence
    dimension or carries no sequence at all; no random ops, no size arguments taken from the
    graph) grown from each op whose output is wider per token than all of its sequence inputs
    (the MLP's up projections): forward through consumers while the values stay wider than the
    region's inputs, up to and including the op that narrows them again (the down projection, or
    ``xf.type_as(x)`` that reads nothing the region does not read already), and backward through
    producers read only inside the region (the norm before the MLP; an earlier region read only
    by this one merges into it). Token-local ops on a path that leaves the region and comes back
    join it (a mixed-precision norm's ``mean -> + eps -> rsqrt`` between its fp32 values), so a
    norm that upcasts its input is a region of its own where nothing wide follows it (before
    attention, before the loss head); a region that still cannot be outlined gives its ops back.
    Each region becomes one call of :func:`~autosp_lm.compiler.tiling.run_tiled` (the
    ``autosp_lm::tiled_region`` custom op), which runs the region's graph on ``chunks`` slices
    of the sequence in the forward and again, with its gradients, in the backward. The chunk
    count makes a chunk's intermediates about ``2 x`` one region input (``ceil(sum of per-token
    output bytes / widest input per token)``), with chunks of at least :data:`MIN_CHUNK_TOKENS`
    tokens, unless ``chunk_tokens`` fixes the tokens per chunk; a region that would run in one
    chunk (fewer than ``2 x MIN_CHUNK_TOKENS`` local tokens at the traced length) is left as it
    is. The chunk count is fixed when the graph is traced (a graph traced at a short length and
    reused, dynamic, at a long one keeps its count).

Holds afterwards
    The graph computes the same values (token for token by the same ops; weight gradients are
    summed over chunks: see :mod:`..tiling`); a region's intermediates are never saved for the
    backward and never exist for more than one chunk at a time. Returns a description per region.
"""
from __future__ import annotations

import math
import operator
from typing import Optional

import sympy
import torch
import torch.fx as fx

from ..graph import SequenceInfo, describe, example, torch_ops
from ..rules.pointwise import POINTWISE, UNARY_LIKE
from ..tiling import Region, register_region, run_tiled

MIN_CHUNK_TOKENS = 512
#: A region is tiled when its intermediates per token add up to at least this many times its
#: widest input or output per token (the MLP of a Llama layer: ~18x in fp32; RoPE angles: 2x).
MIN_WIDTH_RATIO = 4

_RANDOM = {"dropout", "rand_like", "randn_like"}
_POINTWISE = frozenset(torch_ops(*[n for n in POINTWISE + UNARY_LIKE if n not in _RANDOM]))
#: feature-dimension projections: ``F.linear`` and ``x @ W`` (``matmul`` whose other operand
#: carries no sequence: ``token_local`` refuses any operand with the sequence elsewhere)
_LINEAR = frozenset(torch_ops("linear", "matmul"))
_NORMS = frozenset(torch_ops("layer_norm", "rms_norm"))
_REDUCTIONS = frozenset(torch_ops("mean", "sum", "amax", "amin", "var", "std", "norm",
                                  "logsumexp", "softmax", "log_softmax"))


def _key(n: fx.Node):
    if n.op == "call_method":
        return getattr(torch.Tensor, str(n.target), None)
    return n.target


class _Shapes:
    """Sequence dimension and per-token bytes of Dynamo-graph values."""

    def __init__(self, info: SequenceInfo):
        self.info = info

    def seq_dim(self, a) -> Optional[int]:
        """The dimension equal to ``S`` (None: no sequence; -1: the sequence in another form)."""
        shape = self.info.shape(a) if isinstance(a, fx.Node) else None
        if shape is None:
            return None
        dims = [i for i, s in enumerate(shape) if self.info.symbol in s.free_symbols]
        if not dims:
            return None
        if len(dims) > 1 or sympy.simplify(shape[dims[0]] - self.info.symbol) != 0:
            return -1
        return dims[0]

    def per_token(self, a) -> Optional[int]:
        shape, v = self.info.shape(a), example(a)
        d = self.seq_dim(a)
        if shape is None or d is None or d < 0:
            return None
        n = 1
        for i, s in enumerate(shape):
            if i != d:
                if not s.is_Integer:
                    return None
                n *= int(s)
        return n * v.element_size()


def _dims_arg(n: fx.Node, nd: int):
    """Reduction / normalisation dims of ``n`` as non-negative ints (None: not static)."""
    key = _key(n)
    if key in _NORMS:
        shape = n.args[1] if len(n.args) > 1 else n.kwargs.get("normalized_shape")
        if not isinstance(shape, (list, tuple)) or not all(isinstance(s, int) for s in shape):
            return None
        return list(range(nd - len(shape), nd))
    dim = n.args[1] if len(n.args) > 1 else n.kwargs.get("dim")
    if isinstance(dim, int):
        dim = [dim]
    if not isinstance(dim, (list, tuple)) or not dim or not all(isinstance(d, int) for d in dim):
        return None
    return [d % nd for d in dim]


def token_local(n: fx.Node, sh: _Shapes) -> Optional[int]:
    """The sequence dimension of ``n`` when it is a token-local op on sequence values, else None."""
    if n.op not in ("call_function", "call_method"):
        return None
    key = _key(n)
    if key not in _POINTWISE and key not in _LINEAR and key not in _NORMS \
            and key not in _REDUCTIONS:
        return None
    v = example(n)
    d = sh.seq_dim(n)
    if not isinstance(v, torch.Tensor) or d is None or d < 0:
        return None
    nd = v.dim()
    flat = fx.node.map_aggregate((n.args, n.kwargs), lambda a: a)
    for a in torch.utils._pytree.tree_leaves(flat):
        if not isinstance(a, fx.Node):
            continue
        av = example(a)
        if not isinstance(av, torch.Tensor):
            return None  # a size or other value from the graph: its meaning may change per chunk
        ad = sh.seq_dim(a)
        if ad is None:
            continue
        if ad < 0 or ad + nd - av.dim() != d:  # the sequence must line up (right-aligned)
            return None
        if key not in _POINTWISE and ad != d:
            return None
    if key in _LINEAR and d == nd - 1:
        return None
    if key in _NORMS or key in _REDUCTIONS:
        dims = _dims_arg(n, nd)
        if dims is None or any(x <= d for x in dims):
            return None
    return d


def _seq_inputs(n: fx.Node, sh: _Shapes) -> list:
    return [a for a in n.all_input_nodes if sh.seq_dim(a) is not None]


def find_regions(gm: fx.GraphModule, info: SequenceInfo) -> list:
    """The regions to tile: lists of nodes in graph order (see the module docstring)."""
    sh = _Shapes(info)
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    tl = {n: d for n in gm.graph.nodes if (d := token_local(n, sh)) is not None}
    pt = {n: sh.per_token(n) for n in tl}
    tl = {n: d for n, d in tl.items() if pt[n] is not None}

    def narrow_of(n):
        return max([sh.per_token(a) or 0 for a in _seq_inputs(n, sh)], default=0)

    seeds = [n for n in tl if _seq_inputs(n, sh) and pt[n] > narrow_of(n)]
    member: dict = {}  # node -> region id
    regions: list = []
    for seed in seeds:
        if seed in member:
            continue
        d, ref = tl[seed], narrow_of(seed)
        rid = len(regions)
        region = {seed}
        regions.append(region)
        member[seed] = rid
        frontier = [seed]
        ins = set(_seq_inputs(seed, sh))  # the region's sequence inputs
        while frontier:  # forward: wide consumers, and the op that narrows them
            c = frontier.pop()
            for u in c.users:
                if u in region or u not in tl or tl[u] != d or u in member:
                    continue
                # a narrow op that also reads sequence values from outside joins another stream
                # (a residual add), unless it reads only what the region reads already
                # (``xf.type_as(x)`` after ``xf = x.float()``)
                if any(a not in region and a not in ins for a in _seq_inputs(u, sh)) \
                        and pt[u] <= ref:
                    continue
                if any(a not in region and a in member for a in _seq_inputs(u, sh)):
                    continue
                region.add(u)
                member[u] = rid
                ins.update(a for a in _seq_inputs(u, sh) if a not in region)
                if pt[u] > ref:
                    frontier.append(u)
        grown = True
        while grown:  # backward: producers read only inside the region (or a region before it)
            grown = False
            for c in list(region):
                for a in _seq_inputs(c, sh):
                    if a in region or a not in tl or tl[a] != d:
                        continue
                    if a in member:  # an earlier region whose values only this one reads
                        other = regions[member[a]]
                        if all(u in region or u in other for n in other for u in n.users):
                            for n in other:
                                member[n] = rid
                            region |= other
                            other.clear()
                            grown = True
                        continue
                    if all(u in region for u in a.users):
                        region.add(a)
                        member[a] = rid
                        grown = True
        # Token-local ops on a path that leaves the region and comes back (the narrow statistics
        # of a norm: mean -> add eps -> rsqrt between the wide values) belong to it: without them
        # the region cannot be outlined.
        inner = _between(region, tl, d)
        if not any(n in member for n in inner):
            region |= inner
            for n in inner:
                member[n] = rid
        if not _convex(sorted(region, key=order.get), region):
            for n in region:  # give its nodes back: a later region may take them
                member.pop(n, None)
            region.clear()
    out = []
    for region in regions:
        nodes = sorted(region, key=order.get)
        if nodes and any(pt[n] > narrow_of(n) for n in nodes):  # convex: checked as grown
            out.append(nodes)
    return out


def _between(region: set, tl: dict, d: int) -> set:
    """The token-local nodes (sequence at ``d``) outside ``region`` on a path from it back into
    it."""
    down: set = set()
    stack = [u for n in region for u in n.users if u not in region]
    while stack:
        x = stack.pop()
        if x in down or tl.get(x) != d:
            continue
        down.add(x)
        stack.extend(u for u in x.users if u not in region)
    up: set = set()
    stack = [a for n in region for a in n.all_input_nodes if a in down]
    while stack:
        x = stack.pop()
        if x in up:
            continue
        up.add(x)
        stack.extend(a for a in x.all_input_nodes if a in down)
    return up


def _convex(nodes: list, region: set) -> bool:
    """No path leaves the region and comes back (outlining would make a cycle)."""
    outside = set()
    stack = [u for n in nodes for u in n.users if u not in region]
    while stack:
        x = stack.pop()
        if x in outside:
            continue
        outside.add(x)
        stack.extend(u for u in x.users if u not in region)
    return not any(a in outside for n in nodes for a in n.all_input_nodes)


def _outline(gm: fx.GraphModule, nodes: list, info: SequenceInfo, chunk_tokens: Optional[int],
             world: int, compiled: bool = False) -> Optional[str]:
    sh = _Shapes(info)
    region = set(nodes)
    inputs = []
    for n in nodes:
        for a in n.all_input_nodes:
            if a not in region and a not in inputs:
                inputs.append(a)
    outputs = [n for n in nodes if any(u not in region for u in n.users)]
    if not outputs or not any(sh.seq_dim(a) is not None for a in inputs):
        return None
    # The new graph: placeholders, the region's nodes, a tuple of its outputs.
    g = fx.Graph()
    env = {}
    for i, a in enumerate(inputs):
        env[a] = g.placeholder(f"in_{i}")
    for n in nodes:
        env[n] = g.node_copy(n, lambda x: env[x])
    g.output(tuple(env[o] for o in outputs))
    sub = fx.GraphModule(gm, g)
    in_dims = [sh.seq_dim(a) for a in inputs]
    out_dims = [sh.seq_dim(o) for o in outputs]
    if any(d is not None and d < 0 for d in in_dims):
        return None
    out_shapes = [[None if i == d else int(s) for i, s in enumerate(sh.info.shape(o))]
                  for o, d in zip(outputs, out_dims)]
    widths = [sh.per_token(n) or 0 for n in nodes]
    narrow = max([sh.per_token(a) or 0 for a in inputs] + [sh.per_token(o) or 0 for o in outputs])
    if sum(widths) < MIN_WIDTH_RATIO * max(1, narrow):
        return None
    tokens = max(1, _hint(info.shape(outputs[0])[out_dims[0]], info) // max(1, world))
    if chunk_tokens:  # fixed by the caller (tile_chunk_tokens)
        chunks = max(1, math.ceil(tokens / chunk_tokens))
    else:
        chunks = max(1, math.ceil(sum(widths) / max(1, narrow)))
        chunks = max(1, min(chunks, tokens // MIN_CHUNK_TOKENS or 1))
        if chunks == 1:  # short sequence: one chunk gains nothing over the fused ops
            return None
    desc = (f"{describe(nodes[0])} ... {outputs[-1].name}: {len(nodes)} token-local ops "
            f"({max(widths)} B/token at the widest, inputs {narrow} B/token) in {chunks} chunks")
    flops = sum(2.0 * example(n.args[1]).numel() for n in nodes if _key(n) in _LINEAR
                and len(n.args) > 1 and isinstance(example(n.args[1]), torch.Tensor))
    key = register_region(Region(sub, in_dims, out_dims, out_shapes,
                                 [example(o).dtype for o in outputs], desc,
                                 flops_per_token=flops, nodes=[n.name for n in nodes],
                                 compiled=compiled))
    # The call goes after its last input and before the first outside reader of an output.
    pos = {n: i for i, n in enumerate(gm.graph.nodes)}
    last_in = max((pos[a] for a in inputs), default=-1)
    first_use = min(pos[u] for o in outputs for u in o.users if u not in region)
    if last_in >= first_use:
        return None
    anchor = max([a for a in inputs], key=pos.get)
    with gm.graph.inserting_after(anchor):
        call = gm.graph.call_function(run_tiled, (key, chunks, *inputs))
    call.meta["example_value"] = tuple(example(o) for o in outputs)
    for k in ("stack_trace", "nn_module_stack", "source_fn_stack"):
        if k in nodes[0].meta:
            call.meta[k] = nodes[0].meta[k]
    prev = call
    for i, o in enumerate(outputs):
        with gm.graph.inserting_after(prev):
            item = gm.graph.call_function(operator.getitem, (call, i))
        item.meta["example_value"] = example(o)
        o.replace_all_uses_with(item, delete_user_cb=lambda u: u not in region)
        prev = item
    for n in reversed(nodes):
        gm.graph.erase_node(n)
    return desc


def _hint(expr, info: SequenceInfo) -> int:
    env = info.shape_env
    if env is not None:  # the traced length (torch 2.13: optimization_hint; 2.11: size_hint)
        for name in ("optimization_hint", "size_hint"):
            fn = getattr(env, name, None)
            try:
                return int(fn(expr))
            except Exception:  # noqa: BLE001 - try the next spelling
                continue
    return 8192


def tile_sequence(gm: fx.GraphModule, info: SequenceInfo, *, chunk_tokens: Optional[int] = None,
                  world: int = 1, compiled: bool = False) -> list:
    """Outline every region of ``gm`` (see the module docstring); returns their descriptions.
    ``compiled``: the regions' chunks run Inductor-compiled code (the Inductor backend)."""
    done = []
    for nodes in find_regions(gm, info):
        desc = _outline(gm, nodes, info, chunk_tokens, world, compiled)
        if desc:
            done.append(desc)
    if done:
        gm.graph.lint()
        gm.recompile()
    return done
