"""Rules: elementwise and broadcasting ops (operands aligned from the right; full operands are
chunked in the layout of the sharded one), dtype/device casts, ``*_like`` factories."""
from __future__ import annotations

import sympy

import torch.fx as fx

from ..graph import REP, Shard, integer, is_shard, op_name, target_key, torch_ops
from .common import layout_refusal, ndim, realign, same_length, tensor_args
from .registry import rule

# ops whose extra operands lend only dtype/device: align just the first
CAST_LIKE = ("type_as", "to", "type")
UNARY_LIKE = ("type_as", "to", "type", "float", "double", "half", "bfloat16", "int", "long",
              "bool", "contiguous", "clone", "detach", "requires_grad_", "zeros_like",
              "ones_like", "empty_like", "full_like", "rand_like", "randn_like", "dropout", "cpu",
              "cuda")
POINTWISE = (
    "add", "sub", "mul", "div", "true_divide", "floor_divide", "neg", "negative", "pow", "rsqrt",
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
    "div_", "masked_fill_", "clamp_", "copy_", "fill_", "zero_", "pow_", "neg_")


@rule(*torch_ops(*POINTWISE, *UNARY_LIKE), accepts=("blocks",))
def pointwise(rw, n):
    name = op_name(n)
    out_shape = rw.info.shape(n)
    if out_shape is None:
        return rw.fallback(n, "non-tensor result")
    nd = len(out_shape)
    only_first = name in CAST_LIKE
    operands = tensor_args(n, only_first)
    if name.endswith("_") and not is_shard(rw.state(n.args[0])):
        return rw.fallback(n, "in-place op on a replicated full value")
    cands = []
    for a in operands:
        s = rw.state(a)
        if is_shard(s):
            cands.append(s.with_dim(s.dim + nd - ndim(a)))
    if not cands:
        return rw.fallback(n, "no sharded operand")
    target = max(cands, key=lambda c: (cands.count(c), -cands.index(c)))
    repl = {}
    for a in operands:  # operands shifted against each other meet by a halo exchange
        s = rw.state(a)
        if is_shard(s) and a not in repl:
            cand = s.with_dim(s.dim + nd - ndim(a))
            if cand == target:
                continue
            if not same_length(cand, target):
                return rw.fallback(n, f"operands sharded differently ({target} vs {cand})")
            refused = layout_refusal(rw, n, "operands shifted against each other")
            if refused is not None:
                return refused
            repl[a] = realign(rw, a, target.with_dim(s.dim))
            rw.note_rewrite("short-range mixing", n, f"operand {a.name} shifted by "
                            f"{target.pad_left - s.pad_left} position(s) to meet the others "
                            f"(seq_window)", repl[a])
    for a in operands:
        if rw.state(a) is REP and a not in repl:
            shp = rw.info.shape(a)
            ad = target.dim - (nd - len(shp))
            if ad < 0 or integer(shp[ad]) == 1:
                continue
            if sympy.simplify(shp[ad] - out_shape[target.dim]) != 0:
                return rw.fallback(n, "operand sizes along the sequence differ")
            repl[a] = rw.localize(a, target.with_dim(ad))
    if only_first:
        args = (rw.value(n.args[0]),) + tuple(rw.map(list(n.args[1:]), rw.original_value))
        kwargs = rw.map(n.kwargs, rw.original_value)
    else:
        def f(x):
            return repl[x] if x in repl else rw.value(x)
        args, kwargs = rw.map(n.args, f), rw.map(n.kwargs, f)
    rw.bind(n, rw.emit(n, args, kwargs))
    return target


# ========================================================== replicated chains computed locally
_RANDOM_LIKE = ("rand_like", "randn_like", "dropout")


#: the ops a replicated chain may be made of to be computed on local rows (:func:`localize_chain`)
_CHAIN_OPS = frozenset(torch_ops(*[n for n in POINTWISE + UNARY_LIKE
                                   if not n.endswith("_") and n not in _RANDOM_LIKE],
                                 "unsqueeze"))


def localize_chain(rw, node, shard: Shard):
    """This rank's chunk of the replicated value ``node`` computed from the chunks of its inputs
    (None where that does not apply): a value that the graph computes whole on every rank from
    a sequence input by elementwise ops, casts and ``unsqueeze`` (RoPE's ``cos``/``sin`` tables
    from ``position_ids``: ``[1, 1, S, d]`` in fp32 on every rank, only ever read in this rank's
    rows) is computed on this rank's rows alone, so the whole-sequence value is never made.
    Exact: elementwise ops commute with taking rows. Inputs without the sequence at the aligned
    dim (``inv_freq``, broadcast dims of size 1) are used whole."""
    if shard.merged or shard.padded or not isinstance(node, fx.Node) \
            or node.op not in ("call_function", "call_method") or rw.state(node) is not REP \
            or target_key(node) not in _CHAIN_OPS:
        return None
    shape = rw.info.shape(node)
    d = shard.dim
    if shape is None or d >= len(shape) or not rw.info.has_seq(shape[d]):
        return None
    unsqueeze = op_name(node) == "unsqueeze"
    if unsqueeze:
        k = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim")
        if not isinstance(k, int):
            return None
        k = k + len(shape) if k < 0 else k
        if k == d:
            return None
    repl = {}
    for a in node.all_input_nodes:
        shp = rw.info.shape(a)
        if shp is None:
            continue
        ad = (d if d < k else d - 1) if unsqueeze else d - (len(shape) - len(shp))
        if ad < 0 or integer(shp[ad]) == 1:
            continue
        if sympy.simplify(shp[ad] - shape[d]) != 0:
            return None
        repl[a] = rw.localize(a, shard.with_dim(ad))

    def f(x):
        return repl[x] if x in repl else rw.value(x)
    return rw.emit(node, rw.map(node.args, f), rw.map(node.kwargs, f))


@rule(*torch_ops("tril", "triu"), accepts=("blocks",))
def triangle(rw, n):
    """``tril``/``triu`` keep or zero entries by their place in the last two dims: local when
    the sequence (or its blocks) is a dim before them."""
    x = n.args[0]
    s = rw.state(x)
    if not is_shard(s) or s.dim >= ndim(x) - 2 or any(
            rw.state(a) is not REP or rw.is_full(a) for a in n.all_input_nodes if a is not x):
        return rw.fallback(n, f"{op_name(n)} over the sequence")
    rw.emit_local(n)
    return s
