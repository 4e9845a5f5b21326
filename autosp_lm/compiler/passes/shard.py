"""Graph pass — shard the sequence: state propagation and rewriting, node by node.

Expects
    The Dynamo graph (torch-function level: ``torch.*`` / ``F.*`` calls, tensor methods,
    ``operator`` calls) of a whole single-device model and the
    :class:`~autosp_lm.compiler.graph.SequenceInfo` of :mod:`.find_sequence`.

Rewrites
    Builds a new graph node by node, giving every value a state (:mod:`..graph`): replicated
    (full sequence or no sequence), :class:`Shard` (this rank's contiguous chunk) or REDUCED (the
    loss). Values are sharded *lazily*: a replicated value stays full (cheap integer work such as
    label shifts, ``arange``, RoPE tables, masks runs on the whole sequence) until it meets
    per-token work — an op whose output carries the sequence and requires grad, a heavy op
    (embedding, linear, attention, norm, loss) or a sharded operand. There :meth:`Rewriter.localize`
    takes this rank's chunk in the consumer's layout (a pad for shifted values, a ``narrow``).
    Each op is then rewritten by the rule of its family (:mod:`..rules`); an op without a rule
    goes to the fallback rule (gather, full compute, re-shard).

Holds afterwards
    Per-token compute runs on ``S/P`` positions; SymInt sizes in the graph still mean the
    *global* length (``torch.arange(S)`` stays global); sizes queried from sharded tensors are
    rewritten to their global values; graph outputs that carry the sequence are this rank's
    shard. The report lists the attention rewrites, collectives, loss rewrites and fallbacks.
"""
from __future__ import annotations

import operator
from typing import Any, Optional

import sympy
import torch
import torch.fx as fx
import torch.nn.functional as F

import autosp_lm.parallel.collectives  # noqa: F401 - registers the autosp_lm:: collectives

from .. import ops  # noqa: F401 - registers autosp_lm::grad_scale
from .. import rules
from ..graph import (REDUCED, REP, AutoSPError, SequenceInfo, Shard, describe, example,
                     is_shard, is_tensor_node, static_int, target_key, torch_ops)
from ..report import Report
from ..rules import fallback as fb

# per-token work that shards a full operand even when nothing requires grad (inference); plain
# matmuls of replicated values (RoPE tables: inv_freq @ positions) stay full
HEAVY = frozenset(torch_ops("embedding", "linear", "scaled_dot_product_attention", "layer_norm",
                            "rms_norm", "conv1d")) | frozenset(rules.LOSS_OPS)
# ops whose first operand is the value and whose other operands only lend dtype/device/shape
_LENDERS = frozenset(torch_ops("type_as", "to", "view_as", "expand_as", "reshape_as", "new_zeros",
                               "new_ones", "new_empty", "new_full", "new_tensor"))


class Rewriter:
    """Drives the rules over the graph; rules use only the interface listed in
    :mod:`autosp_lm.compiler.rules.registry`."""

    def __init__(self, gm: fx.GraphModule, info: SequenceInfo, report: Report):
        self.gm, self.info, self.report = gm, info, report
        self.graph = fx.Graph()
        self._env: dict[fx.Node, Any] = {}
        self._state: dict[fx.Node, Any] = {}
        self._override: dict[fx.Node, tuple] = {}
        self._local_cache: dict = {}
        self._gather_cache: dict = {}
        self._chunk = self._start = self._S = None
        self._ranges = self._positions = self._order = None
        self._effects: set = set()

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
        """Insert ``autosp_lm::<op>(*args, group, world)`` (default: the SP group) and count it
        in the report."""
        out = self.call(getattr(torch.ops.autosp_lm, op).default, *args,
                        self.info.group if group is None else group,
                        self.info.world if world is None else world)
        self.report.collective(op, requires_grad)
        return out

    @property
    def plan(self):
        return self.info.plan

    # -- sizes ----------------------------------------------------------------------------------
    def S(self):
        if self._S is None:
            if self.info.sym_placeholder is not None:
                self._S = self._env[self.info.sym_placeholder]
            else:
                self._S = self.method("size", self._env[self.info.seq_placeholder],
                                      self.info.seq_dim)
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

    def frac(self, f):
        """A graph value for ``f * S`` (``f`` a Fraction with ``f * S`` an integer)."""
        if f.denominator == 1:
            return self.sym(f.numerator * self.info.symbol)
        v = self.call(operator.floordiv, self.S(), f.denominator)
        return v if f.numerator == 1 else self.call(operator.mul, v, f.numerator)

    def local_ranges(self):
        """This rank's positions as graph values ``[(start, length), ...]`` (one range for the
        contiguous split, up to two under the ring layout)."""
        if self._ranges is None:
            plan = self.plan
            if plan is None or plan.contiguous:
                self._ranges = [(self.chunk_start(), self.chunk_len())]
            else:
                self._ranges = [(self.frac(a), self.frac(n)) for a, n in plan.ranges]
        return self._ranges

    def local_positions(self):
        """This rank's global positions, a LongTensor graph value ``[S/P]``."""
        if self._positions is None:
            parts = [self.call(torch.arange, a, self.call(operator.add, a, n), device=self.device)
                     for a, n in self.local_ranges()]
            self._positions = parts[0] if len(parts) == 1 else self.call(torch.cat, parts)
        return self._positions

    def sequence_order(self):
        """The permutation that puts an all-gather (SP rank order) of every rank's positions in
        sequence order (None for the contiguous split)."""
        plan = self.plan
        if plan is None or plan.contiguous:
            return None
        if self._order is None:
            parts = []
            for ranges in plan.all_ranges:
                for a, n in ranges:
                    start = self.frac(a)
                    parts.append(self.call(torch.arange, start,
                                           self.call(operator.add, start, self.frac(n)),
                                           device=self.device))
            self._order = self.call(torch.argsort, self.call(torch.cat, parts))
        return self._order

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
        parts = [self.call(torch.narrow, x, d, a, n) for a, n in self.local_ranges()]
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
                if lo is None:
                    return None
                c, k = lo
                return Shard(i, c, 1, 0, k)
        return None

    # -- driver ---------------------------------------------------------------------------------
    def run(self) -> fx.GraphModule:
        for n in self.gm.graph.nodes:
            if n.op == "placeholder":
                new = self.graph.placeholder(n.target, type_expr=n.type)
                new.meta.update(n.meta)
                self._env[n], self._state[n] = new, REP
            elif n.op == "get_attr":
                new = self.graph.get_attr(n.target)
                new.meta.update(n.meta)
                self._env[n], self._state[n] = new, REP
            elif n.op == "output":
                self._output(n)
            else:
                self._state[n] = self._visit(n)
                self._override.clear()
        new_gm = fx.GraphModule(self.gm, self.graph)
        # drop what the rewrite left unused, never a node the original graph kept without users
        new_gm.graph.eliminate_dead_code(
            is_impure_node=lambda node: node in self._effects or node.is_impure())
        new_gm.graph.lint()
        new_gm.recompile()
        return new_gm

    def _visit(self, n: fx.Node):
        key = target_key(n)
        ins = list(n.all_input_nodes)
        states = [self.state(a) for a in ins]
        # element of a tuple (chunk/unbind/max results)
        if key is operator.getitem and isinstance(example(n.args[0]), (tuple, list)):
            s = self.state(n.args[0])
            self.emit_local(n)
            return s[n.args[1]] if isinstance(s, tuple) else s
        if any(s is REDUCED for s in states):
            return self._visit_reduced(n)
        if not any(is_shard(s) for s in states):
            if not self._needs_shard(n, key):
                self.emit_local(n)
                return REP
            primary = self._primary(n, key, ins)
            if primary is None:  # the sequence appears here from non-sequence inputs
                self.emit_local(n)
                return REP
            shard = self.fresh_shard(primary)
            if shard is None:
                return self.fallback(n, "sequence size not of the form c*(S-k)")
            fill = -100 if key in rules.LOSS_OPS and primary is not n.args[0] else 0
            self._override[primary] = (self.localize(primary, shard, fill), shard)
        fn = rules.lookup(n)
        if fn is None:
            return self.fallback(n, "no sharding rule for this op")
        return fn(self, n)

    def _needs_shard(self, n, key) -> bool:
        for a in n.all_input_nodes:
            if self.is_full(a) and (example(a).requires_grad or key in HEAVY):
                return True
        ev = example(n)
        outs = ev if isinstance(ev, (tuple, list)) else [ev]
        for o in outs:
            if isinstance(o, torch.Tensor) and o.requires_grad and any(
                    self.info.has_seq(s) for s in o.shape):
                return True
        return False

    def _primary(self, n, key, ins):
        full = [a for a in ins if self.is_full(a)]
        if not full:
            return None
        if key in _LENDERS:
            return full[0] if full[0] is n.args[0] else None
        grad = [a for a in full if example(a).requires_grad]
        return (grad or full)[0]

    def _visit_reduced(self, n):
        """Ops on the loss (REDUCED): forward replicated, backward per rank."""
        if any(is_shard(self.state(a)) for a in n.all_input_nodes):
            raise AutoSPError(f"AutoSP: {describe(n)} combines a value reduced over the sequence "
                              f"with per-token values; such global statistics are not supported")
        scale = 1.0 / self.info.world

        def wrap(a):
            if not isinstance(a, fx.Node):
                return a
            new = self.value(a)
            if self.state(a) is REP and is_tensor_node(a) and example(a).requires_grad:
                # replicated grad-requiring values meet the per-rank loss: every rank
                # back-propagates them fully -> scale by 1/P (sum over the group stays exact)
                if self.is_full(a):
                    raise AutoSPError(f"AutoSP: {describe(n)} combines the loss with a "
                                      f"full-sequence value that requires grad")
                new = self.call(torch.ops.autosp_lm.grad_scale.default, new, scale)
            return new

        self.bind(n, self.emit(n, self.map(n.args, wrap), self.map(n.kwargs, wrap)))
        if target_key(n) in (torch.Tensor.detach, torch.detach):
            return REP
        return REDUCED if isinstance(example(n), torch.Tensor) else REP

    def _output(self, n):
        def out(a):
            if not isinstance(a, fx.Node):
                return a
            if self.is_full(a):
                shard = self.fresh_shard(a)
                if shard is not None:
                    return self.localize(a, shard)
            return self._env[a]

        self.graph.output(self.map(n.args[0], out), type_expr=n.type)


def shard_graph(gm: fx.GraphModule, info: SequenceInfo, report: Report) -> fx.GraphModule:
    """Run the sharding pass and return the rewritten graph module."""
    return Rewriter(gm, info, report).run()
