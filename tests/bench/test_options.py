"""The benchmark's command line turned into cells (autosp_lm/bench/names.py, options.py)."""
import argparse

import pytest

from autosp_lm.bench import names, options, plan
from autosp_lm.bench.options import BenchConfigError
from autosp_lm.config.cli import ArgumentError


def test_strategy_names_and_2d_plans():
    assert names.strategy_spec("ulysses-eager") == ("ulysses", {"compile": False})
    reg, opts = names.strategy_spec("autosp-u2")
    assert reg == "autosp" and opts == dict(names.STRATEGIES["autosp"][1], ulysses_degree=2)
    assert names.strategy_spec("ulysses-u4")[1]["ulysses_degree"] == 4
    # the planner's entries are there (one recipe table), and ALST as users run it (eager,
    # host offload) beside the compiled program the planner traces
    for planned in plan.STRATEGIES:
        assert planned in names.STRATEGIES
    for n in plan.HOST_OFFLOAD:
        assert names.STRATEGIES[n][1]["cpu_offloading"] is True
        assert names.STRATEGIES[n][1]["compile"] is False
        assert names.STRATEGIES[f"{n}-compiled"] == plan.STRATEGIES[n]
    for bad in ("autosp-u", "autosp-ux", "ring-u2", "nope"):
        assert not names.known(bad)
        with pytest.raises(KeyError):
            names.strategy_spec(bad)


def test_strategies_lengths_and_fractions():
    assert options.parse_strategies(" none, autosp-u2 ,,ring") == ["none", "autosp-u2", "ring"]
    with pytest.raises(BenchConfigError, match=r"unknown strategy \['nope'\]; choose from none"):
        options.parse_strategies("none,nope")
    assert options.parse_lengths("4096,1024,2048") == [1024, 2048, 4096]
    with pytest.raises(BenchConfigError, match="--seq-lengths '1k' must be comma-separated"):
        options.parse_lengths("1k")
    assert options.parse_fractions(options.CURVE_FRACTIONS) == [0.5, 0.3, 0.2, 0.1, 0.05, 0.0]
    assert options.parse_fractions("") == [] and options.parse_fractions("0.1, ") == [0.1]


def test_model_overrides_keep_their_types():
    got = options.parse_overrides("hidden_size=512, rope_theta=5e5,norm=rms,,")
    assert got == {"hidden_size": 512, "rope_theta": 500000.0, "norm": "rms"}
    assert type(got["hidden_size"]) is int and type(got["rope_theta"]) is float
    assert options.parse_overrides("") == {} == options.parse_overrides(None)
    with pytest.raises(ArgumentError, match="--model-overrides 'num_layers' must be key=value"):
        options.parse_overrides("hidden_size=8,num_layers")


def test_steps_checks():
    options.check_steps(0, needs_times=False)
    options.check_steps(3, needs_times=True)
    with pytest.raises(BenchConfigError, match="--steps -1: give a number"):
        options.check_steps(-1, needs_times=False)
    with pytest.raises(BenchConfigError, match="--steps 0 measures memory only"):
        options.check_steps(0, needs_times=True)


def _args(**kw):
    base = dict(model="gpt-tiny", nproc=4, steps=2, bf16=True, fp32_residual_connection=False,
                seed=7, micro_batch_size=1, simulate_world_size=None, threads=0,
                compile_backend="aot_eager", packed=False, warm_compile_cache=False,
                peak_repeats=-1)
    return argparse.Namespace(**dict(base, **kw))


def test_cells_from_flags(monkeypatch):
    monkeypatch.setattr(options.os, "cpu_count", lambda: 16)
    base = options.base_cell(_args(), "cpu", {"num_layers": 2})
    assert base["threads"] == 4  # cores / ranks
    assert base["peak_repeats"] == 0 and base["overrides"] == {"num_layers": 2}
    assert base["fp32_residual"] is False and base["device"] == "cpu"
    assert options.base_cell(_args(threads=3), "cpu", {})["threads"] == 3
    cells = options.table_cells(base, ["none", "ulysses"], [64, 128], interleave=False)
    assert [(c["strategy"], c["seq_length"]) for c in cells] == [
        ("none", 64), ("ulysses", 64), ("none", 128), ("ulysses", 128)]  # length by length
    assert all(c["steps"] == 2 and c["model"] == "gpt-tiny" for c in cells)
    # interleaved: the cells measure memory only, the timing jobs take the steps
    assert {c["steps"] for c in options.table_cells(base, ["none"], [64], True)} == {0}
    assert base["steps"] == 2  # not changed in place


def test_environment_records():
    args = _args(warm_compile_cache=True)
    env = options.environment(args, "cpu")
    assert list(env) == ["torch", "device", "cpu_count", "machine", "python", "model", "nproc",
                         "steps", "simulate_world_size", "warm_compile_cache", "flags", "date"]
    assert env["device"] == "cpu" and env["flags"] == vars(args) and env["warm_compile_cache"]
    assert list(options.environment(args, "cpu", curve=True)) == [
        "torch", "device", "cpu_count", "model", "nproc", "steps", "flags", "date"]
