"""Partition pass — keep the saved activations the SAC policy chose in host memory.

Expects
    The forward and backward graphs from the min-cut partitioner (the joint graph having been
    tagged by the SAC pass, :mod:`.sac`, whose offload plan marks saved tensors with
    ``node.meta["autosp_offload"] = True``; the partitioner copies node meta): the forward
    returns its ``num_fwd_outputs`` outputs followed by the values saved for the backward, and
    the backward's placeholders of the same names receive them. Runs in the partition function
    (``aot_eager``) or in Inductor's ``custom_partitioner_fn`` (torch 2.11-2.13), right after
    the min-cut partition.

Rewrites
    For each marked saved value ``x``: in the forward, ``h = autosp_lm::offload(x, slot)`` right
    after ``x`` is computed, and the forward returns ``h`` (its host copy) instead of ``x``; in the
    backward, ``autosp_lm::reload(h, slot, device)`` right before the first reader of the
    placeholder, whose readers then read the reloaded tensor. The ops (:mod:`..offload`) copy
    asynchronously on a side stream with prefetch on CUDA and plainly on CPU; Inductor runs
    custom ops as they are.

Holds afterwards
    The backward receives marked values as host tensors only: each one's device memory is freed
    after its last forward use and allocated again when the backward reloads it. Values are
    bitwise the same. Returns the number of tensors offloaded and their bytes.
"""
from __future__ import annotations

import torch
import torch.fx as fx

from .. import offload as offload_ops
from ..graph import is_alias_op
from .sac_cost import tensor_bytes
from .sac_graph import flat_outputs


def _fake(target, *args):
    from torch._guards import detect_fake_mode
    vals = [a.meta["val"] if isinstance(a, fx.Node) else a for a in args]
    mode = detect_fake_mode([v for v in vals if isinstance(v, torch.Tensor)])
    with mode:
        return target(*vals)


def _root_chain(o: fx.Node):
    """The value whose storage ``o`` views, and the view ops from it to ``o``."""
    chain = []
    while o.op == "call_function" and is_alias_op(o) and o.args and isinstance(o.args[0], fx.Node):
        chain.append(o)
        o = o.args[0]
    return o, list(reversed(chain))


def offload_activations(fw: fx.GraphModule, bw: fx.GraphModule,
                        num_fwd_outputs: int) -> tuple[int, int]:
    out_node = next(n for n in reversed(fw.graph.nodes) if n.op == "output")
    outs = flat_outputs(fw.graph)
    saved = list(outs[num_fwd_outputs:])
    placeholders = {n.name: n for n in bw.graph.nodes if n.op == "placeholder"}
    groups: dict = {}  # marked value -> [(index in saved, saved node, view chain)]
    for i, o in enumerate(saved):
        if not isinstance(o, fx.Node) or o.name not in placeholders:
            continue
        r, chain = _root_chain(o)
        if r.meta.get("autosp_offload") and isinstance(r.meta.get("val"), torch.Tensor) and \
                not any(isinstance(a, fx.Node) for v in chain for a in v.args[1:]):
            groups.setdefault(r, []).append((i, o, chain))
    count = total = 0
    for r, items in groups.items():
        order = {n: i for i, n in enumerate(bw.graph.nodes)}
        used = [placeholders[o.name] for _, o, _ in items if placeholders[o.name].users]
        if not used:
            continue
        slot = offload_ops.new_slot()
        dev = str(r.meta["val"].device)
        with fw.graph.inserting_after(r):
            h = fw.graph.call_function(torch.ops.autosp_lm.offload.default, (r, slot))
        h.meta["val"] = _fake(torch.ops.autosp_lm.offload.default, r, slot)
        for i, _, _ in items:  # every saved alias of r is handed over as the host copy
            saved[i] = h
        carrier = placeholders[items[0][1].name]
        first = min((u for ph in used for u in ph.users), key=order.get)
        with bw.graph.inserting_before(first):
            back = bw.graph.call_function(torch.ops.autosp_lm.reload.default, (carrier, slot, dev))
        back.meta["val"] = _fake(torch.ops.autosp_lm.reload.default, h, slot, dev)
        for _, o, chain in items:
            ph = placeholders[o.name]
            cur = back
            readers = [u for u in ph.users if u is not back]
            if readers and chain:
                with bw.graph.inserting_before(min(readers, key=order.get)):
                    for v in chain:  # the saved view, rebuilt on the reloaded tensor
                        nv = bw.graph.call_function(v.target, (cur, *v.args[1:]), dict(v.kwargs))
                        nv.meta["val"] = v.meta.get("val")
                        cur = nv
            ph.replace_all_uses_with(cur, delete_user_cb=lambda u: u is not back)
            ph.meta["val"] = h.meta["val"]
        count += 1
        total += tensor_bytes(r.meta["val"])
    if not count:
        return 0, 0
    args = out_node.args[0]
    if not isinstance(args, (tuple, list)) or list(args) != outs:  # pragma: no cover
        raise AssertionError("AutoSP internal error: the partitioned forward returns a "
                             "nested structure; activation offload expects a flat tuple")
    out_node.args = (type(args)(list(args[:num_fwd_outputs]) + saved),)
    for g in (fw, bw):
        g.graph.eliminate_dead_code() if g is fw else None
        g.graph.lint()
        g.recompile()
    return count, total


def _is_rng_state(n: fx.Node) -> bool:
    """``n`` is the RNG state an activation checkpoint saves (output 0 of
    ``higher_order.run_and_save_rng_state``): a few bytes the backward's replay needs."""
    import operator
    return (n.op == "call_function" and n.target is operator.getitem and bool(n.args)
            and isinstance(n.args[0], fx.Node)
            and getattr(n.args[0].target, "__name__", "") == "run_and_save_rng_state"
            and n.args[1] == 0)


def checkpoint_inputs(fw: fx.GraphModule, num_fwd_outputs: int) -> set:
    """Positions, among the values ``fw`` saves for the backward, of the inputs of activation
    checkpoints: computed by the forward outside a checkpointed region (or at its boundary,
    saved) and read in the forward by a node the region recomputes
    (``node.meta["recompute"]`` MUST/PREFER_RECOMPUTE, through views). These are what eager
    ``torch.utils.checkpoint`` keeps, e.g. each transformer block's input under full
    recomputation. Graph inputs (parameters, the batch) and the regions' RNG states are not."""
    from torch.utils.checkpoint import CheckpointPolicy
    redo = (CheckpointPolicy.MUST_RECOMPUTE, CheckpointPolicy.PREFER_RECOMPUTE)

    def read_in_region(n: fx.Node) -> bool:
        for u in n.users:
            if u.meta.get("recompute") in redo:
                return True
            if is_alias_op(u) and u.args and u.args[0] is n and read_in_region(u):
                return True
        return False

    out = set()
    for i, o in enumerate(flat_outputs(fw.graph)[num_fwd_outputs:]):
        if isinstance(o, fx.Node):
            r, _ = _root_chain(o)
            if r.op == "call_function" and r.meta.get("recompute") not in redo \
                    and isinstance(r.meta.get("val"), torch.Tensor) and not _is_rng_state(r) \
                    and read_in_region(r):
                out.add(i)
    return out


def offload_checkpoint_inputs(fw: fx.GraphModule, bw: fx.GraphModule,
                              num_fwd_outputs: int) -> tuple[int, int]:
    """The compiled form of ``--cpu-offloading`` (the ALST recipe's offload of what full
    recomputation keeps): the checkpoints' saved inputs (:func:`checkpoint_inputs`) go to host
    memory as they are made and come back before their first reader in the backward, through
    :func:`offload_activations` (the offload ops: a side stream with prefetch on CUDA, host
    buffers outside torch's allocator on CPU). Returns (tensors, bytes) offloaded."""
    saved = flat_outputs(fw.graph)[num_fwd_outputs:]
    for i in checkpoint_inputs(fw, num_fwd_outputs):
        _root_chain(saved[i])[0].meta["autosp_offload"] = True
    return offload_activations(fw, bw, num_fwd_outputs)
