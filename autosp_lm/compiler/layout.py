"""The sequence layout as the sharding pass emits it: the global length ``S``, this rank's share
and positions, symbolic sizes, and whether the plan's layout is the contiguous one in rank order.

:class:`SequenceLayout` is a part of :class:`~autosp_lm.compiler.passes.shard.Rewriter` (it uses
the rewriter's ``call`` / ``method`` / ``info`` / ``plan``); rules reach it through the rewriter
interface of :mod:`autosp_lm.compiler.rules.registry`.
"""
from __future__ import annotations

import operator

import sympy
import torch

from .graph import AutoSPError


class SequenceLayout:
    """Sizes and positions of the sequence on this rank (a mixin of the rewriter)."""

    @property
    def plan(self):
        """The :class:`~autosp_lm.compiler.graph.SPPlan` (None before planning / in tests)."""
        return self.info.plan

    def contiguous_layout(self) -> bool:
        """Each rank holds one contiguous piece of the sequence, the pieces in SP-rank order (the
        halo exchange and the exclusive scan rely on it): true without a ring degree; a ring
        plan's zigzag layout, or its Ulysses-group order, is not."""
        return self.plan is None or self.plan.ring_degree == 1

    def heads_split_only(self) -> bool:
        """Attention is split over heads only (Ulysses over the whole SP group, no ring degree):
        what a hand-written attention region relies on."""
        return self.plan is None or self.plan.ring_degree == 1

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

    def positions(self):
        """The global positions of this rank's rows (int64): ``r*S/P + arange(S/P)`` for the
        contiguous split; :meth:`local_positions` in general."""
        if self._pos is None:
            self._pos = self.local_positions()
        return self._pos

    def sym(self, expr):
        """A graph value for a sympy expression in S (int when constant)."""
        expr = sympy.expand(self.info.canon(expr))
        if expr.is_Integer:
            return int(expr)
        try:
            poly = sympy.Poly(expr, self.info.symbol)
        except sympy.PolynomialError:
            poly = None
        if poly is None or poly.degree() != 1 or not all(c.is_Rational for c in poly.all_coeffs()) \
                or not poly.all_coeffs()[1].is_Integer:
            raise AutoSPError(f"AutoSP: cannot express the size {expr} in the graph")
        a, b = poly.all_coeffs()
        v = self.S()
        if a.q != 1:  # S / q: blocks of q positions, q divides S (the report's length multiple)
            v = self.call(operator.floordiv, v, int(a.q))
        if a.p != 1:
            v = self.call(operator.mul, v, int(a.p))
        b = int(b)
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
