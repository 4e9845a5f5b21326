import glob
import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

import pretrain
from autosp_lm.training import checkpoint as ckpt
from tests.helpers.launch import Job

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BASE = ["--mock-data", "--seq-length", "64", "--global-batch-size", "4", "--micro-batch-size", "1",
        "--log-interval", "1", "--eval-iters", "0", "--lr-warmup-iters", "1", "--lr", "3e-3"]


def run(*extra):
    return pretrain.main(BASE + list(extra))


def test_loss_falls_on_overfit_batch():
    # one sample repeated: --train-iters 40 over a 4-sample dataset is not possible, so use a
    # global batch of 1 and a learnable synthetic language
    res = pretrain.main(["--mock-data", "--seq-length", "64", "--global-batch-size", "4",
                         "--train-iters", "40", "--lr", "3e-3", "--lr-warmup-iters", "2",
                         "--log-interval", "40", "--eval-iters", "0", "--model", "gpt-tiny"])
    first = sum(res.losses[i] for i in range(1, 4)) / 3
    last = sum(res.losses[i] for i in range(38, 41)) / 3
    assert last < first - 1.0, (first, last)


def _dp_worker(rank, world, argv):
    res = pretrain.main(argv)
    return res.losses, res.grad_norms


DP_ARGV = BASE + ["--train-iters", "4", "--model", "llama-tiny"]
DP_JOB = Job("tests.training.test_training:_dp_worker", (DP_ARGV,))
LAUNCH = {2: [DP_JOB]}  # in the session's shared launch (tests/helpers/launch.py)


def test_one_rank_equals_two_data_parallel_ranks(launch2):
    single = pretrain.main(DP_ARGV)
    (l0, g0), (l1, g1) = launch2(DP_JOB)
    assert l0 == l1 and g0 == g1  # every rank reports the same figures
    for it in single.losses:
        assert l0[it] == pytest.approx(single.losses[it], rel=1e-6, abs=1e-7)
        assert g0[it] == pytest.approx(single.grad_norms[it], rel=1e-5)


def test_metrics_file_json_lines(tmp_path):
    path = tmp_path / "m" / "metrics.jsonl"
    run("--train-iters", "3", "--metrics-file", str(path))
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert [r["iteration"] for r in rows] == [1, 2, 3]
    for key in ("iteration", "lm_loss", "lr", "grad_norm", "step_time_ms", "tokens_per_s",
                "consumed_samples", "tflops_per_device", "mem_peak_rss_bytes"):
        assert key in rows[0], key
    assert rows[-1]["consumed_samples"] == 12
    assert rows[0]["tokens_per_s"] > 0 and rows[0]["lr"] > 0


def test_checkpoint_resume_is_exact(tmp_path):
    full = run("--train-iters", "8", "--save", str(tmp_path / "a"), "--save-interval", "4")
    first = run("--train-iters", "8", "--exit-interval", "4", "--save", str(tmp_path / "b"))
    assert first.exit_reason == "exit-interval" and max(first.losses) == 4
    assert open(tmp_path / "b" / "latest").read().strip() == "4"
    resumed = run("--train-iters", "8", "--load", str(tmp_path / "b"), "--save", str(tmp_path / "b"))
    assert sorted(resumed.losses) == [5, 6, 7, 8]
    for it in range(5, 9):
        assert resumed.losses[it] == full.losses[it]  # bitwise identical on CPU fp32
        assert resumed.grad_norms[it] == full.grad_norms[it]
    sa = torch.load(tmp_path / "a" / "iter_0000008" / ckpt.MODEL_FILE)["model"]
    sb = torch.load(tmp_path / "b" / "iter_0000008" / ckpt.MODEL_FILE)["model"]
    for k in sa:
        assert torch.equal(sa[k], sb[k]), k


def test_checkpoints_store_the_typed_config_and_older_ones_still_load(tmp_path):
    """A checkpoint's metadata holds the run's typed configuration (its parts, by the flags'
    names); a checkpoint from before it (the flags under ``args``) resumes exactly the same."""
    from autosp_lm.config.run_config import stored_config
    save, flags = str(tmp_path / "c"), ["--lr-decay-iters", "3"]
    full = run("--train-iters", "3", *flags)
    run("--train-iters", "2", "--save", save, *flags)
    meta_path = os.path.join(save, "iter_0000002", ckpt.META_FILE)
    meta = json.load(open(meta_path))
    config = meta["config"]
    assert config["config_version"] == 1 and config["strategy"] == "none"
    assert config["training"]["checkpoint"]["save"] == save
    assert config["training"]["optimizer"]["lr_decay_iters"] == 3
    assert (config["data"]["seq_length"], config["parallel"]["world_size"]) == (64, 1)
    assert config["model"]["name"] == "llama-tiny" and "args" not in meta
    old = {k: v for k, v in meta.items() if k != "config"}
    old["args"] = {"model": "llama-tiny", "seq_length": 64, "lr": 3e-3, "save": save,
                   "train_iters": 2, "tokenizer_model": None, "strategy": "none"}
    json.dump(old, open(meta_path, "w"))
    legacy = stored_config(old)
    assert legacy["training"]["optimizer"]["lr"] == 3e-3 and legacy["data"]["seq_length"] == 64
    assert legacy["training"]["checkpoint"]["save"] == save and legacy["strategy"] == "none"
    resumed = run("--train-iters", "3", "--load", save, *flags)
    assert sorted(resumed.losses) == [3] and resumed.losses[3] == full.losses[3]


def test_crash_during_save_keeps_previous_checkpoint(tmp_path, monkeypatch):
    save = str(tmp_path / "ck")
    run("--train-iters", "2", "--save", save)
    real_save = torch.save

    def failing_save(obj, path, *a, **k):
        if str(path).endswith(ckpt.MODEL_FILE):
            with open(path, "wb") as f:
                f.write(b"partial")  # a half-written file, then the crash
            raise OSError("disk full (simulated)")
        return real_save(obj, path, *a, **k)

    monkeypatch.setattr(ckpt.torch, "save", failing_save)
    with pytest.raises(OSError, match="simulated"):
        run("--train-iters", "4", "--load", save, "--save", save)
    monkeypatch.setattr(ckpt.torch, "save", real_save)
    assert open(os.path.join(save, "latest")).read().strip() == "2"
    assert not os.path.exists(os.path.join(save, "iter_0000004"))
    res = run("--train-iters", "3", "--load", save)
    assert sorted(res.losses) == [3]


def test_auto_resume_without_a_tracker_takes_the_newest_complete_checkpoint(tmp_path, capsys):
    """A job killed after a save renamed its first checkpoint into place, before it wrote the
    tracker: with --load equal to --save the restart resumes from it; with another --load it is
    still an error asking for the tracker."""
    save = str(tmp_path / "ck")
    run("--train-iters", "2", "--save", save, "--save-interval", "1")
    os.remove(os.path.join(save, ckpt.TRACKER))
    os.makedirs(os.path.join(save, ".iter_0000003.tmp"))  # a partial one is never chosen
    res = run("--train-iters", "3", "--load", save, "--save", save)
    assert sorted(res.losses) == [3]
    assert f"resumed from {save}/iter_0000002 at iteration 2" in capsys.readouterr().out
    os.remove(os.path.join(save, ckpt.TRACKER))
    with pytest.raises(SystemExit):
        run("--train-iters", "4", "--load", save)
    assert "no 'latest' tracker file" in capsys.readouterr().err


def test_corrupt_or_missing_checkpoint_is_a_clear_error(tmp_path, capsys):
    save = str(tmp_path / "ck")
    run("--train-iters", "1", "--save", save)
    model_file = os.path.join(save, "iter_0000001", ckpt.MODEL_FILE)
    data = open(model_file, "rb").read()
    open(model_file, "wb").write(data[: len(data) // 2])
    with pytest.raises(SystemExit):
        run("--train-iters", "2", "--load", save)
    err = capsys.readouterr().err
    assert model_file in err and "corrupt" in err
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(SystemExit):
        run("--train-iters", "2", "--load", str(empty))
    assert "no checkpoint found" in capsys.readouterr().err
    open(os.path.join(save, "latest"), "w").write("7\n")
    with pytest.raises(SystemExit):
        run("--train-iters", "2", "--load", save)
    assert "iter_0000007" in capsys.readouterr().err
    # same path for --save and --load with nothing there yet: the auto-resume idiom starts fresh
    res = run("--train-iters", "1", "--load", str(tmp_path / "new"), "--save", str(tmp_path / "new"))
    assert res.iteration == 1


def test_resume_with_different_model_shape_is_refused(tmp_path, capsys):
    save = str(tmp_path / "ck")
    run("--train-iters", "1", "--save", save)
    with pytest.raises(SystemExit):
        run("--train-iters", "2", "--load", save, "--num-layers", "3")
    assert "num_layers: checkpoint 2 vs now 3" in capsys.readouterr().err


def test_sigterm_saves_and_exits(tmp_path):
    save = tmp_path / "ck"
    metrics = tmp_path / "m.jsonl"
    cmd = [sys.executable, os.path.join(ROOT, "pretrain.py")] + BASE + [
        "--train-iters", "100000", "--save", str(save), "--metrics-file", str(metrics)]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.time() + 120
    while time.time() < deadline and not (metrics.exists() and metrics.read_text().count("\n") >= 2):
        time.sleep(0.2)
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 0, out
    it = int(open(save / "latest").read())
    assert it >= 2 and (save / f"iter_{it:07d}" / ckpt.MODEL_FILE).exists()
    last = out.strip().splitlines()[-1]  # the last line says what was saved and how to resume
    assert last.startswith(f"pretrain.py: stopped by SIGTERM after iteration {it}; checkpoint saved to "), last
    assert f"iter_{it:07d}" in last and f"--load {save}" in last


def test_wandb_offline_writes_a_run(tmp_path):
    pytest.importorskip("wandb")
    run("--train-iters", "2", "--wandb-project", "autosp-test", "--wandb-exp-name", "t",
        "--wandb-save-dir", str(tmp_path))
    runs = glob.glob(str(tmp_path / "wandb" / "offline-run-*"))
    assert runs, os.listdir(tmp_path)
    assert glob.glob(os.path.join(runs[0], "*.wandb"))


def test_eval_and_lr_schedule(tmp_path):
    res = pretrain.main(BASE[:-4] + ["--train-iters", "4", "--eval-interval", "2", "--eval-iters", "1",
                                     "--lr", "1e-3", "--min-lr", "1e-4", "--lr-decay-style", "linear",
                                     "--lr-warmup-iters", "1"])
    assert sorted(res.eval_losses) == [2, 4]
    from autosp_lm.training.schedule import LRSchedule
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0)
    s = LRSchedule(opt, max_lr=1.0, min_lr=0.1, warmup_iters=2, decay_iters=6, style="cosine")
    lrs = []
    for _ in range(8):
        lrs.append(s.lr)
        s.step()
    assert lrs[0] == 0.5 and lrs[1] == 1.0 and lrs[2] == 1.0
    assert lrs[4] == pytest.approx(0.55) and lrs[6] == lrs[7] == 0.1


def test_compile_with_sac_on_one_device_matches_eager(capsys):
    """`pretrain.py --compile --sac` (single-device SAC compile) changes no result and reports."""
    argv = ["--train-iters", "2", "--model", "gpt-tiny"]
    eager = run(*argv)
    sac = run(*argv, "--compile", "--sac", "--compile-backend", "aot_eager")
    for it in eager.losses:
        assert sac.losses[it] == pytest.approx(eager.losses[it], rel=1e-5)
        assert sac.grad_norms[it] == pytest.approx(eager.grad_norms[it], rel=1e-4)
    assert "SAC (single device)" in capsys.readouterr().out


def test_bf16_checkpoint_holds_fp32_main_weights_and_resumes_exactly(tmp_path):
    """Megatron-style --bf16: the checkpoint holds the fp32 main parameters (not the bf16 copies
    the model computes with), so a resumed run continues bit for bit."""
    bf16 = ["--bf16", "--model", "llama-tiny", "--num-layers", "1"]
    full = run(*bf16, "--train-iters", "4")
    run(*bf16, "--train-iters", "4", "--exit-interval", "2", "--save", str(tmp_path / "b"))
    state = torch.load(tmp_path / "b" / "iter_0000002" / ckpt.MODEL_FILE)["model"]
    assert {v.dtype for v in state.values() if v.is_floating_point()} == {torch.float32}
    # the main weights moved by less than bf16's resolution would be lost in a bf16 copy
    assert any(not torch.equal(v, v.bfloat16().float()) for v in state.values())
    resumed = run(*bf16, "--train-iters", "4", "--load", str(tmp_path / "b"))
    for it in (3, 4):
        assert resumed.losses[it] == full.losses[it]
        assert resumed.grad_norms[it] == full.grad_norms[it]
