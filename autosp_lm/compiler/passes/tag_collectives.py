"""Joint-graph pass — tag the sequence-parallel collectives: never recompute them.

Expects
    An AOTAutograd joint forward/backward graph (ATen level) that may contain ``autosp_lm::``
    collectives inserted by the sharding pass and their backward counterparts.

Rewrites
    Nothing structural: every ``autosp_lm::`` collective gets
    ``node.meta["recompute"] = CheckpointPolicy.MUST_SAVE``.

Holds afterwards
    The partitioner (and the SAC pass, which keeps existing tags of collectives) never places a
    collective in the backward as a recomputation: each one runs exactly once per step. Returns
    the number of nodes tagged.
"""
from __future__ import annotations

import torch.fx as fx
from torch.utils.checkpoint import CheckpointPolicy

from ..graph import is_collective_op, namespace


def tag_collectives(joint_gm: fx.GraphModule) -> int:
    count = 0
    for node in joint_gm.graph.nodes:
        if node.op == "call_function" and namespace(node.target) == "autosp_lm" \
                and is_collective_op(node.target):
            node.meta["recompute"] = CheckpointPolicy.MUST_SAVE
            count += 1
    return count
