"""SAC stages for the max-context mode: whole layers, bounded where the dataflow says a layer ends.

Expects
    The facts of one AOTAutograd joint graph (:class:`.sac_graph.JointGraphFacts`: its forward
    units in program order, their members, readers, kinds and bytes) with the partitioner's
    output list (forward outputs, then one gradient or None per primal).

Rewrites
    Nothing: it only reads the graph.

Holds afterwards
    :func:`layer_boundaries` names one forward unit per attention (the residual-stream value
    entering its layer) and one after the last attention; no module names, shapes or op names
    are consulted, only which values depend on trainable and non-trainable inputs and which are
    read after which. :class:`.sac_graph.JointGraphFacts` numbers the stages by them.
"""
from __future__ import annotations

import torch
import torch.fx as fx

from ..graph import example

#: Stage layouts: ``attention`` (default) bounds stages at attention kernels, which are never
#: recomputed; ``layers`` (the max-context mode) bounds them at one residual-stream value before
#: each attention (:func:`layer_boundaries`) and lets attention be recomputed like any compute
#: op, so that a stage is a whole layer and only its input need stay saved.
STAGES = ("attention", "layers")


def layer_boundaries(facts, graph: fx.Graph, outs: list, num_fwd_outputs: int) -> list:
    """One forward unit before each attention whose value alone carries everything the rest
    of the model reads from what came before: the residual stream entering a layer, found
    from the dataflow, not from module names.

    The *activations* are the units that depend both on a trainable input (a primal the
    backward returns a gradient for: parameters, or their shards under graph FSDP) and on an
    input that is not trainable (token ids, positions): the hidden states, not weight casts,
    rotary tables or masks. In program order, an activation is a *cut* when no activation
    before it is read after it: the residual value ``x_l`` entering layer ``l`` (nothing of
    layer ``l-1`` is read past it) and ``h_l = x_l + attn(x_l)``; nothing inside the
    attention or MLP branches, which the residual edge spans. The boundary before an
    attention is the last cut between it and the previous attention (none: the two share a
    stage); after the last attention, the first cut as wide as those (the residual after it),
    so that the last layer's attention does not run again before the loss head's backward."""
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    grads = outs[num_fwd_outputs:]
    primals = [n for n in placeholders if "tangents" not in str(n.target)]
    trainable = {p for p, gr in zip(primals, grads) if isinstance(gr, fx.Node)}
    other = {p for p in primals if p not in trainable and isinstance(example(p), torch.Tensor)}
    dep_t, dep_o = set(trainable), set(other)
    for n in graph.nodes:
        if n in facts.fwd and n.op == "call_function":
            ins = n.all_input_nodes
            if any(a in dep_t for a in ins):
                dep_t.add(n)
            if any(a in dep_o for a in ins):
                dep_o.add(n)
    acts = [u for u in facts.units if u in dep_t and u in dep_o]
    act_set = set(acts)
    last_read = {}
    for u in acts:
        readers = [r for m in facts.members[u] for r in facts.readers[m] if r in act_set]
        last_read[u] = max((facts.order[r] for r in readers), default=facts.order[u])
    cuts, reach = [], -1
    for u in acts:  # facts.units is in program order
        if reach <= facts.order[u] and last_read[u] > facts.order[u]:
            cuts.append(u)
        reach = max(reach, last_read[u])
    attn = [u for u in facts.units if facts.kind[u] == "attention"]
    bounds, prev, ci = [], -1, 0
    for a in attn:
        best = None
        while ci < len(cuts) and facts.order[cuts[ci]] < facts.order[a]:
            if facts.order[cuts[ci]] > prev:
                best = cuts[ci]
            ci += 1
        if best is not None:
            bounds.append(best)
        prev = facts.order[a]
    # after the last attention: the first cut as wide as a layer input (the residual after
    # the last attention), so that the last layer's attention is not run again before the
    # loss head's backward (the tail stage: the last MLP, the final norm, the loss head)
    width = max((facts.bytes.get(b, 0) for b in bounds), default=0)
    tail = [c for c in cuts if facts.order[c] > prev
            and width <= 2 * facts.bytes.get(c, 0) <= 4 * width]
    if attn and tail:
        bounds.append(tail[0])
    return bounds
