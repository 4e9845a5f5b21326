"""The sharding-rule registry: op objects -> rule functions.

A rule is ``fn(rw, node) -> state``: given the sharding pass's rewriter ``rw`` and an original
Dynamo-graph ``node`` with at least one sharded input (or one that must start sharding), it emits
the node's local computation into the new graph (``rw.bind(node, value)``) and returns the state
of the result (:class:`~autosp_lm.compiler.graph.Shard`, ``REP``, ``REDUCED`` or a tuple of them),
or hands the node to ``rw.fallback(node, reason)``.

Rules are keyed by the objects the graph calls (:func:`~autosp_lm.compiler.graph.target_key`):
``torch.add``, ``torch.Tensor.add``, ``operator.add``, ``torch.ops.aten.add`` are four keys of one
rule; ``torch.ops.mylib.add`` is none of them.

The rewriter interface a rule may use (and nothing else of it):

========================  =========================================================================
``rw.info``               the :class:`~autosp_lm.compiler.graph.SequenceInfo` (symbol ``S``, world,
                          rank, group, shapes in canonical symbols)
``rw.report``             the :class:`~autosp_lm.compiler.report.Report` being filled
``rw.state(a)``           the state of original node ``a``
``rw.value(a)``           the new-graph value of original node ``a`` (this rank's chunk if sharded)
``rw.map(args, fn)``      ``rw.value`` (or ``fn``) mapped over nested arguments
``rw.bind(n, v)``         record ``v`` as the new-graph value of original node ``n``
``rw.emit(n, a, kw)``     a new node with ``n``'s op and the given arguments
``rw.emit_local(n)``      ``n``'s op on the mapped arguments, bound to ``n``
``rw.call / rw.method``   new ``call_function`` / ``call_method`` nodes
``rw.is_full(a)``         ``a`` is replicated and carries the sequence
``rw.localize(a, s)``     this rank's chunk of the full value ``a`` in layout ``s`` (cached)
``rw.gather(a)``          the full value of the sharded node ``a`` (one ``all_gather``, cached)
``rw.fallback(n, why)``   run ``n`` on the gathered sequence (the fallback rule)
``rw.sym(expr)``          a graph value for an expression in ``S``
``rw.chunk_len()``        ``S / P`` (this rank's number of positions) as a graph value
``rw.local_positions()``  this rank's global positions (LongTensor); ``rw.local_ranges()``: them
                          as ``(start, length)`` graph values (one range, two under a ring plan)
``rw.plan``               the :class:`~autosp_lm.compiler.graph.SPPlan` (``U x R``, groups)
``rw.device``             the device of the sequence inputs
``rw.collective(...)``    insert an ``autosp_lm::`` collective (default: over the SP group; the
                          report counts it if it survives dead-code elimination)
``rw.note_fallback(...)`` record a fallback with the node it emitted (dropped if that node dies)
``rw.note_rewrite(...)``  the same for a rewrite record (``report.rewrite``: class, node, how)
``rw.positions()``        the global positions of this rank's rows (= ``rw.local_positions()``)
``rw.allowed(kind, n)``   False when a previous attempt refused the plan ``kind`` at node ``n``
``rw.replan(kind, n, w)`` give up plan ``kind`` started at ``n``: the pass starts over without it
``rw.restate(n, state)``  change the state of an earlier node (an in-place op redefined it)
``rw.contiguous_layout()`` each rank's rows are one contiguous piece, in rank order (the halo
                          exchange and the exclusive scan need it: :func:`.common.layout_refusal`)
``rw.heads_split_only()`` attention is split over heads only (hand-written regions need it)
``rw.tags``               a dict for facts rules attach to original nodes (``("index", n)``: the
                          values of ``n`` are rank-local indices; see :mod:`.tokens`)
``rw.current``            the original node being rewritten
``rw.length_hint()``      the traced sequence length (None when unknown)
========================  =========================================================================

**What a rule accepts.** ``@rule(*targets, accepts=(...))`` declares the operand states a rule
handles beyond ``Shard``/``REP``; for the others the rewriter prepares the operands first:

* ``"overhang"`` — a :class:`~autosp_lm.compiler.graph.Shard` with negative pads (rows outside
  the virtual sequence, see its docstring); otherwise moved back into the sequence first
  (:func:`.common.into_sequence`);
* ``"blocks"`` — a :class:`~autosp_lm.compiler.graph.Shard` whose dim counts blocks of
  positions (``block > 1``, a chunked scan's cut); otherwise the op falls back (gathered);

**State rules.** Values inside an attention region (:class:`~autosp_lm.compiler.graph.Heads`)
and rank-local rows (:class:`~autosp_lm.compiler.graph.Rows`) are handled by one function per
state kind, ``@state_rule("heads")`` / ``@state_rule("rows")``, called for every node with such an
operand before the op's own rule. It returns the result's state, or ``NotImplemented``: then
``Heads`` operands leave the region (one all-to-all back to the sequence layout) and the op's own
rule runs; ``Rows`` operands make the rewriter refuse the plan that made them.
"""
from __future__ import annotations

from typing import Callable, Optional

import torch.fx as fx

from ..graph import target_key
from ..kernels import spec_of

RULES: dict = {}
ACCEPTS: dict = {}  # rule function -> frozenset of accepted operand features
STATE_RULES: dict = {}  # "heads" | "rows" -> fn(rw, node) -> state or NotImplemented
KERNEL_RULES: dict = {}  # a registered kernel's kind -> its rule (rules/kernels.py)


class Replan(Exception):
    """Raised through the rewriter (``rw.replan``): the plan ``kind`` started at node ``node``
    cannot be finished exactly; the sharding pass starts over with it refused."""

    def __init__(self, kind: str, node: str, why: str):
        super().__init__(f"{kind} plan at {node}: {why}")
        self.kind, self.node, self.why = kind, node, why


def rule(*targets, accepts=()) -> Callable:
    """Register the decorated function as the rule of every op object in ``targets``."""
    def deco(fn):
        for t in targets:
            RULES[t] = fn
        ACCEPTS[fn] = frozenset(accepts) | ACCEPTS.get(fn, frozenset())
        return fn
    return deco


def state_rule(kind: str) -> Callable:
    def deco(fn):
        STATE_RULES[kind] = fn
        return fn
    return deco


def kernel_rule(*kinds: str) -> Callable:
    """Register the decorated function as the rule of registered kernels of ``kinds``."""
    def deco(fn):
        for k in kinds:
            KERNEL_RULES[k] = fn
        return fn
    return deco


def lookup(node: fx.Node) -> Optional[Callable]:
    """The rule of ``node``'s op (its own, else its kernel registration's), or None."""
    key = target_key(node)
    try:
        fn = RULES.get(key)
    except TypeError:  # an unhashable target
        return None
    if fn is None:
        spec = spec_of(node)
        fn = KERNEL_RULES.get(spec.kind) if spec is not None else None
    return fn


def accepts(node: fx.Node, feature: str) -> bool:
    """Whether the rule of ``node``'s op handles operands with ``feature`` itself."""
    fn = lookup(node)
    return fn is not None and feature in ACCEPTS.get(fn, ())
