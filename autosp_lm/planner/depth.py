"""Depth extrapolation for the memory planner: trace a model of alike blocks at 2 and 3 blocks.

The transformer blocks of a model whose blocks are all alike (same module, same parameters and
buffers, nothing per-layer in the config) each add the same graph nodes to the training step, so
the simulated step of ``L`` blocks is affine in ``L``: the step is traced with the model cut to
``a`` blocks and to ``b = a + 1`` (``a = 2``: the first and the last block may differ from the
middle ones, e.g. in what the embedding or the final norm saves), and every term of the step's
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

import dataclasses
from dataclasses import dataclass, field
from typing import Optional

from ..models import build_model
from ..parallel.fsdp import block_list
from .capture import simulate_captured
from .liveness import LiveMemory
from .trace import TracedStep, model_bytes, trace_full

BASE_BLOCKS = 2  # a: the cut models have a and a + 1 blocks


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


def _lerp(a: int, va: int, vb: int, L: int) -> int:
    return va + (L - a) * (vb - va)


@dataclass
class DepthTracedStep(TracedStep):
    """A :class:`~autosp_lm.planner.trace.TracedStep` of ``blocks`` blocks whose step is the
    extrapolation of the traces of its cut models (``cuts``: ``a`` and ``a + 1`` blocks, and
    ``a + 2`` with the check)."""

    cuts: list = field(default_factory=list, repr=False)
    base: int = BASE_BLOCKS

    def extrapolate(self, mems: list, L: int) -> LiveMemory:
        a, (ma, mb) = self.base, mems[:2]
        lin = {k: _lerp(a, getattr(ma, k), getattr(mb, k), L)
               for k in ("peak", "forward_peak", "saved", "backward_peak", "host", "stall_s")}
        # the peak of each cut is its forward or backward peak; if the phase of the peak moves
        # with the depth, the larger extrapolation holds (never below the forward's)
        peak = max(lin["peak"], lin["forward_peak"])
        phase = mb.peak_phase if peak == lin["peak"] else "forward"
        at = f"{mb.peak_at} (extrapolated from {a} and {a + 1} blocks to {L})"
        return LiveMemory(peak, at, phase, lin["forward_peak"], lin["saved"],
                          lin["backward_peak"], lin["host"], max(0.0, lin["stall_s"]))

    def step_time(self, seq: int, device) -> float:
        """The cut models' step times extrapolated to every block (linear in the depth)."""
        a, (ta, tb) = self.base, [cut.step_time(seq, device) for cut in self.cuts[:2]]
        return ta + (len(self.block_bytes) - a) * (tb - ta)

    def stall(self, seq: int, device) -> float:
        """The cut models' waits for offload's copies back, extrapolated to every block."""
        a, (sa, sb) = self.base, [cut.stall(seq, device) for cut in self.cuts[:2]]
        return max(0.0, sa + (len(self.block_bytes) - a) * (sb - sa))

    def offloads(self) -> bool:
        return any(cut.offloads() for cut in self.cuts)

    def step(self, seq: int, grad_fraction: float = 1.0, target: Optional[str] = None,
             clock=None):
        mems, missing = [], {}
        for cut in self.cuts:
            mems.append(cut.step(seq, grad_fraction=grad_fraction, target=target, clock=clock))
            missing.update(simulate_captured.not_counted)
        if len(self.cuts) > 2:  # --check-depth: the a + 2 trace against the extrapolation
            got, want = self.extrapolate(mems, self.base + 2), mems[2]
            row = {"seq": seq, "blocks": self.base + 2, "peak": [got.peak, want.peak],
                   "saved": [got.saved, want.saved]}
            self.depth.setdefault("checks", []).append(row)
            if got.peak != want.peak or got.saved != want.saved:
                raise RuntimeError(
                    f"memory plan: depth extrapolation does not hold for {self.strategy!r} at "
                    f"{seq} tokens: from {self.base} and {self.base + 1} blocks it predicts "
                    f"{self.base + 2} blocks at peak {got.peak} / saved {got.saved} bytes, their "
                    f"trace gives {want.peak} / {want.saved}; plan with --no-depth-extrapolation "
                    f"(traces every block)")
        simulate_captured.not_counted = missing
        return self.extrapolate(mems, len(self.block_bytes))


def trace_by_depth(name: str, cfg, sp: int, seq: int, *, bf16: bool = False,
                   offload: bool = False, check: bool = False,
                   base: int = BASE_BLOCKS, fsdp_world: int = 0,
                   sac_device: Optional[str] = None) -> TracedStep:
    """:func:`~autosp_lm.planner.plan.trace_step` by depth extrapolation where it applies (alike
    blocks, more than ``base + 2`` of them), else of the full model; ``traced.depth`` says which."""
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
        traced = trace_full(name, cfg, sp, seq, bf16=bf16, offload=offload,
                            fsdp_world=fsdp_world, sac_device=sac_device)
        traced.depth = {"extrapolated": False, "reason": why, "blocks": L}
        return traced
    counts = [base, base + 1] + ([base + 2] if check else [])
    cuts = [trace_full(name, dataclasses.replace(cfg, num_layers=n), sp, seq, bf16=bf16,
                       offload=offload, fsdp_world=fsdp_world, sac_device=sac_device)
            for n in counts]
    b = cuts[1]
    if any(c.input_length != b.input_length or c.zigzag != b.zigzag or c.sp != b.sp
           for c in cuts):
        raise RuntimeError(f"memory plan: the cut models of {name!r} trace differently (input "
                           f"length, layout or SP size); plan with --no-depth-extrapolation")
    depth = {"extrapolated": True, "extrapolated_from": [base, base + 1], "blocks": L}
    if check:
        depth["checked_with"] = base + 2
    return DepthTracedStep(b.strategy, b.sp, b.traced_seq, b.input_length, [], pbytes,
                           block_bytes, plan=b.plan, zigzag=b.zigzag, depth=depth,
                           graph_fsdp_world=fsdp_world, cuts=cuts, base=base)
