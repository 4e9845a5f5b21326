"""Each room takes its part of the run's configuration, built without argparse: the data
builders a DataConfig, the trainer a TrainingConfig. A run put together from the parts by hand
trains exactly like ``pretrain.py`` given the same values as flags."""
from __future__ import annotations

import dataclasses

import pytest

import pretrain
from autosp_lm.config.build import parse_run_config
from autosp_lm.data import DataConfig, build_data
from autosp_lm.models import build_model, preset_config
from autosp_lm.parallel import init_parallel
from autosp_lm.strategies import build_strategy
from autosp_lm.training import Trainer
from autosp_lm.training.config import CheckpointConfig, OptimizerConfig, TrainingConfig

FLAGS = ["--mock-data", "--num-layers", "1", "--seq-length", "32", "--global-batch-size", "2",
         "--train-iters", "3", "--eval-iters", "0", "--lr-warmup-iters", "1", "--lr", "3e-3",
         "--log-interval", "1"]


def test_a_run_from_parts_equals_pretrain_given_the_same_flags(tmp_path):
    expected = pretrain.main(FLAGS)
    pretrain.seed_everything(1234)
    data = build_data(DataConfig(seq_length=32, mock_data=True), (6, 0, 0),
                      mock_vocab_size=preset_config("llama-tiny").vocab_size)
    cfg = preset_config("llama-tiny", num_layers=1)
    pretrain.seed_everything(1234)
    ps = init_parallel(1)
    model = build_model(cfg)
    strategy = build_strategy("none", ps)
    strategy.setup(model)
    train = TrainingConfig(train_iters=3, global_batch_size=2, grad_accum_steps=2, seq_length=32,
                           eval_iters=0, optimizer=OptimizerConfig(lr=3e-3, lr_warmup_iters=1,
                                                                   lr_decay_iters=3),
                           checkpoint=CheckpointConfig(save=str(tmp_path / "c")))
    result = Trainer(train, ps, model, cfg, strategy, data, run_record={"by": "hand"}).train()
    assert result.losses == expected.losses and result.grad_norms == expected.grad_norms
    assert result.checkpoint.endswith("iter_0000003")


def test_the_flags_give_the_same_parts():
    """What the test above builds by hand is what the flags build."""
    run = parse_run_config(FLAGS, 1)
    assert run.data == DataConfig(seq_length=32, mock_data=True)
    assert run.training.optimizer == OptimizerConfig(lr=3e-3, lr_warmup_iters=1, lr_decay_iters=3)
    assert (run.training.grad_accum_steps, run.training.logging.log_interval) == (2, 1)
    assert run.model.config == preset_config("llama-tiny", num_layers=1)
    with pytest.raises(dataclasses.FrozenInstanceError):
        run.training.optimizer.lr = 1.0
