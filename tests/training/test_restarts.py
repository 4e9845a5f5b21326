"""The faults people meet, under torchrun, against an uninterrupted run (docs/training.md,
"Restarts").

* a rank SIGKILLed in the middle of an iteration under ``torchrun --max-restarts``: the ranks
  restart, resume from the last checkpoint (``--load`` equal to ``--save``), and every loss of
  every attempt equals the uninterrupted run's, bit for bit;
* a rank SIGKILLed while writing an ``--async-save`` checkpoint: the restart resumes from the
  last complete checkpoint, never the partial one, with the same losses;
* a rank that hangs (SIGSTOP): the other ends after ``--distributed-timeout-minutes`` with one
  line naming the collective and the rank that did not arrive.

The faults come from tests/helpers/pretrain_faults.py. The default suite runs the two kills as
the two failed attempts of one job (one launch fewer); ``-m slow`` runs each in a job of its
own. The uninterrupted run is the same command in the session's shared 2-rank launch
(tests/helpers/launch.py).
"""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time

import pytest

import pretrain
from autosp_lm.parallel.spawn import free_port
from tests.helpers.launch import Job

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
FAULTS = os.path.join(ROOT, "tests", "helpers", "pretrain_faults.py")
ARGV = ["--model", "llama-tiny", "--mock-data", "--seq-length", "64", "--global-batch-size", "2",
        "--micro-batch-size", "1", "--train-iters", "6", "--log-interval", "1", "--eval-iters", "0",
        "--lr-warmup-iters", "1", "--lr", "3e-3", "--ulysses"]


def _uninterrupted(rank, world, argv):
    return pretrain.main(argv).losses


REFERENCE = Job("tests.training.test_restarts:_uninterrupted", (ARGV,))
LAUNCH = {2: [REFERENCE]}


def _env(fault: str, iteration) -> dict:
    env = dict(os.environ, AUTOSP_FAULT=fault, AUTOSP_FAULT_ITERATION=str(iteration),
               AUTOSP_FAULT_RANK="1", PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
    paths = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    env["PYTHONPATH"] = os.pathsep.join([ROOT] + paths)  # the ranks import this tree
    return env


def _torchrun(max_restarts: int, *extra) -> list:
    # static rendezvous on a port of its own (the README's plain torchrun, without port clashes)
    return [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
            "--max-restarts", str(max_restarts), "--monitor-interval", "0.1",
            "--master-port", str(free_port()), FAULTS, *ARGV, *extra]


def _rows(path) -> list:
    return [json.loads(line) for line in open(path).read().splitlines()]


def _check_losses(rows, reference):
    """Every logged iteration of every attempt equals the uninterrupted run's loss exactly."""
    assert sorted({r["iteration"] for r in rows}) == sorted(reference)
    for r in rows:
        assert r["lm_loss"] == reference[r["iteration"]], (r["iteration"], r["lm_loss"],
                                                           reference[r["iteration"]])


@pytest.mark.overlap_launch  # its torchrun job runs while the shared launch ends; reads it after
def test_killed_ranks_restart_and_resume_exactly(tmp_path, launch2):
    """Attempt 1: rank 1 killed while writing the async checkpoint of iteration 4; attempt 2
    resumes from iteration 2 (never the partial 4) and rank 1 is killed in the middle of iteration
    3; attempt 3 resumes from 2 again and finishes. Each kill comes before the attempt's next
    save, so each restart's checkpoint is known."""
    ck, metrics = tmp_path / "ck", tmp_path / "m.jsonl"
    cmd = _torchrun(2, "--save", str(ck), "--load", str(ck), "--save-interval", "2",
                    "--ckpt-format", "torch_dist", "--async-save", "--metrics-file", str(metrics))
    out = subprocess.run(cmd, cwd=tmp_path, env=_env("kill-in-async-save,kill", "4,3"),
                         capture_output=True, text=True, timeout=300)
    log = out.stdout + out.stderr
    assert out.returncode == 0, log[-4000:]
    assert "killed while writing the checkpoint of iteration 4" in log, log[-4000:]
    assert "[fault] rank 1 (pid" in log and "kill in iteration 3" in log, log[-4000:]
    assert log.count(f"resumed from {ck}/iter_0000002 at iteration 2") == 2, log[-4000:]
    assert "iter_0000004 at iteration" not in log
    rows = _rows(metrics)
    its = [r["iteration"] for r in rows]
    # attempt 1 logs 1-4 (5 at most, if rank 1's step ran before its writer died), attempt 2
    # none, attempt 3 replays 3 and 4
    assert its[:4] == [1, 2, 3, 4] and its[-4:] == [3, 4, 5, 6] and len(its) in (8, 9), its
    _check_losses(rows, launch2(REFERENCE)[0])
    assert open(ck / "latest").read().strip() == "6"
    assert sorted(os.listdir(ck)) == ["iter_0000002", "iter_0000004", "iter_0000006", "latest"]


@pytest.mark.slow  # both kills as one job of three attempts: test_killed_ranks_restart_and_resume_exactly
def test_rank_killed_mid_step_restarts_and_resumes_exactly(tmp_path, launch2):
    ck, metrics = tmp_path / "ck", tmp_path / "m.jsonl"
    cmd = _torchrun(1, "--save", str(ck), "--load", str(ck), "--save-interval", "2",
                    "--metrics-file", str(metrics))
    out = subprocess.run(cmd, cwd=tmp_path, env=_env("kill", 4), capture_output=True, text=True,
                         timeout=300)
    log = out.stdout + out.stderr
    assert out.returncode == 0, log[-4000:]
    assert "[fault] rank 1 (pid" in log, log[-4000:]
    assert f"resumed from {ck}/iter_0000002 at iteration 2" in log, log[-4000:]
    rows = _rows(metrics)
    assert [r["iteration"] for r in rows] == [1, 2, 3, 3, 4, 5, 6]  # attempt 2 replays 3
    _check_losses(rows, launch2(REFERENCE)[0])
    assert open(ck / "latest").read().strip() == "6"


@pytest.mark.slow  # both kills as one job of three attempts: test_killed_ranks_restart_and_resume_exactly
def test_rank_killed_during_async_save_resumes_from_last_complete_checkpoint(tmp_path, launch2):
    ck, metrics = tmp_path / "ck", tmp_path / "m.jsonl"
    cmd = _torchrun(1, "--save", str(ck), "--load", str(ck), "--save-interval", "2",
                    "--ckpt-format", "torch_dist", "--async-save", "--metrics-file", str(metrics))
    out = subprocess.run(cmd, cwd=tmp_path, env=_env("kill-in-async-save", 4),
                         capture_output=True, text=True, timeout=300)
    log = out.stdout + out.stderr
    assert out.returncode == 0, log[-4000:]
    assert "killed while writing the checkpoint of iteration 4" in log, log[-4000:]
    # the partial checkpoint of iteration 4 is never chosen: the restart takes iteration 2's
    assert f"resumed from {ck}/iter_0000002 at iteration 2" in log, log[-4000:]
    assert "iter_0000004 at iteration" not in log
    _check_losses(_rows(metrics), launch2(REFERENCE)[0])
    assert open(ck / "latest").read().strip() == "6"
    assert sorted(os.listdir(ck)) == ["iter_0000002", "iter_0000004", "iter_0000006", "latest"]


def _kill(pids):
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def test_hung_rank_ends_the_job_with_one_line_naming_it():
    timeout_minutes = 0.1  # 6 s: a collective waits this long for the stopped rank
    cmd = _torchrun(0, "--distributed-timeout-minutes", str(timeout_minutes))
    proc = subprocess.Popen(cmd, env=_env("stop", 3), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    lines, stamps, stopped = [], {}, []

    def read():
        for line in proc.stdout:
            lines.append(line)
            if line.startswith("[fault]"):
                stamps.setdefault("stop", time.monotonic())
                stopped.extend(int(p) for p in re.findall(r"pid (\d+)", line))
            if line.startswith("pretrain.py: error:"):
                stamps.setdefault("error", time.monotonic())
                _kill(stopped)  # as torchrun would after its shutdown timeout (30 s)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        proc.wait(timeout=240)
        reader.join(timeout=10)
    finally:
        _kill(stopped)  # never leave a stopped process behind
        if proc.poll() is None:
            proc.kill()
    log = "".join(lines)
    errors = [ln for ln in lines if ln.startswith("pretrain.py: error:")]
    assert proc.returncode != 0 and len(errors) == 1, log[-4000:]
    assert not any(ln.startswith("[rank") for ln in lines), log[-4000:]  # no rank's traceback
    line = errors[0]
    assert "rank 1 did not arrive" in line and "on rank 0, iteration 3" in line, line
    assert re.search(r"(all_reduce|all_to_all\w*|all_gather\w*|broadcast|barrier) #\d+ of the ", line), line
    assert "timed out after 6 s (--distributed-timeout-minutes 0.1)" in line, line
    waited = stamps["error"] - stamps["stop"]
    assert waited < 6 + 20, waited  # the timeout and a few heartbeats, not torch's 30 minutes


@pytest.mark.parametrize("before,after,requeued", [
    ("100", "600", True),      # stopped (time limit, a killed or hung rank) after saving more
    ("100", "100", False),     # no new checkpoint: a flag error, a crash before the first save
    ("19500", "20000", False),  # finished
    (None, None, False),       # failed before any checkpoint
])
def test_the_slurm_example_requeues_an_unfinished_run_that_made_progress(tmp_path, before, after,
                                                                           requeued):
    """examples/slurm_llama3_8b.sbatch's requeue logic, with srun and scontrol stubbed."""
    ck, bin_dir = tmp_path / "ck", tmp_path / "bin"
    ck.mkdir()
    bin_dir.mkdir()
    if before is not None:
        (ck / "latest").write_text(before + "\n")
    # srun: the "training" moves the tracker and fails, as a step ended by a killed rank does
    write = f"echo {after} > {ck}/latest; " if after is not None else ""
    (bin_dir / "srun").write_text(f"#!/bin/bash\n{write}exit 1\n")
    (bin_dir / "scontrol").write_text(
        f"#!/bin/bash\nif [ \"$1\" = requeue ]; then echo \"$@\" >> {tmp_path}/requeued; "
        "else echo node1; fi\n")
    for f in bin_dir.iterdir():
        f.chmod(0o755)
    env = dict(os.environ, PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}", CKPT=str(ck),
               SLURM_JOB_ID="42", SLURM_JOB_NODELIST="node1", SLURM_RESTART_COUNT="0")
    out = subprocess.run(["bash", os.path.join(ROOT, "examples", "slurm_llama3_8b.sbatch")],
                         env=env, capture_output=True, text=True, timeout=30)
    assert out.returncode == 1, out.stderr  # the step's exit status
    assert (tmp_path / "requeued").exists() == requeued, out.stdout + out.stderr
    if requeued:
        assert (tmp_path / "requeued").read_text().split() == ["requeue", "42"]


@pytest.mark.slow  # three AutoSP compilations (~3 min on 2 cores)
def test_autosp_rank_killed_mid_step_restarts_exactly_under_c10d_rendezvous(tmp_path):
    """The issue's case: SP 2 with --autosp, rank 1 SIGKILLed in iteration 5 of 6, under
    torchrun's c10d rendezvous (--standalone: the agent's store shared with the workers)."""
    from tests.helpers.measure_restarts import job, loss_difference
    flags = ["--model", "llama-tiny", "--autosp", "--compile-backend", "aot_eager", "--mock-data",
             "--seq-length", "128", "--global-batch-size", "2", "--micro-batch-size", "1",
             "--eval-iters", "0"]
    common = dict(train_iters=6, save_interval=2, standalone=True, timeout=900)
    ref = job(str(tmp_path / "uninterrupted"), flags, **common)
    assert ref["returncode"] == 0, ref["log"][-3000:]
    reference = {r["iteration"]: r["lm_loss"] for r in ref["rows"]}
    res = job(str(tmp_path / "killed"), flags, fault="kill", kill_iteration=5, **common)
    assert res["returncode"] == 0 and res["killed"], res["log"][-3000:]
    assert [it for _, it in res["resumed"]] == ["4"], res["log"][-3000:]
    assert loss_difference(res["rows"], reference) == 0.0
