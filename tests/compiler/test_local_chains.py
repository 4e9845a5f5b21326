"""A value the graph computes whole on every rank from a sequence input by elementwise ops (the
RoPE tables from ``position_ids``) is computed on the rank's own rows: no whole-sequence copy of
it exists in the step (one process, a simulated 2-rank group, fake tensors)."""
from __future__ import annotations

import pytest
import torch

from autosp_lm.planner.plan import trace_step
from autosp_lm.planner.trace import model_config


def _table_nodes(traced):
    """(fw + bw) nodes computing cos/sin, with their shapes at the traced length."""
    out = []
    for p in traced.partitions:
        for g in (p.fw, p.bw):
            for n in g.graph.nodes:
                if n.op == "call_function" and getattr(n.target, "__name__", "").split(".")[0] \
                        in ("cos", "sin"):
                    out.append(tuple(int(s.node.hint) if isinstance(s, torch.SymInt) else int(s)
                                     for s in n.meta["val"].shape))
    return out


# the max-context mode (the same pass on its layer-stage graphs): -m slow
@pytest.mark.parametrize("strategy", ["autosp", pytest.param("autosp-max", marks=pytest.mark.slow)])
def test_rotary_tables_are_computed_on_the_local_rows(strategy):
    seq, sp = 1024, 2
    cfg = model_config("llama-tiny", {"num_layers": 1}, seq)
    traced = trace_step(strategy, cfg, sp, seq, depth=False)
    shapes = _table_nodes(traced)
    assert shapes, "the model's cos/sin were not found in the step"
    # [1, 1, S/P, d/2] on this rank, never [1, 1, S, d/2]
    assert all(s[2] == seq // sp for s in shapes), shapes
