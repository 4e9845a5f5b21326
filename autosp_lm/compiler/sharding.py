"""Pass 2 — sharding propagation and shape rewriting (the driver of passes 3-6).

Expects: the Dynamo graph (torch-function level: ``torch.*`` / ``F.*`` calls, tensor methods,
``operator`` calls) of a whole single-device model and the :class:`SequenceInfo` of pass 1.

Rewrites: builds a new graph node by node, giving every value a state (``common``): replicated
(full sequence or no sequence), :class:`Shard` (this rank's contiguous chunk) or REDUCED (the
loss). Values are sharded *lazily*: a replicated value stays full (cheap integer work such as
label shifts, ``arange``, RoPE tables, masks runs on the whole sequence) until it meets
per-token work — an op whose output carries the sequence and requires grad, a heavy op
(embedding, linear, matmul, attention, norm, loss) or a sharded operand. There pass 4
(:mod:`positions`) takes this rank's chunk in the consumer's layout. Rules per op family:

* pointwise / broadcasting ops: operands aligned from the right; full operands are chunked;
* linear / matmul over feature dimensions, embedding, norms and softmax over feature dims;
* views and reshapes: the layout is carried by stride matching (the sequence may merge with
  batch: ``[B, S, V] -> [B*S, V]``); explicit sizes are rewritten (the sequence dim becomes -1,
  so it is the local length ``S/P``); transposes/permutes/expand/cat/stack/chunk/unbind/narrow
  on other dims keep the layout;
* indexing: a slice on the sequence dim that is a shift (``x[:, 1:]``, ``x[:, :-1]``) becomes a
  padded layout (no data movement), other indexing of the sequence falls back;
* reductions over feature dims keep the layout; ``sum``/``mean`` over the sequence become local
  sums plus ``all_reduce_loss`` (REDUCED);
* ``scaled_dot_product_attention`` -> pass 3 (:mod:`attention`), ``cross_entropy`` /
  ``nll_loss`` -> pass 5 (:mod:`loss`), anything else -> pass 6 (:mod:`fallback`).

Afterwards: per-token compute runs on ``S/P`` positions; SymInt sizes in the graph still mean
the *global* length (``torch.arange(S)`` stays global); sizes queried from sharded tensors are
rewritten to their global values; graph outputs that carry the sequence are this rank's shard.
"""
from __future__ import annotations

import math
import operator
from typing import Any, Callable, Optional

import sympy
import torch
import torch.fx as fx
import torch.nn.functional as F

import autosp_lm.parallel.collectives  # noqa: F401 - registers the autosp_lm:: collectives

from . import fallback as fb
from .common import (REDUCED, REP, AutoSPError, SequenceInfo, Shard, describe, example,
                     integer, is_shard, is_tensor_node, op_name, static_int)
from . import ops  # noqa: F401 - registers autosp_lm::grad_scale
from .positions import fresh_shard, localize
from .report import Report

RULES: dict[str, Callable] = {}

# per-token work that shards a full operand even when nothing requires grad (inference); plain
# matmuls of replicated values (RoPE tables: inv_freq @ positions) stay full
HEAVY = {"embedding", "linear", "scaled_dot_product_attention", "cross_entropy", "nll_loss",
         "layer_norm", "rms_norm", "conv1d"}


def rule(*names):
    def deco(fn):
        for name in names:
            RULES[name] = fn
        return fn
    return deco


# --------------------------------------------------------------------------------------------
# the rewriter
# --------------------------------------------------------------------------------------------
class Rewriter:
    def __init__(self, gm: fx.GraphModule, info: SequenceInfo, report: Report):
        self.gm, self.info, self.report = gm, info, report
        self.graph = fx.Graph()
        self.env: dict[fx.Node, Any] = {}
        self.state: dict[fx.Node, Any] = {}
        self.override: dict[fx.Node, tuple] = {}
        self.local_cache: dict = {}
        self.gather_cache: dict = {}
        self._chunk = self._start = self._S = None
        self.current: Optional[fx.Node] = None

    # -- emission helpers ------------------------------------------------------------------
    def call(self, fn, *args, **kwargs) -> fx.Node:
        return self.graph.call_function(fn, tuple(args), kwargs)

    def method(self, name, *args, **kwargs) -> fx.Node:
        return self.graph.call_method(name, tuple(args), kwargs)

    def emit(self, n: fx.Node, args, kwargs) -> fx.Node:
        """``n``'s op with new arguments."""
        new = self.graph.create_node(n.op, n.target, tuple(args), dict(kwargs), name=n.name)
        new.meta.update({k: v for k, v in n.meta.items() if k in ("stack_trace", "nn_module_stack",
                                                                   "source_fn_stack")})
        return new

    def S(self):
        if self._S is None:
            if self.info.sym_placeholder is not None:
                self._S = self.env[self.info.sym_placeholder]
            else:
                self._S = self.method("size", self.env[self.info.seq_placeholder], self.info.seq_dim)
        return self._S

    def chunk_len(self):
        if self._chunk is None:
            self._chunk = self.call(operator.floordiv, self.S(), self.info.world)
        return self._chunk

    def chunk_start(self):
        if self._start is None:
            self._start = self.call(operator.mul, self.chunk_len(), self.info.rank)
        return self._start

    def sym(self, expr):
        """A graph value for a sympy expression in S (int when constant)."""
        expr = sympy.expand(self.info.canon(expr))
        if expr.is_Integer:
            return int(expr)
        poly = sympy.Poly(expr, self.info.symbol)
        if poly.degree() != 1 or any(not c.is_Integer for c in poly.all_coeffs()):
            raise AutoSPError(f"AutoSP: cannot express the size {expr} in the graph")
        a, b = (int(c) for c in poly.all_coeffs())
        v = self.S()
        if a != 1:
            v = self.call(operator.mul, v, a)
        if b:
            v = self.call(operator.add, v, b)
        return v

    # -- state helpers -----------------------------------------------------------------------
    def st(self, a):
        if isinstance(a, fx.Node):
            if a in self.override:
                return self.override[a][1]
            return self.state.get(a, REP)
        return REP

    def arg(self, a):
        """New-graph value of an original argument (this rank's chunk when sharded)."""
        if isinstance(a, fx.Node):
            if a in self.override:
                return self.override[a][0]
            return self.env[a]
        return a

    def map(self, a, fn=None):
        fn = fn or self.arg
        return fx.node.map_aggregate(a, lambda x: fn(x) if isinstance(x, fx.Node) else x)

    def copy(self, n):
        out = self.emit(n, self.map(n.args), self.map(n.kwargs))
        self.env[n] = out
        return out

    def is_full(self, a) -> bool:
        """A replicated tensor that carries the sequence."""
        return (is_tensor_node(a) and self.st(a) is REP
                and any(self.info.has_seq(s) for s in example(a).shape))

    def local_or_full(self, a, shard: Shard, fill=0):
        return localize(self, a, shard, fill)

    # -- driver --------------------------------------------------------------------------------
    def run(self) -> fx.GraphModule:
        for n in self.gm.graph.nodes:
            self.current = n
            if n.op == "placeholder":
                new = self.graph.placeholder(n.target, type_expr=n.type)
                new.meta.update(n.meta)
                self.env[n], self.state[n] = new, REP
            elif n.op == "get_attr":
                new = self.graph.get_attr(n.target)
                new.meta.update(n.meta)
                self.env[n], self.state[n] = new, REP
            elif n.op == "output":
                self.output(n)
            else:
                self.state[n] = self.visit(n)
                self.override.clear()
        new_gm = fx.GraphModule(self.gm, self.graph)
        new_gm.graph.eliminate_dead_code()
        new_gm.graph.lint()
        new_gm.recompile()
        return new_gm

    def input_nodes(self, n):
        return [a for a in n.all_input_nodes]

    def visit(self, n: fx.Node):
        name = op_name(n)
        ins = self.input_nodes(n)
        states = [self.st(a) for a in ins]
        # element of a tuple (chunk/unbind/max results)
        if name == "getitem" and isinstance(example(n.args[0]), (tuple, list)):
            s = self.st(n.args[0])
            self.copy(n)
            return s[n.args[1]] if isinstance(s, tuple) else s
        if any(s is REDUCED for s in states):
            return self.visit_reduced(n)
        if not any(is_shard(s) for s in states) and not self.needs_shard(n, name):
            self.copy(n)
            return REP
        if not any(is_shard(s) for s in states):
            primary = self.primary(n, ins)
            if primary is None:  # the sequence appears here from non-sequence inputs
                self.copy(n)
                return REP
            shard = fresh_shard(self, primary)
            if shard is None:
                return fb.fallback(self, n, "sequence size not of the form c*(S-k)")
            fill = -100 if name in ("cross_entropy", "nll_loss") and primary is not n.args[0] else 0
            self.override[primary] = (localize(self, primary, shard, fill), shard)
        fn = RULES.get(name)
        if fn is None:
            return fb.fallback(self, n, f"no sharding rule for '{name}'")
        return fn(self, n)

    def needs_shard(self, n, name) -> bool:
        for a in self.input_nodes(n):
            if self.is_full(a) and (example(a).requires_grad or name in HEAVY):
                return True
        ev = example(n)
        outs = ev if isinstance(ev, (tuple, list)) else [ev]
        for o in outs:
            if isinstance(o, torch.Tensor) and o.requires_grad and any(
                    self.info.has_seq(s) for s in o.shape):
                return True
        return False

    def primary(self, n, ins):
        full = [a for a in ins if self.is_full(a)]
        if not full:
            return None
        if op_name(n) in ("type_as", "to", "view_as", "expand_as", "reshape_as", "new_zeros",
                          "new_ones", "new_empty", "new_full", "new_tensor"):
            return full[0] if full[0] is n.args[0] else None
        grad = [a for a in full if example(a).requires_grad]
        return (grad or full)[0]

    def visit_reduced(self, n):
        """Ops on the loss (REDUCED): forward replicated, backward per rank."""
        name = op_name(n)
        if any(is_shard(self.st(a)) for a in n.all_input_nodes):
            raise AutoSPError(f"AutoSP: {describe(n)} combines a value reduced over the sequence "
                              f"with per-token values; such global statistics are not supported")
        scale = 1.0 / self.info.world

        def wrap(a):
            if not isinstance(a, fx.Node):
                return a
            new = self.arg(a)
            if (self.st(a) is REP and is_tensor_node(a) and example(a).requires_grad):
                # replicated grad-requiring values meet the per-rank loss: every rank
                # back-propagates them fully -> scale by 1/P (sum over the group stays exact)
                if self.is_full(a):
                    raise AutoSPError(f"AutoSP: {describe(n)} combines the loss with a "
                                      f"full-sequence value that requires grad")
                new = self.call(torch.ops.autosp_lm.grad_scale.default, new, scale)
            return new

        out = self.emit(n, self.map(n.args, wrap), self.map(n.kwargs, wrap))
        self.env[n] = out
        if name == "detach":
            return REP
        ev = example(n)
        return REDUCED if isinstance(ev, torch.Tensor) else REP

    def output(self, n):
        def out(a):
            if not isinstance(a, fx.Node):
                return a
            if self.is_full(a):
                shard = fresh_shard(self, a)
                if shard is not None:
                    return localize(self, a, shard)
            return self.env[a]

        self.graph.output(self.map(n.args[0], out), type_expr=n.type)


# --------------------------------------------------------------------------------------------
# rules
# --------------------------------------------------------------------------------------------
def ndim(a) -> int:
    return example(a).dim()


def norm_dim(d, nd):
    return d + nd if d < 0 else d


def tensor_args(rw, n, only_first=False):
    args = [a for a in list(n.args) + list(n.kwargs.values()) if is_tensor_node(a)]
    nested = []
    for a in list(n.args) + list(n.kwargs.values()):
        if isinstance(a, (list, tuple)):
            nested += [x for x in a if is_tensor_node(x)]
    args += nested
    if only_first:
        return [n.args[0]] if is_tensor_node(n.args[0]) else []
    return args


_UNARY_LIKE = {"type_as", "to", "type", "float", "double", "half", "bfloat16", "int", "long",
               "bool", "contiguous", "clone", "detach", "requires_grad_", "zeros_like", "ones_like",
               "empty_like", "full_like", "rand_like", "randn_like", "dropout", "cpu", "cuda"}


@rule("add", "sub", "mul", "div", "true_divide", "floor_divide", "neg", "negative", "pow", "rsqrt",
      "sqrt", "exp", "exp2", "expm1", "log", "log1p", "log2", "cos", "sin", "tan", "tanh", "sigmoid",
      "silu", "gelu", "relu", "relu6", "leaky_relu", "elu", "selu", "celu", "softplus", "mish",
      "hardswish", "hardsigmoid", "erf", "erfc", "abs", "square", "reciprocal", "sign", "clamp",
      "clamp_min", "clamp_max", "clip", "where", "masked_fill", "eq", "ne", "lt", "le", "gt", "ge",
      "logical_and", "logical_or", "logical_not", "logical_xor", "bitwise_and", "bitwise_or",
      "bitwise_xor", "bitwise_not", "remainder", "fmod", "maximum", "minimum", "lerp", "addcmul",
      "addcdiv", "polar", "complex", "real", "imag", "conj", "angle", "positive", "floor", "ceil",
      "round", "trunc", "frac", "nan_to_num", "isnan", "isinf", "isfinite", "atan2", "hypot",
      "sinh", "cosh", "asin", "acos", "atan", "softsign", "tanhshrink", "threshold", "hardtanh",
      "logit", "xlogy", "heaviside", "copysign", "signbit", "float_power", "mul_", "add_", "sub_",
      "div_", "masked_fill_", "clamp_", "copy_", "fill_", "zero_", "pow_", "neg_",
      *_UNARY_LIKE)
def pointwise(rw: Rewriter, n):
    name = op_name(n)
    out_shape = rw.info.shape(n)
    if out_shape is None:
        return fb.fallback(rw, n, "non-tensor result")
    nd = len(out_shape)
    only_first = name in ("type_as", "to", "type")
    operands = tensor_args(rw, n, only_first)
    if name.endswith("_") and not is_shard(rw.st(n.args[0])):
        return fb.fallback(rw, n, "in-place op on a replicated full value")
    target = None
    for a in operands:
        s = rw.st(a)
        if is_shard(s):
            cand = s.with_dim(s.dim + nd - ndim(a))
            if target is None:
                target = cand
            elif cand != target:
                return fb.fallback(rw, n, f"operands sharded differently ({target} vs {cand})")
    if target is None:
        return fb.fallback(rw, n, "no sharded operand")
    repl = {}
    for a in operands:
        if rw.st(a) is REP and a not in repl:
            shp = rw.info.shape(a)
            ad = target.dim - (nd - len(shp))
            if ad < 0 or integer(shp[ad]) == 1:
                continue
            if sympy.simplify(shp[ad] - out_shape[target.dim]) != 0:
                return fb.fallback(rw, n, "operand sizes along the sequence differ")
            repl[a] = localize(rw, a, target.with_dim(ad))
    if only_first:
        args = (rw.arg(n.args[0]),) + tuple(rw.map(list(n.args[1:]), lambda x: rw.env[x]))
        kwargs = rw.map(n.kwargs, lambda x: rw.env[x])
    else:
        f = lambda x: repl.get(x) if x in repl else rw.arg(x)
        args, kwargs = rw.map(n.args, f), rw.map(n.kwargs, f)
    rw.env[n] = rw.emit(n, args, kwargs)
    return target


def _sizes_arg(n, start=1):
    """The size list of view/reshape/expand/repeat given as varargs or one sequence."""
    rest = list(n.args[start:])
    if "size" in n.kwargs:
        rest = [n.kwargs["size"]]
    elif "shape" in n.kwargs:
        rest = [n.kwargs["shape"]]
    if len(rest) == 1 and isinstance(rest[0], (list, tuple, torch.Size)):
        return list(rest[0])
    return rest


def map_view(rw, s: Shard, in_shape, out_shape) -> Optional[Shard]:
    """Layout after a row-major reshape ``in_shape -> out_shape`` (None: the sequence is split)."""
    info = rw.info
    L = info.symbol - s.pad_left - s.pad_right
    t_in = s.inner * math.prod(in_shape[s.dim + 1:])
    before_in = s.outer * math.prod(in_shape[:s.dim])
    suffix = sympy.Integer(1)
    for od in reversed(range(len(out_shape))):
        ratio = sympy.cancel(t_in / suffix)
        if ratio.is_Integer and ratio >= 1:
            q = sympy.cancel(out_shape[od] / (L * ratio))
            if q.is_Integer and q >= 1:
                if sympy.cancel(math.prod(out_shape[:od]) * q - before_in) == 0:
                    return Shard(od, int(q), int(ratio), s.pad_left, s.pad_right)
        suffix = suffix * out_shape[od]
    return None


@rule("view", "reshape", "flatten", "unflatten", "squeeze", "unsqueeze", "view_as", "reshape_as",
      "ravel", "atleast_1d", "atleast_2d", "atleast_3d")
def view_like(rw: Rewriter, n):
    x = n.args[0]
    s = rw.st(x)
    if not is_shard(s):
        return fb.fallback(rw, n, "sequence operand is not the reshaped tensor")
    in_shape, out_shape = rw.info.shape(x), rw.info.shape(n)
    new = map_view(rw, s, in_shape, out_shape)
    if new is None:
        return fb.fallback(rw, n, "reshape splits the sequence dimension")
    sizes = [-1 if i == new.dim else static_int(sz, f"dimension {i} of {n.name}")
             for i, sz in enumerate(out_shape)]
    rw.env[n] = rw.method("reshape", rw.arg(x), sizes)
    return new


@rule("view_as_complex", "view_as_real")
def complex_view(rw, n):
    x = n.args[0]
    s = rw.st(x)
    if not is_shard(s) or s.dim >= ndim(x) - 1:
        return fb.fallback(rw, n, "complex view over the sequence dimension")
    rw.env[n] = rw.emit(n, (rw.arg(x),), {})
    return s


@rule("transpose", "swapaxes", "swapdims", "permute", "t", "movedim", "moveaxis", "adjoint", "mT")
def transpose_like(rw: Rewriter, n):
    x = n.args[0]
    s = rw.st(x)
    if not is_shard(s):
        return fb.fallback(rw, n, "unexpected sharded argument")
    nd = ndim(x)
    name = op_name(n)
    perm = list(range(nd))
    if name in ("transpose", "swapaxes", "swapdims"):
        a, b = (n.args[1], n.args[2]) if len(n.args) >= 3 else (n.kwargs.get("dim0"), n.kwargs.get("dim1"))
        a, b = norm_dim(a, nd), norm_dim(b, nd)
        perm[a], perm[b] = perm[b], perm[a]
    elif name == "permute":
        perm = [norm_dim(d, nd) for d in _sizes_arg(n)]
        if not perm and "dims" in n.kwargs:
            perm = [norm_dim(d, nd) for d in n.kwargs["dims"]]
    elif name in ("t", "mT", "adjoint"):
        perm[-1], perm[-2] = perm[-2], perm[-1]
    else:  # movedim(src, dst)
        src, dst = n.args[1], n.args[2]
        src = [src] if isinstance(src, int) else list(src)
        dst = [dst] if isinstance(dst, int) else list(dst)
        src, dst = [norm_dim(d, nd) for d in src], [norm_dim(d, nd) for d in dst]
        rest = [d for d in range(nd) if d not in src]
        perm = [None] * nd
        for a, b in zip(src, dst):
            perm[b] = a
        it = iter(rest)
        perm = [p if p is not None else next(it) for p in perm]
    rw.env[n] = rw.emit(n, rw.map(n.args), rw.map(n.kwargs))
    return s.with_dim(perm.index(s.dim))


@rule("expand", "expand_as", "broadcast_to")
def expand(rw: Rewriter, n):
    x = n.args[0]
    s = rw.st(x)
    if not is_shard(s):
        return fb.fallback(rw, n, "expanding to the sequence length")
    out_shape = rw.info.shape(n)
    od = s.dim + len(out_shape) - ndim(x)
    sizes = [-1 if i == od else static_int(sz, f"dimension {i} of {n.name}")
             for i, sz in enumerate(out_shape)]
    rw.env[n] = rw.method("expand", rw.arg(x), sizes)
    return s.with_dim(od)


@rule("repeat")
def repeat(rw, n):
    x = n.args[0]
    s = rw.st(x)
    reps = _sizes_arg(n)
    od = s.dim + len(reps) - ndim(x) if is_shard(s) else None
    if od is None or not isinstance(reps[od], int) or reps[od] != 1:
        return fb.fallback(rw, n, "repeat along the sequence")
    rw.env[n] = rw.emit(n, rw.map(n.args), rw.map(n.kwargs))
    return s.with_dim(od)


def _dim_arg(n, pos, default=None, key="dim"):
    if len(n.args) > pos:
        return n.args[pos]
    return n.kwargs.get(key, default)


@rule("repeat_interleave")
def repeat_interleave(rw, n):
    x = n.args[0]
    s = rw.st(x)
    dim = _dim_arg(n, 2)
    reps = _dim_arg(n, 1, key="repeats")
    if (not is_shard(s) or dim is None or norm_dim(dim, ndim(x)) == s.dim
            or isinstance(reps, fx.Node)):
        return fb.fallback(rw, n, "repeat_interleave along the sequence")
    rw.env[n] = rw.emit(n, rw.map(n.args), rw.map(n.kwargs))
    return s


@rule("chunk", "split", "tensor_split", "unbind", "split_with_sizes")
def split_like(rw, n):
    x = n.args[0]
    s = rw.st(x)
    name = op_name(n)
    nd = ndim(x)
    dim = _dim_arg(n, 1 if name == "unbind" else 2, 0)
    if not is_shard(s) or not isinstance(dim, int) or norm_dim(dim, nd) == s.dim:
        return fb.fallback(rw, n, f"{name} along the sequence")
    dim = norm_dim(dim, nd)
    if any(isinstance(a, fx.Node) for a in fx.node.map_aggregate(n.args[1:], lambda v: v)
           if not isinstance(a, (list, tuple))):
        pass
    rw.env[n] = rw.emit(n, rw.map(n.args), rw.map(n.kwargs))
    out = s.with_dim(s.dim - 1) if (name == "unbind" and dim < s.dim) else s
    return tuple(out for _ in example(n))


@rule("narrow", "select")
def narrow(rw, n):
    x = n.args[0]
    s = rw.st(x)
    nd = ndim(x)
    dim = _dim_arg(n, 1, 0)
    if not is_shard(s) or norm_dim(dim, nd) == s.dim:
        return fb.fallback(rw, n, f"{op_name(n)} on the sequence dimension")
    rw.env[n] = rw.emit(n, rw.map(n.args), rw.map(n.kwargs))
    if op_name(n) == "select" and norm_dim(dim, nd) < s.dim:
        return s.with_dim(s.dim - 1)
    return s


@rule("cat", "concat", "concatenate", "stack", "hstack", "vstack")
def cat(rw, n):
    name = op_name(n)
    tensors = list(n.args[0] if n.args else n.kwargs["tensors"])
    dim = _dim_arg(n, 1, 0)
    if name in ("cat", "concat", "concatenate"):
        # empty operands (an empty KV cache: torch.cat([torch.tensor([]), k])) add nothing
        kept = [t for t in tensors if not (is_tensor_node(t) and example(t).numel() == 0
                                           and not any(rw.info.has_seq(s) for s in example(t).shape))]
        if len(kept) == 1 and is_shard(rw.st(kept[0])):
            rw.env[n] = rw.arg(kept[0])
            return rw.st(kept[0])
    if name in ("hstack", "vstack") or not isinstance(dim, int):
        return fb.fallback(rw, n, f"{name}")
    out_nd = len(rw.info.shape(n))
    dim = norm_dim(dim, out_nd)
    target = None
    for t in tensors:
        s = rw.st(t)
        if is_shard(s):
            od = s.dim + (1 if name == "stack" and s.dim >= dim else 0)
            cand = s.with_dim(od)
            if target is None:
                target = cand
            elif cand != target:
                return fb.fallback(rw, n, "operands sharded differently")
    if target is None or (name != "stack" and target.dim == dim):
        return fb.fallback(rw, n, f"{name} along the sequence")
    new_list = []
    for t in tensors:
        s = rw.st(t)
        if is_shard(s) or not rw.is_full(t):
            new_list.append(rw.arg(t))
        else:
            td = target.dim - (1 if name == "stack" and target.dim > dim else 0)
            new_list.append(localize(rw, t, target.with_dim(td)))
    args = (new_list,) + tuple(rw.map(list(n.args[1:])))
    kwargs = {k: v for k, v in rw.map(n.kwargs).items() if k != "tensors"}
    rw.env[n] = rw.emit(n, args, kwargs)
    return target


@rule("flip", "roll")
def flip_roll(rw, n):
    x = n.args[0]
    s = rw.st(x)
    dims = _dim_arg(n, 1 if op_name(n) == "flip" else 2, None, key="dims")
    if dims is None and op_name(n) == "flip":
        dims = _sizes_arg(n)
    if isinstance(dims, int):
        dims = [dims]
    if not is_shard(s) or dims is None or s.dim in [norm_dim(d, ndim(x)) for d in dims]:
        return fb.fallback(rw, n, f"{op_name(n)} over the sequence")
    rw.env[n] = rw.emit(n, rw.map(n.args), rw.map(n.kwargs))
    return s


@rule("pad")
def pad(rw, n):
    x = n.args[0]
    s = rw.st(x)
    p = _dim_arg(n, 1, key="pad")
    nd = ndim(x)
    if not is_shard(s) or not isinstance(p, (list, tuple)):
        return fb.fallback(rw, n, "pad of the sequence")
    touched = [nd - 1 - i // 2 for i, v in enumerate(p) if v != 0]
    if s.dim in touched:
        return fb.fallback(rw, n, "pad along the sequence")
    rw.env[n] = rw.emit(n, rw.map(n.args), rw.map(n.kwargs))
    return s


# -- indexing ---------------------------------------------------------------------------------
@rule("getitem")
def getitem(rw: Rewriter, n):
    x, idx = n.args
    s = rw.st(x)
    if not is_shard(s):
        return fb.fallback(rw, n, "indexing with a sharded index")
    nd = ndim(x)
    items = list(idx) if isinstance(idx, tuple) else [idx]
    if any(isinstance(i, fx.Node) and is_tensor_node(i) for i in items) or any(
            isinstance(i, (list, bool)) for i in items):
        return fb.fallback(rw, n, "advanced indexing of a sharded tensor")
    consumed = sum(1 for i in items if i is not None and i is not Ellipsis)
    if Ellipsis in items:
        k = items.index(Ellipsis)
        items = items[:k] + [slice(None)] * (nd - consumed) + items[k + 1:]
    items += [slice(None)] * (nd - sum(1 for i in items if i is not None))
    in_dim = out_dim = 0
    new_items, new_shard = [], None
    for it in items:
        if it is None:
            new_items.append(None)
            out_dim += 1
            continue
        if in_dim == s.dim:
            if not isinstance(it, slice):
                return fb.fallback(rw, n, "selecting single positions of the sequence")
            shifted = _shift(rw, s, it)
            if shifted is None:
                return fb.fallback(rw, n, "a slice of the sequence that is not a shift")
            new_shard = shifted.with_dim(out_dim)
            new_items.append(slice(None))
        else:
            new_items.append(it)
        in_dim += 1
        if isinstance(it, slice):
            out_dim += 1
    if all(isinstance(i, slice) and i == slice(None) for i in new_items):
        rw.env[n] = rw.arg(x)
    else:
        rw.env[n] = rw.emit(n, (rw.arg(x), rw.map(tuple(new_items))), {})
    return new_shard


def _shift(rw, s: Shard, sl: slice) -> Optional[Shard]:
    if s.merged or sl.step not in (None, 1):
        return None
    pl, pr = s.pad_left, s.pad_right
    L = rw.info.symbol - pl - pr
    start, stop = sl.start, sl.stop
    if isinstance(start, fx.Node) or isinstance(stop, fx.Node):
        def val(v):
            return rw.info.canon(example(v)) if isinstance(v, fx.Node) else v
        start, stop = val(start), val(stop)
    if start is None:
        start = 0
    start = sympy.sympify(start)
    if start.is_Integer:
        if start < 0:
            return None
        a = int(start)
    else:  # start given as an expression in S, e.g. S - k, not a shift
        return None
    if stop is None:
        b = 0
    else:
        stop = sympy.sympify(stop)
        if stop.is_Integer:
            if stop >= 0:
                return None
            b = -int(stop)
        else:
            k = integer(L - stop)
            if k is None or k < 0:
                return None
            b = k
    return Shard(s.dim, 1, 1, pl + a, pr + b)


# -- feature-dim ops --------------------------------------------------------------------------
@rule("linear")
def linear(rw, n):
    x = n.args[0]
    s = rw.st(x)
    others = [a for a in n.all_input_nodes if a is not x]
    if not is_shard(s) or s.dim == ndim(x) - 1 or any(
            is_shard(rw.st(a)) or rw.is_full(a) for a in others):
        return fb.fallback(rw, n, "linear over the sequence dimension")
    rw.env[n] = rw.emit(n, rw.map(n.args), rw.map(n.kwargs))
    return s


@rule("embedding")
def embedding(rw, n):
    ids = n.args[0]
    s = rw.st(ids)
    if not is_shard(s) or any(is_shard(rw.st(a)) for a in n.all_input_nodes if a is not ids):
        return fb.fallback(rw, n, "embedding with a sharded table")
    rw.env[n] = rw.emit(n, rw.map(n.args), rw.map(n.kwargs))
    return s


@rule("matmul", "mm", "bmm")
def matmul(rw, n):
    a, b = n.args[0], n.args[1]
    sa, sb = rw.st(a), rw.st(b)
    na, nb = ndim(a), ndim(b)
    if na < 2 or nb < 2:
        return fb.fallback(rw, n, "matmul with a vector")
    if is_shard(sa) and sa.dim == na - 1:
        return fb.fallback(rw, n, "matmul contracting the sequence")
    new_b = rw.arg(b)
    if is_shard(sb):
        if sb.dim == nb - 1:
            return fb.fallback(rw, n, "matmul producing a sequence-sharded column dimension")
        if sb.dim == nb - 2:  # contraction over the sequence: gather the right operand
            new_b = fb.gather(rw, b)
            rw.report.fallbacks.append(f"{describe(n)}: contracts the sequence of its right operand "
                                       f"-> all_gather of that operand")
            sb = REP
    if not is_shard(sa):
        return fb.fallback(rw, n, "only the right operand is sharded")
    out_nd = len(rw.info.shape(n))
    od = sa.dim + out_nd - na
    if is_shard(sb):  # both sharded along batch dims: must agree
        if sb.with_dim(sb.dim + out_nd - nb) != sa.with_dim(od):
            return fb.fallback(rw, n, "operands sharded differently")
    elif rw.is_full(b):
        shp = rw.info.shape(b)
        bd = od - (out_nd - nb)
        if bd >= 0 and bd < nb - 2 and rw.info.has_seq(shp[bd]):
            new_b = localize(rw, b, sa.with_dim(bd))
    rw.env[n] = rw.emit(n, (rw.arg(a), new_b) + tuple(rw.map(list(n.args[2:]))), rw.map(n.kwargs))
    return sa.with_dim(od)


@rule("addmm")
def addmm(rw, n):
    """``addmm(bias, x2d, W)`` (GPT-2's Conv1D): rows of ``x2d`` sharded, ``W`` replicated."""
    bias, a, b = n.args[0], n.args[1], n.args[2]
    sa = rw.st(a)
    if (not is_shard(sa) or sa.dim != 0 or is_shard(rw.st(b)) or rw.is_full(b)
            or is_shard(rw.st(bias)) or rw.is_full(bias)):
        return fb.fallback(rw, n, "addmm over the sequence")
    rw.env[n] = rw.emit(n, rw.map(n.args), rw.map(n.kwargs))
    return sa


@rule("layer_norm", "rms_norm", "group_norm_last")
def norm(rw, n):
    x = n.args[0]
    s = rw.st(x)
    shape = _dim_arg(n, 1, key="normalized_shape")
    k = 1 if isinstance(shape, int) else len(shape)
    if not is_shard(s) or s.dim >= ndim(x) - k or any(
            is_shard(rw.st(a)) or rw.is_full(a) for a in n.all_input_nodes if a is not x):
        return fb.fallback(rw, n, "normalization over the sequence")
    rw.env[n] = rw.emit(n, rw.map(n.args), rw.map(n.kwargs))
    return s


@rule("softmax", "log_softmax", "cumsum", "cumprod", "logcumsumexp", "cummax", "cummin", "sort",
      "argsort", "topk", "normalize", "glu", "kthvalue")
def along_dim(rw, n):
    x = n.args[0]
    s = rw.st(x)
    name = op_name(n)
    pos = {"topk": 2, "kthvalue": 2, "normalize": 2}.get(name, 1)
    default = -1 if name in ("sort", "argsort", "topk", "normalize", "glu", "kthvalue") else None
    dim = _dim_arg(n, pos, default)
    if name == "normalize" and len(n.args) <= 2 and "dim" not in n.kwargs:
        dim = 1
    if not is_shard(s) or dim is None or norm_dim(dim, ndim(x)) == s.dim:
        return fb.fallback(rw, n, f"{name} along the sequence")
    rw.env[n] = rw.emit(n, rw.map(n.args), rw.map(n.kwargs))
    ev = example(n)
    return tuple(s for _ in ev) if isinstance(ev, (tuple, list)) else s


_REDUCTIONS = {"sum", "mean", "amax", "amin", "max", "min", "argmax", "argmin", "std", "var",
               "logsumexp", "prod", "all", "any", "norm", "nansum", "nanmean", "count_nonzero",
               "std_mean", "var_mean", "aminmax"}


@rule(*_REDUCTIONS)
def reduction(rw: Rewriter, n):
    name = op_name(n)
    x = n.args[0]
    if name in ("max", "min") and len(n.args) > 1 and is_tensor_node(n.args[1]):
        return pointwise(rw, n)
    s = rw.st(x)
    if not is_shard(s):
        return fb.fallback(rw, n, "unexpected sharded argument")
    nd = ndim(x)
    dim = _dim_arg(n, 2 if name == "norm" else 1, None)
    if name == "norm":
        dim = n.kwargs.get("dim", dim)
    if isinstance(dim, (torch.dtype,)):
        dim = None
    keepdim = n.kwargs.get("keepdim", n.args[2] if len(n.args) > 2 and name != "norm" else False)
    dims = None if dim is None else ([dim] if isinstance(dim, int) else list(dim))
    if dims is not None and not all(isinstance(d, int) for d in dims):
        return fb.fallback(rw, n, "reduction over symbolic dims")
    dims = list(range(nd)) if dims is None or dims == [] else [norm_dim(d, nd) for d in dims]
    if s.dim not in dims:
        rw.env[n] = rw.emit(n, rw.map(n.args), rw.map(n.kwargs))
        new = s if keepdim else s.with_dim(s.dim - sum(1 for d in dims if d < s.dim))
        ev = example(n)
        return tuple(new for _ in ev) if isinstance(ev, (tuple, list)) else new
    if name not in ("sum", "mean", "nansum", "nanmean"):
        return fb.fallback(rw, n, f"{name} over the sequence")
    return reduce_sequence(rw, n, x, s, dims, bool(keepdim), mean=name in ("mean", "nanmean"))


def valid_mask(rw, s: Shard, nd: int):
    """Bool tensor marking this rank's logical (non-padding) positions, broadcastable to the
    local tensor of layout ``s``."""
    pos = rw.call(torch.arange, rw.chunk_len(), device=rw.device())
    pos = rw.call(operator.add, pos, rw.chunk_start())
    lo = rw.call(operator.ge, pos, s.pad_left)
    hi = rw.call(operator.lt, pos, rw.sym(rw.info.symbol - s.pad_right))
    valid = rw.call(operator.and_, lo, hi)
    if s.merged:
        valid = rw.method("reshape", valid, [1, -1, 1])
        valid = rw.method("expand", valid, [s.outer, -1, s.inner])
        valid = rw.method("reshape", valid, [-1])
    return rw.method("reshape", valid, [1] * s.dim + [-1] + [1] * (nd - s.dim - 1))


def _device(rw):
    ph = rw.info.seq_placeholder
    ev = example(ph)
    return ev.device if isinstance(ev, torch.Tensor) else None


Rewriter.device = _device


def reduce_sequence(rw: Rewriter, n, x, s: Shard, dims, keepdim, mean):
    """sum/mean over dims that include the sequence: local sum, divide by the global count,
    all_reduce_loss (forward: the global value on every rank; backward: each rank its share)."""
    from torch.distributed import is_available  # noqa: F401 - keep import light
    xl = rw.arg(x)
    if s.padded:
        xl = rw.call(torch.where, valid_mask(rw, s, ndim(x)), xl, 0)
    kwargs = {k: v for k, v in rw.map(n.kwargs).items() if k in ("dtype",)}
    local = rw.call(torch.sum, xl, dims, keepdim, **kwargs)
    if mean:
        shape = rw.info.shape(x)
        count = math.prod(shape[d] for d in dims)
        local = rw.call(operator.truediv, local, rw.sym(count))
    out = rw.call(torch.ops.autosp_lm.all_reduce_loss.default, rw.method("contiguous", local),
                  rw.info.group, rw.info.world)
    rw.report.collective("all_reduce_loss", bool(example(x).requires_grad))
    rw.report.loss.append(f"{describe(n)}: {'mean' if mean else 'sum'} over the sequence -> local "
                          f"sum + all_reduce_loss")
    rw.env[n] = out
    return REDUCED


@rule("size", "dim", "numel", "nelement", "ndimension")
def size_query(rw, n):
    """Sizes of sharded tensors are answered with their global values."""
    ev = example(n)

    def val(v):
        if isinstance(v, torch.SymInt):
            return rw.sym(rw.info.canon(v))
        return int(v) if isinstance(v, int) else v

    if isinstance(ev, (tuple, list, torch.Size)):
        out = tuple(val(v) for v in ev)
    else:
        out = val(ev)
    rw.env[n] = out
    return REP


@rule("new_zeros", "new_ones", "new_empty", "new_full", "new_tensor")
def new_factory(rw, n):
    # the tensor only lends dtype/device; the sizes are explicit (global) -> a full value
    rw.env[n] = rw.emit(n, rw.map(n.args), rw.map(n.kwargs))
    return REP


def shard_graph(gm: fx.GraphModule, info: SequenceInfo, report: Report) -> fx.GraphModule:
    """Run pass 2 (with 3-6 as its rules) and return the rewritten graph module."""
    from . import attention, loss  # noqa: F401 - register their rules
    return Rewriter(gm, info, report).run()
