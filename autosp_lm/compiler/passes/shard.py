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

import torch
import torch.fx as fx

from .. import ops  # noqa: F401 - registers autosp_lm::grad_scale
from .. import rules
from ..graph import (REDUCED, REP, AutoSPError, SequenceInfo, describe, example, is_distributed,
                     is_heads, is_rows, is_shard, is_tensor_node, mutated_operand, target_key,
                     torch_ops)
from ..kernels import no_rule_reason
from ..report import Report
from ..rule_interface import RuleInterface
from ..rules.common import into_sequence
from ..rules.head_parallel import head_parallel
from ..rules.registry import Replan

# per-token work that shards a full operand even when nothing requires grad (inference); plain
# matmuls of replicated values (RoPE tables: inv_freq @ positions) stay full
HEAVY = frozenset(torch_ops("embedding", "linear", "scaled_dot_product_attention", "layer_norm",
                            "rms_norm", "conv1d")) | frozenset(rules.LOSS_OPS)
# ops whose first operand is the value and whose other operands only lend dtype/device/shape
_LENDERS = frozenset(torch_ops("type_as", "to", "view_as", "expand_as", "reshape_as", "new_zeros",
                               "new_ones", "new_empty", "new_full", "new_tensor"))


class Rewriter(RuleInterface):
    """Drives the rules over the graph: visits every original node, prepares its operands and
    hands it to the rule of its op (or its operands' state), then builds the graph module. Rules
    use only :class:`~autosp_lm.compiler.rule_interface.RuleInterface` (listed in
    :mod:`autosp_lm.compiler.rules.registry`)."""

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
