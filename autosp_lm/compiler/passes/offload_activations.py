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
from .sac_graph import flat_outputs, tensor_bytes


def _fake(target, *args):
    from torch._guards import detect_fake_mode
    vals = [a.meta["val"] if isinstance(a, fx.Node) else a for a in args]
    mode = detect_fake_mode([v for v in vals if isinstance(v, torch.Tensor)])
    with mode:
        return target(*vals)


def offload_activations(fw: fx.GraphModule, bw: fx.GraphModule,
                        num_fwd_outputs: int) -> tuple[int, int]:
    out_node = next(n for n in reversed(fw.graph.nodes) if n.op == "output")
    outs = flat_outputs(fw.graph)
    placeholders = {n.name: n for n in bw.graph.nodes if n.op == "placeholder"}
    count = total = 0
    replace = {}
    for x in outs[num_fwd_outputs:]:
        if not isinstance(x, fx.Node) or not x.meta.get("autosp_offload") or x in replace:
            continue
        ph = placeholders.get(x.name)
        val = x.meta.get("val")
        if ph is None or not isinstance(val, torch.Tensor) or not ph.users:
            continue
        slot = offload_ops.new_slot()
        dev = str(val.device)
        with fw.graph.inserting_after(x):
            h = fw.graph.call_function(torch.ops.autosp_lm.offload.default, (x, slot))
        h.meta["val"] = _fake(torch.ops.autosp_lm.offload.default, x, slot)
        replace[x] = h
        order = {n: i for i, n in enumerate(bw.graph.nodes)}
        first = min(ph.users, key=order.get)
        with bw.graph.inserting_before(first):
            r = bw.graph.call_function(torch.ops.autosp_lm.reload.default, (ph, slot, dev))
        ph.replace_all_uses_with(r, delete_user_cb=lambda u: u is not r)
        ph.meta["val"] = h.meta["val"]
        r.meta["val"] = _fake(torch.ops.autosp_lm.reload.default, h, slot, dev)
        count += 1
        total += tensor_bytes(val)
    if not count:
        return 0, 0
    args = out_node.args[0]
    if not isinstance(args, (tuple, list)) or list(args) != outs:  # pragma: no cover
        raise AssertionError("AutoSP internal error: the partitioned forward returns a "
                             "nested structure; activation offload expects a flat tuple")
    out_node.args = (type(args)(list(args[:num_fwd_outputs])
                                + [replace.get(n, n) for n in args[num_fwd_outputs:]]),)
    for g in (fw, bw):
        g.graph.lint()
        g.recompile()
    return count, total
