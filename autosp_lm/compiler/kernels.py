"""Telling AutoSP what a custom kernel is: ``register_kernel``.

A custom op (``torch.library`` op, a package's kernel, an opaque Python function the graph calls)
has no sharding rule: AutoSP cannot see inside it, so it gathers the whole sequence around it
(the fallback, named in the compile report). A registration says what the op does along the
sequence, and AutoSP then keeps it on this rank's share:

``register_kernel(op, "token_local", rows=("x",), dim=0, offsets=None)``
    Each row of the ``rows`` arguments along ``dim`` (tokens, or the (token, expert) rows of a
    mixture of experts) is computed from that row alone (other tensor arguments, the weights, are
    the same on every rank). Every tensor output has its rows along ``dim`` too. ``offsets``
    names an argument of cumulative row counts per group (``grouped_mm``'s ``offs``): the rows
    are grouped, e.g. sorted by expert; under AutoSP each rank groups its own rows, so the
    offsets it passes are the counts of its own rows.
``register_kernel(op, "per_head", inputs={"x": "b s h d", "A": "h"}, outputs=("b s h d",))``
    Independent along the ``h`` dimension; needs the whole ``s`` dimension (the sequence).
    Layouts name each dimension by a letter (``s`` sequence, ``h`` the independent one, any other
    letter for the rest); an input without ``s`` is replicated and split along ``h`` only. The
    op runs head-parallel: one Ulysses all-to-all per input (1/P of the heads, the whole
    sequence) and the inverse one where the outputs leave for per-token work.
``register_kernel(op, "attention", q="q", k="k", v="v", layout="b s h d", outputs=(...))``
    An attention kernel (FlashAttention and the like): per head over the whole sequence, so it
    runs under the Ulysses all-to-all like ``scaled_dot_product_attention``. Causal flags,
    windows, softmax scales and variable-length offsets (``cu_seqlens``: positions in the
    whole sequence) pass through unchanged. The query and key/value heads must divide by the
    Ulysses degree.

``register_kernel(op, "loss", names={"input": "_input"})``
    A fused loss (linear + cross-entropy, Liger-style): a mean (or sum) over the tokens of its
    ``input`` rows (hidden states, the sequence along any dim) and ``target``, skipping targets
    equal to ``ignore_index``. It must accept ``reduction="sum"``; AutoSP runs it on this rank's
    tokens with that and divides by the count of valid targets of all ranks, the token-weighted
    mean of one device. ``names`` maps cross_entropy's argument names (``input``, ``target``,
    ``ignore_index``, ``reduction``) to the op's where they differ.

``op`` is the op object (``torch.ops.mylib.kernel``, an ``OpOverload``, a Python function) or its
qualified name (``"mylib::kernel"``, resolved when the graph is compiled, so a package that is
not installed costs nothing). Arguments are named as in the op's schema or signature. A Python
function is kept whole in Dynamo's graph (``torch._dynamo.allow_in_graph``) and traced by
AOTAutograd on this rank's values, so it must be PyTorch code; a kernel of another language
(Triton, CUDA) is registered as the ``torch.library`` custom op that wraps it.

An output layout of ``None`` marks an output no computation may use (a kernel's random-number
state, an empty debug tensor): a graph that uses it takes the fallback.

Built in (:func:`_builtin`): ``torch._grouped_mm`` / ``torch.nn.functional.grouped_mm`` and
transformers' ``grouped_mm_fallback`` (token-local with offsets: transformers' default MoE
experts), and FlashAttention 2's ``flash_attn::_flash_attn_forward`` /
``_flash_attn_varlen_forward`` ops by name (active only where the package defines them).
"""
from __future__ import annotations

import inspect
import types
from dataclasses import dataclass, field
from typing import Any, Optional

import torch
import torch.fx as fx

KINDS = ("token_local", "per_head", "attention", "loss")
LOSS_ARGS = ("input", "target", "ignore_index", "reduction")


@dataclass(frozen=True)
class KernelSpec:
    """What a registered kernel is (see the module docstring); built by :func:`register_kernel`."""

    kind: str
    name: str
    rows: tuple = ()
    dim: int = 0
    offsets: Optional[str] = None
    inputs: dict = field(default_factory=dict)  # per_head / attention: arg name -> layout
    outputs: tuple = ()  # per_head / attention: one layout per tensor output
    attention: tuple = ()  # attention: the q, k, v argument names
    names: dict = field(default_factory=dict)  # loss: cross_entropy's argument name -> the op's


_BY_OBJECT: dict = {}
_BY_NAME: dict = {}  # "ns::op" -> spec (resolved against the graph's targets)


def _layout(text: str, what: str) -> str:
    letters = text.replace(" ", "")
    if len(set(letters)) != len(letters) or "h" not in letters:
        raise ValueError(f"register_kernel: layout {text!r} of {what} must name each dimension "
                         f"once by a letter and contain 'h' (the independent dimension)")
    return letters


def register_kernel(op, kind: str, *, rows=(), dim: int = 0, offsets: Optional[str] = None,
                    inputs: Optional[dict] = None, outputs=(), q: str = "q", k: str = "k",
                    v: str = "v", layout: str = "b s h d", names: Optional[dict] = None
                    ) -> KernelSpec:
    """Register ``op`` as a kernel of ``kind`` (``token_local``, ``per_head``, ``attention``).
    Returns the spec; registering the same op again replaces it."""
    if kind not in KINDS:
        raise ValueError(f"register_kernel: kind {kind!r} is not one of {', '.join(KINDS)}")
    name = op if isinstance(op, str) else _qualified(op)
    if kind == "token_local":
        if not rows:
            raise ValueError("register_kernel: a token_local kernel needs rows=(argument names "
                             "that hold the rows)")
        spec = KernelSpec(kind, name, rows=tuple(rows), dim=dim, offsets=offsets)
    elif kind == "loss":
        bad = set(names or {}) - set(LOSS_ARGS)
        if bad:
            raise ValueError(f"register_kernel: a loss kernel's names= maps {', '.join(LOSS_ARGS)} "
                             f"to the op's argument names; {sorted(bad)} are not among them")
        spec = KernelSpec(kind, name, names={**{a: a for a in LOSS_ARGS}, **(names or {})})
    else:
        if kind == "attention":
            lay = _layout(layout, "q/k/v")
            if "s" not in lay:
                raise ValueError("register_kernel: an attention layout needs 's' (the sequence)")
            ins = {q: lay, k: lay, v: lay, **(inputs or {})}
            outs = tuple(outputs) or (layout,)
        else:
            if not inputs:
                raise ValueError("register_kernel: a per_head kernel needs inputs={argument: "
                                 "layout}, e.g. {'x': 'b s h d'}")
            ins, outs = dict(inputs), tuple(outputs)
            if not outs:
                raise ValueError("register_kernel: a per_head kernel needs outputs=(layout of "
                                 "each tensor output,)")
        spec = KernelSpec(kind, name, inputs={a: _layout(t, a) for a, t in ins.items()},
                          attention=(q, k, v) if kind == "attention" else (),
                          outputs=tuple(None if t is None else _layout(t, "an output")
                                        for t in outs))
    if isinstance(op, str):
        _BY_NAME[op] = spec
    else:
        if isinstance(op, types.FunctionType):  # Dynamo keeps the call in the graph, whole
            torch._dynamo.allow_in_graph(op)
        for key in _keys(op):
            _BY_OBJECT[key] = spec
    return spec


def unregister_kernel(op) -> None:
    """Forget a registration (tests; a package that registers its own)."""
    if isinstance(op, str):
        _BY_NAME.pop(op, None)
    else:
        for key in _keys(op):
            _BY_OBJECT.pop(key, None)


def _keys(op) -> list:
    out = [op]
    if isinstance(op, torch._ops.OpOverload):
        out.append(op.overloadpacket)
    return out


def _qualified(op) -> str:
    if isinstance(op, torch._ops.OpOverload):
        op = op.overloadpacket
    if isinstance(op, torch._ops.OpOverloadPacket):
        return op._qualified_op_name
    if isinstance(op, type(torch.add)):  # a torch.<builtin>
        return f"torch.{op.__name__}"
    return f"{getattr(op, '__module__', '?')}.{getattr(op, '__qualname__', repr(op))}"


def _target(node: fx.Node):
    if node.op != "call_function":
        return None
    t = node.target
    return t.overloadpacket if isinstance(t, torch._ops.OpOverload) else t


def spec_of(node: fx.Node) -> Optional[KernelSpec]:
    """The registration of ``node``'s op, or None."""
    t = _target(node)
    if t is None:
        return None
    try:
        spec = _BY_OBJECT.get(t)
    except TypeError:  # an unhashable target
        return None
    if spec is None and isinstance(t, torch._ops.OpOverloadPacket):
        spec = _BY_NAME.get(t._qualified_op_name)
    if spec is None and _BUILTIN_PENDING:
        _load_builtin()
        return spec_of(node)
    return spec


def bind(node: fx.Node) -> dict:
    """``{argument name: value}`` of ``node``'s call (the op's schema, the ATen schema of a
    ``torch.<builtin>``, or the Python signature)."""
    t = node.target
    schema = getattr(t, "_schema", None)
    if schema is None and isinstance(t, torch._ops.OpOverloadPacket):
        schema = t.default._schema if hasattr(t, "default") else None
    if schema is None and isinstance(t, type(torch.add)):  # torch.<builtin>: its ATen op
        packet = getattr(torch.ops.aten, getattr(t, "__name__", ""), None)
        schema = packet.default._schema if hasattr(packet, "default") else None
    if schema is not None:
        names = [a.name for a in schema.arguments]
    else:
        try:
            names = list(inspect.signature(t).parameters)
        except (TypeError, ValueError):
            names = []
    out = dict(zip(names, node.args))
    out.update(node.kwargs)
    return out


def is_custom(node: fx.Node) -> bool:
    """An op of a ``torch.library`` namespace other than PyTorch's own."""
    t = _target(node)
    return isinstance(t, torch._ops.OpOverloadPacket) and \
        t._qualified_op_name.split("::")[0] not in ("aten", "prims", "autosp_lm")


def no_rule_reason(node: fx.Node) -> str:
    """The fallback's reason for an op without a rule (naming the registration for custom ops)."""
    if is_custom(node):
        return (f"no sharding rule for this op; Fix: tell AutoSP what it is with "
                f"autosp_lm.compiler.register_kernel({_target(node)._qualified_op_name!r}, "
                f"kind={' | '.join(repr(k) for k in KINDS)}, ...) (docs/autosp.md)")
    return "no sharding rule for this op"


# ---------------------------------------------------------------------------- built-ins
def _builtin() -> list[tuple[Any, str, dict]]:
    """``(op or "ns::name", kind, options)`` for the kernels real runs use."""
    out: list = [("transformers::grouped_mm_fallback", "token_local",
                  dict(rows=("input",), offsets="offs"))]
    for fn, rows in ((getattr(torch, "_grouped_mm", None), "self"),
                     (getattr(torch.ops.aten, "_grouped_mm", None), "self"),
                     (getattr(torch.nn.functional, "grouped_mm", None), "mat_a")):
        if fn is not None:
            out.append((fn, "token_local", dict(rows=(rows,), offsets="offs")))
    # FlashAttention 2's ops (flash_attn_interface.py): (out, softmax_lse, S_dmask, rng_state)
    out.append(("flash_attn::_flash_attn_forward", "attention",
                dict(layout="b s h d", inputs={"alibi_slopes": "h"},
                     outputs=("b s h d", "b h s", None, None))))
    out.append(("flash_attn::_flash_attn_varlen_forward", "attention",
                dict(layout="s h d", inputs={"alibi_slopes": "h"},
                     outputs=("s h d", "h s", None, None))))
    return out


_BUILTIN_PENDING = [True]


def _load_builtin() -> None:
    _BUILTIN_PENDING.clear()
    for op, kind, opts in _builtin():
        if isinstance(op, str) and op in _BY_NAME:
            continue
        if not isinstance(op, str) and op in _BY_OBJECT:
            continue
        register_kernel(op, kind, **opts)
