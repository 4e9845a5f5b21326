"""One vocabulary of recipes (autosp_lm/strategies/recipes.py): ``pretrain.py --recipe NAME``
reads back as the recipe's strategy and options, flags given beside it win, and the planner's and
the benchmark's tables are the recipe table. Fast: flags only, no training."""
from __future__ import annotations

import pytest

from autosp_lm.config.arguments import ArgumentError, UsageError, build_parser, parse_args
from autosp_lm.config.build import build_run_config
from autosp_lm.strategies.recipes import ALST_MODELLED, RECIPES, planner_spec, recipe

MODELLED = {"ulysses+alst", "ring+alst", "ulysses+upipe"}
_AC = {"compile": True, "recompute_granularity": "full", "recompute_method": "uniform",
       "recompute_num_layers": 1, "chunked_loss": True}
#: the planner's table before the recipes: the programs it traced (its predictions must not move)
PLANNER_BEFORE = {
    "none": ("none", {"compile": True}), "ulysses": ("ulysses", {"compile": True}),
    "ring": ("ring", {"compile": True}), "autosp": ("autosp", {"sac": True}),
    "autosp-nosac": ("autosp", {"sac": False}),
    "autosp-offload": ("autosp", {"sac": True, "offload_activations": True}),
    "autosp-max": ("autosp", {"sac": True, "max_context": True}),
    "autosp-max-offload": ("autosp", {"sac": True, "max_context": True,
                                      "offload_activations": True}),
    "none+ac": ("none", dict(_AC)), "ulysses+ac": ("ulysses", dict(_AC)),
    "ring+ac": ("ring", dict(_AC)),
    "ulysses+alst": ("ulysses", dict(_AC, tiled_mlp=True, cpu_offloading=True)),
    "ring+alst": ("ring", dict(_AC, tiled_mlp=True, cpu_offloading=True)),
    "ulysses+upipe": ("ulysses", dict(_AC, tiled_mlp=True, cpu_offloading=True,
                                      attention_head_chunks=0)),
}


def run(argv, world):
    return build_run_config(parse_args(["--mock-data", *argv]), world)


@pytest.mark.parametrize("name", [*RECIPES, "autosp-u2", "ulysses-u2"])
def test_every_recipe_reads_back_as_its_options(name):
    r = recipe(name)
    world = 1 if r.strategy == "none" else 2
    got = run(["--recipe", name], world)
    assert got.strategy == r.strategy and got.recipe == name
    for key, value in r.options.items():
        assert getattr(got.strategy_options, key) == value, key
    assert got.parallel.sequence_parallel_size == world


def test_flags_given_beside_the_recipe_win():
    got = run(["--recipe", "ulysses+alst", "--compile", "--recompute-num-layers", "2"], 2)
    assert got.strategy_options.compile and got.strategy_options.recompute_num_layers == 2
    assert got.strategy_options.cpu_offloading and got.strategy_options.tiled_mlp
    assert run(["--recipe", "autosp-nosac", "--sac"], 2).sac
    assert not run(["--recipe", "autosp"], 2).strategy_options.max_context
    got = run(["--recipe", "ulysses", "--ulysses", "--sequence-parallel-size", "2"], 4)
    assert got.strategy == "ulysses" and got.parallel.data_parallel_size == 2


@pytest.mark.parametrize("argv,match", [
    (["--recipe", "ulysses+alst", "--ring"], r"--recipe ulysses\+alst runs --ulysses, and --ring "
                                            r"names another strategy"),
    (["--recipe", "none+ac", "--autosp"], "runs no sequence parallelism, and --autosp"),
])
def test_another_strategy_flag_is_an_error(argv, match):
    with pytest.raises(ArgumentError, match=match):
        parse_args(argv)


def test_unknown_recipe_and_the_list(capsys):
    with pytest.raises(UsageError, match=r"unknown recipe 'nope'; the recipes: none, ulysses"):
        parse_args(["--recipe", "nope"])
    with pytest.raises(SystemExit) as e:
        parse_args(["--recipe", "list"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert all(n in out for n in RECIPES) and "eager" in out
    assert "--recipe list" in " ".join(build_parser().format_help().split())


def test_the_planner_and_the_benchmark_read_the_recipe_table():
    from autosp_lm.bench import names
    from autosp_lm.planner import trace
    assert trace.STRATEGIES == PLANNER_BEFORE  # the same programs traced: the same predictions
    for n, spec in trace.STRATEGIES.items():
        assert spec == planner_spec(n)[:2]
    assert trace.HOST_OFFLOAD == MODELLED == set(trace.MODELLED)
    assert names.STRATEGIES == {n: (r.strategy, dict(r.options)) for n, r in RECIPES.items()}
    assert list(names.STRATEGIES)[:len(trace.STRATEGIES)] == list(trace.STRATEGIES)
    for n in MODELLED:  # the plain name: as users run it; -compiled: what the planner traces
        assert RECIPES[n].eager and not RECIPES[f"{n}-compiled"].eager
        assert names.STRATEGIES[f"{n}-compiled"] == trace.STRATEGIES[n]
    assert names.strategy_spec("autosp-u4") == ("autosp", {"sac": True, "ulysses_degree": 4})


def test_the_planner_refuses_eager_recipes_and_names_its_models():
    from autosp_lm.planner.trace import modelled_lines, parse_strategies
    for n in ("ulysses-eager", "ring-eager", "none-eager"):
        with pytest.raises(ValueError, match=rf"recipe '{n}' runs eagerly: the memory planner "
                                             rf"traces compiled graphs.*plan '{n[:-6]}'"):
            planner_spec(n)
        with pytest.raises(ValueError, match="runs eagerly"):
            parse_strategies(f"autosp,{n}")
    with pytest.raises(ValueError, match=r"'ulysses\+alst' traces the same program"):
        parse_strategies("ulysses+alst-compiled")
    with pytest.raises(ValueError, match="unknown recipe"):
        planner_spec("nope")
    for n in MODELLED:
        assert planner_spec(n)[2] == ALST_MODELLED and planner_spec(f"{n}-compiled")[2] is None
    assert planner_spec("autosp-max")[2] is None
    lines = modelled_lines(["autosp", "ulysses+alst", "ring+alst", "ulysses+alst"])
    assert lines == [f"modelled: ulysses+alst, ring+alst: {ALST_MODELLED}"]  # once, not per row


def test_the_plan_command_says_what_is_modelled():
    from autosp_lm.config.plan_command import pretrain_command
    c = pretrain_command("ulysses+alst", model="llama-tiny", seq=4096, world=2, sp=2)
    assert c["flags"][-4:] == ["--recipe", "ulysses+alst", "--sequence-parallel-size", "2"]
    assert c["note"] == f"modelled: {ALST_MODELLED}"
    assert pretrain_command("autosp-max", model="llama-tiny", seq=4096, world=2, sp=2)["note"] == ""
    with pytest.raises(ValueError, match="runs eagerly"):
        pretrain_command("ulysses-eager", model="llama-tiny", seq=4096, world=2, sp=2)
