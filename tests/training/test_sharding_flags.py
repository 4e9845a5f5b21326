"""The flags of the sharded modes: checked before any work, naming both flags; the defaults."""
import pytest

from autosp_lm.config.arguments import ArgumentError, parse_args
from autosp_lm.config.build import build_run_config
from autosp_lm.parallel.sharding_kinds import sharding_kind


def check(argv, world=1):
    return build_run_config(parse_args(argv), world)


@pytest.mark.parametrize("argv,match", [
    (["--use-torch-fsdp2", "--use-distributed-optimizer"],
     "--use-torch-fsdp2 and --use-distributed-optimizer are mutually exclusive"),
    (["--async-save", "--save", "x"], "--async-save needs --ckpt-format torch_dist"),
    (["--use-torch-fsdp2", "--async-save", "--ckpt-format", "torch", "--save", "x"],
     "--async-save needs --ckpt-format torch_dist"),
    (["--use-torch-fsdp2", "--async-save"], "--async-save needs --save"),
])
def test_incompatible_combinations_name_both_flags(argv, match):
    with pytest.raises(ArgumentError, match=match):
        check(argv)


def test_checkpoint_format_defaults():
    def saved(argv):
        return check(argv).training.checkpoint
    assert saved([]).ckpt_format == "torch"
    assert saved(["--use-torch-fsdp2"]).ckpt_format == "torch_dist"
    assert saved(["--use-distributed-optimizer"]).ckpt_format == "torch_dist"
    assert saved(["--use-torch-fsdp2", "--ckpt-format", "torch"]).ckpt_format == "torch"
    assert saved(["--ckpt-format", "torch_dist", "--async-save", "--save", "x"]).async_save


def test_the_strategy_picks_the_implementation():
    from autosp_lm.parallel.state import ParallelState
    from autosp_lm.strategies import build_strategy
    ps = ParallelState()
    whole = build_strategy("autosp", ps).needs_full_graph
    assert sharding_kind(True, False, whole) == "graph_fsdp"
    for name, opts in (("none", {}), ("ulysses", {}), ("ring", {"compile": True}),
                       ("none", {"compile": True, "sac": True})):
        assert sharding_kind(True, False, build_strategy(name, ps, **opts).needs_full_graph) == "fsdp2"
    assert build_strategy("ulysses", ps, compile=True, fullgraph=True).needs_full_graph
    assert sharding_kind(False, True, whole) == "distributed_optimizer"
    assert sharding_kind(False, False, whole) == "none"


def test_the_slurm_example_passes_the_flag_checks():
    """examples/slurm_llama3_8b.sbatch: its pretrain.py flags are valid on its 32 ranks."""
    import os
    import re
    import shlex
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    text = open(os.path.join(root, "examples", "slurm_llama3_8b.sbatch")).read()
    block = text.split("\n  pretrain.py \\\n", 1)[1]  # the arguments srun passes to pretrain.py
    command = block.split("\n#", 1)[0].split("||", 1)[0].replace("\\\n", " ")
    train_iters = re.search(r"^TRAIN_ITERS=(\d+)$", text, re.M).group(1)
    command = command.replace("$TRAIN_ITERS", train_iters)
    argv = [a.replace('"', "") for a in shlex.split(command, posix=False)]
    run = check(argv, world=32)
    saved = run.training.checkpoint
    assert (run.parallel.use_torch_fsdp2, saved.ckpt_format, saved.async_save) == (True, "torch_dist", True)
    assert (run.parallel.sequence_parallel_size, run.parallel.data_parallel_size) == (8, 4)
    assert saved.auto_resume and run.training.train_iters == int(train_iters)  # what the requeue reads
