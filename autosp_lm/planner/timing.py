"""The planner's predicted step time: the compiler's cost model summed over a traced step.

Every node of the step's partitioned forward and backward graphs is priced as the checkpointing
pass prices it (:func:`~autosp_lm.compiler.passes.sac_cost.node_seconds_of`: matmul and
attention FLOPs at the device's sustained rates, memory-bound ops at its bandwidth, collectives
as latency plus bytes on the wire). What a plan recomputes is in its backward graph, so full
recomputation, SAC and the max-context mode are priced by the same rule. Activation offload's
copies run on a side stream at the host link's bandwidth (``DeviceParams.host_bw``), overlapped
with compute as the offload ops run them: what they add to the step is the compute stream's wait
for copies back that have not ended (``liveness.Clock``, simulated with the memory at each
length: ``TracedStep.step_time``). The graphs are traced with a symbolic sequence length, so each node's cost is
split by how it grows with the length: attention kernels quadratically, every other node whose
tensors have a sequence dimension linearly, the rest (parameter gathers, optimizer-side work in
the graphs, collective latency) not at all. The prediction at another length scales those three
parts (exact for the FLOP and byte counts; the plan the compiler would choose at that length may
differ, which is why the planner traces again at the length it answers).

It is a roofline estimate: no overlap of collectives with compute, no kernel launch overhead,
and the optimizer step (outside the graphs) is not counted. Plans are compared with it, on one
device preset, not timed.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.fx as fx

from ..compiler.graph import example, is_attention_backward_op, is_attention_op, is_collective_op
from ..compiler.passes.sac_cost import estimate_node_flops, node_seconds_of
from .capture import unwrap_rng


@dataclass
class StepTime:
    """Seconds of one rank's forward + backward at the traced length, by growth in length."""

    constant: float = 0.0
    linear: float = 0.0
    quadratic: float = 0.0

    def at(self, ratio: float) -> float:
        """Seconds at ``ratio`` times the traced (local) length."""
        return self.constant + self.linear * ratio + self.quadratic * ratio * ratio

    def __add__(self, other: "StepTime") -> "StepTime":
        return StepTime(self.constant + other.constant, self.linear + other.linear,
                        self.quadratic + other.quadratic)


def _symbolic(v) -> bool:
    if isinstance(v, (tuple, list)):
        return any(_symbolic(x) for x in v)
    if not isinstance(v, torch.Tensor):
        return False
    return any(isinstance(s, torch.SymInt) and s.node.expr.free_symbols for s in v.shape)


def _inner(n: fx.Node):
    """The op an RNG wrapper (``higher_order.run_and_save_rng_state`` / ``run_with_rng_state``:
    attention recomputed under activation checkpointing) runs, as a stand-in node
    (``planner.capture``'s); other nodes as they are."""
    inner = unwrap_rng(n)
    if inner is not n:
        inner.all_input_nodes = [a for a in inner.args if isinstance(a, fx.Node)]
        inner.name = n.name
    return inner


_SIDE_STREAM_OPS = ("autosp_lm::offload", "autosp_lm::reload")


def node_time(node: fx.Node, device, world: int) -> StepTime:
    """:class:`StepTime` of one node on the compute stream. The offload ops' copies run on a
    side stream (:mod:`autosp_lm.compiler.offload`): 0 here; what they cost the step is the
    compute stream's wait for them (``liveness.Clock``)."""
    out = StepTime()
    if node.op != "call_function" or getattr(getattr(node.target, "_schema", None), "name",
                                             None) in _SIDE_STREAM_OPS:
        return out
    n = _inner(node)  # an activation checkpoint's RNG wrapper: priced as the op it runs
    sec, _ = node_seconds_of(n, estimate_node_flops(n), device, world)
    if not sec:
        return out
    grows = _symbolic(example(n)) or any(_symbolic(example(a)) for a in n.all_input_nodes)
    if not grows:
        out.constant += sec
    elif is_attention_op(n.target) or is_attention_backward_op(n.target):
        out.quadratic += sec
    elif is_collective_op(n.target):  # the latency stays, the bytes grow
        out.constant += device.link_latency
        out.linear += sec - device.link_latency
    else:
        out.linear += sec
    return out


def node_seconds(gm: fx.GraphModule, device, world: int, ratio: float,
                 cache: Optional[dict] = None):
    """``seconds(node)`` of ``gm``'s nodes at ``ratio`` times the traced length, for
    :class:`~autosp_lm.planner.liveness.Clock`; ``cache``: kept between calls (each node is
    priced once per device)."""
    key = (id(gm), device.name)
    times = cache.get(key) if cache is not None else None
    if times is None:
        times = {n: node_time(n, device, world) for n in gm.graph.nodes}
        if cache is not None:
            cache[key] = times
    return lambda n: times[n].at(ratio) if n in times else 0.0


def graph_time(gm: fx.GraphModule, device, world: int) -> StepTime:
    """:class:`StepTime` of one graph on ``device`` (a ``DeviceParams``)."""
    out = StepTime()
    for node in gm.graph.nodes:
        out = out + node_time(node, device, world)
    return out


def step_time(partitions: list, device, world: int) -> StepTime:
    """:class:`StepTime` of a captured step (``planner.capture.Partition`` list)."""
    total = StepTime()
    for p in partitions:
        total = total + graph_time(p.fw, device, world) + graph_time(p.bw, device, world)
    return total


__all__ = ["StepTime", "graph_time", "node_seconds", "node_time", "step_time"]
