import dataclasses
import os

import pytest

from autosp_lm.config.arguments import ArgumentError, parse_args
from autosp_lm.config.build import build_run_config


def check(argv, world=1):
    return build_run_config(parse_args(argv), world)


@pytest.mark.parametrize("argv,world,match", [
    (["--global-batch-size", "6", "--micro-batch-size", "4"], 1, "--global-batch-size 6 is not divisible"),
    (["--ulysses", "--ring"], 2, "mutually exclusive"),
    (["--sequence-parallel-size", "2"], 2, "needs a strategy"),
    (["--ulysses", "--sequence-parallel-size", "3"], 4, "not divisible by --sequence-parallel-size 3"),
    (["--ulysses", "--seq-length", "130"], 4, "sequence length 130 is not divisible.*--seq-length 128 or 132"),
    (["--autosp", "--seq-length", "130"], 4, "sequence length 130 is not divisible.*--seq-length 128 or 132"),
    (["--ring", "--seq-length", "12"], 4, r"2 x sequence-parallel size.*= 8"),
    (["--group-query-attention"], 1, "--num-query-groups"),
    (["--num-query-groups", "2"], 1, "--group-query-attention"),
    (["--lr-warmup-iters", "50", "--train-iters", "10"], 1, "--lr-warmup-iters 50"),
    (["--min-lr", "1", "--lr", "0.1"], 1, "--min-lr"),
    (["--data-path", "x"], 1, "--tokenizer-model"),
    (["--data-path", "1", "a", "2", "--tokenizer-model", "t"], 1, "pairs"),
    (["--mock-data", "--data-path", "x", "--tokenizer-model", "t"], 1, "mutually exclusive"),
    (["--split", "1,x"], 1, "--split"),
    (["--save-interval", "5"], 1, "--save DIR"),
    (["--load", "/nonexistent/ckpt"], 1, "no such directory"),
    (["--seq-length", "20000"], 1, "--max-position-embeddings"),
    (["--hidden-size", "66"], 1, "--num-attention-heads"),
    (["--model", "gpt-tiny", "--group-query-attention", "--num-query-groups", "2"], 1, "only supported for llama"),
    (["--ulysses", "--sac"], 2, "--sac"),
    (["--ulysses", "--sequence-parallel-size", "8", "--seq-length", "64"], 8,
     "4 query heads and 2 key/value heads cannot be split over sequence-parallel size 8.*2, 4"),
    (["--autosp", "--ulysses-degree", "2", "--num-attention-heads", "3", "--hidden-size", "48"], 2,
     "3 query heads and 3 key/value heads cannot be split over --ulysses-degree 2.*: 1 \\(the rest of P is a ring\\)"),
    (["--autosp", "--num-attention-heads", "3", "--hidden-size", "48", "--seq-length", "66"], 2,
     "sequence length 66 is not divisible by 2 x sequence-parallel size.*64 or 68"),
    (["--sac"], 1, "--compile"),
    (["--reset-attention-mask", "--mock-data"], 1, "--reset-attention-mask needs documents"),
    (["--ulysses", "--max-context"], 2, "--max-context: options of the AutoSP checkpointing"),
    (["--autosp", "--no-sac", "--max-context"], 2, "--max-context: options of the AutoSP"),
    (["--ulysses", "--attention-head-groups", "2"], 2, "--attention-head-groups is an AutoSP"),
    (["--autosp", "--attention-head-groups", "-1"], 2, "--attention-head-groups -1"),
    (["--ulysses", "--memory-budget-gb", "70"], 2, "--memory-budget-gb: AutoSP chooses its "
                                                   "memory plan.*use it with --autosp"),
    (["--autosp", "--no-sac", "--memory-budget-gb", "70"], 2, "--memory-budget-gb: AutoSP"),
    (["--autosp", "--memory-budget-gb", "0"], 2, "--memory-budget-gb must be > 0 GiB, got 0.0"),
    (["--distributed-timeout-minutes", "0"], 1, "--distributed-timeout-minutes 0.0 must be positive"),
    (["--ulysses", "--attention-head-groups", "2"], 2, "--ulysses baseline chunks its heads "
                                                       "with --attention-head-chunks"),
    (["--autosp", "--attention-head-chunks", "2"], 2, "--attention-head-chunks is an option of "
                                                      "the hand-written --ulysses.*--attention-"
                                                      "head-groups"),
    (["--ring", "--attention-head-chunks", "2"], 2, "--attention-head-chunks is an option of"),
    # llama-tiny at SP 2: each rank 2 query heads and 1 kv head
    (["--ulysses", "--attention-head-chunks", "3"], 2,
     "--attention-head-chunks 3 does not split each rank's 2 query heads \\(4 heads over 2 "
     "ranks\\) and the 1 key/value head\\(s\\).*use one of 1, 2 \\(0: 2"),
    (["--ulysses", "--sequence-parallel-size", "4", "--ulysses-degree", "2",
      "--attention-head-chunks", "2"], 4, "--ulysses-degree 2 below the sequence-parallel size 4 "
                                          "makes the 2-D hybrid, which has no head chunks"),
])
def test_bad_flags_name_the_problem(argv, world, match):
    with pytest.raises(ArgumentError, match=match):
        check(argv, world)


def test_derived_values():
    a = check(["--global-batch-size", "16", "--micro-batch-size", "2"], world=4)
    assert (a.parallel.data_parallel_size, a.parallel.sequence_parallel_size,
            a.training.grad_accum_steps) == (4, 1, 2)
    a = check(["--ulysses", "--global-batch-size", "4"], world=4)
    assert (a.parallel.data_parallel_size, a.parallel.sequence_parallel_size,
            a.training.grad_accum_steps, a.strategy) == (1, 4, 4, "ulysses")
    a = check(["--autosp", "--num-attention-heads", "3", "--hidden-size", "48"], world=2)
    assert a.parallel.sequence_parallel_size == 2  # 3 heads at SP 2: a ring (docs/autosp.md)
    a = check(["--autosp", "--context-parallel-size", "2"], world=4)
    assert (a.parallel.data_parallel_size, a.parallel.sequence_parallel_size, a.sac) == (2, 2, True)
    assert check(["--autosp", "--no-sac"], world=2).sac is False
    opts = check(["--autosp", "--max-context", "--offload-activations"], world=2).strategy_options
    assert (opts.max_context, opts.offload_activations) == (True, True)
    opts = check(["--autosp", "--max-context", "--use-torch-fsdp2"], world=2).strategy_options
    assert opts.max_context and opts.backend == "inductor"  # accepted (gloo.py: the crash fixed)
    assert check(["--autosp", "--attention-head-groups", "0"], 2
                 ).strategy_options.attention_head_groups == 0
    assert check(["--ulysses", "--attention-head-chunks", "0"], 2
                 ).strategy_options.attention_head_chunks == 0
    assert check(["--ulysses"], 2).strategy_options.attention_head_chunks == 1
    # --memory-budget-gb: AutoSP chooses the plan unless flags name one (they win)
    assert check(["--autosp", "--memory-budget-gb", "70"], 2).strategy_options.choose_plan
    for flags in (["--max-context"], ["--offload-activations"], ["--sac-memory-target-gb", "9"],
                  ["--attention-head-groups", "0"], ["--sac-recompute-budget", "0.5"]):
        opts = check(["--autosp", "--memory-budget-gb", "70", *flags], 2).strategy_options
        assert not opts.choose_plan, flags


def test_schedule_defaults_are_resolved_values_and_the_namespace_stays_as_parsed():
    """Validation returns values: the warm-up and decay defaults are resolved in the typed
    config, and the parsed namespace is not written into."""
    ns = parse_args(["--train-iters", "50", "--autosp"])
    before = dict(vars(ns))
    run = build_run_config(ns, 2)
    assert vars(ns) == before
    assert (run.training.optimizer.lr_decay_iters, run.training.optimizer.lr_warmup_iters) == (50, 5)
    assert run.training.checkpoint.ckpt_format == "torch" and run.sac
    with pytest.raises(dataclasses.FrozenInstanceError):
        run.seed = 1


def test_the_model_config_is_read_once_from_an_hf_checkpoint(tmp_path, monkeypatch):
    """--hf-checkpoint's config.json is read once per run configuration."""
    import json

    import torch
    from safetensors.torch import save_file

    from autosp_lm.models import hf
    from tests.models.test_hf_import import LLAMA
    path = str(tmp_path / "ckpt")
    os.makedirs(path)
    json.dump(LLAMA, open(os.path.join(path, "config.json"), "w"))
    save_file({"x": torch.zeros(1)}, os.path.join(path, "model.safetensors"))
    reads = []
    real = hf.read_hf_config
    monkeypatch.setattr(hf, "read_hf_config", lambda *a, **k: reads.append(a) or real(*a, **k))
    run = check(["--hf-checkpoint", path, "--mock-data", "--seq-length", "64"])
    assert len(reads) == 1 and run.model.hf_checkpoint == path
    assert run.model.config.num_layers == run.to_dict()["model"]["config"]["num_layers"]


def test_every_flag_has_help():
    from autosp_lm.config.arguments import build_parser
    for action in build_parser()._actions:
        assert action.help, f"{action.option_strings} has no help text"


def _help_of(parser, flag):
    """The rendered help text of ``flag``, on one line."""
    action = next(a for a in parser._actions if flag in a.option_strings)
    return " ".join(parser._get_formatter()._expand_help(action).split())


def test_help_states_each_default_once():
    from autosp_lm.config.arguments import build_parser
    from autosp_lm.models.config import preset_config
    p = build_parser()
    text = " ".join(p.format_help().split())
    assert "(default: None)" not in text and "(default: False)" not in text and "(default: True)" not in text
    for a in p._actions:
        assert _help_of(p, a.option_strings[0]).count("default") <= 1, a.option_strings
    tiny = preset_config("llama-tiny")  # shape flags name where their default comes from
    assert _help_of(p, "--num-layers").endswith(f"(default: the --model preset's; llama-tiny: {tiny.num_layers})")
    assert f"llama-tiny: {tiny.ffn_hidden_size}" in _help_of(p, "--ffn-hidden-size")
    assert _help_of(p, "--init-method-std").endswith("llama-tiny: 0.02)")
    assert "on by default with --autosp" in _help_of(p, "--sac")
    assert "default" in _help_of(p, "--no-sac") and "(default" not in _help_of(p, "--no-sac")
    assert _help_of(p, "--seq-length").endswith("(default: 1024)")
    assert "DIR/wandb/" in _help_of(p, "--wandb-save-dir")  # where W&B really puts its runs


def test_pretrain_reports_bad_flags(capsys):
    import pretrain
    with pytest.raises(SystemExit) as e:
        pretrain.main(["--global-batch-size", "7", "--micro-batch-size", "2", "--mock-data"])
    assert e.value.code == 1
    err = capsys.readouterr().err
    assert err.startswith("pretrain.py: error: --global-batch-size 7") and err.count("\n") == 1
    with pytest.raises(SystemExit) as e:  # argparse's own refusals: one line too, its exit status
        pretrain.main(["--no-such-flag"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "unrecognized arguments: --no-such-flag" in err and "--help" in err
