"""The pretrain.py command of a plan (autosp_lm/config/plan_command.py): for every planner strategy
the printed flags, read by the trainer's own parser and checks, give back the plan's strategy,
options and model, and a flag that drifts from its option is caught."""
from __future__ import annotations

import os
import shlex
import sys

import pytest

from autosp_lm.config.arguments import ArgumentError, parse_args, strategy_options, validate_args
from autosp_lm import plan_command as command
from autosp_lm.planner.trace import HOST_OFFLOAD, STRATEGIES

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.mark.parametrize("fsdp2", [False, True])
@pytest.mark.parametrize("name", list(STRATEGIES))
def test_every_plan_has_a_command_the_trainer_reads_back(name, fsdp2):
    c = command.pretrain_command(name, model="llama-3.1-8b", seq=4_930_560, world=32, sp=32,
                                 bf16=True, fsdp2=fsdp2)
    argv = shlex.split(c["command"])
    assert argv[:6] == ["torchrun", "--nnodes", "4", "--nproc-per-node", "8", "pretrain.py"]
    assert argv[6:] == c["flags"]
    args = validate_args(parse_args(c["flags"]), 32)
    registry, options = STRATEGIES[name]
    assert args.strategy == registry and args.seq_length == 4_930_560
    assert args.max_position_embeddings >= 4_930_560  # past the preset's 131,072
    got = strategy_options(args)
    eager = fsdp2 and name in HOST_OFFLOAD  # the trainer's way to run the recipe under FSDP2
    for key, value in options.items():
        if eager and key == "compile":
            assert got.compile is False and "eager" in c["note"]
        else:
            assert getattr(got, key) == value, key
    assert bool(c["note"]) == eager
    assert args.bf16 and args.use_torch_fsdp2 == fsdp2


def test_model_overrides_and_data_parallel_ranks():
    c = command.pretrain_command("none+ac", model="llama-tiny", seq=4096, world=4, sp=1,
                                 overrides={"num_layers": 6, "hidden_size": 128})
    assert c["command"].startswith("torchrun --nproc-per-node 4 pretrain.py --model llama-tiny "
                                   "--num-layers 6 --hidden-size 128 --seq-length 4096")
    args = validate_args(parse_args(c["flags"]), 4)
    assert args.num_layers == 6 and args.data_parallel_size == 4  # a whole sequence a rank


def test_a_flag_that_means_something_else_is_caught(monkeypatch):
    """The check is what makes the command trustworthy: a flag dropped or renamed for one
    option raises, naming the option and what the trainer read instead."""
    real = command._option_flags

    def lossy(key, value):
        return [] if key == "max_context" else real(key, value)
    monkeypatch.setattr(command, "_option_flags", lossy)
    with pytest.raises(ValueError, match=r"max_context=False \(plan: True\)"):
        command.pretrain_command("autosp-max", model="llama-tiny", seq=4096, world=2, sp=2)


def test_compiled_offload_under_fsdp2_is_refused_before_any_work():
    """Why the command runs those recipes eagerly under FSDP2: the trainer refuses the
    compiled offload there, at the flags' check (it used to fail once the model was built)."""
    argv = ["--model", "llama-tiny", "--ulysses", "--compile", "--recompute-granularity", "full",
            "--cpu-offloading", "--use-torch-fsdp2", "--global-batch-size", "1"]
    with pytest.raises(ArgumentError, match="drop --compile"):
        validate_args(parse_args(argv), 2)


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
    assert "--cpu-offloading" in c["command"] and "--compile" not in c["command"]
    assert "eager" in c["command_note"]
    assert plan_memory._command(args, "autosp", 0, 2)["command"] == "(none: nothing fits)"
