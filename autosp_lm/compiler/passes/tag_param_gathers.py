"""Joint-graph pass — tag graph FSDP's parameter all-gathers: reshard after forward.

Expects
    An AOTAutograd joint forward/backward graph (ATen level) of a model sharded by graph FSDP
    (``autosp_lm.parallel.fsdp_graph``): each parameter read is a
    ``_c10d_functional.all_gather_into_tensor`` (+ ``wait_tensor``) of the parameter's local
    shard, each gradient a ``reduce_scatter_tensor`` in the backward. Gathers are recognised by
    op and provenance (:func:`~autosp_lm.compiler.graph.param_gathers`), nothing else.

Rewrites
    Nothing structural: every node of each gather chain (cast, padding, the collective, its
    wait, the views of the gathered value) gets ``node.meta["recompute"] =
    CheckpointPolicy.MUST_RECOMPUTE`` (``reshard_after_forward=True``, default) or ``MUST_SAVE``
    (``False``: keep the gathered parameters from the forward to the backward).

Holds afterwards
    With MUST_RECOMPUTE the partitioner saves no gathered parameter for the backward: the
    forward frees each one after its last forward use and the backward gathers again the ones it
    needs right before their use, i.e. FSDP's reshard after forward, at the price FSDP pays too
    (each parameter is all-gathered twice per step, its gradient reduce-scattered once). The SAC
    pass leaves these nodes alone (:mod:`.sac_graph` excludes them from its units). Without this
    pass the default partitioner never recomputes a collective and would keep every gathered
    parameter alive through the step. Returns the counts and bytes for the report.
"""
from __future__ import annotations

import torch.fx as fx
from torch.utils.checkpoint import CheckpointPolicy

from ..graph import example, is_param_reduce_scatter, param_gathers
from .sac_cost import tensor_bytes


def tag_param_gathers(joint_gm: fx.GraphModule, reshard_after_forward: bool = True) -> dict:
    tag = CheckpointPolicy.MUST_RECOMPUTE if reshard_after_forward else CheckpointPolicy.MUST_SAVE
    gathers = param_gathers(joint_gm.graph)
    for chain in gathers.values():
        for n in chain:
            n.meta["recompute"] = tag
    scatters = [n for n in joint_gm.graph.nodes if is_param_reduce_scatter(n)]
    return dict(gathers=len(gathers),
                gather_bytes=sum(tensor_bytes(example(g)) for g in gathers),
                reduce_scatters=len(scatters),
                reduce_scatter_bytes=sum(tensor_bytes(example(n.args[0])) for n in scatters),
                reshard_after_forward=reshard_after_forward)
