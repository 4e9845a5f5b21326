"""What the compiler does to the min-cut partitioner's output before it runs.

Torch's partitioner is used as it is; this module holds the fix-ups its output needs in cases our
passes create and torch does not handle yet (each one a no-op when nothing is out of place).
"""
from __future__ import annotations

import torch
import torch.fx as fx


def opaque_after_rng_states(fw: fx.GraphModule, bw: fx.GraphModule, num_fwd_outputs: int) -> None:
    """Put saved opaque objects (graph FSDP's DeviceMesh, a DTensor's metadata on torch 2.13)
    back behind every saved tensor, where AOTAutograd's runtime looks for them.

    When the partition recomputes an op tagged ``nondeterministic_seeded`` (an SDPA kernel: the
    max-context mode recomputes attention), torch's ``functionalize_rng_ops`` appends each op's
    saved RNG state to the forward's outputs just before the saved sizes, i.e. *after* the
    opaque objects, and the backward's matching inputs just before the tangents; the runtime
    counts the RNG states among the saved tensors and the opaque objects as the block right
    before the sizes, so the first RNG states are read as the mesh. Moving the opaque outputs
    (and the backward's inputs for them) behind the RNG states restores the layout the runtime
    expects: tensors, opaque objects, sizes. A no-op when nothing is out of place."""
    from torch._functorch._aot_autograd.graph_compile import is_opaque_node

    out = next(n for n in reversed(fw.graph.nodes) if n.op == "output")
    outs = list(out.args[0])
    saved = outs[num_fwd_outputs:]

    def is_sym(n):
        v = n.meta.get("val") if isinstance(n, fx.Node) else n
        return isinstance(v, (int, torch.SymInt, torch.SymFloat, torch.SymBool))

    opaque = [i for i, n in enumerate(saved) if is_opaque_node(n)]
    first_sym = next((i for i, n in enumerate(saved) if is_sym(n)), len(saved))
    if not opaque or all(i >= first_sym - len(opaque) for i in opaque):
        return
    moved = [saved[i] for i in opaque]
    rest = [n for i, n in enumerate(saved) if i not in set(opaque)]
    k = next((i for i, n in enumerate(rest) if is_sym(n)), len(rest))
    out.args = (tuple(outs[:num_fwd_outputs] + rest[:k] + moved + rest[k:]),) + tuple(out.args[1:])
    fw.recompile()
    phs = [n for n in bw.graph.nodes if n.op == "placeholder"]
    opaque_phs = [n for n in phs if is_opaque_node(n)]
    tangent = next((n for n in phs if "tangents" in str(n.target)), None)
    if tangent is None:  # no tangent: behind the last placeholder
        last = phs[-1]
        for n in opaque_phs:
            if n is not last:
                last.append(n)
                last = n
    else:
        for n in opaque_phs:
            tangent.prepend(n)
    bw.recompile()
