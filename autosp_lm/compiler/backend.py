"""The AutoSP ``torch.compile`` backend: Dynamo graph -> SP passes -> AOTAutograd -> compiler.

Order: with SAC, the loss head is fused first (:mod:`chunked_loss`); pass 1
(:mod:`find_sequence`), pass 2 with its rules 3-6 (:mod:`sharding`, :mod:`attention`,
:mod:`positions`, :mod:`loss`, :mod:`fallback`), pass 7 (:mod:`report`) on the Dynamo graph; then AOTAutograd builds the joint forward/backward graph (the collectives' autograd
formulas give the backward collectives) and partitions it:

* ``sac=True`` and :mod:`autosp_lm.compiler.sac` present: the joint graph first has each
  attention's backward rewritten to read the attention output in the sequence layout only
  (:mod:`attention_out`, so it is saved once instead of twice), gets the SP collectives tagged
  ``MUST_SAVE`` (:func:`tag_collectives`), then goes through the SAC
  partition function (aot_eager: ``partition_fn=sac_partition_fn(budget)``; Inductor: the
  ``joint_custom_post_pass`` hook runs ``apply_sac`` before Inductor's min-cut partitioner);
* otherwise the default min-cut partitioner (which never recomputes custom ops, so collectives
  are not repeated in the backward).
"""
from __future__ import annotations

import functools
import importlib
from typing import Optional

import torch
import torch.distributed as dist
import torch.fx as fx

from .attention_out import keep_attention_output_once
from .chunked_loss import fuse_loss_heads
from .common import AutoSPError
from .find_sequence import find_sequence
from .report import Report, merge
from .sharding import shard_graph

COLLECTIVE_OPS = ("all_to_all", "all_gather", "reduce_scatter", "all_reduce_sum", "all_reduce_loss")


def load_sac():
    """The SAC module (issue 6) or None while it has not landed."""
    try:
        return importlib.import_module("autosp_lm.compiler.sac")
    except ImportError:
        return None


def tag_collectives(joint_gm: fx.GraphModule) -> int:
    """Tag every ``autosp_lm::`` collective of the joint graph ``MUST_SAVE`` (never recomputed)."""
    from torch.utils.checkpoint import CheckpointPolicy
    count = 0
    for node in joint_gm.graph.nodes:
        t = node.target
        if node.op == "call_function" and isinstance(t, torch._ops.OpOverload) and \
                t.namespace == "autosp_lm" and t._opname in COLLECTIVE_OPS:
            node.meta["recompute"] = CheckpointPolicy.MUST_SAVE
            count += 1
    return count


def _group_info(group):
    if not (dist.is_available() and dist.is_initialized()):
        return 1, 0, ""
    from autosp_lm.parallel.collectives import group_name
    return dist.get_world_size(group), dist.get_rank(group), group_name(group)


class AutoSPBackend:
    def __init__(self, group=None, *, sac: bool = True, backend: str = "inductor",
                 sac_budget: Optional[float] = None, verbose: bool = True,
                 attention_output_once: bool = True, chunked_loss: bool = True):
        if backend not in ("inductor", "aot_eager"):
            raise ValueError(f"AutoSP backend must be 'inductor' or 'aot_eager', got {backend!r}")
        self.group, self.sac, self.backend = group, sac, backend
        self.sac_budget, self.verbose = sac_budget, verbose
        self.attention_output_once = attention_output_once
        self.chunked_loss = chunked_loss
        self.report: Optional[Report] = None
        self.sac_stats: list = []
        self.outputs_kept_once = 0
        self.__name__ = "autosp"

    def __call__(self, gm: fx.GraphModule, example_inputs):
        world, rank, gname = _group_info(self.group)
        report = Report(world=world, rank=rank, backend=self.backend)
        sac = load_sac() if self.sac else None
        fused = fuse_loss_heads(gm) if sac is not None and self.chunked_loss else []
        info = find_sequence(gm, world=world, rank=rank, group=gname)
        report.sequence_inputs = dict(info.inputs)
        report.local_length = f"S/{world}"
        new_gm = shard_graph(gm, info, report)
        if not report.attention:
            raise AutoSPError(
                "AutoSP found no F.scaled_dot_product_attention in the model: sequence "
                "parallelism needs attention through SDPA (hand-written q@k^T attention or a model "
                "without attention is not supported)")
        report.notes += [f"loss head {f}" for f in fused]
        if not self.sac:
            report.sac = "off"
        elif sac is None:
            report.sac = "requested but unavailable (autosp_lm/compiler/sac.py has not landed)"
        else:
            report.sac = f"on (budget {self._budget(sac)})"
        self.report = merge(self.report, report)
        self.sac_stats = []
        self.outputs_kept_once = 0
        compiled = self._compile(new_gm, example_inputs, sac)
        if sac is not None and self.sac_stats:
            st = self.sac_stats[-1]
            saved, base = st.get("saved_bytes"), st.get("saved_bytes_no_recompute")
            report.sac += (f": {st.get('nodes_recomputed', '?')} forward nodes recomputed"
                           + (f", saved-for-backward {saved / 2**20:.2f} MiB of "
                              f"{base / 2**20:.2f} MiB without recompute (at the traced length)"
                              if isinstance(saved, (int, float)) and isinstance(base, (int, float))
                              else ""))
            if self.outputs_kept_once:
                report.sac += (f"; attention output saved once, in the sequence layout, for "
                               f"{self.outputs_kept_once} of {len(report.attention)} attentions "
                               f"(the backward gets rowsum(dO*O) by one [B, H, S/P, 1] "
                               f"all_to_all each)")
                report.collectives_bwd["all_to_all"] += self.outputs_kept_once
        if self.verbose and (not dist.is_initialized() or dist.get_rank() == 0):
            print(self.report.text(), flush=True)
        return compiled

    def _compile(self, gm, example_inputs, sac):
        from torch._dynamo.backends.common import aot_autograd
        from torch._functorch.partitioners import min_cut_rematerialization_partition
        if self.backend == "aot_eager":
            from torch._dynamo.backends.debugging import boxed_nop
            partition = min_cut_rematerialization_partition
            if sac is not None:
                inner = sac.sac_partition_fn(self._budget(sac), on_stats=self.sac_stats.append)

                def partition(joint_module, joint_inputs, **kw):
                    self._keep_output_once(joint_module)
                    tag_collectives(joint_module)
                    return inner(joint_module, joint_inputs, **kw)
            return aot_autograd(fw_compiler=boxed_nop, bw_compiler=boxed_nop,
                                partition_fn=partition,
                                keep_inference_input_mutations=True)(gm, example_inputs)
        from torch._inductor.compile_fx import compile_fx
        patches = {}
        if sac is not None:
            budget = self._budget(sac)

            def joint_pass(graph: fx.Graph):
                owner = graph.owning_module
                self._keep_output_once(owner)
                tag_collectives(owner)
                self.sac_stats.append(sac.apply_sac(owner, budget=budget))

            patches["joint_custom_post_pass"] = joint_pass
        return compile_fx(gm, example_inputs, config_patches=patches or None)

    def _keep_output_once(self, joint_gm) -> None:
        if self.attention_output_once:
            self.outputs_kept_once += keep_attention_output_once(joint_gm)

    def _budget(self, sac) -> float:
        if self.sac_budget is not None:
            return float(self.sac_budget)
        return float(getattr(sac, "DEFAULT_BUDGET", 0.5))
