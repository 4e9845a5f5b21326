"""Rules: elementwise and broadcasting ops (operands aligned from the right; full operands are
chunked in the layout of the sharded one), dtype/device casts, ``*_like`` factories."""
from __future__ import annotations

import sympy

from ..graph import REP, integer, is_shard, op_name, torch_ops
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
