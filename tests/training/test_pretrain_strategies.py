"""End to end: `pretrain.py --ulysses/--ring/--autosp` on 2 and 4 ranks trains with the losses
of one rank on the same data (the strategy contracts of the README, through the whole trainer).
One layer: what is checked is the trainer's path, layer-to-layer behaviour is tested elsewhere.
The default suite's runs are items of the session's shared 2-rank launch (tests/helpers/launch.py).
"""
import json
import os
import shutil
import tempfile

import pytest

import pretrain
from tests.helpers.dist import run_distributed
from tests.helpers.launch import Job

ARGS = ["--mock-data", "--seq-length", "64", "--global-batch-size", "2", "--micro-batch-size", "1",
        "--train-iters", "3", "--log-interval", "1", "--eval-iters", "1", "--eval-interval", "3",
        "--lr", "3e-3", "--lr-warmup-iters", "1", "--num-layers", "1"]

_reference = {}


def reference(model):
    if model not in _reference:
        _reference[model] = pretrain.main(ARGS + ["--model", model])
    return _reference[model]


def _worker(rank, world, runs):
    out = []
    for argv in runs:
        res = pretrain.main(argv)
        out.append((res.losses, res.grad_norms, res.eval_losses))
    return out


def _runs(model, strategy_flags_list):
    return [ARGS + ["--model", model] + flags for flags in strategy_flags_list]


def check(model, strategy_flags_list, world, per_rank=None):
    ref = reference(model)
    if per_rank is None:
        per_rank = run_distributed(_worker, world, _runs(model, strategy_flags_list))
    for i, flags in enumerate(strategy_flags_list):
        losses, norms, evals = per_rank[0][i]
        for r in range(world):
            assert per_rank[r][i][0] == losses, f"{flags}: ranks disagree on the loss"
        for it, value in ref.losses.items():
            assert losses[it] == pytest.approx(value, rel=1e-5), (flags, it)
            assert norms[it] == pytest.approx(ref.grad_norms[it], rel=1e-4), (flags, it)
        assert evals[3] == pytest.approx(ref.eval_losses[3], rel=1e-5), flags


TWO_RANKS = [["--ulysses"], ["--ring"], ["--autosp", "--compile-backend", "aot_eager", "--no-sac"]]
TWO_RANKS_JOB = Job("tests.training.test_pretrain_strategies:_worker", (_runs("llama-tiny", TWO_RANKS),))


def test_two_ranks_match_one_rank(launch2):
    check("llama-tiny", TWO_RANKS, 2, launch2(TWO_RANKS_JOB))


@pytest.mark.slow  # the same on a second model, a launch of its own
def test_two_ranks_match_one_rank_on_gpt():
    check("gpt-tiny", TWO_RANKS, 2)


@pytest.mark.slow  # SP 4 parity: tests/parallel/test_{ulysses,ring}.py, the 2-D AutoSP plan at 4 ranks
def test_four_ranks_and_dp_x_sp_match_one_rank():
    check("llama-tiny", [["--ulysses"], ["--ring"],
                         ["--autosp", "--compile-backend", "aot_eager"],
                         ["--ulysses", "--sequence-parallel-size", "2"]], 4)


#: the main job in bf16 on the built-in corpus (test_autosp_bf16_on_the_builtin_corpus_...);
#: the default suite's without evaluation (under -m slow with it: CORPUS_EVAL)
CORPUS_ARGV = ["--bf16", "--seq-length", "128", "--global-batch-size", "2", "--micro-batch-size",
               "1", "--train-iters", "3", "--log-interval", "1", "--eval-iters", "0", "--lr",
               "3e-3", "--lr-warmup-iters", "1", "--num-layers", "1"]
CORPUS_EVAL = [a for a in CORPUS_ARGV if a not in ("--eval-iters", "0")] + [
    "--eval-iters", "1", "--eval-interval", "3"]


def _corpus_worker(rank, world, argv):
    """``argv`` with AutoSP on the built-in corpus, built into a new directory (rank 0 makes it,
    every rank uses it: --data-cache-path) that the test removes; -> (losses, grad norms,
    evaluation losses), the metrics file's lines and the directory."""
    import torch.distributed as dist
    where = [tempfile.mkdtemp(prefix="autosp_lm_corpus_") if rank == 0 else None]
    dist.broadcast_object_list(where, src=0)
    cache = where[0]
    metrics = os.path.join(cache, "metrics.jsonl")
    res = pretrain.main(argv + ["--data-cache-path", cache, "--autosp", "--compile-backend",
                                "aot_eager", "--memory-budget-gb", "4", "--metrics-file", metrics])
    lines = open(metrics).read().splitlines() if rank == 0 else None
    return (res.losses, res.grad_norms, res.eval_losses), lines, cache


CORPUS_JOB = Job("tests.training.test_pretrain_strategies:_corpus_worker", (CORPUS_ARGV,))
LAUNCH = {2: [TWO_RANKS_JOB, CORPUS_JOB]}  # the default suite's: in the shared launch


def test_autosp_bf16_on_the_builtin_corpus_matches_one_rank(launch2):
    """The main job in bf16: `torchrun --nproc-per-node 2 pretrain.py --autosp --bf16` on the
    built-in corpus (SAC on), with a memory budget (AutoSP chooses the plan: the metrics file
    records which), reports the losses of one bf16 rank; one layer and aot_eager (the
    job's path through the trainer is the point: layer-to-layer behaviour is tested elsewhere,
    AutoSP with SAC in bf16 on Inductor by tests/training/test_bf16.py's matrix; an Inductor
    compile here cost a cold suite ~70 CPU seconds). Without evaluation, whose graph is a second
    compile (~7 CPU seconds): AutoSP's evaluation is checked by test_two_ranks_match_one_rank, in
    bf16 by the slow test below.
    Tolerances from tests/test_bf16.py: the loss within 1e-4 (measured with 2 layers: <= 3e-5
    after 3 Adam steps), the global gradient norm within the per-gradient bf16 bound 4u = 2**-6."""
    _check_corpus_run(launch2(CORPUS_JOB), CORPUS_ARGV)


@pytest.mark.slow  # the same with an evaluation, a launch of its own
def test_autosp_bf16_on_the_builtin_corpus_evaluates_as_one_rank():
    per_rank = run_distributed(_corpus_worker, 2, CORPUS_EVAL)
    _check_corpus_run(per_rank, CORPUS_EVAL)


def _check_corpus_run(per_rank, argv):
    from tests.training.test_bf16 import GRAD_TOL_BF16, LOSS_TOL_BF16
    cache = per_rank[0][2]
    try:
        ref = pretrain.main(argv + ["--data-cache-path", cache])  # the ranks' corpus
    finally:
        shutil.rmtree(cache, ignore_errors=True)
    runs = [json.loads(x)["run"] for x in per_rank[0][1] if '"run"' in x]
    assert len(runs) == 1 and runs[0]["memory_plan"] == "sac-keep-all", runs
    assert 0 < runs[0]["memory_plan_predicted_peak_bytes"] <= runs[0]["memory_budget_bytes"]
    losses, norms, evals = per_rank[0][0]
    assert per_rank[1][0][0] == losses
    assert set(losses) == {1, 2, 3}
    for it, value in ref.losses.items():
        assert losses[it] == pytest.approx(value, rel=LOSS_TOL_BF16), it
        assert norms[it] == pytest.approx(ref.grad_norms[it], rel=GRAD_TOL_BF16), it
    assert sorted(evals) == sorted(ref.eval_losses) == ([3] if "--eval-interval" in argv else [])
    for it, value in ref.eval_losses.items():
        assert evals[it] == pytest.approx(value, rel=LOSS_TOL_BF16)


@pytest.mark.slow  # every strategy under document masks: tests/parallel/test_document_masking.py
def test_packed_documents_on_the_builtin_corpus_match_one_rank():
    """`pretrain.py --autosp --reset-attention-mask --reset-position-ids --eod-mask-loss` on the
    built-in corpus (packed: documents end inside samples), Inductor with SAC as the main job
    runs, and the Ulysses and Ring baselines, report the losses of one rank (fp32, 1e-5)."""
    argv = ["--seq-length", "128", "--global-batch-size", "2", "--micro-batch-size", "1",
            "--train-iters", "2", "--log-interval", "1", "--eval-iters", "1",
            "--eval-interval", "2", "--lr", "3e-3", "--lr-warmup-iters", "1", "--num-layers", "1",
            "--reset-attention-mask", "--reset-position-ids", "--eod-mask-loss"]
    ref = pretrain.main(argv)  # builds the corpus into this test's cache; the ranks reuse it
    runs = [argv + ["--autosp"], argv + ["--ulysses"], argv + ["--ring"]]
    per_rank = run_distributed(_worker, 2, runs)
    for i, run in enumerate(runs):
        losses, norms, evals = per_rank[0][i]
        assert per_rank[1][i][0] == losses, run[-1]
        for it, value in ref.losses.items():
            assert losses[it] == pytest.approx(value, rel=1e-5), (run[-1], it)
            assert norms[it] == pytest.approx(ref.grad_norms[it], rel=1e-4), (run[-1], it)
        assert evals[2] == pytest.approx(ref.eval_losses[2], rel=1e-5), run[-1]


@pytest.mark.slow  # the 6-head 2 x 2 plan: tests/compiler/test_autosp_2d.py (default suite)
def test_more_ranks_than_heads_divide_trains_with_one_rank_losses():
    """6 query heads on 4 ranks: the Ulysses plan alone must refuse (6 % 4), the compiler's
    2-D plan (2 x 2, chosen) trains with the single-rank losses; Inductor, SAC on; and the
    hand-written hybrid (--ulysses --ulysses-degree 2) too."""
    argv = ARGS + ["--model", "llama-tiny", "--num-attention-heads", "6", "--hidden-size", "48",
                   "--train-iters", "2", "--eval-interval", "2"]
    ref = pretrain.main(argv)
    runs = [argv + ["--autosp"], argv + ["--ulysses", "--ulysses-degree", "2"]]
    per_rank = run_distributed(_worker, 4, runs)
    for i, run in enumerate(runs):
        losses, norms, evals = per_rank[0][i]
        for r in range(4):
            assert per_rank[r][i][0] == losses, run
        for it, value in ref.losses.items():
            assert losses[it] == pytest.approx(value, rel=1e-5), (run, it)
            assert norms[it] == pytest.approx(ref.grad_norms[it], rel=1e-4), (run, it)
        assert evals[2] == pytest.approx(ref.eval_losses[2], rel=1e-5), run
