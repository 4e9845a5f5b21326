"""Single-device compilation with sequence-aware activation checkpointing (``--compile --sac``).

``sac_compile(model)`` is ``torch.compile`` with a backend that runs AOTAutograd with the SAC
partition function (:mod:`autosp_lm.compiler.sac`):

* ``backend="aot_eager"``: ``aot_autograd(fw_compiler=nop, bw_compiler=nop,
  partition_fn=sac_partition_fn(budget))`` - no code generation, for tests.
* ``backend="inductor"``: Inductor's own ``compile_fx`` (its decompositions, joint-graph passes and
  fw/bw compilers), with ``torch._inductor.config.custom_partitioner_fn`` patched, only for the
  duration of this graph's compilation, to a SAC partitioner. Inductor calls it after its
  joint-graph passes with ``num_fwd_outputs``; it tags and calls the min-cut partitioner, exactly
  as Inductor's default does. Inductor's FX-graph cache and the AOTAutograd cache are switched off
  for the duration of the compilation (``config.patch``): the pass always runs, its stats are
  always fresh, and no cache entry can carry one model's partition to another or to a compile
  without SAC.

Every ``sac_compile`` call owns its backend object: compiling two models in one process gives
each its own budget and stats, and nothing global is changed outside a compilation.
"""
from __future__ import annotations

from typing import Any, Callable, Optional

import torch

from torch._inductor.custom_graph_pass import CustomPartitionerFn

from autosp_lm.compiler.chunked_loss import fuse_loss_heads
from autosp_lm.compiler.sac import SACPartitionFn

__all__ = ["sac_compile", "SACBackend"]

_BACKENDS = ("inductor", "aot_eager")


def _boxed_nop(gm: torch.fx.GraphModule, example_inputs):
    """No-op AOTAutograd compiler with the boxed calling convention (inputs list is consumed)."""
    def run(args):
        return gm(*args)
    run._boxed_call = True
    return run


class SACInductorPartitioner(CustomPartitionerFn):
    """``torch._inductor.config.custom_partitioner_fn``: SAC tags, then the min-cut partitioner.

    Inductor calls it after its joint-graph passes, with ``compiler``,
    ``static_lifetime_input_indices`` and ``num_fwd_outputs``."""

    def __init__(self, inner: SACPartitionFn):
        self.inner = inner

    def __call__(self, gm, joint_inputs, **kwargs):
        kwargs.setdefault("compiler", "inductor")
        num_fwd_outputs = kwargs.pop("num_fwd_outputs")
        return self.inner(gm, joint_inputs, num_fwd_outputs=num_fwd_outputs, **kwargs)

    def uuid(self):
        # Identifies the policy; caches are switched off while SAC compiles anyway (see module
        # docstring), so that the pass always runs and reports its stats.
        return ("autosp_lm.sac", self.inner.budget, self.inner.num_tokens)


class SACBackend:
    """A ``torch.compile`` backend: AOTAutograd + SAC partitioning + ``backend`` codegen.

    ``stats`` lists one dict per compiled joint graph (see :func:`~autosp_lm.compiler.sac.apply_sac`;
    several with graph breaks, none for inference-only graphs).
    """

    def __init__(self, budget: float = 0.1, backend: str = "inductor",
                 num_tokens: Optional[int] = None, chunked_loss: bool = True):
        if backend not in _BACKENDS:
            raise ValueError(f"sac_compile: backend must be one of {_BACKENDS}, got {backend!r}")
        if budget < 0:
            raise ValueError(f"--sac-recompute-budget must be >= 0, got {budget}")
        self.budget = budget
        self.backend = backend
        self.num_tokens = num_tokens
        self.chunked_loss = chunked_loss
        self.stats: list = []
        self.fused_losses: list = []

    def partition_fn(self) -> SACPartitionFn:
        return SACPartitionFn(self.budget, on_stats=self.stats.append, num_tokens=self.num_tokens)

    def __call__(self, gm: torch.fx.GraphModule, example_inputs):
        if self.chunked_loss:
            self.fused_losses += fuse_loss_heads(gm)
        if self.backend == "aot_eager":
            from torch._dynamo.backends.common import aot_autograd

            return aot_autograd(fw_compiler=_boxed_nop, bw_compiler=_boxed_nop,
                                partition_fn=self.partition_fn(),
                                keep_inference_input_mutations=True)(gm, example_inputs)
        from torch._inductor import config as inductor_config
        from torch._inductor.compile_fx import compile_fx

        from torch._functorch import config as functorch_config

        part = SACInductorPartitioner(self.partition_fn())
        with inductor_config.patch(custom_partitioner_fn=part, fx_graph_cache=False), \
                functorch_config.patch(enable_autograd_cache=False):
            return compile_fx(gm, example_inputs)


def _attach(compiled: Any, backend: SACBackend) -> Any:
    if isinstance(compiled, torch.nn.Module):
        # OptimizedModule forwards unknown attribute writes to the wrapped model; give the
        # compiled wrapper its own small subclass that carries the backend instead.
        base = type(compiled)
        cls = type("SACCompiledModule", (base,), {
            "_sac_backend": None,
            "sac_stats": property(lambda self: self._sac_backend.stats),
            "sac_budget": property(lambda self: self._sac_backend.budget),
            "sac_fused_losses": property(lambda self: self._sac_backend.fused_losses),
        })
        compiled.__class__ = cls
        compiled._sac_backend = backend
    else:
        compiled.sac_stats = backend.stats
        compiled.sac_budget = backend.budget
        compiled.sac_fused_losses = backend.fused_losses
        compiled._sac_backend = backend
    return compiled


def sac_compile(model: Callable, *, budget: float = 0.1, backend: str = "inductor",
                dynamic: Optional[bool] = None, fullgraph: bool = False,
                num_tokens: Optional[int] = None, chunked_loss: bool = True) -> Any:
    """Compile ``model`` (an ``nn.Module`` or function) for single-device training with SAC.

    ``budget``: recompute at most ``budget`` x the step's FLOPs (``--sac-recompute-budget``).
    ``backend``: ``"inductor"`` (default) or ``"aot_eager"``. Returns the compiled callable; its
    ``.sac_stats`` is the live list of per-graph SAC stats (filled at the first training call).
    ``chunked_loss``: fuse ``linear -> cross_entropy`` loss heads into one op that recomputes
    the logits in sequence chunks (:mod:`autosp_lm.compiler.chunked_loss`); listed in
    ``.sac_fused_losses``.
    """
    sac_backend = SACBackend(budget=budget, backend=backend, num_tokens=num_tokens,
                             chunked_loss=chunked_loss)
    compiled = torch.compile(model, backend=sac_backend, dynamic=dynamic, fullgraph=fullgraph)
    return _attach(compiled, sac_backend)
