"""The one vocabulary of the AutoSP passes: sharding states, sequence facts, op identity.

**States.** A value of the Dynamo graph is in one of three states during the sharding pass:

* :data:`REP` — *replicated*: computed identically on every rank. It may carry the full sequence
  (a "full" value, e.g. ``labels`` or ``torch.arange(S)``) or no sequence at all (parameters,
  scalars).
* :class:`Shard` — this rank's contiguous chunk of the sequence. See the class for the layout.
* :class:`Heads` — inside a hand-written attention region: the whole sequence, this rank's heads.
* :class:`Rows` — rank-local rows in an order of their own (tokens sorted by expert).
* :data:`REDUCED` — the result of a reduction over the whole sequence (the loss): identical on
  every rank in the forward, but its backward is *per rank* (each rank back-propagates its own
  share; parameter gradients are summed over the SP group afterwards).

Tuples (``chunk``/``unbind`` results) carry a tuple of states.

**Op identity.** Ops are identified by the objects the graph calls, never by a bare name:
:func:`target_key` maps a node to ``torch.add`` / ``torch.Tensor.add`` (for ``x.add(y)``) /
``operator.add`` / an op *packet* such as ``torch.ops.aten.add`` (namespace kept), so a user's
``mylib::softmax`` is never taken for ``torch.softmax``. :func:`op_name` gives the short name of an
op that has already been matched by object (for messages and for branching inside a family).

**Joint-graph predicates** (ATen level, after AOTAutograd): :func:`is_collective_op`,
:func:`is_attention_op`, :func:`is_attention_backward_op`, :func:`is_random_op`,
:func:`is_alias_op`, :func:`is_all_to_all`; and :func:`check_post_decomposition`, which every
op inserted into a joint graph must pass.
"""
from __future__ import annotations

import math
import operator
from dataclasses import dataclass, field
from typing import Any, Optional

import sympy
import torch
import torch.fx as fx

from .joint_graph import (  # noqa: F401 - re-exported: the passes' one vocabulary
    AUTOSP_COLLECTIVES, COLLECTIVE_NAMESPACES, check_post_decomposition, example, is_alias_op,
    is_all_to_all, is_attention_backward_op, is_attention_op, is_collective_op,
    is_param_reduce_scatter, is_random_op, is_ring_attention_backward_op, is_ring_attention_op,
    is_tensor_node, namespace, param_gathers, schema_arg, schema_name)


class AutoSPError(RuntimeError):
    """A model or configuration AutoSP cannot run exactly; the message names the numbers."""


# ============================================================================ states
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

    A negative pad is an *overhang*: the logical sequence starts before virtual position 0 (or
    ends after ``S``) and those rows are held by no rank. They are zeros (``F.pad(x, (k, 0))``
    of a sequence of length ``S``), or never read (a convolution's outputs past the end that a
    slice cuts off). Only slices, pads, ``cat`` and convolutions accept such a layout; the
    rewriter moves any other consumer's operand back into the virtual sequence first.

    ``block > 1``: the sequence is cut into blocks of ``block`` consecutive positions and ``dim``
    counts blocks (``outer * L * inner / block`` entries); the positions within a block are
    another dimension, whole on every rank. A chunked scan's ``x.reshape(B, S // c, c, ...)``
    gives it; each rank then holds whole blocks, so the length must be a multiple of
    ``block * P``. Only rules that accept ``"blocks"`` see such operands.
    """

    dim: int
    outer: int = 1
    inner: int = 1
    pad_left: int = 0
    pad_right: int = 0
    block: int = 1

    @property
    def merged(self) -> bool:
        """The dim holds other than one entry per position (merged rows, or blocks)."""
        return self.outer != 1 or self.inner != 1 or self.block != 1

    @property
    def padded(self) -> bool:
        return bool(self.pad_left or self.pad_right)

    @property
    def overhang(self) -> bool:
        return self.pad_left < 0 or self.pad_right < 0

    def with_dim(self, dim: int) -> "Shard":
        return Shard(dim, self.outer, self.inner, self.pad_left, self.pad_right, self.block)

    def same_sequence(self, other: "Shard") -> bool:
        return (self.outer, self.inner, self.pad_left, self.pad_right, self.block) == (
            other.outer, other.inner, other.pad_left, other.pad_right, other.block)


def is_shard(state) -> bool:
    return isinstance(state, Shard)


@dataclass(frozen=True)
class Heads:
    """Inside a hand-written attention region (``rules/attention_region.py``): the whole sequence
    on every rank, and this rank's ``1/P`` of an independent dimension ``dim`` (the heads, or
    batch x heads). ``qdim`` is the query-sequence dimension, where the sequence is split again
    when the value leaves the region (one all-to-all, the inverse of the one that entered it);
    ``region`` names the region's entry node (for the report)."""

    dim: int
    qdim: Optional[int]
    region: str = ""

    def renumber(self, dim: int, qdim: Optional[int]) -> "Heads":
        return Heads(dim, qdim, self.region)


def is_heads(state) -> bool:
    return isinstance(state, Heads)


@dataclass(frozen=True)
class Rows:
    """Rank-local rows (``rules/tokens.py``): along ``dim`` this rank holds rows computed from its
    own tokens only, in an order of its own (fixed by the node ``order``, e.g. a sort of the
    tokens by expert). Concatenated over ranks they are a permutation of the single-device rows;
    only per-row computation is allowed on them until they are put back in token order."""

    dim: int
    order: str

    def with_dim(self, dim: int) -> "Rows":
        return Rows(dim, self.order)


def is_rows(state) -> bool:
    return isinstance(state, Rows)


def is_distributed(state) -> bool:
    """A value that is not the same on every rank: Shard, Heads or Rows."""
    return isinstance(state, (Shard, Heads, Rows))


# ============================================================================ op identity
_INPLACE_OPERATORS = frozenset({operator.setitem, operator.iadd, operator.isub, operator.imul,
                                operator.itruediv})


def mutated_operand(node: fx.Node):
    """The operand an in-place op writes into (``x[i] = v``, ``x.add_(y)``, ``torch.relu_(x)``),
    or None for any other op."""
    if node.op == "call_method":
        name = str(node.target)
    elif node.op == "call_function":
        if node.target in _INPLACE_OPERATORS:
            return node.args[0] if node.args else None
        name = str(getattr(node.target, "__name__", ""))
    else:
        return None
    if name.endswith("_") and not name.startswith("__") and node.args and \
            isinstance(node.args[0], fx.Node):
        return node.args[0]
    return None


def target_key(node: fx.Node) -> Any:
    """The object that identifies ``node``'s op: the function it calls, ``torch.Tensor.<name>``
    for a method call, the op packet (``torch.ops.<ns>.<name>``) of an op overload."""
    if node.op == "call_method":
        return getattr(torch.Tensor, str(node.target), ("method", str(node.target)))
    t = node.target
    if isinstance(t, torch._ops.OpOverload):
        return t.overloadpacket
    return t


_OPERATOR_NAMES = {
    operator.add: "add", operator.sub: "sub", operator.mul: "mul", operator.truediv: "div",
    operator.floordiv: "floor_divide", operator.neg: "neg", operator.pow: "pow",
    operator.matmul: "matmul", operator.getitem: "getitem", operator.iadd: "add",
    operator.isub: "sub", operator.imul: "mul", operator.itruediv: "div",
    operator.and_: "bitwise_and", operator.or_: "bitwise_or", operator.xor: "bitwise_xor",
    operator.invert: "bitwise_not", operator.eq: "eq", operator.ne: "ne", operator.lt: "lt",
    operator.le: "le", operator.gt: "gt", operator.ge: "ge", operator.mod: "remainder",
    operator.abs: "abs", operator.pos: "positive",
}
OPERATORS_BY_NAME: dict[str, list] = {}
for _fn, _name in _OPERATOR_NAMES.items():
    OPERATORS_BY_NAME.setdefault(_name, []).append(_fn)

# namespaces whose public functions are the same op under the same name as torch.<name>
_TORCH_NAMESPACES = (torch, torch.nn.functional, torch._C._nn, torch.special, torch.linalg)


def torch_ops(*names: str) -> list:
    """Every callable the graph may hold for the torch op ``name``: ``torch.<name>``,
    ``torch.Tensor.<name>``, ``torch.nn.functional.<name>`` (and its C twin ``torch._C._nn``),
    ``torch.special``/``torch.linalg`` entries, the ``operator`` function and the ATen packet."""
    out = []
    for name in names:
        for ns in _TORCH_NAMESPACES:
            fn = getattr(ns, name, None)
            if callable(fn) and not isinstance(fn, type):
                out.append(fn)
        fn = getattr(torch.Tensor, name, None)
        if fn is not None:
            out.append(fn)
        out += OPERATORS_BY_NAME.get(name, [])
        packet = getattr(torch.ops.aten, name, None) if not name.startswith("__") else None
        if isinstance(packet, torch._ops.OpOverloadPacket):
            out.append(packet)
    return out


def op_name(node: fx.Node) -> str:
    """The short name of ``node``'s op (``add`` for ``torch.add``, ``x.add`` and ``operator.add``;
    ``attention`` for ``mylib::attention``). For messages and for branching within an op family
    already matched by :func:`target_key`, never for matching."""
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


def _source_line(node: fx.Node) -> tuple[str, str]:
    """``(file:line, code)`` of the user's source line that produced ``node`` (Dynamo's stack
    trace), or empty strings."""
    lines = [ln.strip() for ln in (node.meta.get("stack_trace") or "").strip().splitlines()]
    files = [i for i, ln in enumerate(lines) if ln.startswith("File ")]
    if not files:
        return "", ""
    i = files[-1]
    loc = lines[i]
    try:
        path = loc.split('"')[1].rsplit("/", 1)[-1]
        lineno = loc.split("line ")[1].split(",")[0]
        loc = f"{path}:{lineno}"
    except IndexError:
        pass
    code = lines[i + 1] if i + 1 < len(lines) else ""
    return loc, clean_snippet(code)


_CLOSING = {"(": ")", "[": "]", "{": "}"}


def _open_brackets(code: str) -> list:
    """The brackets still open at the end of ``code`` (outside string literals), innermost last."""
    stack, quote = [], None
    for i, c in enumerate(code):
        if quote:
            if c == quote and code[i - 1] != "\\":
                quote = None
        elif c in "'\"":
            quote = c
        elif c in _CLOSING:
            stack.append(c)
        elif c in ")]}" and stack and _CLOSING[stack[-1]] == c:
            stack.pop()
    return stack


def clean_snippet(code: str, limit: int = 80) -> str:
    """One source line for a report, never cut mid-word or left with dangling brackets: a line
    longer than ``limit`` is cut at a word boundary, and brackets a cut (or a statement that
    continues on the next line) leaves open are closed after ``...`` in the right order."""
    code = code.strip()
    cut = len(code) > limit
    if cut:
        code = code[:limit]
        at = max(code.rfind(" "), code.rfind(","), code.rfind("("))
        code = code[:at + 1] if at > limit // 2 else code
    code = code.rstrip().rstrip(",").rstrip()
    stack = _open_brackets(code)
    if not stack:
        return code + " ..." if cut else code
    sep = "" if code.endswith(tuple(_CLOSING)) else ", "
    return code + sep + "..." + "".join(_CLOSING[c] for c in reversed(stack))


def source_location(node: fx.Node) -> str:
    """``file:line`` of the user's code that produced ``node`` ('' when Dynamo recorded none)."""
    return _source_line(node)[0]


def describe(node: fx.Node) -> str:
    """``name (op)`` plus the user's source location and line when Dynamo recorded them."""
    loc, code = _source_line(node)
    where = f" at {loc}: {code}" if loc else ""
    return f"{node.name} ({op_name(node)}){where}"


# ============================================================================ values and sizes
def to_expr(size) -> sympy.Expr:
    if isinstance(size, torch.SymInt):
        return size.node.expr
    return sympy.Integer(int(size))


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


@dataclass
class SPPlan:
    """The sequence-parallel plan: ``P = U x R`` (Ulysses degree ``U``: all-to-all over heads in
    groups of ``U`` consecutive ranks; ring degree ``R``: key/value blocks rotated over the ranks
    with the same Ulysses rank), and this rank's positions: ``ranges`` of ``(start, length)`` as
    fractions of the sequence length (the layout of
    :func:`autosp_lm.parallel.slicing.shard_fractions`; one contiguous range when ``R == 1``)."""

    ulysses_degree: int = 1
    ring_degree: int = 1
    ulysses_group: str = ""  # registered group names ("" for a group of one)
    ring_group: str = ""
    ranges: tuple = ()
    all_ranges: tuple = ()  # every SP rank's ranges, in rank order (to reorder a gather)
    reason: str = ""

    @property
    def contiguous(self) -> bool:
        return self.ring_degree == 1


@dataclass
class SequenceInfo:
    """What the find-sequence pass found: the sequence inputs and the symbol of their length."""

    symbol: sympy.Symbol  # canonical symbol of the global sequence length S
    aliases: dict  # other symbols Dynamo gave the same length -> symbol
    inputs: dict  # placeholder name -> sequence dims
    sym_placeholder: Optional[fx.Node]  # a SymInt placeholder equal to S, when Dynamo lifted one
    seq_placeholder: Optional[fx.Node]  # a tensor placeholder with the sequence (fallback for S)
    seq_dim: int = 1
    world: int = 1
    rank: int = 0
    group: str = ""
    shape_env: Any = None
    plan: Any = None  # SPPlan, set by the plan pass
    # k for each ``S % k`` taken as 0 because the traced length is a multiple of k (the plan then
    # holds for such lengths only: the rewriter folds them into the report's length multiple)
    assumed_multiples: set = field(default_factory=set)

    def canon(self, expr) -> sympy.Expr:
        """``expr`` in the canonical symbol, with Dynamo's replacements, and with the divisions
        and remainders that are exact written as such (:meth:`_divisions`)."""
        expr = to_expr(expr) if not isinstance(expr, sympy.Basic) else expr
        if self.shape_env is not None:
            try:
                # replace, not ShapeEnv.simplify: its cached results go stale as the known
                # divisibility grows, so they would depend on the order of the calls (and differ
                # between ranks, whose passes iterate sets in different orders)
                expr = self.shape_env.replace(expr)
            except Exception:  # pragma: no cover - private API drift
                pass
        if self.aliases:
            expr = expr.xreplace(self.aliases)
        return self._divisions(expr)

    def _divisions(self, expr):
        """``a // b`` as ``a / b`` and ``a % b`` as 0 where the division is exact: Dynamo
        guarded ``a % b == 0`` (``4 * (S // 4)`` is ``S`` after einops' ``"b (c l) -> b c l"``),
        the quotient is a constant, or ``a`` is ``c*S + d`` with ``d`` a multiple of an integer
        ``b`` and the traced length makes it divide (a padding to a multiple of ``b``,
        ``(b - S % b) % b``, is then 0). The last kind holds for some lengths only: the multiple
        of ``S`` it needs goes to :attr:`assumed_multiples`. Other divisions stay as they are."""
        from torch.utils._sympy.functions import FloorDiv, Mod
        if not isinstance(expr, sympy.Basic) or not expr.has(FloorDiv, Mod):
            return expr
        env = self.shape_env
        known = set()
        hint = None
        if env is not None:
            try:
                env._update_divisible()
                known = {env.replace(k).xreplace(self.aliases or {}) for k in env.divisible}
                vals = getattr(env, "backed_var_to_val", None)  # torch 2.13; 2.11: var_to_val
                hint = (vals if vals is not None else env.var_to_val).get(self.symbol)
            except Exception:  # pragma: no cover - private API drift
                pass

        def multiple(a, k):  # the multiple of S that makes c*S + d divisible by k, or None
            if hint is None or not (k.is_Integer and k > 1) or a.free_symbols != {self.symbol}:
                return None
            try:
                coeffs = sympy.Poly(a, self.symbol).all_coeffs()
            except sympy.PolynomialError:
                return None
            if len(coeffs) != 2 or not all(c.is_Integer for c in coeffs):
                return None
            c, d, k = int(coeffs[0]), int(coeffs[1]), int(k)
            if d % k or (c * int(hint)) % k:
                return None
            return k // math.gcd(c, k)

        def rewrite(e):
            if isinstance(e, (FloorDiv, Mod)):
                a, b = e.args
                ra, rb = rewrite(a), rewrite(b)
                q = sympy.cancel(ra / rb)
                exact = q.is_Integer or Mod(a, b) in known
                if not exact:
                    need = multiple(ra, rb)
                    if need is not None:
                        self.assumed_multiples.add(need)
                        exact = True
                if exact:
                    return q if isinstance(e, FloorDiv) else sympy.Integer(0)
                return e
            if e.args and e.has(FloorDiv, Mod):
                try:
                    return e.func(*[rewrite(x) for x in e.args])
                except Exception:  # a function that takes integers only: keep it whole
                    return e
            return e

        try:
            return sympy.expand(rewrite(expr))
        except Exception:  # pragma: no cover - keep the expression rather than guess
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
        try:  # floor(S/2) and the like are not polynomials in S
            poly = sympy.Poly(expr, self.symbol) if self.symbol in expr.free_symbols else None
        except sympy.PolynomialError:
            return None
        if poly is None or poly.degree() != 1:
            return None
        c, b = poly.all_coeffs()
        if not (c.is_Integer and b.is_Integer) or c <= 0 or b % c or -b < 0:
            return None
        return int(c), int(-b // c)
