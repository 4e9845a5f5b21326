"""Rules: ops that read only metadata of a sharded tensor (sizes) or borrow its dtype/device."""
from __future__ import annotations

import torch

from ..graph import REP, example, torch_ops
from .registry import rule


@rule(*torch_ops("size", "dim", "numel", "nelement", "ndimension"))
def size_query(rw, n):
    """Sizes of sharded tensors are answered with their global values."""
    ev = example(n)

    def val(v):
        if isinstance(v, torch.SymInt):
            return rw.sym(rw.info.canon(v))
        return int(v) if isinstance(v, int) else v

    if isinstance(ev, (tuple, list, torch.Size)):
        out = tuple(val(v) for v in ev)
    else:
        out = val(ev)
    rw.bind(n, out)
    return REP


@rule(*torch_ops("new_zeros", "new_ones", "new_empty", "new_full", "new_tensor"))
def new_factory(rw, n):
    """The tensor only lends dtype/device; the sizes are explicit (global): a full value."""
    rw.emit_local(n)
    return REP
