"""What the sharding rules see of the rewriter: the new graph being built, the state and the
new-graph value of every original node, and the chunk (or the gathered whole) of a value.

:class:`RuleInterface` holds the rewriter's bookkeeping (the new graph, the value and state maps,
the per-node overrides of the node being rewritten, the chunk and gather caches, the collectives
and report records kept only if their node survives dead-code elimination) and every method of
the rewriter interface listed in :mod:`autosp_lm.compiler.rules.registry`; with
:class:`~autosp_lm.compiler.layout.SequenceLayout` (sizes and positions) it is all a rule may
use. :class:`~autosp_lm.compiler.passes.shard.Rewriter` extends it with the driver: the walk over
the original graph, the choice of the rule for each node, the values that leave the graph, the
replanning loop. Split from :mod:`.passes.shard` where serving the rules parts from deciding
which rule runs: what a rule may call is this file, and the driver can change without a rule
noticing.
"""
from __future__ import annotations

import operator
from typing import Any, Optional

import sympy
import torch
import torch.fx as fx
import torch.nn.functional as F

import autosp_lm.parallel.collectives  # noqa: F401 - registers the autosp_lm:: collectives
import autosp_lm.parallel.halo_scan  # noqa: F401 - registers seq_window, exclusive_scan

from .graph import REP, SequenceInfo, Shard, example, is_tensor_node, static_int
from .layout import SequenceLayout
from .report import Report
from .rules import fallback as fb
from .rules.pointwise import localize_chain
from .rules.registry import Replan


class RuleInterface(SequenceLayout):
    """The rewriter as the rules see it (:mod:`autosp_lm.compiler.rules.registry` lists the
    interface); :class:`~autosp_lm.compiler.passes.shard.Rewriter` adds the driver."""

    def __init__(self, gm: fx.GraphModule, info: SequenceInfo, report: Report,
                 refused: frozenset = frozenset()):
        self.gm, self.info, self.report = gm, info, report
        self.graph = fx.Graph()
        self._env: dict[fx.Node, Any] = {}
        self._state: dict[fx.Node, Any] = {}
        self._override: dict[fx.Node, tuple] = {}
        self._local_cache: dict = {}
        self._gather_cache: dict = {}
        self._chunk = self._start = self._S = self._pos = None
        self._ranges = self._positions = self._order = None
        self._effects: set = set()  # nodes the original graph kept without users (effects)
        self._exit_cache: dict = {}
        self._collectives: list = []  # (new node, op, requires_grad), counted after DCE
        self._fallbacks: list = []  # (report record, new node), kept if the node survives DCE
        self._rewrites: list = []  # the same for rewrite records
        self.refused = refused  # plans a previous attempt had to give up (see Replan)
        self.tags: dict = {}  # rule-private facts about original nodes (index spaces ...)
        self.current: Optional[fx.Node] = None  # the original node being rewritten
        self.head_groups = 1  # the attention rule's query-head groups (shard_graph)

    # -- emission -----------------------------------------------------------------------------
    def call(self, fn, *args, **kwargs) -> fx.Node:
        return self.graph.call_function(fn, tuple(args), kwargs)

    def method(self, name, *args, **kwargs) -> fx.Node:
        return self.graph.call_method(name, tuple(args), kwargs)

    def emit(self, n: fx.Node, args, kwargs) -> fx.Node:
        """``n``'s op with new arguments (keeps its source location for the report)."""
        new = self.graph.create_node(n.op, n.target, tuple(args), dict(kwargs), name=n.name)
        new.meta.update({k: v for k, v in n.meta.items()
                         if k in ("stack_trace", "nn_module_stack", "source_fn_stack")})
        if not n.users:  # kept by Dynamo for its effect (e.g. vmap nesting): keep it too
            self._effects.add(new)
        return new

    def emit_local(self, n: fx.Node) -> fx.Node:
        """``n``'s op on the new-graph values of its arguments, bound to ``n``."""
        out = self.emit(n, self.map(n.args), self.map(n.kwargs))
        self.bind(n, out)
        return out

    def bind(self, n: fx.Node, value) -> None:
        self._env[n] = value

    def collective(self, op, *args, requires_grad: bool = True, group: Optional[str] = None,
                   world: Optional[int] = None) -> fx.Node:
        """Insert ``autosp_lm::<op>(*args, group, world)`` (default: the SP group); the report
        counts it if it is still used once the graph is complete."""
        out = self.call(getattr(torch.ops.autosp_lm, op).default, *args,
                        self.info.group if group is None else group,
                        self.info.world if world is None else world)
        self._collectives.append((out, op, requires_grad))
        return out

    def note_fallback(self, n: fx.Node, reason: str, out) -> None:
        """Record a fallback in the report; dropped again if ``out`` is dead in the end."""
        self.report.fallback(n, reason)
        self._fallbacks.append((self.report.fallbacks[-1], out))

    def note_rewrite(self, cls: str, n: fx.Node, how: str, out) -> None:
        """Record a rewrite (class ``cls``) in the report; dropped if ``out`` dies."""
        self.report.rewrite(cls, n, how)
        self._rewrites.append((self.report.rewrites[-1], out))

    def length_hint(self) -> Optional[int]:
        """The traced sequence length (None when unknown)."""
        from .passes.plan import seq_hint
        h = seq_hint(self.info) if self.info.seq_placeholder is not None else None
        return h if h is not None and h > 0 else None

    def allowed(self, kind: str, node: fx.Node) -> bool:
        """False when a previous attempt gave up the plan ``kind`` for ``node``."""
        return (kind, node.name) not in self.refused and (kind, "*") not in self.refused

    def replan(self, kind: str, node, why: str):
        """Give up the plan ``kind`` started at ``node`` (a node or its name): the pass starts
        over without it."""
        raise Replan(kind, getattr(node, "name", node), why)

    def restate(self, node: fx.Node, state) -> None:
        """Change the state of an earlier original node (an in-place op redefined it)."""
        self._state[node] = state

    @property
    def device(self):
        ev = example(self.info.seq_placeholder)
        return ev.device if isinstance(ev, torch.Tensor) else None

    # -- states ---------------------------------------------------------------------------------
    def state(self, a):
        if isinstance(a, fx.Node):
            if a in self._override:
                return self._override[a][1]
            return self._state.get(a, REP)
        return REP

    def value(self, a):
        """New-graph value of an original argument (this rank's chunk when sharded)."""
        if isinstance(a, fx.Node):
            if a in self._override:
                return self._override[a][0]
            return self._env[a]
        return a

    def original_value(self, a):
        """New-graph value of ``a`` ignoring a chunk taken for the current node."""
        return self._env[a] if isinstance(a, fx.Node) else a

    def map(self, a, fn=None):
        fn = fn or self.value
        return fx.node.map_aggregate(a, lambda x: fn(x) if isinstance(x, fx.Node) else x)

    def is_full(self, a) -> bool:
        """A replicated tensor that carries the sequence."""
        return (is_tensor_node(a) and self.state(a) is REP
                and any(self.info.has_seq(s) for s in example(a).shape))

    def gather(self, node):
        """The full value of the sharded original node ``node`` (cached per node)."""
        if node not in self._gather_cache:
            self._gather_cache[node] = fb.gather(self, node)
        return self._gather_cache[node]

    def fallback(self, n: fx.Node, reason: str):
        return fb.fallback(self, n, reason)

    def redefine(self, node: fx.Node, value, state) -> None:
        """An in-place op wrote into ``value`` (a gathered or converted copy of original node
        ``node``): from now on ``node`` is ``value`` in ``state``."""
        self._env[node], self._state[node] = value, state
        self._gather_cache.pop(node, None)
        self._exit_cache.pop(node, None)
        for key in [k for k in self._local_cache if k[0] is node]:
            del self._local_cache[key]

    def assume(self, a, value, state):
        """For the current node only: read operand ``a`` as ``value`` in ``state``."""
        self._override[a] = (value, state)

    def forget(self, a):
        """Undo :meth:`assume` for operand ``a``."""
        self._override.pop(a, None)

    # -- positions: the chunk of a full value -------------------------------------------------
    def localize(self, node, shard: Shard, fill=0):
        """This rank's chunk of the full value ``node`` (an original graph node) in ``shard``:
        an optional reshape that un-merges the sequence (``[B*L] -> [B, L]``), a constant pad of
        shifted values back to the input length ``S`` (``fill``: ``ignore_index`` for loss
        targets, 0 otherwise), ``narrow`` of ``[r*S/P, (r+1)*S/P)`` and the reshape back. One
        chunk per (value, layout, fill), reused."""
        key = (node, shard, fill)
        if key in self._local_cache:
            return self._local_cache[key]
        x = localize_chain(self, node, shard) if fill == 0 else None
        if x is not None:  # computed from its inputs' chunks (rotary tables from positions)
            self._local_cache[key] = x
            return x
        shape = self.info.shape(node)
        d = shard.dim
        x = self._env[node]
        if shard.merged:
            pre = [static_int(s, f"dimension {i} of {node.name}") for i, s in enumerate(shape[:d])]
            post = [static_int(s, f"dimension {i} of {node.name}")
                    for i, s in enumerate(shape[d + 1:])]
            x = self.method("reshape", x, pre + [shard.outer, -1, shard.inner] + post)
            d, nd = d + 1, len(shape) + 2
        else:
            nd = len(shape)
        if shard.padded:
            pad = [0, 0] * (nd - 1 - d) + [shard.pad_left, shard.pad_right]
            x = self.call(F.pad, x, pad, value=fill)
        ranges = self.local_ranges()
        if shard.block != 1:  # whole blocks: positions / block
            ranges = [(self.call(operator.floordiv, a, shard.block),
                       self.call(operator.floordiv, n, shard.block)) for a, n in ranges]
        parts = [self.call(torch.narrow, x, d, a, n) for a, n in ranges]
        x = parts[0] if len(parts) == 1 else self.call(torch.cat, parts, d)
        if shard.merged:
            x = self.method("reshape", x, pre + [-1] + post)
        else:
            x = self.method("contiguous", x)
        self._local_cache[key] = x
        return x

    def fresh_shard(self, node) -> Optional[Shard]:
        """A layout for a full value that meets sharded compute for the first time: its first
        dimension of size ``c * (S - k)`` (``c > 1``: the sequence merged with ``c`` outer rows)."""
        shape = self.info.shape(node)
        if shape is None:
            return None
        for i, s in enumerate(shape):
            if self.info.has_seq(s):
                lo = self.info.length_offset(s)
                if lo is not None:
                    c, k = lo
                    return Shard(i, c, 1, 0, k)
                ratio = sympy.cancel(s / self.info.symbol)  # S / b: one entry per block
                if ratio.is_Rational and ratio.p == 1 and ratio.q > 1 and \
                        self.report.length_multiple % (ratio.q * self.info.world) == 0:
                    return Shard(i, 1, 1, 0, 0, int(ratio.q))
                return None
        return None
