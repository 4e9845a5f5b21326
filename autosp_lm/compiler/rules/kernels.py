"""Rules: registered kernels (:mod:`autosp_lm.compiler.kernels`) — what a registration promises.

Expects a call of an op registered with ``register_kernel``:

* ``token_local`` — the ``rows`` arguments in one distributed state along the declared dim:
  sequence-sharded tokens (:class:`~autosp_lm.compiler.graph.Shard`) or rank-local rows
  (:class:`~autosp_lm.compiler.graph.Rows`, e.g. tokens sorted by expert). The other tensor
  arguments replicated and free of the sequence (weights); the ``offsets`` argument, if any, the
  group counts of this rank's own rows (a ``histc`` of rank-local sorted ids, its ``cumsum``
  and casts: :mod:`.tokens` keeps them local when they feed nothing else).
* ``loss`` — its ``input`` sequence-sharded (hidden states), its ``target`` sharded alike or a
  replicated full value (labels), every other tensor argument replicated (the projection).
* ``per_head`` / ``attention`` — the ``inputs`` in their declared layouts: the ``s`` dim
  sequence-sharded (or already whole, inside a head-parallel region split along ``h``), inputs
  without ``s`` replicated; any other tensor argument replicated (``cu_seqlens``: positions of
  the whole sequence).

Rewrites: ``loss`` as cross_entropy (:mod:`.loss`): run with ``reduction="sum"`` on this rank's
tokens, divided by the count of valid targets of all ranks. ``token_local`` runs on this rank's rows (exact: each row depends only on itself, and
grouped rows are grouped by this rank); the outputs keep the rows' state. ``per_head`` and
``attention`` enter a head-parallel region: each sequence-sharded input takes the Ulysses
all-to-all (the whole sequence, ``1/P`` of ``h``), a replicated input its ``1/P`` slice of
``h``; the kernel runs on them unchanged; its outputs are values of the region
(:class:`~autosp_lm.compiler.graph.Heads`) that leave by the inverse all-to-all where per-token
work needs them. Anything else: the gather fallback, with the reason.
"""
from __future__ import annotations

import torch
import torch.fx as fx

from ..graph import REP, Heads, example, integer, is_heads, is_rows, is_shard, is_tensor_node, op_name
from ..kernels import bind, spec_of
from . import tokens  # noqa: F401 - defines the "rows" state rule wrapped below
from .attention_region import to_heads
from .common import ndim, norm_dim
from .loss import token_mean
from .registry import STATE_RULES, kernel_rule, state_rule


def _outputs(n):
    ev = example(n)
    return list(ev) if isinstance(ev, (tuple, list)) else [ev]


def _others_replicated(rw, n, used) -> bool:
    """Every tensor argument not in ``used`` is replicated, carries no sequence and no
    rank-local index."""
    for a in n.all_input_nodes:
        if a in used or not is_tensor_node(a):
            continue
        if rw.state(a) is not REP or rw.is_full(a) or ("index", a) in rw.tags:
            return False
    return True


def token_local(rw, n: fx.Node, refuse):
    """The state of registered token-local kernel ``n`` on this rank's rows, or ``refuse(why)``."""
    spec = spec_of(n)
    args = bind(n)
    rows = [args.get(r) for r in spec.rows if is_tensor_node(args.get(r))]
    if not rows:
        return refuse(f"{spec.name}: none of its rows arguments {spec.rows} is a tensor")
    s0 = rw.state(rows[0])
    if not (is_rows(s0) or is_shard(s0)) or any(rw.state(a) != s0 for a in rows):
        return refuse(f"{spec.name}: its rows arguments are not in one sharded state")
    if s0.dim != norm_dim(spec.dim, ndim(rows[0])):
        return refuse(f"{spec.name}: the rows are along dim {spec.dim}, the sequence is not")
    used = set(rows)
    off = args.get(spec.offsets) if spec.offsets else None
    if is_tensor_node(off):
        tag = rw.tags.get(("index", off))
        if not (is_rows(s0) and tag is not None and tag[0] == ("counts", s0.order)):
            return refuse(f"{spec.name}: its offsets are not the counts of this rank's own "
                          f"grouped rows")
        used.add(off)
    if not _others_replicated(rw, n, used):
        return refuse(f"{spec.name}: a tensor argument besides the rows is sharded or carries "
                      f"the sequence")
    out = rw.emit_local(n)
    states = [s0.with_dim(norm_dim(spec.dim, o.dim())) if hasattr(o, "dim") else REP
              for o in _outputs(n)]
    rw.note_rewrite("token routing" if is_rows(s0) else "other", n,
                    f"registered token-local kernel ({spec.name}) on this rank's rows", out)
    return tuple(states) if isinstance(example(n), (tuple, list)) else states[0]


def _kv_repeat(rw, spec, args, name, heads, h) -> int:
    """For an attention kernel's k/v with fewer heads than ranks: how often each kv head repeats
    so that every rank holds the kv heads of its query heads (1: no repeat)."""
    q = args.get(spec.attention[0]) if spec.attention else None
    if name not in spec.attention[1:] or not is_tensor_node(q):
        return 1
    hq = integer(rw.info.shape(q)[spec.inputs[spec.attention[0]].index("h")])
    P = rw.info.world
    if hq is None or heads is None or hq % heads or hq % P or heads % P == 0:
        return 1
    g = hq // heads
    return next((r for r in range(2, g + 1) if g % r == 0 and heads * r % P == 0), 1)


def per_head(rw, n: fx.Node, refuse):
    """The state of registered per-head/attention kernel ``n`` run head-parallel, or
    ``refuse(why)``."""
    spec = spec_of(n)
    if not rw.heads_split_only():
        return refuse(f"{spec.name}: a registered {spec.kind} kernel runs under the Ulysses "
                      f"all-to-all, and this plan splits attention over a ring too; Fix: a "
                      f"sequence-parallel size that divides the heads (--ulysses-degree)")
    args = bind(n)
    P = rw.info.world
    used, moved, split = set(), [], None

    def give_up(why):
        for a in moved:
            rw.forget(a)
        return refuse(f"{spec.name}: {why}")

    for name, lay in spec.inputs.items():
        a = args.get(name)
        if not is_tensor_node(a):
            continue
        if len(lay) != ndim(a):
            return give_up(f"argument {name} has {ndim(a)} dims, its layout {lay!r} {len(lay)}")
        h, sd = lay.index("h"), (lay.index("s") if "s" in lay else None)
        heads = integer(rw.info.shape(a)[h])
        if heads is not None and heads % P and _kv_repeat(rw, spec, args, name, heads, h) > 1:
            pass  # repeated below
        elif heads is None or heads % P:
            return give_up(f"argument {name} has {heads} along 'h', not a multiple of the {P} "
                           f"ranks; Fix: a sequence-parallel size that divides it")
        s = rw.state(a)
        rep = _kv_repeat(rw, spec, args, name, heads, h)
        if rep > 1 and is_shard(s):  # fewer kv heads than ranks: each rank's query heads'
            # kv heads, repeated before the all-to-all (as the kernel's GQA would pair them)
            rw.assume(a, rw.call(torch.repeat_interleave, rw.value(a), rep, dim=h), s)
            heads *= rep
        if sd is None:
            ok = s is REP and not rw.is_full(a)
        elif is_shard(s):
            ok = s.dim == sd and not (s.padded or s.merged)
        else:
            ok = is_heads(s) and s.dim == h
        v = to_heads(rw, a, h) if ok else None
        if v is None:
            return give_up(f"argument {name} is not in its declared layout {lay!r} (the "
                           f"sequence along 's', split along 'h')")
        rw.assume(a, v, Heads(h, sd, n.name))
        moved.append(a)
        used.add(a)
        split = split or heads
    if not moved or not _others_replicated(rw, n, used):
        return give_up("a tensor argument outside its declared inputs is sharded or carries "
                       "the sequence")
    rw.emit_local(n)
    rw.report.region(n, split=split, per_rank=split // P, ops=[op_name(n)],
                     entry=f"registered {spec.kind} kernel {spec.name}")
    states = [REP if lay is None else
              Heads(lay.index("h"), lay.index("s") if "s" in lay else None, n.name)
              for lay in spec.outputs]
    if len(states) != len(_outputs(n)):
        raise ValueError(f"register_kernel: {spec.name} returns {len(_outputs(n))} tensors, "
                         f"its registration lists {len(states)} output layouts")
    return tuple(states) if isinstance(example(n), (tuple, list)) else states[0]


@kernel_rule("loss")
def loss_rule(rw, n):
    """A registered fused loss: cross_entropy's token-weighted mean over the SP group."""
    spec = spec_of(n)
    args = bind(n)
    op_names = spec.names
    b = {c: args[a] for c, a in op_names.items() if a in args}
    if not is_tensor_node(b.get("input")) or "target" not in b:
        return rw.fallback(n, f"{spec.name}: its input/target arguments "
                              f"({op_names['input']}, {op_names['target']}) are not both given")
    rest = {a: v for a, v in args.items() if a not in op_names.values()}
    if not _others_replicated(rw, n, {b["input"], b["target"]}):
        return rw.fallback(n, f"{spec.name}: an argument besides its input and target is "
                              f"sharded or carries the sequence")

    def call(x, t, **kw):
        named = {op_names[c]: v for c, v in kw.items()}
        return rw.call(n.target, **{op_names["input"]: x, op_names["target"]: t}, **named,
                       **rw.map(rest))
    return token_mean(rw, n, b, call)


@kernel_rule("token_local")
def token_local_rule(rw, n):
    return token_local(rw, n, lambda why: rw.fallback(n, why))


@kernel_rule("per_head", "attention")
def per_head_rule(rw, n):
    return per_head(rw, n, lambda why: rw.fallback(n, why))


# Registered kernels come before the state rules of the values they take: rank-local rows
# (rules/tokens.py) and head-parallel regions (rules/attention_region.py). A refusal there hands
# the node on (rows: the plan that made them is refused; heads: the operands leave the region and
# the kernel's own rule above runs).
_ON_ROWS, _INSIDE = STATE_RULES["rows"], STATE_RULES["heads"]


@state_rule("rows")
def rows_or_kernel(rw, n):
    spec = spec_of(n)
    if spec is not None and spec.kind == "token_local":
        return token_local(rw, n, lambda why: NotImplemented)
    return _ON_ROWS(rw, n)


@state_rule("heads")
def region_or_kernel(rw, n):
    spec = spec_of(n)
    if spec is not None and spec.kind != "token_local":
        out = per_head(rw, n, lambda why: NotImplemented)
        if out is not NotImplemented:
            return out
    return _INSIDE(rw, n)
