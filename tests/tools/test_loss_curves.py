"""tools/loss_curves.py: its own logic on synthetic curves (the maximum difference, reading the
trainer's metrics file, the JSON and the plot, --replot, the run commands); a real run of two
strategies under -m slow."""
import json
import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "tools"))
import loss_curves as lc  # noqa: E402

CURVES = {"none": {1: 9.0, 2: 8.5, 3: 8.0},
          "ulysses": {1: 9.0, 2: 8.52, 3: 8.01},
          "ring": {1: 9.001, 2: 8.49, 3: 8.0}}


def test_max_difference_is_the_widest_spread_at_one_iteration():
    diff = lc.max_difference(CURVES)
    assert diff["iteration"] == 2 and diff["between"] == ["ring", "ulysses"]
    assert diff["value"] == pytest.approx(0.03)
    # any two curves: a pair that excludes the first curve is found as well as one that includes it
    assert lc.max_difference({"a": {1: 1.0}, "b": {1: 1.5}, "c": {1: 0.5}})["between"] == ["c", "b"]


def test_max_difference_only_over_iterations_every_curve_has():
    diff = lc.max_difference({"a": {1: 1.0, 2: 5.0}, "b": {1: 1.25}})
    assert (diff["iteration"], diff["value"]) == (1, 0.25)
    with pytest.raises(ValueError, match="no iteration"):
        lc.max_difference({"a": {1: 1.0}, "b": {2: 1.0}})


def test_read_losses_keeps_training_records_and_the_last_of_a_repeat(tmp_path):
    path = tmp_path / "m.jsonl"
    records = [{"iteration": 1, "lm_loss": 9.0, "lr": 1e-3}, {"iteration": 1, "eval_lm_loss": 8.0},
               {"iteration": 2, "lm_loss": 8.0}, {"iteration": 2, "lm_loss": 7.5}]
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    assert lc.read_losses(str(path)) == {1: 9.0, 2: 7.5}


def test_outputs_and_replot(tmp_path):
    out = str(tmp_path / "sub" / "curves")
    meta = {"title": "synthetic", "command": "python tools/loss_curves.py", "iterations": 3}
    result = lc.write_outputs(out, CURVES, meta)
    with open(out + ".json") as f:
        data = json.load(f)
    assert data == json.loads(json.dumps(result))
    assert data["final_loss"] == {"none": 8.0, "ulysses": 8.01, "ring": 8.0}
    assert data["max_difference"]["iteration"] == 2 and data["command"] == meta["command"]
    with open(out + ".png", "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    os.unlink(out + ".png")
    again = lc.main(["--replot", "--output", out])  # from the JSON alone
    assert again == result and os.path.getsize(out + ".png") > 10_000


def test_every_run_has_the_same_flags_but_its_strategy():
    args = lc.parse_args(["--train-iters", "7", "--seed", "5"])
    cmds = {s: lc.pretrain_command(args, s, "m.jsonl", "w") for s in args.strategies}
    assert list(cmds) == ["none", "ulysses", "ring", "autosp"]
    for s, cmd in cmds.items():
        flags = cmd[6:]
        assert cmd[5].endswith("pretrain.py") and "--nproc-per-node=2" in cmd
        assert "--bf16" in flags and flags[flags.index("--seed") + 1] == "5"
        assert flags[flags.index("--log-interval") + 1] == "1"  # a loss at every iteration
        rest = [f if f != s else "none" for f in flags if f not in lc.STRATEGY_FLAGS[s]]
        assert rest == cmds["none"][6:]  # ("none": the value of --wandb-exp-name)
    assert "--bf16" not in lc.pretrain_command(lc.parse_args(["--fp32"]), "none", "m", "w")
    assert lc.pretrain_command(args, "none+compile", "m", "w")[-1] == "--compile"


def test_arguments(capsys):
    with pytest.raises(SystemExit) as e:
        lc.main(["--help"])
    assert e.value.code == 0 and "--replot" in capsys.readouterr().out
    for bad in ("none,sideways", "none"):
        with pytest.raises(SystemExit):
            lc.parse_args(["--strategies", bad])


@pytest.mark.slow
def test_a_short_real_run(tmp_path):
    """Two strategies, 3 iterations each, on 2 gloo ranks; W&B offline in the work folder."""
    out = str(tmp_path / "curves")
    result = lc.main(["--strategies", "none,ulysses", "--train-iters", "3", "--seq-length", "128",
                      "--output", out, "--work-dir", str(tmp_path / "work")])
    assert set(result["final_loss"]) == {"none", "ulysses"} and result["iterations"] == 3
    assert result["max_difference"]["value"] < 1e-2  # the same loss, up to bf16 rounding
    assert os.listdir(tmp_path / "work" / "wandb")
