"""Depth extrapolation of the memory planner (autosp_lm/planner/depth.py): a model of alike blocks
is traced cut to 2 and 3 blocks (one more while the two cuts peak at different nodes) and its
step extrapolated linearly to the full depth. Checked against a real trace: the extrapolation to
one block more must equal that cut's simulated peak and saved bytes exactly (``check=True``,
``--check-depth``, raises otherwise), at two lengths."""
from __future__ import annotations

import dataclasses

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from autosp_lm.planner.depth import DepthTracedStep, trace_by_depth, why_not_alike
from autosp_lm.planner.plan import Layout, predict
from autosp_lm.planner.trace import model_config
from autosp_lm.models import build_model

LENGTHS = (512, 1024)


def _check(name: str, bf16: bool = False) -> None:
    # 5 blocks: extrapolated (more than 2 + 2); the check traces 2, 3 and 4 blocks
    cfg = model_config("llama-tiny", {"num_layers": 5})
    traced = trace_by_depth(name, cfg, 2, LENGTHS[0], bf16=bf16, check=True)
    assert isinstance(traced, DepthTracedStep)
    assert traced.depth["extrapolated_from"] == [2, 3] and traced.depth["blocks"] == 5
    for L in LENGTHS:
        r = predict(traced, L, Layout(world=2, bf16=bf16))  # raises if the next cut's check fails
        assert r["peak_bytes"] > r["static_bytes"]
    assert len(traced.cuts) >= 3  # the checks traced the next cut model
    rows = traced.depth["checks"]
    assert [row["seq"] for row in rows] == list(LENGTHS)
    for row in rows:  # extrapolated == traced, exactly
        assert row["peak"][0] == row["peak"][1] and row["saved"][0] == row["saved"][1], row
        assert row["saved"][1] > 0 and row["blocks"] in (4, 5)
    # the full-depth terms: 5 blocks' parameters, not the cut models'
    assert len(traced.block_bytes) == 5
    assert sum(traced.param_bytes) == 4 * cfg.num_parameters()
    torch._dynamo.reset()


# -m slow: three traces each (~15-25 s a trace of the hand-written strategies; AutoSP's, the
# cheapest, ~45 CPU s cold). The default suite keeps the refusal of blocks that are not alike
# (below) and the planner's predictions against measured steps (tests/tools/test_plan_memory.py)
@pytest.mark.slow
@pytest.mark.parametrize("name,bf16", [("autosp", False), ("none", False), ("ulysses", False),
                                       ("autosp", True), ("ring", False)])
def test_depth_extrapolation_exact(name, bf16):
    _check(name, bf16)


def test_not_alike_blocks_refused():
    """Blocks that differ (here one block of another width) or a per-layer config field: no
    extrapolation, with the reason (the planner then traces every block)."""
    cfg = model_config("llama-tiny", {"num_layers": 3})
    other = dataclasses.replace(cfg, ffn_hidden_size=2 * cfg.ffn_hidden_size)
    with FakeTensorMode(allow_non_fake_inputs=True):
        model = build_model(cfg)
        assert why_not_alike(cfg, model) is None
        odd = build_model(other)
    from autosp_lm.parallel.fsdp import block_list
    block_list(model)[1] = block_list(odd)[1]
    assert "block 1 differs" in why_not_alike(cfg, model)

    @dataclasses.dataclass
    class PerLayer:
        num_layers: int = 3
        layer_types: tuple = ("full", "sliding", "full")

    assert "layer_types" in why_not_alike(PerLayer(), model)


def test_small_models_traced_whole(monkeypatch):
    """A model of at most 4 blocks is traced whole (the cut models and the check would be as
    big); the plan says so."""
    import autosp_lm.planner.depth as md
    calls = []
    monkeypatch.setattr(md, "trace_full", lambda *a, **k: calls.append(a[1].num_layers) or
                        md.TracedStep("none", 1, 512, 512, [], [], []))
    t = md.trace_by_depth("none", model_config("llama-tiny", {"num_layers": 4}), 2, 512)
    assert calls == [4] and t.depth["extrapolated"] is False and "4 blocks" in t.depth["reason"]
