"""Depth extrapolation for the memory planner: trace a model of alike blocks at 2 and 3 blocks.

The transformer blocks of a model whose blocks are all alike (same module, same parameters and
buffers, nothing per-layer in the config) each add the same graph nodes to the training step, so
the simulated step of ``L`` blocks is affine in ``L``: the step is traced with the model cut to
``a`` blocks and to ``b = a + 1`` (``a = 2``: the first and the last block may differ from the
middle ones, e.g. in what the embedding or the final norm saves; ``a = 2 + PREFETCH`` where the
step offloads activations: :func:`base_blocks`), and every term of the step's
:class:`~autosp_lm.planner.liveness.LiveMemory` at any length is ``v(a) + (L - a) (v(b) - v(a))``.
Two small traces replace one of ``L`` blocks (whose cost, sympy work in Dynamo/AOTAutograd and the
custom ops' bodies, grows with the graph). Everything else :func:`~autosp_lm.planner.plan.predict`
uses (parameter bytes, block bytes: the FSDP term, optimizer states) comes from the full-depth
model built under ``FakeTensorMode`` (no trace). Where the blocks are not alike the full model is
traced and the plan says why (``depth`` in the plan JSON); ``check=True`` (``--check-depth``) also
traces ``a + 2`` blocks and refuses a prediction whose extrapolation to ``a + 2`` differs from
that trace. docs/plan_memory.md ("Depth extrapolation").
"""
from __future__ import annotations

import contextlib
import dataclasses
import time
from dataclasses import dataclass, field
from typing import Callable, Optional

from ..models import build_model
from ..parallel.fsdp import block_list
from .capture import simulate_captured
from .liveness import LiveMemory
from .trace import TracedStep, model_bytes, trace_full

BASE_BLOCKS = 2  # a: the cut models have a and a + 1 blocks (more with offload: base_blocks)


def _signature(block) -> tuple:
    return (type(block), repr(block),
            [(n, tuple(p.shape), p.dtype) for n, p in block.named_parameters()],
            [(n, tuple(b.shape), b.dtype) for n, b in block.named_buffers()])


def per_layer_fields(cfg) -> list:
    """The config's fields that hold one value per layer (a list or tuple, e.g. HF's
    ``layer_types``): a model with any is not one of alike blocks."""
    out = []
    for f in dataclasses.fields(cfg):
        v = getattr(cfg, f.name)
        if isinstance(v, (list, tuple)) or (f.name != "num_layers" and "layer" in f.name
                                           and v not in (None, False)):
            out.append(f.name)
    return out


def why_not_alike(cfg, model) -> Optional[str]:
    """None when every transformer block of ``model`` is alike (same module type, ``repr`` and
    (name, shape, dtype) list of parameters and buffers) and ``cfg`` has no per-layer field;
    otherwise the reason."""
    fields = per_layer_fields(cfg)
    if fields:
        return f"the config has per-layer fields: {', '.join(fields)}"
    blocks = block_list(model)
    if not blocks:
        return "the model has no list of transformer blocks"
    first = _signature(blocks[0])
    for i, b in enumerate(blocks):
        if _signature(b) != first:
            return f"block {i} differs from block 0 (module, parameters or buffers)"
    return None


def base_blocks(name: str, offload: bool = False) -> int:
    """The smaller cut model's blocks for strategy ``name``: :data:`BASE_BLOCKS`, and
    :data:`~autosp_lm.compiler.offload.PREFETCH` more where the step offloads activations. The
    backward's reloads bring each offloaded value back ``PREFETCH`` slots ahead, so a model
    with fewer blocks than slots in flight holds all of its offloaded values on the device at
    once and its step does not grow by one block's share per block: the cut models must
    already be in that steady state (a 16-block model extrapolated from 2 and 3 blocks
    predicted no saving from offload at all)."""
    from ..compiler.offload import PREFETCH
    from .trace import STRATEGIES
    opts = STRATEGIES[name][1]
    moves = offload or opts.get("offload_activations") or opts.get("cpu_offloading")
    return BASE_BLOCKS + (PREFETCH if moves else 0)


def _lerp(a: int, va: int, vb: int, L: int) -> int:
    return va + (L - a) * (vb - va)


def _on_a_line(ma: LiveMemory, mb: LiveMemory, mc: LiveMemory) -> bool:
    """Three consecutive cut models whose step is affine in the depth there: the same phase of
    the peak and the same growth a block of the peak and of the saved bytes. Where the cuts peak
    at different places (the smaller one in another block's kernel or the loss head, and a node
    whose live set grows with the depth overtaking it a block later) the growth differs, and a
    line through the first two would be overtaken."""
    return (ma.peak_phase == mb.peak_phase == mc.peak_phase
            and mc.peak - mb.peak == mb.peak - ma.peak
            and mc.saved - mb.saved == mb.saved - ma.saved)


@dataclass
class DepthTracedStep(TracedStep):
    """A :class:`~autosp_lm.planner.trace.TracedStep` of ``blocks`` blocks whose step is the
    extrapolation of the traces of its cut models (``cuts``: ``base``, ``base + 1``, ...
    blocks; ``more(n)`` traces the cut of ``n`` blocks when a prediction needs it)."""

    cuts: list = field(default_factory=list, repr=False)
    base: int = BASE_BLOCKS
    more: Optional[Callable] = field(default=None, repr=False)
    check: bool = False
    full: Optional[TracedStep] = field(default=None, repr=False)  # traced whole, if needed

    def extrapolate(self, mems: list, L: int, a: Optional[int] = None) -> LiveMemory:
        a = self.base if a is None else a
        ma, mb = mems[:2]
        lin = {k: _lerp(a, getattr(ma, k), getattr(mb, k), L)
               for k in ("peak", "forward_peak", "saved", "backward_peak", "host", "stall_s")}
        # the peak of each cut is its forward or backward peak; if the phase of the peak moves
        # with the depth, the larger extrapolation holds (never below the forward's)
        peak = max(lin["peak"], lin["forward_peak"])
        phase = mb.peak_phase if peak == lin["peak"] else "forward"
        at = f"{mb.peak_at} (extrapolated from {a} and {a + 1} blocks to {L})"
        return LiveMemory(peak, at, phase, lin["forward_peak"], lin["saved"],
                          lin["backward_peak"], lin["host"], max(0.0, lin["stall_s"]))

    def compute_time(self, seq: int, device) -> float:
        """The cut models' compute time extrapolated to every block (linear in the depth: a
        sum over the nodes, each block's nodes alike)."""
        a, (ta, tb) = self.base, [cut.compute_time(seq, device) for cut in self.cuts[:2]]
        return ta + (len(self.block_bytes) - a) * (tb - ta)

    def stall(self, seq: int, device) -> float:
        """The waits for offload's copies back, extrapolated to every block from the deepest two
        cut models traced (the prefetch and the copies' backlog settle with the depth)."""
        if self.full is not None:
            return self.full.stall(seq, device)
        a = self.base + len(self.cuts) - 2
        sa, sb = (cut.stall(seq, device) for cut in self.cuts[-2:])
        return max(0.0, sa + (len(self.block_bytes) - a) * (sb - sa))

    def offloads(self) -> bool:
        return any(cut.offloads() for cut in self.cuts)

    def _cut(self, i: int):
        while len(self.cuts) <= i:
            self.cuts.append(self.more(self.base + len(self.cuts)))
        return self.cuts[i]

    def step(self, seq: int, grad_fraction: float = 1.0, target: Optional[str] = None,
             clock=None):
        """The step of every block, extrapolated from two cut models on one line: the first
        three consecutive cuts whose peaks grow by the same bytes a block (:func:`_on_a_line`;
        one block more is traced while they do not, up to the model's depth), extrapolated from
        the last two of them; with ``check`` the next cut is traced too and must equal the
        extrapolation to its depth."""
        L, missing = len(self.block_bytes), {}

        def sim(i):
            m = self._cut(i).step(seq, grad_fraction=grad_fraction, target=target, clock=clock)
            missing.update(simulate_captured.not_counted)
            return m

        i, mems = 0, [sim(0), sim(1), sim(2)]  # (more than base + 2 blocks: trace_by_depth)
        while not _on_a_line(*mems[i:i + 3]):
            if self.base + i + 3 >= L:  # no line below the model's own depth: trace it whole
                if self.full is None:
                    self.full = self.more(L)
                m = self.full.step(seq, grad_fraction=grad_fraction, target=target, clock=clock)
                self.depth.setdefault("traced_whole_at", []).append(f"{seq}:{target}")
                return m
            i += 1
            mems.append(sim(i + 2))
        i += 1  # the last two of the three (the first may be before the line)
        a = self.base + i
        used = self.depth.setdefault("extrapolated_from_at", {})
        used[f"{seq}:{target}"] = [a, a + 1]
        if self.check and a + 2 <= L:
            want = mems[i + 2] if len(mems) > i + 2 else sim(i + 2)
            got = self.extrapolate(mems[i:i + 2], a + 2, a)
            row = {"seq": seq, "blocks": a + 2, "peak": [got.peak, want.peak],
                   "saved": [got.saved, want.saved]}
            self.depth.setdefault("checks", []).append(row)
            if got.peak != want.peak or got.saved != want.saved:
                raise RuntimeError(
                    f"memory plan: depth extrapolation does not hold for {self.strategy!r} at "
                    f"{seq} tokens: from {a} and {a + 1} blocks it predicts {a + 2} blocks at "
                    f"peak {got.peak} / saved {got.saved} bytes, their trace gives "
                    f"{want.peak} / {want.saved}; plan with --no-depth-extrapolation "
                    f"(traces every block)")
        simulate_captured.not_counted = missing
        return self.extrapolate(mems[i:i + 2], L, a)


@contextlib.contextmanager
def traced_progress(progress: Optional[Callable[[str], None]], name: str, sp: int, seq: int,
                    n: int, m: Optional[int], what: str):
    """One line to ``progress`` (if any) before trace ``n`` of ``m`` of strategy ``name`` (the
    model as ``what`` says: all its blocks, or a cut model; ``m`` None: a cut model beyond those
    planned, which a prediction needed) and one after it, with its seconds."""
    head = (f"{name} SP {sp}: trace {n} of {m} ({what}) at {seq} tokens" if m is not None else
            f"{name} SP {sp}: trace {n}, one cut model more ({what}: the first two peak at "
            f"different nodes) at {seq} tokens")
    if progress is not None:
        progress(head)
    t0 = time.time()
    yield
    if progress is not None:
        progress(f"{head}: done in {time.time() - t0:.0f} s")


def trace_by_depth(name: str, cfg, sp: int, seq: int, *, bf16: bool = False,
                   offload: bool = False, check: bool = False,
                   base: Optional[int] = None, fsdp_world: int = 0,
                   sac_device: Optional[str] = None,
                   progress: Optional[Callable[[str], None]] = None) -> TracedStep:
    """:func:`~autosp_lm.planner.plan.trace_step` by depth extrapolation where it applies (alike
    blocks, more than ``base + 2`` of them), else of the full model; ``traced.depth`` says which.
    ``base`` (default :func:`base_blocks`): the smaller cut model's blocks. ``progress``: one
    line before and after each trace (:func:`traced_progress`), the cuts a prediction adds
    later included."""
    if base is None:
        base = base_blocks(name, offload)
    from torch._subclasses.fake_tensor import FakeTensorMode
    with FakeTensorMode(allow_non_fake_inputs=True):
        model = build_model(cfg)
    pbytes, block_bytes = model_bytes(model)
    L = len(block_bytes)
    why = why_not_alike(cfg, model)
    del model
    if why is None and L <= base + 2:
        why = f"{L} blocks: no more than the cut models' {base} + 1 and the check's + 1"
    if why is not None:
        with traced_progress(progress, name, sp, seq, 1, 1, f"all {L} blocks"):
            traced = trace_full(name, cfg, sp, seq, bf16=bf16, offload=offload,
                                fsdp_world=fsdp_world, sac_device=sac_device)
        traced.depth = {"extrapolated": False, "reason": why, "blocks": L}
        return traced
    planned = 2 + (1 if check else 0)  # a prediction may add cuts (DepthTracedStep.step)
    traced_cuts = [0]

    def cut_model(n: int) -> TracedStep:
        traced_cuts[0] += 1
        k = traced_cuts[0]
        with traced_progress(progress, name, sp, seq, k, planned if k <= planned else None,
                             f"cut to {n} of {L} blocks"):
            return trace_full(name, dataclasses.replace(cfg, num_layers=n), sp, seq,
                              bf16=bf16, offload=offload, fsdp_world=fsdp_world,
                              sac_device=sac_device)

    def more(n: int) -> TracedStep:
        cut = cut_model(n)
        if (cut.input_length, cut.zigzag, cut.sp) != (first.input_length, first.zigzag,
                                                      first.sp):
            raise RuntimeError(f"memory plan: the cut models of {name!r} trace differently "
                               f"(input length, layout or SP size); plan with "
                               f"--no-depth-extrapolation")
        return cut

    first = cut_model(base)
    cuts = [first, more(base + 1)]
    b = cuts[1]
    depth = {"extrapolated": True, "extrapolated_from": [base, base + 1], "blocks": L}
    if check:
        depth["checked_with"] = "the next cut model"
    return DepthTracedStep(b.strategy, b.sp, b.traced_seq, b.input_length, [], pbytes,
                           block_bytes, plan=b.plan, zigzag=b.zigzag, depth=depth,
                           graph_fsdp_world=fsdp_world, cuts=cuts, base=base, more=more,
                           check=check)
