"""The partitioned graphs of a compiled training step, captured, and their live memory at any length.

:func:`capture_backend` is a ``torch.compile`` backend that runs AOTAutograd with the min-cut
partitioner and op-by-op execution (what ``aot_eager`` does) and records every partitioned
forward/backward pair in a list: the graphs of the hand-written strategies, simulated exactly as
AutoSP's (whose backend records its own pairs: ``AutoSPBackend.partitions``).

:func:`length_size_of` evaluates a fake value's bytes at another sequence length: a graph traced
with the sequence dimension dynamic carries sizes as sympy expressions of one symbol whose hint is
the traced length; substituting another length gives that graph's sizes there exactly. A symbol
whose hint is not the traced length (a second dynamic size) is refused, never guessed.
:func:`simulate_captured` is :func:`~autosp_lm.compiler.liveness.simulate_step` of every captured
pair at one length (graph breaks: the pairs run one after the other; what a pair hands to the next
is not modelled: our strategies compile one graph).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch
import torch.fx as fx

from .graph import AutoSPError
from .liveness import LiveMemory, _root, simulate_step
from .passes.sac_graph import flat_outputs

__all__ = ["Partition", "capture_backend", "length_size_of", "simulate_captured"]


@dataclass
class Partition:
    """One partitioned step: the forward, the backward and the number of the user's outputs of
    the forward (the rest are saved for the backward)."""

    fw: fx.GraphModule
    bw: fx.GraphModule
    num_fwd_outputs: int


def _boxed_nop(gm: fx.GraphModule, example_inputs):
    def run(args):
        return gm(*args)
    run._boxed_call = True
    return run


def capture_backend(store: list) -> Callable:
    """A ``torch.compile`` backend: AOTAutograd, the min-cut partitioner (AOTAutograd's
    defaults), no code generation; every partition is appended to ``store`` as a
    :class:`Partition`."""
    from torch._dynamo.backends.common import aot_autograd
    from torch._functorch.partitioners import min_cut_rematerialization_partition

    def partition(joint, joint_inputs, *, num_fwd_outputs, **kwargs):
        fw, bw = min_cut_rematerialization_partition(joint, joint_inputs,
                                                     num_fwd_outputs=num_fwd_outputs, **kwargs)
        store.append(Partition(fw, bw, num_fwd_outputs))
        return fw, bw

    backend = aot_autograd(fw_compiler=_boxed_nop, bw_compiler=_boxed_nop, partition_fn=partition,
                           keep_inference_input_mutations=True)
    backend.__name__ = "capture"
    return backend


def _expr(s):
    if isinstance(s, int):
        return s
    return s.node.expr


def length_size_of(traced_length: int, length: int, hints: dict) -> Callable:
    """``size_of`` for :func:`simulate_step`: a tensor's bytes with every symbol of its shape
    whose hint (``hints``: the shape environment's symbol -> traced value) is ``traced_length``
    set to ``length`` (static sizes unchanged)."""
    import sympy
    cache: dict = {}

    def value(e) -> int:
        if isinstance(e, int):
            return e
        v = cache.get(e)
        if v is None:
            subs = {}
            for sym in e.free_symbols:
                hint = hints.get(sym)
                if hint != traced_length:
                    raise AutoSPError(
                        f"memory plan: a size of the traced graph depends on {sym} (traced as "
                        f"{hint}), which is not the sequence length ({traced_length}); only the "
                        f"sequence dimension may be dynamic: mark the others static")
                subs[sym] = length
            r = sympy.sympify(e).xreplace(subs)
            try:
                v = cache[e] = int(r)
            except TypeError:
                raise AutoSPError(f"memory plan: the size {e} does not evaluate at length "
                                  f"{length}") from None
        return v

    def size_of(t) -> int:
        if not isinstance(t, torch.Tensor):
            return 0
        n = 1
        for s in t.shape:
            n *= value(_expr(s))
        return n * t.element_size()

    return size_of


def _hints(p: Partition) -> dict:
    """Symbol -> traced value of the shape environment of a captured pair ({} when static)."""
    for n in p.fw.graph.nodes:
        v = n.meta.get("val")
        if isinstance(v, torch.Tensor):
            for s in v.shape:
                if isinstance(s, torch.SymInt):
                    env = s.node.shape_env  # backed_var_to_val: torch >= 2.13's name
                    vals = getattr(env, "backed_var_to_val", None)
                    return {k: int(x) for k, x in (vals if vals is not None
                                                   else env.var_to_val).items()}
    return {}


def _scaled_grads(bw: fx.GraphModule, size_of: Callable, fraction: float) -> Callable:
    grads = set()
    for o in flat_outputs(bw.graph):
        if isinstance(o, fx.Node):
            v = _root(o).meta.get("val")
            if isinstance(v, torch.Tensor) and all(isinstance(d, int) for d in v.shape):
                grads.add(id(v))

    def scaled(t) -> int:
        n = size_of(t)
        return int(n * fraction) if id(t) in grads else n

    return scaled


def simulate_captured(partitions: list, traced_length: int, length: Optional[int] = None,
                      device: Optional[torch.device] = None,
                      grad_fraction: float = 1.0) -> LiveMemory:
    """The live memory of the captured step at ``length`` (default: the traced length): the
    pairs simulated in order, the peak the largest of theirs, the saved bytes their sum.
    ``grad_fraction``: the backward's outputs of static shape (the parameters' gradients) count
    that fraction of their bytes (sharded gradients: 1 / the shard count)."""
    if not partitions:
        raise AutoSPError("memory plan: no partitioned graph was captured (did the step run "
                          "backward through the compiled model?)")
    best, saved = None, 0
    for p in partitions:
        size_of = length_size_of(traced_length, traced_length if length is None else length,
                                 _hints(p))
        if grad_fraction != 1.0:
            size_of = _scaled_grads(p.bw, size_of, grad_fraction)
        m = simulate_step(p.fw, p.bw, p.num_fwd_outputs, device=device, size_of=size_of)
        saved += m.saved
        if best is None or m.peak > best.peak:
            best = m
    return LiveMemory(best.peak, best.peak_at, best.peak_phase, best.forward_peak, saved,
                      best.backward_peak)
