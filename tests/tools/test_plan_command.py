"""The pretrain.py command of a plan (autosp_lm/config/plan_command.py): for every planner strategy
the printed flags (``--recipe NAME`` and the layout), read by the trainer's own parser and checks,
give back the recipe's strategy, options and model, and a flag that drifts from its option is
caught."""
from __future__ import annotations

import os
import shlex
import sys

import pytest

from autosp_lm.config import plan_command as command
from autosp_lm.config import recipe_flags
from autosp_lm.config.arguments import ArgumentError, parse_args
from autosp_lm.config.build import build_run_config
from autosp_lm.planner.trace import MODELLED, STRATEGIES
from autosp_lm.strategies.recipes import recipe

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.mark.parametrize("fsdp2", [False, True])
@pytest.mark.parametrize("name", [*STRATEGIES, "ulysses+alst-compiled"])
def test_every_plan_has_a_command_the_trainer_reads_back(name, fsdp2):
    c = command.pretrain_command(name, model="llama-3.1-8b", seq=4_930_560, world=32, sp=32,
                                 bf16=True, fsdp2=fsdp2)
    argv = shlex.split(c["command"])
    assert argv[:6] == ["torchrun", "--nnodes", "4", "--nproc-per-node", "8", "pretrain.py"]
    assert argv[6:] == c["flags"]
    run = build_run_config(parse_args(c["flags"]), 32)
    r = recipe(name)
    assert run.strategy == r.strategy and run.training.seq_length == 4_930_560
    assert run.model.config.max_position_embeddings >= 4_930_560  # past the preset's 131,072
    got = run.strategy_options
    # the trainer's way to run a compiled offload under FSDP2: eagerly, the flags written out
    eager = fsdp2 and r.options.get("cpu_offloading") and r.options.get("compile")
    assert ("--recipe" not in c["flags"]) == bool(eager)
    for key, value in r.options.items():
        if eager and key == "compile":
            assert got.compile is False and "eager" in c["note"]
        else:
            assert getattr(got, key) == value, key
    assert ("modelled: " in c["note"]) == (name in MODELLED)
    assert bool(c["note"]) == bool(eager or name in MODELLED)
    assert run.training.bf16 and run.parallel.use_torch_fsdp2 == fsdp2


def test_model_overrides_and_data_parallel_ranks():
    c = command.pretrain_command("none+ac", model="llama-tiny", seq=4096, world=4, sp=1,
                                 overrides={"num_layers": 6, "hidden_size": 128})
    assert c["command"].startswith("torchrun --nproc-per-node 4 pretrain.py --model llama-tiny "
                                   "--num-layers 6 --hidden-size 128 --seq-length 4096")
    run = build_run_config(parse_args(c["flags"]), 4)
    assert run.model.config.num_layers == 6 and run.parallel.data_parallel_size == 4


def test_a_flag_that_means_something_else_is_caught(monkeypatch):
    """The check is what makes the command trustworthy: a flag dropped or renamed for one
    option raises, naming the option and what the trainer read instead."""
    real = recipe_flags.option_flags

    def lossy(key, value):
        return [] if key == "max_context" else real(key, value)
    monkeypatch.setattr(recipe_flags, "option_flags", lossy)
    with pytest.raises(ValueError, match=r"max_context=False \(plan: True\)"):
        command.pretrain_command("autosp-max", model="llama-tiny", seq=4096, world=2, sp=2)


def test_compiled_offload_under_fsdp2_is_refused_before_any_work():
    """Why the command runs those recipes eagerly under FSDP2: the trainer refuses the
    compiled offload there, at the flags' check (it used to fail once the model was built)."""
    argv = ["--model", "llama-tiny", "--ulysses", "--compile", "--recompute-granularity", "full",
            "--cpu-offloading", "--use-torch-fsdp2", "--global-batch-size", "1"]
    with pytest.raises(ArgumentError, match="drop --compile"):
        build_run_config(parse_args(argv), 2)
    with pytest.raises(ArgumentError, match="drop --compile"):
        build_run_config(parse_args(["--recipe", "ulysses+alst-compiled", "--use-torch-fsdp2",
                                     "--global-batch-size", "1"]), 2)


def test_the_planner_prints_it(capsys):
    sys.path.insert(0, os.path.join(ROOT, "tools"))
    try:
        import plan_memory
    finally:
        sys.path.remove(os.path.join(ROOT, "tools"))
    args = plan_memory.parse_args(["--model", "llama-tiny", "--world-size", "2",
                                   "--sequence-parallel-size", "2", "--bf16",
                                   "--use-torch-fsdp2"])
    c = plan_memory._command(args, "ulysses+alst", 8192, 2)
    assert c["command"].startswith("torchrun --nproc-per-node 2 pretrain.py --model llama-tiny")
    assert "--recipe ulysses+alst " in c["command"] and "--compile" not in c["command"]
    assert c["command_note"] == ""  # modelled: said once per report, not per row
    assert plan_memory._command(args, "autosp", 0, 2)["command"] == "(none: nothing fits)"
