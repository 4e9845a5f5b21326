"""The memory planner in Megatron-style bf16 (bf16 compute parameters, fp32 main parameters):
the traced model computes with bf16 parameters, so the saved activations are bf16, and the
unsharded layout holds the bf16 copies beside the fp32 main parameters. Prediction against the
measured CPU peak of the same step (``LivePeak``: exact), llama-tiny cut to one block."""
from __future__ import annotations

import pytest

from autosp_lm.planner.check import measure_step
from autosp_lm.planner.plan import Layout, predict, trace_step
from autosp_lm.planner.trace import model_config

SEQ = 2048


# +ac (its traces ~2x AutoSP's): -m slow; AutoSP in the default suite
@pytest.mark.parametrize("name", [pytest.param("ulysses+ac", marks=pytest.mark.slow), "autosp"])
def test_bf16_prediction_equals_measured_peak(name):
    cfg = model_config("llama-tiny", {"num_layers": 1})
    layout = Layout(world=2, bf16=True, device="cpu")
    traced = trace_step(name, cfg, 2, SEQ, bf16=True, layout=layout, depth=False)
    pred = predict(traced, SEQ, layout)
    meas = measure_step(name, cfg, 2, SEQ, world=2, bf16=True)
    # static: fp32 main parameters, their bf16 compute copies, AdamW's moments, the batch
    assert abs(pred["static_bytes"] / meas["measured_start_bytes"] - 1) <= 0.02, (pred, meas)
    step = pred["peak_bytes"] - pred["static_bytes"]
    assert abs(step / meas["measured_step_peak_bytes"] - 1) <= 0.005, (pred, meas)
    fp32 = predict(trace_step(name, cfg, 2, SEQ, depth=False), SEQ, Layout(world=2, device="cpu"))
    # what the step keeps is smaller in bf16 (the residual stream and the saved activations)
    assert pred["saved_activations_bytes"] < fp32["saved_activations_bytes"]
