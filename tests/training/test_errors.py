"""What a user sees when something goes wrong or a run is stopped, through real launches.

Every known error (a flag, an AutoSP refusal found by the compiler, data, checkpoint) under
torchrun with 2 ranks: one ``pretrain.py: error:`` line, printed once, no Python traceback from
the ranks, torchrun's root cause naming the same line, a non-zero exit, no hang (every launch has
a timeout). The default suite checks one error found before the process group is made and one
after it; ``-m slow`` the other errors and SIGTERM, forwarded by torchrun or sent to the ranks
(the default suite sends it to one process: tests/training/test_training.py). The torchrun jobs of each run concurrently (one launch each, the costly part); the
single-process cases run in this process.
"""
import os
import signal
import subprocess
import sys
import threading
import time

import pytest

import pretrain
from autosp_lm.training import checkpoint as ckpt
from tests.helpers.data import make_texts, train_tiny_tokenizer

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TINY = ["--mock-data", "--seq-length", "64", "--global-batch-size", "2", "--micro-batch-size", "1",
        "--eval-iters", "0", "--log-interval", "1", "--lr-warmup-iters", "1"]
ERROR = "pretrain.py: error:"
TIMEOUT = 240  # per launch: far above a normal run (about 10 s), far below a hang (collectives: 30 min)


def _torchrun(script, argv, tmp_path, name):
    out = open(tmp_path / f"{name}.log", "w")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           "--monitor-interval", "0.1", os.path.join(ROOT, script)] + argv
    env = dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1")
    return subprocess.Popen(cmd, cwd=tmp_path, env=env, stdout=out, stderr=subprocess.STDOUT,
                            start_new_session=True), tmp_path / f"{name}.log"


def _wait(proc, log):
    try:
        proc.wait(timeout=TIMEOUT)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        pytest.fail(f"hung for {TIMEOUT} s:\n{log.read_text()[-3000:]}")
    return proc.returncode, log.read_text()


def _ranks(proc):
    """The pids of torchrun's workers (its children)."""
    try:
        text = open(f"/proc/{proc.pid}/task/{proc.pid}/children").read()
    except OSError:
        return []
    return [int(p) for p in text.split()]


def _signal_after(metrics, proc, targets, n=2):
    """Send SIGTERM to ``targets(proc)`` once ``n`` iterations are logged (a background thread:
    the job stops as soon as it can, whatever test runs meanwhile)."""
    def watch():
        deadline = time.time() + TIMEOUT
        while time.time() < deadline and proc.poll() is None:
            if metrics.exists() and metrics.read_text().count("\n") >= n:
                for pid in targets(proc):
                    os.kill(pid, signal.SIGTERM)
                return
            time.sleep(0.1)
    threading.Thread(target=watch, daemon=True).start()


def _start(tmp, names):
    """Start the torchrun jobs ``names`` at once (and with "one-process", the fresh interpreter);
    -> {name: (process, log)}, after making only the files those jobs read."""
    jobs = {}
    if "data" in names:  # a real tokenizer beside a corrupt dataset (found building the datasets)
        tok = train_tiny_tokenizer(tmp, make_texts(40))
        (tmp / "bad.idx").write_bytes(b"MMIDIDX\x00\x00 truncated")
        (tmp / "bad.bin").write_bytes(b"\x00" * 8)
        jobs["data"] = ("pretrain.py", [a for a in TINY if a != "--mock-data"] + [
            "--data-path", str(tmp / "bad"), "--tokenizer-model", tok, "--train-iters", "1"])
    if "checkpoint" in names:  # a truncated model file (found loading it, after the model is built)
        save = str(tmp / "ck")
        pretrain.main(TINY + ["--train-iters", "1", "--save", save])
        model_file = os.path.join(save, "iter_0000001", ckpt.MODEL_FILE)
        data = open(model_file, "rb").read()
        open(model_file, "wb").write(data[: len(data) // 2])
        jobs["checkpoint"] = ("pretrain.py", TINY + ["--train-iters", "2", "--load", save])
    if "flag" in names:
        jobs["flag"] = ("pretrain.py", TINY + ["--global-batch-size", "7"])
    if "autosp" in names:
        jobs["autosp"] = ("tests/helpers/pretrain_unchecked_autosp.py",
                          TINY + ["--autosp", "--model", "gpt-tiny", "--hidden-size", "48",
                                  "--num-attention-heads", "3", "--ulysses-degree", "2",
                                  "--compile-backend", "aot_eager", "--train-iters", "1"])
    if "sigterm-ranks" in names:
        jobs["sigterm-ranks"] = ("pretrain.py", TINY + [
            "--train-iters", "100000", "--save", str(tmp / "p1"), "--load", str(tmp / "p1"),
            "--metrics-file", str(tmp / "p1.jsonl")])
    if "sigterm-torchrun" in names:
        jobs["sigterm-torchrun"] = ("pretrain.py", TINY + [
            "--train-iters", "100000", "--save", str(tmp / "p2"), "--metrics-file", str(tmp / "p2.jsonl")])
    procs = {name: _torchrun(script, argv, tmp, name) for name, (script, argv) in jobs.items()}
    if "sigterm-ranks" in procs:
        _signal_after(tmp / "p1.jsonl", procs["sigterm-ranks"][0], _ranks)
    if "sigterm-torchrun" in procs:
        _signal_after(tmp / "p2.jsonl", procs["sigterm-torchrun"][0], lambda proc: [proc.pid])
    if "one-process" in names:  # one process, no launcher: a fresh interpreter's exit
        one = open(tmp / "one.log", "w")
        procs["one-process"] = (subprocess.Popen(
            [sys.executable, os.path.join(ROOT, "pretrain.py"), "--mock-data", "--lr", "-1"],
            cwd=tmp, env=dict(os.environ, PYTHONPATH=ROOT), stdout=one, stderr=subprocess.STDOUT,
            start_new_session=True), tmp / "one.log")
    return procs


def _stop(procs):
    for proc, _ in procs.values():
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


#: the default suite's jobs: an error found before the process group is made (a flag: the
#: agent's store picks the reporting rank) and one after it (a checkpoint: the job's own store),
#: a fresh interpreter without a launcher
DEFAULT = ("flag", "checkpoint", "one-process")
#: -m slow: the other errors (a compiler refusal, data) and SIGTERM, forwarded by torchrun or sent
#: to the ranks themselves (~13 CPU s each; the trainer's handler by default in one process:
#: tests/training/test_training.py::test_sigterm_saves_and_exits)
SLOW = ("autosp", "data", "sigterm-ranks", "sigterm-torchrun")


@pytest.fixture(scope="module")
def launches(tmp_path_factory):
    """Start every default torchrun job of this module at once; the tests read their outcomes."""
    tmp = tmp_path_factory.mktemp("launches")
    procs = _start(tmp, DEFAULT)
    yield procs, tmp
    _stop(procs)


@pytest.fixture(scope="module")
def slow_launches(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("slow_launches")
    procs = _start(tmp, SLOW)
    yield procs, tmp
    _stop(procs)


def _launched(request, name):
    return request.getfixturevalue("launches" if name in DEFAULT else "slow_launches")


def _one_error_line(out):
    lines = [ln for ln in out.splitlines() if ln.startswith(ERROR)]
    assert len(lines) == 1, out[-4000:]
    assert not any(ln.startswith("[rank") or "autosp_lm/" in ln or 'pretrain.py", line' in ln
                   for ln in out.splitlines()), out[-4000:]  # no traceback from the ranks
    root = out.split("Root Cause", 1)[-1]  # torchrun's summary names the same line
    assert f"traceback : {lines[0]}" in root, out[-3000:]
    return lines[0]


@pytest.mark.parametrize("name,expect", [
    ("flag", ["--global-batch-size 7 is not divisible", "multiple of"]),
    pytest.param("autosp", ["AutoSP:", "3 query heads", "Ulysses degrees that work with P=2: 1",
                            "ring"], marks=pytest.mark.slow),
    pytest.param("data", ["bad.idx", "truncated", "rebuild the dataset with tools/preprocess_data.py"],
                 marks=pytest.mark.slow),
    ("checkpoint", [ckpt.MODEL_FILE, "corrupt", "earlier iteration"]),
])
def test_error_under_torchrun_is_one_line_once(request, name, expect):
    procs, _ = _launched(request, name)
    code, out = _wait(*procs[name])
    assert code != 0, out[-3000:]
    line = _one_error_line(out)
    for text in expect:
        assert text in line, line


@pytest.mark.slow  # SIGTERM to one process: tests/training/test_training.py::test_sigterm_saves_and_exits
def test_sigterm_to_the_ranks_saves_and_torchrun_exits_0(slow_launches):
    procs, tmp = slow_launches
    code, out = _wait(*procs["sigterm-ranks"])
    assert code == 0, out[-3000:]
    it = int(open(tmp / "p1" / "latest").read())
    last = out.strip().splitlines()[-1]
    assert last == (f"pretrain.py: stopped by SIGTERM after iteration {it}; checkpoint saved to "
                    f"{tmp / 'p1' / f'iter_{it:07d}'}; to resume, rerun the same command (its --load "
                    "is the --save directory)"), out[-2000:]
    assert "Traceback" not in out


@pytest.mark.slow  # as the test above
def test_sigterm_to_torchrun_saves_and_torchrun_reports_the_signal(slow_launches):
    """torchrun forwards the signal; the ranks save and print the line; torchrun itself exits 1
    with its SignalException (its own behaviour, documented in docs/training.md)."""
    procs, tmp = slow_launches
    code, out = _wait(*procs["sigterm-torchrun"])
    it = int(open(tmp / "p2" / "latest").read())
    assert (tmp / "p2" / f"iter_{it:07d}" / ckpt.MODEL_FILE).exists()
    lines = [ln for ln in out.splitlines() if ln.startswith("pretrain.py: stopped by SIGTERM")]
    assert len(lines) == 1 and f"--load {tmp / 'p2'}" in lines[0], out[-3000:]
    assert code != 0 and "SignalException" in out  # torchrun's doing, not the ranks'


# ------------------------------------------------------------------ one process
def _err(capsys, argv, code=1):
    with pytest.raises(SystemExit) as e:
        pretrain.main(argv)
    assert e.value.code == code
    out, err = capsys.readouterr()
    assert err.startswith(ERROR) and err.count("\n") == 1, err
    assert "Traceback" not in out + err
    return err, out


def test_errors_in_one_process_are_one_line(tmp_path, capsys):
    err, _ = _err(capsys, ["--data-path", str(tmp_path / "corpus"), "--tokenizer-model", str(tmp_path / "t")])
    assert "--tokenizer-model" in err and "no such file" in err
    (tmp_path / "t.model").write_bytes(b"not a model")
    err, _ = _err(capsys, ["--data-path", str(tmp_path / "corpus"), "--tokenizer-model", str(tmp_path / "t.model")])
    assert "not a SentencePiece model" in err and "tools/train_tokenizer.py" in err
    tok = train_tiny_tokenizer(tmp_path, make_texts(40))
    err, _ = _err(capsys, ["--data-path", str(tmp_path / "corpus"), "--tokenizer-model", tok])
    assert "corpus.bin and" in err and "tools/preprocess_data.py" in err
    (tmp_path / "ck").mkdir()
    (tmp_path / "ck" / "latest").write_text("3\n")
    err, out = _err(capsys, TINY + ["--load", str(tmp_path / "ck")])
    assert "iter_0000003" in err and out == ""  # found before any set-up
    err, _ = _err(capsys, TINY + ["--seq-length", "zero"], code=2)
    assert "--seq-length" in err and "--help" in err


def test_debug_adds_the_traceback(capsys, monkeypatch):
    with pytest.raises(SystemExit):
        pretrain.main(TINY + ["--global-batch-size", "7", "--micro-batch-size", "2", "--debug"])
    err = capsys.readouterr().err
    assert "Traceback" in err and err.strip().splitlines()[-1].startswith(ERROR)
    monkeypatch.setenv("AUTOSP_LM_DEBUG", "1")
    with pytest.raises(SystemExit):
        pretrain.main(TINY + ["--global-batch-size", "7", "--micro-batch-size", "2"])
    assert "Traceback" in capsys.readouterr().err


def test_closing_lines_say_what_was_saved(tmp_path, capsys):
    pretrain.main(TINY + ["--train-iters", "1"])
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert last.startswith("pretrain.py: done: trained iteration 1 in ") and "nothing was saved" in last
    save = str(tmp_path / "ck")
    pretrain.main(TINY + ["--train-iters", "2", "--save", save])
    assert capsys.readouterr().out.strip().splitlines()[-1].endswith(
        f"checkpoint saved to {save}/iter_0000002 (to train further: --load {save} and a larger --train-iters)")
    res = pretrain.main(TINY + ["--train-iters", "2", "--load", save])  # nothing left to train
    out = capsys.readouterr().out.strip().splitlines()
    assert res.exit_reason == "already-finished" and len(out) == 1, out
    assert out[0] == (f"pretrain.py: nothing to train: the checkpoint in {save} is at iteration 2 and "
                      "--train-iters is 2; raise --train-iters to train further")


def test_a_bad_flag_in_a_fresh_process_is_one_line_and_exit_1(launches):
    code, out = _wait(*launches[0]["one-process"])
    assert code == 1 and out == "pretrain.py: error: --lr must be positive, got -1.0\n", out
