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
``rw.collective(...)``    insert an ``autosp_lm::`` collective (default: over the SP group) and
                          count it in the report
========================  =========================================================================
"""
from __future__ import annotations

from typing import Callable, Optional

import torch.fx as fx

from ..graph import target_key

RULES: dict = {}


def rule(*targets) -> Callable:
    """Register the decorated function as the rule of every op object in ``targets``."""
    def deco(fn):
        for t in targets:
            RULES[t] = fn
        return fn
    return deco


def lookup(node: fx.Node) -> Optional[Callable]:
    """The rule of ``node``'s op, or None."""
    key = target_key(node)
    try:
        return RULES.get(key)
    except TypeError:  # an unhashable target
        return None
