"""Shared vocabulary of the AutoSP passes: sharding states, symbolic shapes, op names, errors.

A value in the Dynamo graph is in one of three states:

* :data:`REP` — *replicated*: computed identically on every rank. It may carry the full sequence
  (a "full" value, e.g. ``labels`` or ``torch.arange(S)``) or no sequence at all (parameters,
  scalars).
* :class:`Shard` — this rank's contiguous chunk of the sequence. See the class for the layout.
* :data:`REDUCED` — the result of a reduction over the whole sequence (the loss): identical on
  every rank in the forward, but its backward is *per rank* (each rank back-propagates its own
  share; parameter gradients are summed over the SP group afterwards).

Tuples (``chunk``/``unbind`` results) carry a tuple of states.
"""
from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Any, Optional

import sympy
import torch
import torch.fx as fx


class AutoSPError(RuntimeError):
    """A model or configuration AutoSP cannot run exactly; the message names the numbers."""


class _Rep:
    def __repr__(self):
        return "REP"


class _Reduced:
    def __repr__(self):
        return "REDUCED"


REP = _Rep()
REDUCED = _Reduced()


@dataclass(frozen=True)
class Shard:
    """Layout of a tensor sharded along the sequence.

    Along tensor dimension ``dim`` the full (logical) tensor has size ``outer * L * inner``
    (row-major: ``outer`` blocks of ``L`` sequence positions of ``inner`` elements; ``outer`` and
    ``inner`` are 1 unless a reshape merged the sequence with neighbouring dimensions, e.g.
    ``logits.reshape(-1, V)`` gives ``outer = B``). The logical sequence of length
    ``L = S - pad_left - pad_right`` sits at positions ``[pad_left, S - pad_right)`` of a
    *virtual* sequence of the input length ``S`` (divisible by the group size ``P``); rank ``r``
    holds virtual positions ``[r*S/P, (r+1)*S/P)``. Shifted values (``labels[:, 1:]``,
    ``logits[:, :-1]``) therefore keep equal chunks: positions outside the logical range are
    padding (ignore_index for loss targets, garbage for activations that only meet ignored
    targets).
    """

    dim: int
    outer: int = 1
    inner: int = 1
    pad_left: int = 0
    pad_right: int = 0

    @property
    def merged(self) -> bool:
        return self.outer != 1 or self.inner != 1

    @property
    def padded(self) -> bool:
        return bool(self.pad_left or self.pad_right)

    def with_dim(self, dim: int) -> "Shard":
        return Shard(dim, self.outer, self.inner, self.pad_left, self.pad_right)

    def same_sequence(self, other: "Shard") -> bool:
        return (self.outer, self.inner, self.pad_left, self.pad_right) == (
            other.outer, other.inner, other.pad_left, other.pad_right)


def is_shard(state) -> bool:
    return isinstance(state, Shard)


# --------------------------------------------------------------------------------------------
# op names: torch.add, Tensor.add (call_method "add"), operator.add -> "add"
# --------------------------------------------------------------------------------------------
_OPERATOR_NAMES = {
    operator.add: "add", operator.sub: "sub", operator.mul: "mul", operator.truediv: "div",
    operator.floordiv: "floor_divide", operator.neg: "neg", operator.pow: "pow",
    operator.matmul: "matmul", operator.getitem: "getitem", operator.iadd: "add",
    operator.isub: "sub", operator.imul: "mul", operator.itruediv: "div", operator.and_: "bitwise_and",
    operator.or_: "bitwise_or", operator.xor: "bitwise_xor", operator.invert: "bitwise_not",
    operator.eq: "eq", operator.ne: "ne", operator.lt: "lt", operator.le: "le", operator.gt: "gt",
    operator.ge: "ge", operator.mod: "remainder", operator.abs: "abs", operator.pos: "positive",
}


def op_name(node: fx.Node) -> str:
    if node.op == "call_method":
        return str(node.target)
    t = node.target
    if t in _OPERATOR_NAMES:
        return _OPERATOR_NAMES[t]
    name = getattr(t, "__name__", None) or str(t)
    if isinstance(t, torch._ops.OpOverload):
        name = t._opname
    elif isinstance(t, torch._ops.OpOverloadPacket):
        name = t._qualified_op_name.split("::")[-1]
    return name.lstrip("_") if name.startswith("_") and not name.startswith("__") else name


def describe(node: fx.Node) -> str:
    """``name (op)`` plus the user's source location when Dynamo recorded it."""
    where = ""
    lines = [ln.strip() for ln in (node.meta.get("stack_trace") or "").strip().splitlines()]
    files = [i for i, ln in enumerate(lines) if ln.startswith("File ")]
    if files:
        i = files[-1]
        loc = lines[i]
        try:
            path = loc.split('"')[1].rsplit("/", 1)[-1]
            lineno = loc.split("line ")[1].split(",")[0]
            loc = f"{path}:{lineno}"
        except IndexError:
            pass
        code = lines[i + 1] if i + 1 < len(lines) else ""
        where = f" at {loc}: {code}"
    return f"{node.name} ({op_name(node)}){where}"


# --------------------------------------------------------------------------------------------
# example values and symbolic sizes
# --------------------------------------------------------------------------------------------
def example(node: Any):
    if isinstance(node, fx.Node):
        return node.meta.get("example_value", node.meta.get("val"))
    return node


def is_tensor_node(node: Any) -> bool:
    return isinstance(node, fx.Node) and isinstance(example(node), torch.Tensor)


def to_expr(size) -> sympy.Expr:
    if isinstance(size, torch.SymInt):
        return size.node.expr
    return sympy.Integer(int(size))


@dataclass
class SequenceInfo:
    """What pass 1 found: the sequence inputs and the symbol of their length."""

    symbol: sympy.Symbol  # canonical symbol of the global sequence length S
    aliases: dict  # other symbols Dynamo gave the same length -> symbol
    inputs: dict  # placeholder name -> sequence dim
    sym_placeholder: Optional[fx.Node]  # a SymInt placeholder equal to S, when Dynamo lifted one
    seq_placeholder: Optional[fx.Node]  # a tensor placeholder with the sequence (fallback for S)
    seq_dim: int = 1
    world: int = 1
    rank: int = 0
    group: str = ""
    shape_env: Any = None

    def canon(self, expr) -> sympy.Expr:
        expr = to_expr(expr) if not isinstance(expr, sympy.Basic) else expr
        if self.shape_env is not None:
            try:
                expr = self.shape_env.replace(expr)
            except Exception:  # pragma: no cover - private API drift
                pass
        if self.aliases:
            expr = expr.xreplace(self.aliases)
        return expr

    def shape(self, node) -> Optional[list]:
        ev = example(node)
        if not isinstance(ev, torch.Tensor):
            return None
        return [self.canon(s) for s in ev.shape]

    def has_seq(self, expr) -> bool:
        return self.symbol in self.canon(expr).free_symbols

    def seq_dims(self, node) -> list[int]:
        shape = self.shape(node)
        if shape is None:
            return []
        return [i for i, s in enumerate(shape) if self.symbol in s.free_symbols]

    def length_offset(self, expr) -> Optional[tuple[int, int]]:
        """For ``expr == c * (S - k)`` return ``(c, k)`` (integers, c >= 1, 0 <= k), else None."""
        expr = sympy.expand(self.canon(expr))
        poly = sympy.Poly(expr, self.symbol) if self.symbol in expr.free_symbols else None
        if poly is None or poly.degree() != 1:
            return None
        c, b = poly.all_coeffs()
        if not (c.is_Integer and b.is_Integer) or c <= 0 or b % c or -b < 0:
            return None
        return int(c), int(-b // c)


def integer(expr) -> Optional[int]:
    """``expr`` as a Python int when it simplifies to an integer constant."""
    expr = sympy.simplify(expr)
    if expr.is_Integer:
        return int(expr)
    return None


def static_int(expr, what: str) -> int:
    v = integer(expr)
    if v is None:
        raise AutoSPError(f"AutoSP: {what} has the symbolic size {expr}; only the sequence "
                          f"dimension may be dynamic (mark other dimensions static)")
    return v
