"""The memory planner on AutoSP's 2-D plan (Ulysses within a node x a ring across nodes): the
bodies of its collectives and ring attention run again at every predicted length in the groups of
the trace, so their inner peaks are counted, not listed as missing."""
from __future__ import annotations

import torch

from autosp_lm.planner import plan as M
from autosp_lm.planner import trace


def test_2d_plan_custom_ops_counted_at_other_lengths(monkeypatch):
    monkeypatch.setattr(trace, "GPUS_PER_NODE", 2)  # SP 4 over two 2-GPU nodes: U = 2, R = 2
    cfg = trace.model_config("llama-tiny", {"num_layers": 1}, seq=4096)
    traced = M.trace_step("autosp", cfg, 4, 1024)
    assert (traced.plan["ulysses_degree"], traced.plan["ring_degree"]) == (2, 2)
    peaks = []
    for seq in (1024, 2048, 1024):
        pred = M.predict(traced, seq, M.Layout(world=4, device="cpu"))
        assert pred["custom_ops_not_counted"] == {}, pred["custom_ops_not_counted"]
        peaks.append(pred["step_live_peak_bytes"])
    assert peaks[0] == peaks[2] < peaks[1]  # the same answer again (cached), larger when longer
    ring = {k[0]: v[0] for k, v in traced.inner_cache.items()
            if k[0] is torch.ops.autosp_lm.ring_attention.default}
    assert ring and min(ring.values()) > 0  # the ring's own blocks were counted
    assert not torch.distributed.is_initialized()  # the planner's fake world is gone
