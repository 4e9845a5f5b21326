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

import math
import operator
from typing import Any, Optional

import sympy
import torch
import torch.fx as fx
import torch.nn.functional as F

import autosp_lm.parallel.collectives  # noqa: F401 - registers the autosp_lm:: collectives

from .. import ops  # noqa: F401 - registers autosp_lm::grad_scale
from .. import rules
from ..kernels import no_rule_reason
from ..layout import SequenceLayout
from ..graph import (REDUCED, REP, AutoSPError, SequenceInfo, Shard, describe, example,
                     is_distributed, is_heads, is_rows, is_shard, is_tensor_node, mutated_operand,
                     static_int, target_key, torch_ops)
from ..report import Report
from ..rules import fallback as fb
from ..rules.common import into_sequence
from ..rules.head_parallel import head_parallel
from ..rules.pointwise import localize_chain
from ..rules.registry import Replan

# per-token work that shards a full operand even when nothing requires grad (inference); plain
# matmuls of replicated values (RoPE tables: inv_freq @ positions) stay full
HEAVY = frozenset(torch_ops("embedding", "linear", "scaled_dot_product_attention", "layer_norm",
                            "rms_norm", "conv1d")) | frozenset(rules.LOSS_OPS)
# ops whose first operand is the value and whose other operands only lend dtype/device/shape
_LENDERS = frozenset(torch_ops("type_as", "to", "view_as", "expand_as", "reshape_as", "new_zeros",
                               "new_ones", "new_empty", "new_full", "new_tensor"))


class Rewriter(SequenceLayout):
    """Drives the rules over the graph; rules use only the interface listed in
    :mod:`autosp_lm.compiler.rules.registry`."""

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
        from .plan import seq_hint
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
                written = mutated_operand(n)
                if written in self._override and self._override[written][0] is not \
                        self._env[written]:  # the op wrote into a converted copy
                    self.redefine(written, *self._override[written])
                self._override.clear()
        new_gm = fx.GraphModule(self.gm, self.graph)
        # drop what the rewrite left unused, never an in-place op nor a node the original graph
        # kept without users
        new_gm.graph.eliminate_dead_code(
            is_impure_node=lambda node: node in self._effects or _impure(node))
        new_gm.graph.lint()
        new_gm.recompile()
        alive = set(new_gm.graph.nodes)
        for node, op, rg in self._collectives:
            if node in alive:
                self.report.collective(op, rg)
        for records, notes in ((self.report.fallbacks, self._fallbacks),
                               (self.report.rewrites, self._rewrites)):
            dead = [id(rec) for rec, out in notes if isinstance(out, fx.Node) and out not in alive]
            records[:] = [r for r in records if id(r) not in dead]
        return new_gm

    def _visit(self, n: fx.Node):
        self.current = n
        key = target_key(n)
        ins = list(n.all_input_nodes)
        states = [self.state(a) for a in ins]
        # element of a tuple (chunk/unbind/max results)
        if key is operator.getitem and isinstance(example(n.args[0]), (tuple, list)):
            s = self.state(n.args[0])
            self.emit_local(n)
            elem = self.tags.get(("index_elem", n.args[0]))
            if elem is not None and elem[0] == n.args[1]:
                self.tags[("index", n)] = elem[1]
            return s[n.args[1]] if isinstance(s, tuple) else s
        if any(s is REDUCED for s in states):
            return self._visit_reduced(n)
        ev = example(n)
        if isinstance(ev, torch.SymInt) and not any(is_distributed(s) for s in states):
            c = self.info.canon(ev.node.expr)
            if c.is_Integer:  # e.g. a padding to a multiple, (c - S % c) % c: 0 at every length
                self.bind(n, int(c))  # the plan accepts; written as such, the traced graph
                return REP  # does not carry the remainder (Inductor and AOT cannot decide it)
        if any(is_heads(s) for s in states):
            out = rules.STATE_RULES["heads"](self, n)
            if out is not NotImplemented:
                return out
            # sequence-sharded operands may join instead (x[i] = v, v from the region)
            out = head_parallel(self, n, "writes values of a head-parallel region")
            if out is not None:
                return out
            self._leave_region(n)
        local = [a for a in ins if is_rows(self.state(a)) or ("index", a) in self.tags]
        if local:  # rank-local rows or indices: only the token-routing rules may touch them
            out = rules.STATE_RULES["rows"](self, n)
            if out is not NotImplemented:
                return out
            a = local[0]
            plan = self.state(a).order if is_rows(self.state(a)) else self.tags[("index", a)][1]
            self.replan("rows", plan, f"{describe(n)} has no rule for rank-local rows/indices")
        if not rules.accepts(n, "blocks") and any(
                is_shard(self.state(a)) and self.state(a).block != 1 for a in ins):
            return self.fallback(n, "no rule for the sequence cut into blocks (a chunked "
                                    "scan's reshape(B, S // c, c, ...)): gathered blocks")
        if not rules.accepts(n, "overhang"):
            for a in ins:
                s = self.state(a)
                if is_shard(s) and s.overhang:
                    moved = into_sequence(self, a, s)
                    if moved is None:
                        return self.fallback(n, "operand longer than the input sequence")
                    self._override[a] = moved
        states = [self.state(a) for a in ins]
        if not any(is_distributed(s) for s in states):
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
            return self.fallback(n, no_rule_reason(n))
        return fn(self, n)

    def _leave_region(self, n):
        """Operands of ``n`` inside an attention region go back to the sequence layout."""
        from ..rules.attention_region import leave
        for a in n.all_input_nodes:
            if is_heads(self.state(a)):
                if a not in self._exit_cache:
                    self._exit_cache[a] = leave(self, a)
                self._override[a] = self._exit_cache[a]

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
        if any(is_distributed(self.state(a)) for a in n.all_input_nodes):
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
            s = self.state(a)
            if is_heads(s):
                return leave_value(self, a)
            if is_rows(s) or ("index", a) in self.tags:
                plan = s.order if is_rows(s) else self.tags[("index", a)][1]
                self.replan("rows", plan, "rank-local rows are returned by the model")
            if is_shard(s) and s.overhang:
                moved = into_sequence(self, a, s)
                return moved[0] if moved is not None else self.gather(a)
            if self.is_full(a):
                shard = self.fresh_shard(a)
                if shard is not None:
                    return self.localize(a, shard)
            if s is REP and is_tensor_node(a) and example(a).requires_grad:
                # Every rank returns (and back-propagates) the same replicated value, e.g. a loss
                # computed on the gathered sequence: each contributes 1/P of its gradient so the
                # sum over the group is the one-device gradient.
                return self.call(torch.ops.autosp_lm.grad_scale.default, self._env[a],
                                 1.0 / self.info.world)
            return self._env[a]

        self.graph.output(self.map(n.args[0], out), type_expr=n.type)


def leave_value(rw, a):
    from ..rules.attention_region import leave
    if a not in rw._exit_cache:
        rw._exit_cache[a] = leave(rw, a)
    return rw._exit_cache[a][0]


def _impure(node: fx.Node) -> bool:
    """Dead-code elimination keeps in-place ops (``out.index_add_(...)``, ``x[i] = v``)."""
    return mutated_operand(node) is not None or node.is_impure()


MAX_PLANS = 32


def shard_graph(gm: fx.GraphModule, info: SequenceInfo, report: Report,
                refuse: tuple = (), head_groups: int = 1) -> fx.GraphModule:
    """Run the sharding pass and return the rewritten graph module. A rule that finds out late
    that a plan it started cannot be finished exactly (rank-local rows meeting an op without a
    rule, say) raises :class:`~autosp_lm.compiler.rules.registry.Replan`; the pass then starts
    over with that plan refused (the op takes the fallback) and the report says why. Plan kinds
    in ``refuse`` (``"rows"``, ``"region"``) are never started (to measure the fallback).
    ``head_groups``: the attention rule's query-head groups per rank (1: one group, 0: the most
    the heads allow; :func:`~autosp_lm.compiler.rules.attention.head_groups`)."""
    refused: set = {(kind, "*") for kind in refuse}
    given_up: list = []
    base = report.snapshot()
    for _ in range(MAX_PLANS):
        try:
            rw = Rewriter(gm, info, report, frozenset(refused))
            rw.head_groups = head_groups
            out = rw.run()
        except Replan as e:
            report.restore(base)
            refused.add((e.kind, e.node))
            given_up.append(f"{e.kind} plan at {e.node} given up ({e.why}): fallback instead")
            continue
        report.notes += given_up
        for k in sorted(info.assumed_multiples):  # remainders taken as 0 (SequenceInfo.canon)
            report.length_multiple = math.lcm(report.length_multiple, k)
        return out
    raise AutoSPError("AutoSP: the sharding pass could not settle on a plan")
